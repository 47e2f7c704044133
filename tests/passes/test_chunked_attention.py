"""Attention in chunks of queries (fxmem/ops/chunked_attention.py, passes/chunked_attention.py,
fxmem/planner/attention_chunks.py): the same outputs and gradients as eager's naive attention to float
reassociation at any chunk count, causal, `where` and additive masks included; found in symbolic_trace
and export graphs and left alone where dropout draws masks; chosen by the planner where the budget needs
it, met when measured, recorded in the plan and refused on another model."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import fxmem
from fxmem.trace.capture import capture
from fxmem.ops.chunked_attention import chunked_attention
from fxmem.errors import PlanMismatchError
from fxmem.measure import measure_peak_bytes
from fxmem.passes.chunked_attention import attention_sites, chunk_attention
from models.gpt import GPT, GPTConfig
from tests.conftest import GIB

TOL = dict(atol=1e-6, rtol=1e-5)  # float32 sums over query chunks in another order


def _qkv(batch=2, heads=3, seq=32, dim=4, grads=(True, True, True)):
    torch.manual_seed(seq)
    return [torch.randn(batch, heads, seq, dim, requires_grad=g) for g in grads]


@pytest.mark.parametrize("chunks", [1, 2, 7])  # 32 queries in 7 chunks: 5 each, the last of 2
def test_function_equals_eager_with_causal_and_additive_masks(chunks):
    q, k, v = _qkv()
    causal = torch.ones(32, 32, dtype=torch.bool).triu(1)
    pad = torch.zeros(2, 1, 1, 32)
    pad[1, ..., -5:] = -1e4
    pad.requires_grad_(True)  # an additive mask's gradient, as eager's

    def eager():
        scores = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(4))
        return torch.softmax(scores.masked_fill(causal, float("-inf")) + pad, dim=-1) @ v

    ops = (("mul", 1 / math.sqrt(4)), ("fill", 0, float("-inf")), ("add", 1))
    expected = eager()
    seed = torch.randn_like(expected)
    got = chunked_attention(q, k.transpose(-2, -1), v, chunks, ops, causal, pad)
    torch.testing.assert_close(got, expected, **TOL)
    for a, b in zip(torch.autograd.grad(got, (q, k, v, pad), seed), torch.autograd.grad(expected, (q, k, v, pad), seed)):
        torch.testing.assert_close(a, b, **TOL)


def test_function_with_where_mask_and_none_gradients():
    q, k, v = _qkv(seq=9, grads=(False, True, False))
    keep = torch.ones(9, 9, dtype=torch.bool).tril()
    expected = torch.softmax(torch.where(keep, (q @ k.transpose(-2, -1)) / 2.0, -1e9), dim=-1) @ v
    got = chunked_attention(q, k.transpose(-2, -1), v, 4, (("div", 2.0), ("where", 0, -1e9, True)), keep)
    torch.testing.assert_close(got, expected, **TOL)
    (grad,) = torch.autograd.grad(got.sum(), (k,))
    torch.testing.assert_close(grad, torch.autograd.grad(expected.sum(), (k,))[0], **TOL)
    with pytest.raises(ValueError, match="unknown score op"):
        chunked_attention(q, k.transpose(-2, -1), v, 2, (("fill", 1, 0.0),), keep)


class Decoder(torch.nn.Module):
    """One hand-written attention layer: `torch.where` causal mask, scale from the input's shape, a padding
    mask added, `.softmax`; `dropout` draws masks when p > 0."""

    def __init__(self, dim=16, heads=2, dropout=0.0, return_probs=False):
        super().__init__()
        self.qkv, self.out, self.heads = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, 1), heads
        self.drop, self.return_probs = torch.nn.Dropout(dropout), return_probs
        self.register_buffer("keep", torch.ones(64, 64, dtype=torch.bool).tril())

    def forward(self, x, pad):
        B, T, C = x.size(0), x.size(1), x.size(2)
        qkv = self.qkv(x).view(B, T, 3, self.heads, C // self.heads)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(C // self.heads)
        scores = torch.where(self.keep.narrow(0, 0, T).narrow(1, 0, T), scores, -1e9) + pad[:, None, None, :]
        probs = self.drop(scores.softmax(-1))
        y = self.out((probs @ v).transpose(1, 2).reshape(B, T, C)).sum()
        return (y, probs) if self.return_probs else y


def _decoder_inputs():
    torch.manual_seed(0)
    pad = torch.zeros(2, 12)
    pad[1, -4:] = -1e4
    return torch.randn(2, 12, 16), pad


def _assert_grads_close(model, reference):
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert (p.grad is None) == (ref[name].grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, ref[name].grad, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("method,chunks", [("symbolic_trace", 7), ("export", 2), ("export", 1)])
def test_pass_equals_eager_on_both_tracers(method, chunks):
    model = Decoder()
    x, pad = _decoder_inputs()
    gm = capture(model, (x, pad), method=method)
    (site,) = attention_sites(gm)
    assert (site.batch, site.queries, site.keys, site.head_dim) == (4, 12, 12, 8)
    chunk_attention(gm, chunks)
    assert bool(attention_sites(gm)) == (chunks == 1)
    reference = copy.deepcopy(model)
    expected = reference(x, pad)
    expected.backward()
    loss = gm(x, pad)
    loss.backward()
    torch.testing.assert_close(loss, expected, **TOL)
    _assert_grads_close(model, reference)


def test_sites_need_dropout_that_draws_nothing_and_probabilities_nothing_else_reads():
    x, pad = _decoder_inputs()
    assert attention_sites(capture(Decoder(dropout=0.1).eval(), (x, pad)))
    assert attention_sites(capture(Decoder(dropout=0.0), (x, pad)))
    assert not attention_sites(capture(Decoder(dropout=0.1), (x, pad)))  # training: eager's masks left as traced
    assert not attention_sites(capture(Decoder(return_probs=True), (x, pad)))


def test_pass_on_transformers_eager_attention_equals_eager():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32, use_cache=False,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "eager"  # written out, with transformers' scale, mask and `.type(value.dtype)`
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 64, (1, 32))
    gm = capture(model, (ids,), {"labels": ids})
    (site,) = attention_sites(gm)
    assert (site.batch, site.queries, site.head_dim) == (2, 32, 8)
    reference = copy.deepcopy(model)
    expected = reference(ids, labels=ids).loss
    expected.backward()
    out = chunk_attention(gm, 3)(ids, labels=ids)
    loss = out["loss"] if isinstance(out, dict) else out[0]
    loss.backward()
    torch.testing.assert_close(loss, expected, **TOL)
    _assert_grads_close(model, reference)


def _gpt(n_embd=16):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=32, block_size=64, n_layer=1, n_head=2, n_embd=n_embd, dropout=0.0)
    return GPT(config).train(), torch.randint(0, 32, (1, 64))


@pytest.fixture(scope="module")
def gpt_least():
    """The least budget the planner names for the tiny zoo GPT's step (attention in chunks)."""
    model, ids = _gpt()
    with pytest.raises(fxmem.InfeasibleBudgetError) as info:
        fxmem.plan(model, (ids,), 1e-6, example_kwargs={"targets": ids}, time_limit_s=1)
    assert "chunks of queries" in str(info.value)
    return info.value.min_budget_bytes


