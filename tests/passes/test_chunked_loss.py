"""The chunked loss (passes/chunked_loss.py, fxmem/ops/chunked_cross_entropy.py, fxmem/planner/loss_chunks.py): the same
loss and gradients as eager's cross-entropy to float reassociation at any chunk count, ignored tokens and
label smoothing included, for the losses people write (shifted logits and labels, upcasts, a sum over a
token count, a z-loss); chosen by the planner where the budget needs it, met when measured, recorded in
the plan and refused on another model."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fxmem
from fxmem.trace.capture import capture
from fxmem.ops.chunked_cross_entropy import chunk_bounds, chunked_linear_cross_entropy
from fxmem.errors import PlanMismatchError
from fxmem.measure import measure_peak_bytes
from fxmem.passes.chunked_loss import chunk_loss, loss_sites
from fxmem.trace.step_module import LossStep
from tests.conftest import GIB

TOL = dict(atol=1e-6, rtol=1e-5)  # float32 sums in another order


def test_chunks_cover_the_tokens_with_a_ragged_last_one():
    assert chunk_bounds(32, 7) == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 25), (25, 30), (30, 32)]
    assert chunk_bounds(32, 1) == [(0, 32)] and chunk_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("chunks", [1, 2, 7])
@pytest.mark.parametrize("reduction,smoothing", [("mean", 0.0), ("mean", 0.1), ("sum", 0.2)])
def test_function_equals_cross_entropy(chunks, reduction, smoothing):
    torch.manual_seed(chunks)
    hidden = torch.randn(4, 8, 16, requires_grad=True)  # 32 tokens: 7 chunks of 5, the last of 2
    weight = torch.randn(50, 16, requires_grad=True)
    bias = torch.randn(50, requires_grad=True)
    target = torch.randint(0, 50, (4, 8))
    target[0, :5] = -100  # ignored tokens, across the first chunk boundary
    logits = F.linear(hidden, weight, bias).flatten(0, 1)
    expected = F.cross_entropy(logits, target.flatten(), reduction=reduction, label_smoothing=smoothing)
    want = torch.autograd.grad(expected, (hidden, weight, bias))
    got = chunked_linear_cross_entropy(hidden, weight, bias, target, chunks, reduction, -100, smoothing)
    torch.testing.assert_close(got, expected, **TOL)
    for a, b in zip(torch.autograd.grad(got, (hidden, weight, bias)), want):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("chunks", [1, 2, 7])
@pytest.mark.parametrize("reduction,smoothing", [("mean", 0.0), ("sum", 0.1)])
def test_function_on_shifted_rows_with_a_z_loss_equals_eager(chunks, reduction, smoothing):
    """Targets for the rows a shift keeps (`logits[:, :-1]`), the others ignored; the log-sum-exp of every
    row returned with its gradient, read by z-loss terms on the shifted rows and on all of them."""
    torch.manual_seed(chunks)
    hidden = torch.randn(4, 9, 16, requires_grad=True)  # 36 rows, 32 targets
    weight, bias = torch.randn(50, 16, requires_grad=True), torch.randn(50, requires_grad=True)
    target = torch.randint(0, 50, (4, 9))
    target[0, :3] = -100
    logits = F.linear(hidden, weight, bias)
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), target[:, 1:].flatten(), reduction=reduction,
                               label_smoothing=smoothing)
    expected = expected + 1e-2 * torch.logsumexp(logits[:, :-1], -1).pow(2).mean() \
        + 1e-3 * torch.logsumexp(logits, -1).pow(2).sum()
    want = torch.autograd.grad(expected, (hidden, weight, bias))
    loss, lse = chunked_linear_cross_entropy(hidden, weight, bias, target[:, 1:], chunks, reduction, -100, smoothing,
                                             rows=((0, 4, 1), (0, 8, 1)), logsumexp=True)
    assert lse.shape == (4, 9)
    got = loss + 1e-2 * lse[:, :-1].pow(2).mean() + 1e-3 * lse.pow(2).sum()
    torch.testing.assert_close(got, expected, **TOL)
    for a, b in zip(torch.autograd.grad(got, (hidden, weight, bias)), want):
        torch.testing.assert_close(a, b, **TOL)
    with pytest.raises(ValueError, match="rows selected"):
        chunked_linear_cross_entropy(hidden, weight, bias, target, chunks, rows=((0, 4, 1), (0, 8, 1)))


def test_bf16_weight_gradient_is_summed_in_fp32_and_as_close_to_exact_as_eagers():
    """Each chunk's bf16 products are summed in fp32 with the other chunks' (not rounded to bf16 chunk by
    chunk), as eager's one matmul over every token sums them: the error against float64 is eager's, in
    norm over the whole gradient (one element may round the other way: the sums are in another order)."""
    torch.manual_seed(0)
    hidden = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(500, 32, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(500, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 500, (64,))
    exact = torch.autograd.grad(F.cross_entropy(F.linear(hidden.double(), weight.double(), bias.double()), target),
                                (weight, bias))
    eager = torch.autograd.grad(F.cross_entropy(F.linear(hidden, weight, bias).float(), target), (weight, bias))
    got = torch.autograd.grad(chunked_linear_cross_entropy(hidden, weight, bias, target, 7), (weight, bias))
    for name, g, e, x in zip(("weight", "bias"), got, eager, exact):
        assert g.dtype == e.dtype == torch.bfloat16, name
        error, eagers = (g.double() - x).norm(), (e.double() - x).norm()
        assert error <= eagers * 1.01, f"{name}: error {error:.3g} against float64, eager's {eagers:.3g}"


def test_function_gives_none_where_eager_does_and_nan_with_no_token():
    hidden, weight = torch.randn(6, 8), torch.randn(20, 8, requires_grad=True)
    target = torch.randint(0, 20, (6,))
    loss = chunked_linear_cross_entropy(hidden, weight, None, target, 2)
    (grad,) = torch.autograd.grad(loss, (weight,))
    torch.testing.assert_close(grad, torch.autograd.grad(F.cross_entropy(hidden @ weight.t(), target), (weight,))[0],
                               **TOL)
    all_ignored = torch.full((6,), -100)
    assert torch.isnan(chunked_linear_cross_entropy(hidden, weight, None, all_ignored, 3)).item() == \
        torch.isnan(F.cross_entropy(hidden @ weight.t(), all_ignored)).item()
    with pytest.raises(ValueError, match="'mean' or 'sum'"):
        chunked_linear_cross_entropy(hidden, weight, None, target, 2, reduction="none")


class LmHead(torch.nn.Module):
    """Embedding, one hidden layer, an lm head and the model's own cross-entropy (symbolic_trace captures it)."""

    def __init__(self, vocab=300, dim=16, smoothing=0.0):
        super().__init__()
        self.embed, self.mix = torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, dim)
        self.head, self.frozen = torch.nn.Linear(dim, vocab), torch.nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.smoothing = smoothing

    def forward(self, ids, target):
        hidden = torch.tanh(self.mix(self.embed(ids)))
        return F.cross_entropy(self.head(hidden).flatten(0, 1), target.flatten(), ignore_index=-100,
                               label_smoothing=self.smoothing)


