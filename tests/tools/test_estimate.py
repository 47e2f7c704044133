"""fxmem.estimate against an independent meter (MemTracker) and torch.optim's real state."""
from __future__ import annotations

import pytest
import torch

import fxmem
from fxmem import models
from fxmem.errors import fmt_bytes
from fxmem.tools.estimate import estimate
from fxmem.measure import _StepTracker, measure_peak_bytes


def _bytes_after_forward(module, inputs) -> int:
    """Live bytes right after forward (parameters, inputs, saved activations, the loss), measured."""
    module(*inputs).backward()  # the first call plans
    for p in module.parameters():
        p.grad = None
    tracker = _StepTracker()
    tracker.track_external(module, *inputs)
    with tracker:
        out = module(*inputs)
        current = max(s["Total"] for s in tracker.get_tracker_snapshot("current").values())
    del out
    return current


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_estimate_matches_the_measured_step(autocast):
    torch.manual_seed(0)
    model, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny", 64)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        est = estimate(model, inputs)
        step = fxmem.optimize(model, budget_gb=100.0)  # nothing recomputed: the step the estimate describes
        after_forward = _bytes_after_forward(step, inputs)
        peak = measure_peak_bytes(step, inputs)
    assert est.parameters == sum(p.numel() * 4 for p in model.parameters())
    assert est.gradients == est.parameters
    loss_bytes = 4
    assert abs(after_forward - (est.parameters + est.buffers + est.inputs + est.activations + loss_bytes)) <= 64
    assert abs(est.peak_step - peak) <= 0.01 * peak
    assert est.by_module[0][1] == max(b for _, b in est.by_module)
    assert abs(sum(b for _, b in est.by_module) - est.activations) == 0


def test_bf16_autocast_halves_matmul_and_activation_bytes():
    model, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny", 256)
    fp32 = fxmem.plan(model, inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = fxmem.plan(model, inputs)
    assert "autocast(cpu:bfloat16)" in bf16.signature

    def saved(plan, ops):
        return sum(r.bytes for r in plan.nodes if r.decision == "save" and r.op in ops)

    lower_precision = {"addmm", "gelu"}
    assert saved(fp32, lower_precision) > 0
    assert saved(bf16, lower_precision) * 2 == saved(fp32, lower_precision)
    everything = {r.op for r in fp32.nodes} | {r.op for r in bf16.nodes}
    assert 0.45 < saved(bf16, everything) / saved(fp32, everything) < 0.75


def test_table_names_the_largest_modules_and_optimizer():
    model, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny")
    est = estimate(model, inputs, torch.optim.AdamW(model.parameters()))
    assert est.optimizer_state == 2 * est.parameters
    assert est.total == est.eager_peak + est.optimizer_state
    text = est.table()
    assert "optimizer state (AdamW)" in text and est.by_module[0][0] in text


def test_the_two_peaks_are_the_plan_tables_under_its_names():
    """PyTorch eager's peak and fxmem's keep-all peak are different steps: each figure is shown under the
    name the plan table gives it, and is the plan's figure of that name."""
    model, inputs = models.from_name("gpt-tiny"), models.example_inputs("gpt-tiny")
    est, plan = estimate(model, inputs), fxmem.plan(model, inputs, eager_meter=True)
    assert est.eager_peak == plan.eager_peak_bytes and est.peak_step == plan.baseline_peak_bytes
    assert est.eager_peak > est.peak_step  # eager saves more than fxmem's keep-all step on this GPT
    for text in (est.table(), plan.table()):
        flat = " ".join(text.split())
        assert f"PyTorch eager's peak {fmt_bytes(est.eager_peak)} (" in flat
        assert f"keep-all peak {fmt_bytes(est.peak_step)} (fxmem's step with nothing recomputed" in flat
    assert "peak of one step" not in est.table()


def _gpt2_with_loss():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=1024, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, use_cache=False)
    return transformers.GPT2LMHeadModel(config), torch.randint(0, 1024, (4, 32))


def _lm_loss(out, y):
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten())


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_estimate_counts_the_loss_as_eager_pytorch_runs_it(autocast):
    """With loss_fn (and with labels=, the model's own loss) the estimate is the step with its loss region:
    within 6% of PyTorch eager's measured peak (fxmem's keep-all step saves a little less than eager does);
    without the loss it would leave out the logits' log-softmax and gradients (far below, under bf16)."""
    from fxmem.trace.step_module import LossStep

    model, ids = _gpt2_with_loss()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with_loss_fn = estimate(model, (ids,), loss_fn=_lm_loss, example_target=ids)
        eager = measure_peak_bytes(LossStep(model, _lm_loss), (ids,), {"target": ids})
        with_labels = estimate(model, (ids,), example_kwargs={"labels": ids})
        eager_labels = measure_peak_bytes(model, (ids,), {"labels": ids})
    assert abs(with_loss_fn.peak_step - eager) <= 0.06 * eager, (with_loss_fn.peak_step, eager)
    assert abs(with_labels.peak_step - eager_labels) <= 0.06 * eager_labels, (with_labels.peak_step, eager_labels)
    assert with_loss_fn.loss.startswith("loss_fn") and with_labels.loss.startswith("the model's `loss` output")
    logits = ids.numel() * model.config.vocab_size * 4
    assert with_loss_fn.activations >= logits  # the log-softmax's output, saved for backward, counted
    with pytest.raises(ValueError, match="example_target= goes with loss_fn="):
        estimate(model, (ids,), example_target=ids)


def test_estimate_takes_an_optimizer_by_name():
    model, inputs = models.from_name("mlp-tiny"), models.example_inputs("mlp-tiny")
    est = estimate(model, inputs, "adamw")
    assert est.optimizer_state == 2 * est.parameters and "optimizer state (adamw)" in est.table()
