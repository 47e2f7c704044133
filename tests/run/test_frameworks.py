"""Frameworks train an optimized module as they train the model: transformers' Trainer and Accelerate with
their default arguments (and gradient accumulation), bit for bit as plain training, reading the model's
forward signature, config and methods through the wrapper."""
from __future__ import annotations

import copy
import functools
import inspect

import pytest
import torch

import fxmem

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

VOCAB, TOKENS, BATCH = 128, 64, 2


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=TOKENS,
                                     bos_token_id=0, eos_token_id=0, use_cache=False, loss_type="ForCausalLM")
    return transformers.GPT2LMHeadModel(config)


def samples(n: int = 8) -> list[dict[str, torch.Tensor]]:
    """A dataset as a list of dicts; `row` is a column the model's forward does not take (Trainer drops it)."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (TOKENS,), generator=g)
        mask = torch.ones(TOKENS, dtype=torch.long)
        mask[TOKENS - i:] = 0  # padded rows: the attention mask matters
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100),
                     "row": torch.tensor(i)})
    return rows


@functools.lru_cache(maxsize=None)
def keep_all_bytes() -> int:
    """fxmem's keep-all peak for a batch of `tiny_gpt2`."""
    batch = {k: torch.stack([r[k] for r in samples(BATCH)]) for k in ("input_ids", "attention_mask", "labels")}
    return fxmem.plan(tiny_gpt2(), (), example_kwargs=batch).baseline_peak_bytes


def optimized(model: torch.nn.Module) -> torch.nn.Module:
    """`model` under a budget of 0.8x fxmem's keep-all peak, so that something is recomputed."""
    return fxmem.optimize(model, budget_gb=0.8 * keep_all_bytes() / 2**30, solver="greedy", time_limit_s=1)


def losses_of(module: torch.nn.Module) -> list[torch.Tensor]:
    """The loss of each call, recorded by a forward hook."""
    seen: list[torch.Tensor] = []
    module.register_forward_hook(lambda _m, _args, out: seen.append(out.loss.detach().clone()))
    return seen


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    theirs = dict(b.named_parameters())
    for name, p in a.named_parameters():
        assert torch.equal(p, theirs[name]), name


def test_trainer_with_default_arguments_trains_as_plain_training(tmp_path):
    model = tiny_gpt2()
    plain = copy.deepcopy(model)
    opt = optimized(model)
    runs = []
    for module in (plain, opt):
        args = transformers.TrainingArguments(str(tmp_path / str(len(runs))), report_to=[], use_cpu=True,
                                              per_device_train_batch_size=BATCH, gradient_accumulation_steps=2,
                                              max_steps=2, seed=0)
        losses = losses_of(module)
        result = transformers.Trainer(model=module, args=args, train_dataset=samples()).train()
        runs.append((losses, result.training_loss))
    (plain_losses, plain_loss), (opt_losses, opt_loss) = runs
    assert len(opt_losses) == 4 and torch.equal(torch.stack(opt_losses), torch.stack(plain_losses))
    assert opt_loss == plain_loss
    assert_same_parameters(model, plain)
    assert opt.plans and all(plan.recompute for plan in opt.plans)  # the planned step ran, not eager's
    # Trainer drops the output before backward: the first micro-batch is planned with it held, the later ones
    # (a step's first, and the one accumulating into its gradients) for the loop seen
    assert len(opt.plans) == 3 and "drops them before backward" in opt.plan.loss
    # the checkpoint Trainer saves at the end (tied embeddings: save_pretrained, as for the model) loads back
    saved = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "1" / "checkpoint-2")
    assert_same_parameters(saved, model)


