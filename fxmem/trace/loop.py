"""The user's training loop, as backward sees it: whether a call's outputs beside its loss are still alive when
backward starts (`out = model(...); out.loss.backward()` holds them; `model(...).loss.backward()` and
transformers' `Trainer` drop them first).

A model whose output has a scalar `loss` field (transformers' `labels=`), optimized without `keep_outputs=`,
is planned for the loop seen: `LoopWatch.loop` is HELD (the outputs returned detached and counted until
backward ends) until a call's outputs are seen dropped when its backward starts, then DROPPED (the loss alone
returned, the other fields None, so the loss can be computed in chunks); a call seen holding its output makes it
HELD again. Either plan is within the budget whatever the loop does (the dropped plan holds no outputs at all);
what a call that switches plans holds is its own first call's. The output container is held by a weak
reference (a transformers `ModelOutput`, a dataclass); outputs that cannot be (a plain dict or tuple) are not
watched, and stay held. Reads the outputs' liveness only; writes nothing but `loop`.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxmem.errors import fmt_bytes
from fxmem.trace.loss import is_loss, loss_field

HELD, DROPPED = "held", "dropped"


class LoopWatch:
    """Which loop the next call is planned for (`loop`), from the last call whose backward was seen."""

    def __init__(self) -> None:
        self.loop = HELD

    def watch(self, out: Any) -> None:
        """See, when backward reaches the call's loss, whether `out` or any tensor in it beside the loss is alive."""
        loss = loss_field(out)
        if not is_loss(loss) or loss.grad_fn is None:
            return
        try:
            refs = [weakref.ref(out)]
        except TypeError:  # a dict or tuple: whether the caller keeps it cannot be seen
            return
        leaves = out.values() if isinstance(out, dict) else [getattr(out, f, None) for f in getattr(
            out, "__dataclass_fields__", {})]
        refs += [weakref.ref(t) for t in pytree.tree_leaves(list(leaves))
                 if isinstance(t, torch.Tensor) and t is not loss]
        seen: list[bool] = []

        def at_backward(grads: Any) -> None:
            if not seen:  # the first backward through the call (not one with retain_graph after it)
                seen.append(True)
                self.loop = HELD if any(r() is not None for r in refs) else DROPPED

        loss.grad_fn.register_prehook(at_backward)


def loop_row(loss_row: str, loop: str, held_least: int | None = None) -> str:
    """The plan table's "loss" row, saying which loop the step was planned for."""
    if loop == HELD:
        return f"{loss_row}; planned for a loop that holds them through backward, until one is seen dropping them"
    if held_least is not None:
        return (f"the model's `loss` output; other outputs not returned (None): the budget is below what holding "
                f"them needs (at least {fmt_bytes(held_least)})")
    return ("the model's `loss` output; other outputs not returned (None): planned for the loop seen, which drops "
            "them before backward (a call seen holding its output plans them held again)")
