"""What a user would do instead of fxmem: the methods the benchmark measures fxmem against.

Reads a model and returns a wrapped deep copy per method (the model itself is not changed):
  full-ac       non-reentrant torch.utils.checkpoint around every block, as HF's
                `gradient_checkpointing_enable` does;
  sqrt-n        Chen et al.: about sqrt(n) segments of consecutive blocks, each checkpointed as one
                (what `checkpoint_sequential` does for an nn.Sequential);
  torch-budget  torch.compile with the aot_eager backend (min-cut partitioner) under
                `torch._functorch.config.activation_memory_budget = fraction`.
Blocks are the instances of the model's most repeated module class that has submodules and
parameters (GPT blocks, ResNet basic blocks, UNet res-blocks, MLP hidden layers, HF GPT2Block).
Also builds the real library model the benchmark runs: a transformers GPT-2 from a config.
"""
from __future__ import annotations

import copy
import math
from collections import Counter

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: instances of the most frequent non-torch class with children and
    parameters; among equally frequent classes, the one holding the most parameters (outermost)."""
    def candidate(m: nn.Module) -> bool:
        return (m is not model and not type(m).__module__.startswith("torch.")
                and any(True for _ in m.children()) and any(True for _ in m.parameters()))

    counts = Counter(type(m) for m in model.modules() if candidate(m))
    if not counts:
        raise ValueError(f"{type(model).__name__} has no repeated blocks to checkpoint")
    top = max(counts.values())
    params = {cls: sum(p.numel() for m in model.modules() if type(m) is cls for p in m.parameters())
              for cls, n in counts.items() if n == top}
    cls = max(params, key=params.get)
    return [m for m in model.modules() if type(m) is cls]


def _checkpointed(forward):
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def full_ac(model: nn.Module) -> nn.Module:
    """A copy with every block's forward under non-reentrant activation checkpointing (for a
    transformers model, through its own `gradient_checkpointing_enable`)."""
    model = copy.deepcopy(model)
    library = [m for m in model.modules() if hasattr(m, "gradient_checkpointing_enable")]
    if library:  # a transformers model: its own switch, as its users would turn it on
        library[0].gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    for block in blocks_of(model):
        block.forward = _checkpointed(block.forward)
    return model


def _chained(model: nn.Module, blocks: list[nn.Module], inputs: tuple) -> bool:
    """Whether forward calls the blocks once each, in order, each on the previous one's output."""
    calls: list[tuple[int, object, object]] = []
    handles = [b.register_forward_hook(lambda m, args, out, k=k: calls.append((k, args[0] if args else None, out)))
               for k, b in enumerate(blocks)]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    if [k for k, _, _ in calls] != list(range(len(blocks))):
        return False
    return all(isinstance(out, torch.Tensor) and calls[k + 1][1] is out for k, (_, _, out) in enumerate(calls[:-1]))


def sqrt_n(model: nn.Module, inputs: tuple) -> nn.Module | None:
    """A copy checkpointed in ceil(sqrt(n)) segments of consecutive blocks; None when the blocks
    do not form a chain (e.g. a UNet's skip connections), where segments are not defined."""
    model = copy.deepcopy(model)
    blocks = blocks_of(model)
    if not _chained(model, blocks, inputs):
        return None
    size = math.ceil(math.sqrt(len(blocks)))
    for start in range(0, len(blocks), size):
        segment = blocks[start:start + size]
        forwards = [b.forward for b in segment]

        def run_segment(x, *args, forwards=forwards, **kwargs):
            for forward in forwards:  # blocks share their other arguments (masks, embeddings)
                x = forward(x, *args, **kwargs)
            return x

        segment[0].forward = _checkpointed(run_segment)
        for block in segment[1:]:
            block.forward = lambda x, *args, **kwargs: x
    return model


def aot_eager_counting(graph_flops: list[int]):
    """The aot_eager backend (min-cut partitioner, so activation_memory_budget applies), recording
    the FLOPs of every forward and backward graph it compiles."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from fxmem.price.cost import estimate

    def count(gm, example_inputs):
        graph_flops.append(estimate(gm).total_flops())
        return boxed_nop(gm, example_inputs)

    return aot_autograd(fw_compiler=count, bw_compiler=count, partition_fn=min_cut_rematerialization_partition,
                        keep_inference_input_mutations=True)


def torch_budget(model: nn.Module, fraction: float, inputs: tuple, step) -> tuple[nn.Module, int]:
    """A compiled copy whose partitioner ran under activation_memory_budget=fraction (it runs one
    warm-up `step` to compile), and the FLOPs of the forward and backward graphs it compiled."""
    model = copy.deepcopy(model)
    graph_flops: list[int] = []
    model.compile(backend=aot_eager_counting(graph_flops))
    with torch._functorch.config.patch(activation_memory_budget=fraction):
        step(model, inputs)
    if len(graph_flops) < 2:
        raise RuntimeError(f"torch.compile did not compile a forward and a backward graph at fraction {fraction}")
    return model, sum(graph_flops)


class CausalLMLoss(nn.Module):
    """A Hugging Face causal LM returning its loss: forward(input_ids, labels)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def hf_gpt2(batch_size: int | None = None, seq_len: int = 256) -> tuple[nn.Module, tuple]:
    """transformers' GPT2LMHeadModel from a config (no download): 4 layers, width 256."""
    import transformers

    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=seq_len,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(config)
    lm.loss_type = "ForCausalLM"
    model = CausalLMLoss(lm)
    ids = torch.randint(config.vocab_size, (batch_size or 8, seq_len), generator=torch.Generator().manual_seed(0))
    return model, (ids, ids.clone())
