"""fxmem.dist.fsdp_depth: a rank of identical blocks simulated with 2, 3 and 4 of them and extrapolated holds
what the simulation of all of them holds, to the byte, with eager blocks, torch's checkpoint on every block,
fxmem's block plan in every block and the root's loss in chunks."""
from __future__ import annotations

import dataclasses

import torch

from fxmem.dist.fsdp_depth import depths_for, extrapolate, shallow
from fxmem.fsdp import FsdpPlan, block_list, rank_peak

WORLD = 2


def llama(layers: int):
    import transformers
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False, attn_implementation="eager")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    return model, (), {"input_ids": ids, "labels": ids}


def test_shallow_twin_shares_the_first_blocks():
    model, _, _ = llama(6)
    twin = shallow(model, "model.layers", 2)
    assert type(twin) is type(model) and len(twin.model.layers) == 2 and len(model.model.layers) == 6
    assert twin.model.layers[1] is model.model.layers[1] and twin.lm_head is model.lm_head
    assert depths_for(model.model.layers) == (2, 3, 4) and depths_for(twin.model.layers) is None


def test_blocks_that_differ_in_a_setting_are_simulated_whole():
    """Blocks alike in their tensors but set apart per layer (a dropout's p, as an attention type or sliding
    window would be) are not extrapolated; a block's number alone (`layer_idx`) does not set them apart."""
    def blocks(ps):
        units = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(p)) for p in ps)
        for i, unit in enumerate(units):
            unit.layer_idx = i
        return units
    assert depths_for(blocks([0.1] * 6)) == (2, 3, 4)
    assert depths_for(blocks([0.1] * 5 + [0.0])) is None


def test_extrapolate_takes_the_line_and_refuses_a_bend():
    assert extrapolate({2: {"a": 10}, 3: {"a": 13}, 4: {"a": 16}}, 32) == {"a": 100}
    assert extrapolate({2: {"a": 10}, 3: {"a": 13}, 4: {"a": 17}}, 32) is None


def test_extrapolated_rank_equals_the_whole_simulation():
    """Six identical blocks: eager blocks; torch's checkpoint on every block and the root's loss in chunks;
    fxmem's whole-step block plan; the block's least plan and the root's loss in chunks."""
    import fxmem
    from fxmem.fsdp import block_io, plan_root, quiet
    model, args, kwargs = llama(6)
    path = block_list(model)[0]
    inputs, block_kwargs, hidden = block_io(model, path, args, kwargs)
    root = plan_root(model, path, hidden, args, kwargs, None, time_limit_s=1)
    assert root is not None
    with quiet():
        whole = fxmem.plan(model.model.layers[0], inputs, example_kwargs=block_kwargs, model_loss=False,
                           policy="whole-step")
        least = fxmem.plan(model.model.layers[0], inputs, example_kwargs=block_kwargs, model_loss=False,
                           policy="memory", time_limit_s=1)
    plain = FsdpPlan(WORLD, path, True, None, 0)
    for plan in (plain, dataclasses.replace(plain, checkpoint_blocks=True, root_plan=root),
                 dataclasses.replace(plain, block_plan=whole.to_dict()),
                 dataclasses.replace(plain, block_plan=least.to_dict(), root_plan=root)):
        assert rank_peak(model, args, kwargs, plan, "adamw") == rank_peak(model, args, kwargs, plan, "adamw", whole=True)
