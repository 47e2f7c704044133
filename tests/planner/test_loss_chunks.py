"""`fxmem.planner.loss_chunks`: a `labels=` model whose logits are returned beside its loss cannot have its
loss chunked; its refusal says so and names keep_outputs=False, which lets it chunk and need less.
Where a plan fits, the chunk count is doubled while the plan gets faster (where the loss as traced does not
fit, counts are tried from 8 up, then fewer while faster); the least search skips
planning the loss as traced below its floor."""
from __future__ import annotations

import pytest
import torch

import fxmem


def _gpt2(n_layer: int, n_embd: int, vocab: int, batch: int, seq: int):
    """A transformers GPT-2 of that shape, without a cache, and a batch of token ids for it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=2, vocab_size=vocab, n_positions=seq, use_cache=False))
    return model, torch.randint(0, vocab, (batch, seq))


def test_labels_refusal_names_keep_outputs_false_which_chunks_the_loss():
    model, ids = _gpt2(n_layer=1, n_embd=32, vocab=2000, batch=2, seq=64)
    kwargs = {"input_ids": ids, "labels": ids}
    with pytest.raises(fxmem.InfeasibleBudgetError) as kept:
        fxmem.plan(model, (), 0.001, example_kwargs=kwargs, time_limit_s=2)
    assert "keep_outputs=False" in str(kept.value) and "\n" not in str(kept.value), kept.value
    with pytest.raises(fxmem.InfeasibleBudgetError) as dropped:
        fxmem.plan(model, (), 0.001, example_kwargs=kwargs, keep_outputs=False, time_limit_s=2)
    assert "chunks of tokens" in str(dropped.value), dropped.value
    assert dropped.value.min_budget_bytes < kept.value.min_budget_bytes


def _counts(predicted: dict[int, float], extra: dict[int, int], asked: list[int]):
    """A stand-in for planning the step with the loss in k chunks: plans whose predicted time and extra
    FLOPs are given per k (a k missing from `predicted` does not fit)."""
    from types import SimpleNamespace

    def chunked(k: int):
        asked.append(k)
        if k not in predicted:
            raise fxmem.InfeasibleBudgetError(1, 2)
        return SimpleNamespace(loss_chunks=k, predicted_step_s=predicted[k], extra_flops=extra[k]), None
    return chunked


@pytest.mark.parametrize("predicted, extra, chosen, asked", [
    # more chunks free more of the loss region: doubled while faster, stopped at the first not faster
    ({1: 10.0, 2: 9.0, 4: 8.5, 8: 8.5, 16: 7.0}, {1: 50, 2: 40, 4: 30, 8: 30, 16: 12}, 4, [1, 2, 4, 8]),
    # stopped after a plan recomputing no more than the lm head (10): no count can be faster
    ({1: 10.0, 2: 9.0, 4: 8.0}, {1: 50, 2: 10, 4: 10}, 2, [1, 2]),
    # a count that does not fit stops the doubling
    ({1: 10.0, 2: 9.0}, {1: 50, 2: 40}, 2, [1, 2, 4]),
    # as traced recomputing no more than the lm head costs: never chunked
    ({1: 10.0, 2: 9.0}, {1: 10, 2: 10}, 1, [1]),
    # 2 chunks pay the lm head's matmul and are slower, 4 free enough to be faster
    ({1: 10.0, 2: 10.5, 4: 9.5, 8: 9.6}, {1: 50, 2: 45, 4: 30, 8: 30}, 4, [1, 2, 4, 8]),
    # nor are 4: as traced kept
    ({1: 10.0, 2: 10.5, 4: 10.6, 8: 9.0}, {1: 50, 2: 45, 4: 40, 8: 30}, 1, [1, 2, 4]),
    # from the fewest chunks that fit (4), up to the most worth making (16)
    ({4: 9.0, 8: 8.0, 16: 7.0, 32: 6.0}, {4: 50, 8: 40, 16: 30, 32: 20}, 16, [4, 8, 16]),
])
def test_fastest_chunks_doubles_the_count_while_the_plan_gets_faster(predicted, extra, chosen, asked):
    from fxmem.planner.loss_chunks import _fastest_chunks

    tried: list[int] = []
    chunked = _counts(predicted, extra, tried)
    plan, _ = _fastest_chunks(chunked, chunked(min(predicted)), lm_head_flops=10, most=16)
    assert plan.loss_chunks == chosen and tried == asked



def _least_counts(least: dict[int, int], predicted: dict[int, float], asked: list[int]):
    """`_counts` where a count that does not fit names its least budget (`least`, bytes); each count planned
    once, as the planner does."""
    from types import SimpleNamespace

    def chunked(k: int):
        if k not in asked:
            asked.append(k)
        if k in least:
            raise fxmem.InfeasibleBudgetError(100, least[k])
        return SimpleNamespace(loss_chunks=k, predicted_step_s=predicted[k], extra_flops=50), None
    return chunked


@pytest.mark.parametrize("least, predicted, floor, chosen, asked", [
    # 8 fits; 4 fits and is faster (fewer ops), 2 does not fit: 4, without planning 16, 32, 64
    ({2: 150}, {4: 8.0, 8: 9.0}, 0, 4, [8, 4, 2]),
    # 8 fits, 4 is slower: 8, then doubled while faster (16 is not)
    ({}, {4: 9.5, 8: 9.0, 16: 9.2}, 0, 8, [8, 4, 16]),
    # 8 misses by less than the region more chunks can free: 16 next, which fits
    ({8: 110}, {16: 9.0, 32: 9.5}, 0, 16, [8, 16, 32]),
    # 8 misses by more than the whole region: the most next
    ({8: 400, 32: 150}, {64: 9.0}, 0, 64, [8, 64, 32]),
    # a budget below the weights' floor: the most first
    ({}, {64: 9.0, 32: 9.5}, 200, 64, [64, 32]),
])
def test_chunk_counts_are_searched_from_eight_then_fewer_while_faster(least, predicted, floor, chosen, asked):
    from fxmem.planner.loss_chunks import _fewer_while_faster, _first_fitting

    tried: list[int] = []
    chunked = _least_counts(least, predicted, tried)
    fitting = _first_fitting(chunked, most=64, region=160, budget=100, floor=floor)
    plan, _ = _fewer_while_faster(chunked, fitting)
    if plan is fitting[0]:  # the planner then doubles while faster (`_fastest_chunks`, above)
        from fxmem.planner.loss_chunks import _fastest_chunks

        plan, _ = _fastest_chunks(chunked, fitting, lm_head_flops=10, most=64)
    assert plan.loss_chunks == chosen and tried == asked

def _counted_least_search(monkeypatch, model, ids):
    """(the graphs planned so far, a call returning the refusal that names `model`'s least with a cross-entropy
    `loss_fn`): each graph the engine plans is counted."""
    import torch.nn.functional as F

    import fxmem.run.engine

    planned, plan_graph = [], fxmem.run.engine._planned
    monkeypatch.setattr(fxmem.run.engine, "_planned", lambda *args: planned.append(args[1]) or plan_graph(*args))

    def least() -> fxmem.InfeasibleBudgetError:
        with pytest.raises(fxmem.InfeasibleBudgetError) as refused:
            fxmem.plan(model, (ids,), 1e-6, loss_fn=lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten()),
                       example_target=ids, time_limit_s=2)
        return refused.value

    return planned, least


def test_least_is_the_same_when_the_loss_as_traced_is_not_planned_below_its_floor(monkeypatch):
    import fxmem.planner.loss_chunks
    import fxmem.planner.shape_reuse

    model, ids = _gpt2(n_layer=1, n_embd=32, vocab=2000, batch=2, seq=64)
    planned, least = _counted_least_search(monkeypatch, model, ids)

    skipping = least()
    floor_skipped = len(planned)
    fxmem.planner.shape_reuse.forget()  # the counts refused are planned again, not read from the first call's
    monkeypatch.setattr(fxmem.planner.loss_chunks, "traced_floor", lambda gm, sites: 0)  # the loss as traced planned too
    compared = least()
    assert (skipping.min_budget_bytes, skipping.loss_chunks) == (compared.min_budget_bytes, compared.loss_chunks)
    assert skipping.loss_chunks > 1 and floor_skipped == 1 and len(planned) - floor_skipped == 2


def test_a_loss_region_under_a_tenth_of_the_budget_is_not_chunked_where_the_step_fits(monkeypatch):
    import fxmem.run.engine
    import fxmem.planner.loss_chunks

    model, ids = _gpt2(n_layer=2, n_embd=64, vocab=64, batch=4, seq=128)
    kwargs = {"input_ids": ids, "labels": ids}
    with pytest.raises(fxmem.InfeasibleBudgetError) as refused:
        fxmem.plan(model, (), 1e-6, example_kwargs=kwargs, keep_outputs=False, time_limit_s=2)
    budget = 1.1 * refused.value.min_budget_bytes / 2**30  # matmuls recomputed: more than the lm head's cost
    planned, plan_graph = [], fxmem.run.engine._planned
    monkeypatch.setattr(fxmem.run.engine, "_planned", lambda *args: planned.append(args[1]) or plan_graph(*args))
    plan = fxmem.plan(model, (), budget, example_kwargs=kwargs, keep_outputs=False, time_limit_s=2)
    lm_head_flops = 2 * 512 * 64 * 64  # the loss region, 3 x 512 x 64 x 4 bytes, is 7% of the budget
    assert plan.extra_flops > lm_head_flops and plan.loss_chunks == 1 and len(planned) == 1
    monkeypatch.setattr(fxmem.planner.loss_chunks, "WORTH_TRYING", 0.0)
    planned.clear()
    fxmem.plan(model, (), budget, example_kwargs=kwargs, keep_outputs=False, time_limit_s=2)
    assert len(planned) > 1


def test_fewer_chunks_take_the_decision_of_the_count_above_or_are_not_solved():
    """Halving the count (`_fewer_while_faster`) plans inside `shape_reuse.seeds_only`: a count the decision of
    the count above does not fit is not solved afresh (the planner raises `SeedDoesNotFit`), and the search stops
    at the count above."""
    from types import SimpleNamespace

    from fxmem.planner import shape_reuse
    from fxmem.planner.loss_chunks import _fewer_while_faster

    asked = []

    def chunked(k: int):
        asked.append((k, shape_reuse._step.__dict__.get("only", False)))
        if k == 2:
            shape_reuse.unseeded()  # what the planner does where the seed does not fit
            raise AssertionError("solved afresh inside seeds_only")
        return SimpleNamespace(loss_chunks=k, predicted_step_s={8: 9.0, 4: 8.0}[k]), None

    with shape_reuse.one_step():
        plan, _ = _fewer_while_faster(chunked, chunked(8))
    assert plan.loss_chunks == 4 and asked == [(8, False), (4, True), (2, True)]
    shape_reuse.unseeded()  # outside seeds_only: solving goes on


def test_a_count_refused_below_its_least_is_not_traced_again_and_the_plan_is_a_fresh_ones(monkeypatch):
    """A budget just under the least is refused naming it again; the call at that least then plans only the counts
    that may fit it: a count refused before with a higher least is refused at once, without a trace, and the plan
    is the one a fresh process makes."""
    import torch.nn.functional as F

    import fxmem.planner.loss_chunks
    from fxmem.planner import shape_reuse

    model, ids = _gpt2(n_layer=1, n_embd=32, vocab=2000, batch=2, seq=64)
    traced, chunk_loss = [], fxmem.planner.loss_chunks.chunk_loss
    monkeypatch.setattr(fxmem.planner.loss_chunks, "chunk_loss", lambda gm, k: traced.append(k) or chunk_loss(gm, k))
    loss = lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten())  # noqa: E731

    def plan(budget_bytes: int):
        traced.clear()
        return fxmem.plan(model, (ids,), budget_bytes / 2**30, loss_fn=loss, example_target=ids, time_limit_s=2)

    with pytest.raises(fxmem.InfeasibleBudgetError) as refused:
        plan(1024)
    least = refused.value.min_budget_bytes
    with pytest.raises(fxmem.InfeasibleBudgetError) as under:
        plan(least - 1024)
    assert under.value.min_budget_bytes == least
    refused_counts = set(traced)
    again = plan(least)
    after_refusals = set(traced)
    shape_reuse.forget()
    fresh = plan(least)
    assert again.predicted_peak_bytes <= least and again.loss_chunks > 1
    assert (again.loss_chunks, again.predicted_peak_bytes, again.recompute) == \
        (fresh.loss_chunks, fresh.predicted_peak_bytes, fresh.recompute)
    skipped = set(traced) - after_refusals
    assert skipped and skipped <= refused_counts and after_refusals < set(traced), (refused_counts, after_refusals, traced)


def test_fewer_chunks_are_planned_only_where_their_ops_could_save_two_percent_of_the_step():
    """Fewer chunks save only their ops' overhead: at GPT-2 124M's step on an h100 (8 chunks, ~91 ms) at most
    about 1 ms, so no fewer count is traced and planned; on a step a tenth as long they are."""
    from types import SimpleNamespace

    from fxmem.planner.loss_chunks import OPS_PER_CHUNK, _fewer_may_gain
    from fxmem.price.cost import DEVICE_PRESETS

    h100 = DEVICE_PRESETS["h100"]
    saved_s = 6 * OPS_PER_CHUNK * h100.op_overhead_s  # 8 chunks down to 2
    assert not _fewer_may_gain(SimpleNamespace(loss_chunks=8, predicted_step_s=0.091), h100)
    assert _fewer_may_gain(SimpleNamespace(loss_chunks=8, predicted_step_s=0.0091), h100)
    assert _fewer_may_gain(SimpleNamespace(loss_chunks=8, predicted_step_s=saved_s / 0.02), h100)
    assert not _fewer_may_gain(SimpleNamespace(loss_chunks=2, predicted_step_s=0.0091), h100)  # none fewer


def test_a_least_set_by_the_weights_is_found_with_the_loss_as_traced_alone(monkeypatch):
    """Where the loss's floor as traced is under the weights' (parameters and gradients, every plan's floor), the
    least search plans 1 chunk first, and a least within 1% of the weights' is the least: one trace, and the least
    the search through chunk counts finds too."""
    import fxmem.planner.loss_chunks

    model, ids = _gpt2(n_layer=1, n_embd=256, vocab=64, batch=1, seq=8)  # 3 MiB of weights, a 4 KiB loss region
    planned, least = _counted_least_search(monkeypatch, model, ids)

    traced = least()
    assert len(planned) == 1 and getattr(traced, "loss_chunks", 1) == 1
    fxmem.planner.shape_reuse.forget()
    monkeypatch.setattr(fxmem.planner.loss_chunks, "_weights_floor", lambda gm: 0)  # chunk counts searched first
    planned.clear()
    searched = least()
    assert len(planned) == 2 and searched.min_budget_bytes == traced.min_budget_bytes


def test_more_chunks_are_planned_only_where_the_room_they_free_may_save_two_percent(monkeypatch):
    """Twice the chunks are traced and planned only where what the plan's decision would stop recomputing with
    the room they free, less the ops they add, may reach 2% of the step; a step without a kept decision (or
    under Inductor) is planned as before."""
    from types import SimpleNamespace

    import fxmem.planner.loss_chunks as loss_chunks
    from fxmem.price.cost import DEVICE_PRESETS

    h100 = DEVICE_PRESETS["h100"]
    request = SimpleNamespace(inner="aot_eager", device=h100, time_limit_s=2.0)
    site = SimpleNamespace(lm_head_flops=lambda: 0, dtype=torch.float32)
    rooms = []

    def saved(saving_s):
        monkeypatch.setattr(loss_chunks, "recompute_saved_s", lambda problem, rec, room, limit_s: rooms.append(room)
                            or saving_s)

    planned = (SimpleNamespace(loss_chunks=8, predicted_step_s=0.1), SimpleNamespace(planner=SimpleNamespace(
        decided=("problem", frozenset({1})))))
    added_s = 8 * loss_chunks.OPS_PER_CHUNK * h100.op_overhead_s
    saved(added_s + 0.0019)
    assert not loss_chunks._more_may_gain(planned, 16, 1600, [site], request)
    saved(added_s + 0.0021)
    assert loss_chunks._more_may_gain(planned, 16, 1600, [site], request)
    assert rooms == [100, 100]  # 1600 / 8 - 1600 / 16
    saved(0.0)
    assert loss_chunks._more_may_gain(planned, 16, 1600, [site], SimpleNamespace(**{**vars(request), "inner": "inductor"}))
    assert loss_chunks._more_may_gain((planned[0], SimpleNamespace(planner=SimpleNamespace(decided=None))), 16, 1600,
                                      [site], request)

    asked = []
    fitting = (SimpleNamespace(loss_chunks=8, predicted_step_s=0.1, extra_flops=100), None)
    best = loss_chunks._fastest_chunks(lambda k: asked.append(k), fitting, lm_head_flops=10, most=64,
                                       may_gain=lambda planned, chunks: False)
    assert best is fitting and asked == []


def test_doubling_stops_after_a_count_that_gains_under_two_percent():
    """Twice the chunks free half the room the count before freed: after a count under 2% faster than half of
    it, no more are planned (the faster of the two is kept)."""
    from types import SimpleNamespace

    from fxmem.planner.loss_chunks import _fastest_chunks

    asked = []

    def chunked(k):
        asked.append(k)
        return SimpleNamespace(loss_chunks=k, predicted_step_s={16: 8.9, 32: 8.0}[k], extra_flops=100), None

    fitting = (SimpleNamespace(loss_chunks=8, predicted_step_s=9.0, extra_flops=100), None)
    best = _fastest_chunks(chunked, fitting, lm_head_flops=10, most=64)
    assert best[0].loss_chunks == 16 and asked == [16]