def _ids(vocab=300, shape=(4, 8)):
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, shape)
    target = ids.roll(-1, 1)
    target[:, -1] = -100
    return ids, target


@pytest.mark.parametrize("chunks", [1, 2, 7])
def test_pass_on_symbolic_trace_graph_equals_eager(chunks):
    model = LmHead(smoothing=0.1)
    ids, target = _ids()
    gm = capture(model, (ids, target))
    (site,) = loss_sites(gm)
    assert (site.tokens, site.vocab, site.label_smoothing) == (32, 300, 0.1)
    chunk_loss(gm, chunks)
    assert bool(loss_sites(gm)) == (chunks == 1)
    reference = copy.deepcopy(model)
    expected = reference(ids, target)
    expected.backward()
    loss = gm(ids, target)
    loss.backward()
    torch.testing.assert_close(loss, expected, **TOL)
    _assert_grads_close(model, reference)


class ShiftedLmHead(LmHead):
    """The shifted loss and a z-loss as a model writes them: `logits[:, :-1]`, `logits.size(-1)`, a keepdim
    logsumexp of the shifted logits."""

    def forward(self, ids, target):
        logits = self.head(torch.tanh(self.mix(self.embed(ids))))
        shifted = logits[:, :-1]
        loss = F.cross_entropy(shifted.reshape(-1, logits.size(-1)), target[:, 1:].reshape(-1),
                               label_smoothing=self.smoothing)
        return loss + 1e-3 * shifted.logsumexp(-1, keepdim=True).pow(2).mean()


def test_pass_on_a_shifted_loss_with_a_z_loss_in_a_symbolic_trace_graph_equals_eager():
    model = ShiftedLmHead(smoothing=0.1)
    ids, target = _ids()
    gm = capture(model, (ids, target))
    (site,) = loss_sites(gm)
    assert (site.tokens, site.rows, site.kept, site.logsumexps) == (28, 32, ((0, 4, 1), (0, 7, 1)), 1)
    chunk_loss(gm, 7)
    assert not loss_sites(gm) and ".logsumexp(" not in gm.code and "self.head(" not in gm.code
    reference = copy.deepcopy(model)
    expected = reference(ids, target)
    expected.backward()
    loss = gm(ids, target)
    loss.backward()
    torch.testing.assert_close(loss, expected, **TOL)
    _assert_grads_close(model, reference)


