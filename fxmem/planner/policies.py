"""Named policies beside budgets: the usual checkpointing recipes, planned as fxmem plans.

Reads a policy name (`parse_policy`) and, for a captured step, the module path of every joint-graph
node (`meta["nn_module_stack"]`, through the `CostTable`); returns the recompute decision the planner
then simulates, prices and reports like any other (`fxmem.planner.planner`). Writes nothing.

- "speed": keep everything (no recompute), the step as planned without a budget.
- "memory": the least budget fxmem finds (proven where the search proves it), and its plan.
- "every-layer", "every-N-layers": `torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`
  on every N-th block (block k when k % N == 0, as transformers' `every_n_layers`): such a block keeps
  its inputs and recomputes inside; the other blocks and everything outside the blocks keep all.
- "sqrt": the L blocks in segments of round(sqrt(L)), each segment checkpointed as one call (Chen et
  al.'s sqrt(L) checkpoints, `torch.utils.checkpoint.checkpoint_sequential`).
- "fusible" (`FUSIBLE`, planned by `fxmem.run.inductor.planning` beside a budget's plan, not named by users):
  every pointwise op recomputed, as Inductor fuses it into the kernel that reads it, the rest kept.
- "whole-step": the whole step as one checkpointed call (`checkpoint(model, x)`): the inputs kept,
  everything else recomputed. For a step that runs many times with its saved values held (one block
  of an FSDP2 rank, `fxmem.fsdp`): it saves the least for backward.

Blocks are the items of the model's layer lists: a module path `<list>.<k>` where the list has two or
more items (`transformer.h.3`, `model.layers.3`, `blocks.3`), the outermost such item of each path.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch.fx

from fxmem.price.cost import is_pointwise
from fxmem.trace.module_path import module_path
from fxmem.errors import FxmemError, fmt_bytes, gb_at_least
from fxmem.planner.margin import margin_for
from fxmem.solve.problem import MemoryProblem, repair
from fxmem.solve.recompute.checkpoint import checkpoint_units

# the policies `fxmem.estimate(..., policies=True)` and docs/policies.md compare, least recompute first
POLICIES = ("speed", "every-2-layers", "every-layer", "sqrt", "memory")
_EVERY = re.compile(r"every-(\d+)-layers?")


class PolicyError(FxmemError, ValueError):
    """A policy name fxmem does not know, or a policy that does not apply to this model or budget."""


@dataclass(frozen=True)
class Policy:
    """A named policy: `every_n` > 0 checkpoints every n-th block; "sqrt" segments of blocks."""

    name: str
    every_n: int = 0

    @property
    def checkpoints(self) -> bool:
        """The policy decides what is recomputed (the others keep all, or search the least)."""
        return self.every_n > 0 or self.name in ("sqrt", "whole-step", FUSIBLE.name)


# Inductor's own choice, as its partitioner makes it: every pointwise op recomputed (Inductor fuses it into the
# kernel that reads it), the rest kept. Not a user's policy: `fxmem.run.inductor.planning` plans it beside a budget's.
FUSIBLE = Policy("fusible")


def valid_names() -> str:
    return ("speed, memory, every-layer, every-N-layers (every-2-layers, ...; or every-n-layers with every_n=N), sqrt, "
            "whole-step")


def parse_policy(policy: str | Policy | None, every_n: int | None = None) -> Policy | None:
    """The policy named (None: none). `every_n` alone means "every-n-layers" with that n."""
    if isinstance(policy, Policy):
        return policy
    if every_n is not None:
        if isinstance(every_n, bool) or not isinstance(every_n, int) or every_n < 1:
            raise PolicyError(f"every_n must be a whole number of blocks >= 1, got {every_n!r}")
        if policy not in (None, "every-n-layers"):
            raise PolicyError(f"every_n= goes with policy='every-n-layers' (or alone), not policy={policy!r}")
        return every_layers(every_n)
    if policy is None:
        return None
    if not isinstance(policy, str):
        raise PolicyError(f"policy must be a name ({valid_names()}), got {type(policy).__name__}")
    name = policy.strip().lower().replace("_", "-")
    if name in ("speed", "memory", "sqrt", "whole-step"):
        return Policy(name)
    if name == "every-layer":
        return every_layers(1)
    if name == "every-n-layers":
        raise PolicyError("policy 'every-n-layers' needs every_n=N (or name it 'every-N-layers', e.g. every-2-layers)")
    found = _EVERY.fullmatch(name)
    if found and int(found.group(1)) >= 1:
        return every_layers(int(found.group(1)))
    raise PolicyError(f"unknown policy {policy!r}; valid policies: {valid_names()}")


def every_layers(n: int) -> Policy:
    return Policy("every-layer" if n == 1 else f"every-{n}-layers", n)


# ---- blocks ------------------------------------------------------------------------------------
def find_blocks(module_paths: Iterable[str]) -> tuple[str, ...]:
    """The model's blocks, in the order the paths (forward order) first reach them: per path, the
    outermost `<list>.<k>` whose list has two or more items among the paths."""
    paths = [p.split(".") if p else [] for p in module_paths]
    items: dict[tuple[str, ...], set[str]] = {}
    for parts in paths:
        for j, part in enumerate(parts):
            if part.isdigit():
                items.setdefault(tuple(parts[:j]), set()).add(part)
    blocks: dict[str, None] = {}
    for parts in paths:
        block = _block_of(parts, items)
        if block is not None:
            blocks.setdefault(block, None)
    return tuple(blocks)


def _block_of(parts: list[str], items: dict[tuple[str, ...], set[str]]) -> str | None:
    for j, part in enumerate(parts):
        if part.isdigit() and len(items.get(tuple(parts[:j]), ())) >= 2:
            return ".".join(parts[:j + 1])
    return None


def block_of(path: str, blocks: tuple[str, ...]) -> str | None:
    """The block a module path lies in (None: outside every block)."""
    for block in blocks:
        if block == "" or path == block or path.startswith(block + "."):  # "": the whole step
            return block
    return None


def units_of(policy: Policy, blocks: tuple[str, ...]) -> dict[str, int]:
    """Block -> the checkpointed call it runs in (blocks the policy leaves alone are not listed)."""
    if policy.every_n:
        return {b: k for k, b in enumerate(blocks) if k % policy.every_n == 0}
    segment = max(1, round(math.sqrt(len(blocks))))
    return {b: k // segment for k, b in enumerate(blocks)}


def describe(policy: Policy, blocks: tuple[str, ...]) -> str:
    """One line for the plan's table: which blocks run as one checkpointed call each."""
    if policy.name == "speed":
        return "speed: keep everything, recompute nothing"
    if policy.name == "memory":
        return "memory: the least budget found, and its plan"
    if policy.name == "whole-step":
        return "whole-step: the step as one checkpointed call; inputs kept, everything else recomputed"
    units = units_of(policy, blocks)
    calls: dict[int, list[str]] = {}
    for block, unit in units.items():
        calls.setdefault(unit, []).append(block)
    shown = ", ".join(_span(members) for members in list(calls.values())[:4]) + (" ..." if len(calls) > 4 else "")
    return (f"{policy.name}: {len(calls)} checkpointed call{'s' if len(calls) != 1 else ''} over {len(blocks)} blocks "
            f"({shown}); inputs kept, insides recomputed")