def test_zoo_gpt_chunks_where_the_budget_needs_it_meets_it_and_the_plan_is_refused_elsewhere(gpt_least, tmp_path):
    model, ids = _gpt()
    reference = copy.deepcopy(model)
    plan = fxmem.plan(model, (ids,), gpt_least / GIB, example_kwargs={"targets": ids}, time_limit_s=1)
    assert plan.attention_chunks > 1 and "attention chunks" in plan.table() and "reassociation" in plan.table()
    plan.save(tmp_path / "plan.json")
    loaded = fxmem.Plan.load(tmp_path / "plan.json")
    assert loaded.attention_chunks == plan.attention_chunks
    optimized = fxmem.optimize(model, plan=loaded)  # rewrites the graph as the plan says
    measured = measure_peak_bytes(optimized, (ids,), {"targets": ids}, warmup=True)
    assert measured <= gpt_least, f"measured {measured} > budget {gpt_least}"
    for p in model.parameters():
        p.grad = None
    expected = reference(ids, ids)
    expected.backward()
    loss = optimized(ids, targets=ids)
    loss.backward()
    torch.testing.assert_close(loss, expected, **TOL)
    _assert_grads_close(model, reference)
    with pytest.raises(PlanMismatchError, match="no naive attention"):
        fxmem.optimize(NoAttention(), plan=loaded)(torch.randn(2, 4))
    with pytest.raises(PlanMismatchError):
        fxmem.optimize(_gpt(n_embd=32)[0], plan=loaded)(ids, targets=ids)


class NoAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.linear(x).sum()
