"""fxmem/planner/policies.py, fxmem/tools/policy_table.py: named policies planned by the engine, against the hand-written
`torch.utils.checkpoint` they stand for (peaks measured by MemTracker, losses and gradients against eager)."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fxmem
from fxmem import models
from fxmem.cli.main import main
from fxmem.measure import measure_peak_bytes
from fxmem.planner.policies import Policy, PolicyError, find_blocks, parse_policy, units_of
from tests.conftest import assert_trains_like

GIB = 2**30
GPT = {"n_layer": 4, "n_embd": 32, "n_head": 2, "vocab_size": 32, "block_size": 16, "dropout": 0.1}
# hand-written equivalents: which blocks run inside one torch.utils.checkpoint call each
CALLS = {"every-layer": [[0], [1], [2], [3]], "every-2-layers": [[0], [2]], "sqrt": [[0, 1], [2, 3]], "speed": []}


def hand_checkpointed(model: torch.nn.Module, calls: list[list[int]]) -> torch.nn.Module:
    """`model` (a zoo GPT) with each group of blocks run as one `checkpoint(..., use_reentrant=False)` call."""
    for group in calls:
        forwards = [model.blocks[i].forward for i in group]

        def run(x, forwards=forwards):
            for forward in forwards:
                x = forward(x)
            return x

        model.blocks[group[0]].forward = lambda x, run=run: checkpoint(run, x, use_reentrant=False)
        for i in group[1:]:
            model.blocks[i].forward = lambda x: x
    return model


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return models.from_name("gpt-tiny", **GPT), models.example_inputs("gpt-tiny", 2, **GPT)


# ---- names -------------------------------------------------------------------------------------
def test_names_and_their_forms():
    assert parse_policy(None) is None
    assert parse_policy("every-layer") == Policy("every-layer", 1) == parse_policy("every-1-layers")
    assert parse_policy("every-2-layers") == Policy("every-2-layers", 2) == parse_policy("every-n-layers", every_n=2)
    assert parse_policy(None, every_n=3) == Policy("every-3-layers", 3)
    assert [parse_policy(n).name for n in ("speed", "memory", "sqrt", "Every_Layer", "whole_step")] == \
        ["speed", "memory", "sqrt", "every-layer", "whole-step"]


@pytest.mark.parametrize("bad", ["fast", "every-0-layers", "every-n-layers", 3])
def test_a_bad_policy_is_one_line_listing_the_valid_ones(gpt, bad):
    model, _ = gpt
    with pytest.raises(PolicyError) as caught:
        fxmem.optimize(model, policy=bad)
    message = str(caught.value)
    assert "\n" not in message and "every-" in message
    if bad == "fast":
        assert all(name in message for name in ("speed", "memory", "every-layer", "every-N-layers", "sqrt"))


def test_every_n_must_be_a_whole_number_and_policies_refuse_other_planners(gpt):
    model, _ = gpt
    for every_n in (0, 1.5, True):
        with pytest.raises(PolicyError, match="every_n"):
            fxmem.optimize(model, every_n=every_n)
    with pytest.raises(PolicyError, match="offload"):
        fxmem.optimize(model, policy="sqrt", offload=True)
    with pytest.raises(PolicyError, match="num_stages"):
        fxmem.plan(model, (), policy="sqrt", num_stages=2)


def test_blocks_are_the_outermost_items_of_layer_lists():
    paths = ["wte", "blocks.0.ln_1", "blocks.0.attn.experts.0", "blocks.0.attn.experts.1", "blocks.1.mlp",
             "transformer.h.0", "ln_f", "head.0"]
    assert find_blocks(paths) == ("blocks.0", "blocks.1")  # experts are inside a block; h and head have 1 item
    blocks = tuple(f"model.layers.{k}" for k in range(9))
    assert find_blocks(f"{b}.mlp" for b in blocks) == blocks
    assert units_of(parse_policy("sqrt"), blocks) == {b: k // 3 for k, b in enumerate(blocks)}
    assert units_of(parse_policy("every-2-layers"), blocks) == {b: k for k, b in enumerate(blocks) if k % 2 == 0}


# ---- against torch.utils.checkpoint --------------------------------------------------------------
@pytest.mark.parametrize("name", ["every-layer", "every-2-layers", "sqrt", "speed"])
def test_zoo_gpt_policy_matches_hand_written_checkpointing(gpt, name):
    model, (x, y) = gpt
    optimized = fxmem.optimize(copy.deepcopy(model), policy=name)
    measured = measure_peak_bytes(optimized, (x, y))
    by_hand = measure_peak_bytes(hand_checkpointed(copy.deepcopy(model), CALLS[name]), (x, y))
    plan = optimized.plan
    assert plan.policy.startswith(name)
    assert measured <= by_hand * 1.01, f"{name}: fxmem {measured} bytes, torch.utils.checkpoint {by_hand}"
    assert abs(measured - plan.predicted_peak_bytes) <= 0.01 * measured  # the plan says what it holds
    if name == "speed":
        assert plan.recompute == () and plan.extra_flops == 0
    else:
        assert plan.recompute and plan.predicted_peak_bytes < plan.baseline_peak_bytes
    assert_trains_like(copy.deepcopy(model), optimized, (x, y))  # same loss, gradients and buffers as eager


def test_whole_step_saves_nothing_but_its_inputs(gpt):
    """"whole-step" is `checkpoint(model, ...)` around the whole step: nothing kept from forward to backward
    beyond the inputs (what a block run many times, as under FSDP2, should keep), and it trains as eager."""
    model, (x, y) = gpt
    optimized = fxmem.optimize(copy.deepcopy(model), policy="whole-step")
    measured = measure_peak_bytes(optimized, (x, y))
    whole = copy.deepcopy(model)
    forward = whole.forward
    whole.forward = lambda *args: checkpoint(forward, *args, use_reentrant=False)
    assert optimized.plan.saved_bytes == 0 and optimized.plan.policy.startswith("whole-step")
    assert measured < measure_peak_bytes(copy.deepcopy(model), (x, y))
    assert abs(measured - optimized.plan.predicted_peak_bytes) <= 0.01 * measured
    by_hand = measure_peak_bytes(whole, (x, y))
    assert measured <= by_hand * 1.01, f"whole-step: fxmem {measured} bytes, torch.utils.checkpoint {by_hand}"
    assert_trains_like(copy.deepcopy(model), optimized, (x, y))


def _transformers(kind: str) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                          use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=128, n_positions=64, use_cache=False,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("kind, name, every_n", [("gpt2", "every-layer", 1), ("gpt2", "every-2-layers", 2),
                                                 ("llama", "every-layer", 1)])
def test_transformers_policy_matches_activation_checkpointing(kind, name, every_n):
    model = _transformers(kind)
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "labels": ids}
    by_hand = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # torch.utils.checkpoint, use_reentrant=False; transformers 5.17 names it gradient_checkpointing_enable
        enable = getattr(by_hand, "activation_checkpointing_enable", None) or by_hand.gradient_checkpointing_enable
        enable(every_n_layers=every_n)
    optimized = fxmem.optimize(copy.deepcopy(model), policy=name)
    measured, expected = measure_peak_bytes(optimized, (), kwargs), measure_peak_bytes(by_hand, (), kwargs)
    assert measured <= expected * 1.01, f"{kind} {name}: fxmem {measured} bytes, checkpointing {expected}"
    assert measured < measure_peak_bytes(copy.deepcopy(model), (), kwargs)  # below eager without checkpointing
    assert_trains_like(copy.deepcopy(model), optimized, (), kwargs, atol=1e-6, rtol=1e-5)


# ---- memory, budgets, estimate, CLI --------------------------------------------------------------
def test_memory_is_the_least_budgets_plan(gpt):
    model, (x, y) = gpt
    least = fxmem.plan(model, (x, y), policy="memory", time_limit_s=1)
    with pytest.raises(fxmem.InfeasibleBudgetError) as refused:
        fxmem.plan(model, (x, y), budget_gb=1e-6, time_limit_s=1)
    assert least.budget_bytes == least.min_budget_bytes == refused.value.min_budget_bytes
    at_least = fxmem.plan(model, (x, y), budget_gb=least.budget_bytes / GIB, time_limit_s=1)
    assert least.predicted_peak_bytes <= least.budget_bytes
    assert abs(least.predicted_peak_bytes - at_least.predicted_peak_bytes) <= 0.01 * at_least.predicted_peak_bytes
    optimized = fxmem.optimize(copy.deepcopy(model), plan=least)
    measured = measure_peak_bytes(optimized, (x, y))
    # within 1% of the prediction (which prices every dropout's generator state, replayed or not), and the budget
    assert abs(measured - least.predicted_peak_bytes) <= 0.01 * measured and measured <= least.budget_bytes
    assert_trains_like(copy.deepcopy(model), optimized, (x, y))


def test_policy_with_a_budget_plans_where_it_fits_and_names_its_peak_where_not(gpt):
    model, (x, y) = gpt
    fits = fxmem.plan(model, (x, y), budget_gb=1.0, policy="every-layer")
    assert fits.policy.startswith("every-layer") and fits.budget_bytes == fits.predicted_peak_bytes
    with pytest.raises(PolicyError) as refused:
        fxmem.plan(model, (x, y), budget_gb=fits.predicted_peak_bytes / GIB, policy="every-layer")
    message = str(refused.value)
    assert "\n" not in message and "'every-layer' peaks at" in message and "budget_gb >=" in message
    needed = float(message.split("budget_gb >= ")[1].split(")")[0])
    assert fxmem.plan(model, (x, y), budget_gb=needed, policy="every-layer").recompute == fits.recompute


def test_estimate_lists_every_policy_beside_the_budget(gpt):
    model, (x, y) = gpt
    found = fxmem.estimate(model, (x, y), policies=True, budget_gb=0.0035, time_limit_s=2)
    names = [row.name for row in found.policies]
    assert names[:5] == ["speed", "every-2-layers", "every-layer", "sqrt", "memory"] and names[5].startswith("budget")
    rows = {row.name: row for row in found.policies}
    alone = fxmem.plan(model, (x, y), policy="sqrt")
    assert rows["sqrt"].plan.predicted_peak_bytes == alone.predicted_peak_bytes
    assert rows["sqrt"].plan.recompute == alone.recompute
    peaks = {name: row.plan.predicted_peak_bytes for name, row in rows.items() if row.plan is not None}
    assert peaks["memory"] <= min(peaks.values()) and peaks["speed"] == max(peaks.values())
    table = found.table()
    assert "policies" in table and max(map(len, table.splitlines())) <= 120


def test_cli_plans_under_a_policy(capsys):
    assert main(["gpt-tiny", "--policy", "every-layer", "--batch-size", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "policy" in out and "every-layer: 2 checkpointed calls over 2 blocks" in out
    assert main(["gpt-tiny", "--policy", "often", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "valid policies" in err
    assert main(["gpt-tiny", "--policies", "--quiet"]) == 2


def test_sqrt_segments_round_the_square_root():
    blocks = tuple(f"h.{k}" for k in range(12))
    segments = set(units_of(parse_policy("sqrt"), blocks).values())
    assert len(segments) == math.ceil(12 / round(math.sqrt(12)))


def test_fusible_recomputes_the_pointwise_ops_and_keeps_the_rest(gpt):
    """Inductor's partitioner's choice (`FUSIBLE`, planned beside a budget's plan under Inductor): every
    pointwise op backward needs is recomputed, matmuls, reductions and attention are kept, and training
    matches eager."""
    from fxmem.planner.policies import FUSIBLE

    model, inputs = gpt
    plan = fxmem.plan(copy.deepcopy(model), inputs, policy=FUSIBLE)
    pointwise = {"add", "mul", "sub", "div", "gelu", "tanh", "rsqrt", "pow", "neg", "exp"}
    decided = {row.name: (row.op.split(".")[0], row.decision) for row in plan.nodes}
    recomputed = {op for op, decision in decided.values() if decision == "recompute"}
    saved = {op for op, decision in decided.values() if decision == "save"}
    assert recomputed and recomputed & pointwise and not recomputed & {"mm", "addmm", "bmm", "var_mean"}
    assert not saved & pointwise - {"add"}  # what backward reads of the pointwise ops is recomputed (a sum's
    # inputs may be saved in its place)
    assert plan.predicted_peak_bytes < plan.baseline_peak_bytes
    optimized = fxmem.optimize(copy.deepcopy(model), plan=plan)
    assert_trains_like(copy.deepcopy(model), optimized, inputs)