def _gpt2(vocab=256, n_embd=16):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=n_embd, n_head=2, vocab_size=vocab, n_positions=64,
                                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    return model, torch.randint(0, vocab, (2, 64))


def test_sites_need_logits_nothing_else_reads():
    model, ids = _gpt2()
    from fxmem.trace.loss import OwnLossStep

    assert loss_sites(capture(OwnLossStep(model, keep_outputs=False), (ids,), {"labels": ids}))
    assert not loss_sites(capture(OwnLossStep(model, keep_outputs=True), (ids,), {"labels": ids}))
    weighted = lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), weight=torch.ones(256))  # noqa: E731
    assert not loss_sites(capture(LossStep(model, weighted), (ids,), {"target": ids}))


def _labels(ids):
    """Next-token labels as a collator makes them: the ids, some padding -100 and some token 0."""
    labels = ids.clone()
    labels[0, :5], labels[1, 3:6] = -100, 0
    return labels


def _shifted(out, y, **options):
    """The causal-LM loss as people write it: the logits and the labels shifted by one token."""
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), y[:, 1:].flatten(), **options)


def _upcast_contiguous(out, y):
    """Shifted with `...`, `.contiguous().float()` and `.view`; token 0 the padding ignored; smoothed."""
    logits = out.logits[..., :-1, :].contiguous().float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), y[..., 1:].clamp(min=0).contiguous().view(-1),
                           ignore_index=0, label_smoothing=0.1)


def _sum_over_count(out, y):
    return _shifted(out, y, reduction="sum") / (y[:, 1:] != -100).sum()


def _z_loss(out, y):
    logits = out.logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), y[:, 1:].flatten()) + 1e-4 * torch.logsumexp(logits, -1).pow(2).mean()


def _z_loss_first(out, y):
    """A z-loss over every token's upcast logits, written before the shifted cross-entropy."""
    z = torch.logsumexp(out.logits.float(), -1).pow(2).mean()
    return _shifted(out, y, label_smoothing=0.1) + 1e-4 * z


LOSSES = {"shifted": _shifted, "upcast, contiguous, ignore_index, smoothing": _upcast_contiguous,
          "sum over a count": _sum_over_count, "z-loss": _z_loss, "z-loss first, every token": _z_loss_first}
LOGSUMEXPS = {"z-loss": 1, "z-loss first, every token": 1}


@pytest.mark.parametrize("name", LOSSES)
def test_losses_people_write_are_sites_and_chunked_equal_eager(name):
    model, ids = _gpt2()
    loss_fn, target = LOSSES[name], _labels(ids)
    gm = capture(LossStep(model, loss_fn), (ids,), {"target": target})
    (site,) = loss_sites(gm)
    assert (site.tokens, site.rows, site.kept, site.logsumexps) == (126, 128, ((0, 2, 1), (0, 63, 1)),
                                                                    LOGSUMEXPS.get(name, 0))
    chunk_loss(gm, 7)
    assert not loss_sites(gm)
    reference = copy.deepcopy(model)
    loss = gm(ids, target=target)
    loss.backward()
    expected = loss_fn(reference(ids), target)
    expected.backward()
    torch.testing.assert_close(loss, expected, **TOL)
    _assert_grads_close(model, reference)


def test_logits_read_otherwise_are_not_sites():
    """A slice of the vocabulary, a logsumexp over the tokens, or over the 16-bit logits where the
    cross-entropy reads them upcast: the chunks could not give those, so the logits stay whole."""
    model, ids = _gpt2()
    vocab_slice = lambda out, y: F.cross_entropy(out.logits[..., :-1].flatten(0, 1), y.clamp(max=254).flatten())  # noqa: E731
    over_tokens = lambda out, y: _shifted(out, y) + torch.logsumexp(out.logits, 1).mean()  # noqa: E731
    for loss_fn in (vocab_slice, over_tokens):
        assert not loss_sites(capture(LossStep(model, loss_fn), (ids,), {"target": ids}))
    upcast = lambda out, y: F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten())  # noqa: E731
    other_dtype = lambda out, y: upcast(out, y) + torch.logsumexp(out.logits, -1).float().mean()  # noqa: E731
    model = model.to(torch.bfloat16)
    assert loss_sites(capture(LossStep(model, upcast), (ids,), {"target": ids}))
    assert not loss_sites(capture(LossStep(model, other_dtype), (ids,), {"target": ids}))


