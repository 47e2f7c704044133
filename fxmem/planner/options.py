"""The groups `fxmem.plan` and `fxmem.optimize` take their related options in: the loss (`fxmem.Loss`),
pipeline stages (`fxmem.Pipeline`) and the solver (`fxmem.Solver`). Each group stands for keywords
users already write (`loss_fn=`, `num_stages=`, `time_limit_s=`...), which keep working; a group and one of
its own keywords together are refused in one line. Reads and writes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable


@dataclass(frozen=True)
class Loss:
    """Where the step's loss comes from. `fn(outputs, target) -> scalar` plans the whole step
    `fn(model(*inputs), target)` (`target`: `fxmem.plan`'s example target; `fxmem.optimize` takes it at
    each call as `target=`). Without `fn`, a model whose output has a scalar `loss` is planned from it
    (`from_model=False`: every output keeps its gradient). `keep_outputs`: the outputs beside the loss
    are returned and held to the step's end (default: with `fn`, not returned; a model's own loss, returned)."""

    fn: Callable[[Any, Any], Any] | None = None
    target: Any = None
    keep_outputs: bool | None = None
    from_model: bool = True


@dataclass(frozen=True)
class Pipeline:
    """Pipeline stages (`fxmem.plan` only): `num_stages` stages for `torch.distributed.pipelining`, run
    by `schedule` ("1f1b" or "gpipe") over `n_microbatches`; `example_inputs` is then one microbatch and
    the budget is per stage."""

    num_stages: int
    schedule: str = "1f1b"
    n_microbatches: int | None = None


@dataclass(frozen=True)
class Solver:
    """How the decision is searched: `name` ("auto", "exact", "layered", "cpsat", "greedy"), stopped at
    `time_limit_s`, with kernels priced by timing them on the device here where `calibrate` (default: when
    the model is on a GPU)."""

    name: str = "auto"
    time_limit_s: float = 10.0
    calibrate: bool | None = None


# each group's fields as the keywords users already write
SPELLINGS = {Loss: {"fn": "loss_fn", "target": "example_target", "keep_outputs": "keep_outputs",
                    "from_model": "model_loss"},
             Pipeline: {"num_stages": "num_stages", "schedule": "schedule", "n_microbatches": "n_microbatches"},
             Solver: {"name": "solver", "time_limit_s": "time_limit_s", "calibrate": "calibrate"}}


def spelled_out(group: Any, keywords: dict[str, Any], defaults: dict[str, Any], name: str) -> dict[str, Any]:
    """The keywords `group` stands for, as `keywords` would give them: from the group where given (none of
    its keywords may then be given too), else `keywords` as they are."""
    if group is None:
        return keywords
    kind = next((k for k in SPELLINGS if isinstance(group, k)), None)
    if kind is None:
        raise TypeError(f"{name}= takes an fxmem.{name.capitalize()}(...), got {type(group).__name__}")
    both = [word for word in SPELLINGS[kind].values() if word in keywords and keywords[word] != defaults[word]]
    if both:
        raise ValueError(f"pass {name}=fxmem.{kind.__name__}(...) or {both[0]}=, not both")
    return {**keywords, **{SPELLINGS[kind][f.name]: getattr(group, f.name) for f in fields(group)
                           if SPELLINGS[kind][f.name] in keywords}}