def test_accelerate_prepare_trains_as_plain_training():
    from accelerate import Accelerator

    model = tiny_gpt2()
    plain = copy.deepcopy(model)
    opt = optimized(model)
    runs = []
    for module in (plain, opt):
        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        loader = torch.utils.data.DataLoader(samples(), batch_size=BATCH)
        module, optimizer, loader = accelerator.prepare(module, optimizer, loader)
        losses = []
        for batch in loader:
            with accelerator.accumulate(module):
                batch.pop("row")
                loss = module(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.detach())
        runs.append(torch.stack(losses))
    assert len(runs[1]) == 4 and torch.equal(runs[1], runs[0])
    assert_same_parameters(model, plain)
    assert opt.plans and all(plan.recompute for plan in opt.plans)


def test_the_optimized_module_shows_the_model_forward_signature_and_attributes(tmp_path):
    from transformers.utils.generic import find_labels

    model = tiny_gpt2()
    opt = fxmem.optimize(model, budget_gb=1.0)
    assert inspect.signature(opt.forward) == inspect.signature(model.forward)
    assert find_labels(type(opt)) == find_labels(type(model)) == ["labels"]  # Trainer reads the class's
    # read as the model (Trainer saves a PreTrainedModel with save_pretrained), still fxmem's module
    assert isinstance(opt, fxmem.OptimizedModule) and isinstance(opt, transformers.GPT2LMHeadModel)
    assert issubclass(type(opt), fxmem.OptimizedModule) and repr(opt).startswith("OptimizedModule[GPT2LMHeadModel](")
    assert isinstance(copy.deepcopy(opt), fxmem.OptimizedModule)
    plain = fxmem.optimize(torch.nn.Sequential(torch.nn.Linear(4, 4)), budget_gb=1.0)  # no save_pretrained
    assert inspect.signature(plain.forward) == inspect.signature(plain.fxmem_model.forward)
    assert not isinstance(plain, torch.nn.Sequential)  # its class is its own: nothing frameworks save by class
    assert opt.config is model.config and opt.generation_config is model.generation_config
    assert opt.main_input_name == "input_ids" and opt.can_generate() == model.can_generate()
    assert opt._keys_to_ignore_on_save == model._keys_to_ignore_on_save
    assert opt.num_parameters() == model.num_parameters()
    # what already worked still does: the same state_dict keys, the same parameter objects
    assert list(opt.state_dict()) == list(model.state_dict())
    assert all(a is b for a, b in zip(opt.parameters(), model.parameters()))
    with pytest.raises(AttributeError, match="no attribute 'not_there'"):
        opt.not_there

    opt.save_pretrained(tmp_path)  # the model's weights, under its own keys
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert_same_parameters(loaded, model)

    with_target = fxmem.optimize(model, budget_gb=1.0, loss=fxmem.Loss(fn=lambda out, y: out.logits.sum()))
    shown = inspect.signature(with_target.forward).parameters
    own = inspect.signature(model.forward).parameters
    assert list(shown) == [*list(own)[:-1], "target", "kwargs"]
    assert shown["target"].kind is inspect.Parameter.KEYWORD_ONLY and shown["target"].default is None
    assert with_target.config is model.config
    assert not isinstance(with_target, transformers.GPT2LMHeadModel)  # it returns the loss, not the model's output


def test_lightning_module_holding_it_trains_as_plain_training(tmp_path):
    lightning = pytest.importorskip("lightning")

    class LitLM(lightning.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model, self.losses = model, []

        def training_step(self, batch, _index):
            loss = self.model(**{k: v for k, v in batch.items() if k != "row"}).loss
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    model = tiny_gpt2()
    plain = copy.deepcopy(model)
    runs = []
    for module in (plain, optimized(model)):
        lightning.seed_everything(0, verbose=False)
        lit = LitLM(module)
        trainer = lightning.Trainer(default_root_dir=tmp_path / str(len(runs)), accelerator="cpu", devices=1,
                                    max_steps=2, accumulate_grad_batches=2, enable_progress_bar=False)
        trainer.fit(lit, torch.utils.data.DataLoader(samples(), batch_size=BATCH))
        runs.append(torch.stack(lit.losses))
    assert len(runs[1]) == 4 and torch.equal(runs[1], runs[0])
    assert_same_parameters(model, plain)