def _span(members: list[str]) -> str:
    return members[0] if len(members) == 1 else f"{members[0]}-{members[-1].rsplit('.', 1)[-1]}"


def policy_recompute(policy: Policy, problem: MemoryProblem, nodes: Sequence[torch.fx.Node],
                     forward: Iterable[torch.fx.Node], model: str = "the model") -> tuple[frozenset[int], str]:
    """The recompute set of a checkpointing policy on the problem's candidates (`nodes`, their joint-graph
    nodes; `forward`: every forward node of the joint graph), and the plan's description of it."""
    if policy.name == FUSIBLE.name:
        chosen = [i for i, node in enumerate(nodes) if problem.can_recompute[i] and is_pointwise(node)]
        return repair(problem, chosen), "fusible: every pointwise op recomputed (fused by Inductor), the rest kept"
    module_of = {n.name: module_path(n) for n in forward}
    blocks = ("",) if policy.name == "whole-step" else find_blocks(module_of.values())
    if not blocks:
        raise PolicyError(f"policy {policy.name!r} checkpoints blocks, and {model} has none (no ModuleList or "
                          "Sequential of two or more modules runs in its step); use policy='memory' or budget_gb=")
    units = {"": 0} if policy.name == "whole-step" else units_of(policy, blocks)

    def unit(node: torch.fx.Node) -> int | None:
        if node.op != "call_function" or node.name not in module_of:
            return None
        block = block_of(module_of[node.name], blocks)
        return units.get(block) if block is not None else None

    unit_of = [unit(node) for node in nodes]
    escapes = [any(u.op != "call_function" or u.name not in module_of or unit(u) != own for u in node.users
                   if u.name in module_of or u.op == "output")
               for node, own in zip(nodes, unit_of)]
    return checkpoint_units(problem, unit_of, escapes), describe(policy, blocks)


def every_block_checkpointed(problem: MemoryProblem, nodes: Sequence[torch.fx.Node],
                             forward: Iterable[torch.fx.Node]) -> tuple[frozenset[int], ...]:
    """The "every-layer" decision, as one more start for the least-peak search (`fxmem.planner.fitting.lowest`):
    the searches find blocks by repeated sizes and can miss what the module paths show. () without blocks."""
    try:
        return (policy_recompute(every_layers(1), problem, nodes, forward)[0],)
    except PolicyError:
        return ()


def policy_within_budget(plan: Any, policy: Policy | None, budget: int | None) -> Any:
    """`plan` when no policy or no budget was given, or when the policy's plan fits `budget` with the
    planning margin a budget's plan leaves (`fxmem.planner.margin`); otherwise a one-line refusal naming its peak."""
    if policy is None or budget is None:
        return plan
    margin = margin_for(plan.device)
    if plan.predicted_peak_bytes + margin.bytes_for(budget) <= budget:
        return plan
    need = margin.least_budget(plan.predicted_peak_bytes)
    raise PolicyError(f"policy {policy.name!r} peaks at {fmt_bytes(plan.predicted_peak_bytes)} for {plan.model}, "
                      f"above the budget {fmt_bytes(budget)} (with the planning margin it needs "
                      f"budget_gb >= {gb_at_least(need)}); raise the budget, choose a policy that holds less "
                      "(every-layer, sqrt, memory), or pass budget_gb= alone to plan the cheapest step that fits")