@pytest.fixture(scope="module")
def labels_least():
    """The least budget the planner names for the tiny GPT-2's `labels=` step (the loss in chunks)."""
    model, ids = _gpt2()
    with pytest.raises(fxmem.InfeasibleBudgetError) as info:
        fxmem.plan(model, (ids,), 1e-6, example_kwargs={"labels": ids}, time_limit_s=1, keep_outputs=False)
    assert "chunks of tokens" in str(info.value)
    return info.value.min_budget_bytes


def _assert_grads_close(model, reference):
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert (p.grad is None) == (ref[name].grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, ref[name].grad, **TOL, msg=lambda m: f"{name}: {m}")


def test_labels_path_chunks_where_the_budget_needs_it_and_meets_it(labels_least):
    model, ids = _gpt2()
    least = labels_least
    reference = copy.deepcopy(model)
    optimized = fxmem.optimize(model, budget_gb=least / GIB, keep_outputs=False, time_limit_s=1)
    measured = measure_peak_bytes(optimized, (ids,), {"labels": ids}, warmup=True)
    plan = optimized.plan
    assert plan.loss_chunks > 1 and "loss chunks" in plan.table() and "reassociation" in plan.table()
    assert measured <= least, f"measured {measured} > budget {least}"
    assert abs(plan.predicted_peak_bytes - measured) <= 0.02 * measured
    for p in model.parameters():
        p.grad = None
    expected = reference(ids, labels=ids).loss
    expected.backward()
    loss = optimized(ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, expected, **TOL)
    _assert_grads_close(model, reference)


def test_loss_fn_path_chunks_and_the_plan_is_refused_on_another_model(tmp_path, labels_least):
    model, ids = _gpt2()
    ce = lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), label_smoothing=0.1)  # noqa: E731
    budget = 1.05 * labels_least  # the same step but the loss: below what it needs unchunked
    plan = fxmem.plan(model, (ids,), budget / GIB, loss_fn=ce, example_target=ids, time_limit_s=1)
    assert plan.loss_chunks > 1
    plan.save(tmp_path / "plan.json")
    loaded = fxmem.Plan.load(tmp_path / "plan.json")
    assert loaded.loss_chunks == plan.loss_chunks
    reference = copy.deepcopy(model)
    optimized = fxmem.optimize(model, plan=loaded, loss_fn=ce)
    loss = optimized(ids, target=ids)
    loss.backward()
    expected = ce(reference(ids), ids)
    expected.backward()
    torch.testing.assert_close(loss, expected, **TOL)
    _assert_grads_close(model, reference)
    other, _ = _gpt2(n_embd=32)
    with pytest.raises(PlanMismatchError):
        fxmem.optimize(other, plan=loaded, loss_fn=ce)(ids, target=ids)


@pytest.mark.parametrize("name", [*LOSSES, "labels= with num_items_in_batch"])
def test_losses_people_write_chunk_where_the_budget_needs_it_and_train_as_eager(name, monkeypatch):
    """At half of what any plan with the logits whole needs (the parameters, the log-softmax and its
    gradient), the planner computes the loss in chunks, meets the budget, and two SGD steps are eager's."""
    import fxmem.planner.loss_chunks

    monkeypatch.setattr(fxmem.planner.loss_chunks, "MAX_CHUNKS", 8)  # fewer chunk counts to plan: seconds
    model, ids = _gpt2(vocab=2000)
    target, reference = _labels(ids), copy.deepcopy(model)
    whole = sum(p.numel() * p.element_size() for p in model.parameters()) + 2 * 126 * 2000 * 4
    if name in LOSSES:
        loss_fn, kwargs = LOSSES[name], {"target": target}
        optimized = fxmem.optimize(model, budget_gb=whole / 2 / GIB, loss_fn=loss_fn, time_limit_s=1)
        step, eager = lambda: optimized(ids, **kwargs), lambda: loss_fn(reference(ids), target)
    else:  # transformers' ForCausalLMLoss: reduction="sum" divided by the count
        kwargs = {"labels": target, "num_items_in_batch": (target[:, 1:] != -100).sum()}
        optimized = fxmem.optimize(model, budget_gb=whole / 2 / GIB, keep_outputs=False, time_limit_s=1)
        step, eager = lambda: optimized(ids, **kwargs).loss, lambda: reference(ids, **kwargs).loss
    sgd, eager_sgd = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(2):
        sgd.zero_grad(set_to_none=True)
        eager_sgd.zero_grad(set_to_none=True)
        loss, expected = step(), eager()
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected, **TOL)
        _assert_grads_close(model, reference)
        sgd.step()
        eager_sgd.step()
    assert optimized.plan.loss_chunks > 1, optimized.plan.table()
    sgd.zero_grad(set_to_none=True)
    measured = measure_peak_bytes(optimized, (ids,), kwargs, warmup=False)
    assert measured <= whole / 2, f"measured {measured} > budget {whole / 2}"
