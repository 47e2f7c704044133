"""`fxmem.optimize`: one device's step (`fxmem.api.optimize`), or with `mesh=` one FSDP2 rank planned and sharded.

Reads the unsharded model, the job's 1-D `DeviceMesh` (its process group already initialized) and one rank's
example batch; writes nothing to disk. With `mesh=`, rank 0 of the mesh plans the rank as
`fxmem.fsdp.plan_fsdp` does for the mesh's size (in a fresh process it starts: the plan simulates the rank
under torch's fake process group, which cannot stand beside the job's own), then broadcasts the plan's
JSON (`torch.distributed.broadcast_object_list`); every rank applies `fxmem.fsdp.shard` with that one plan
and gets its model back sharded. Broadcasting rather than planning on every rank: the ranks cannot differ
(a plan depends on timing where a solver's time limit ends it, and on each rank's CPU load), and the
planning costs one rank's CPU, not every rank's. A planning error (an infeasible per-rank budget naming the
least) is broadcast too and raised on every rank, so no rank waits for a plan that will not come.
"""
from __future__ import annotations

import inspect
import io
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Sequence

import torch

from fxmem import api
from fxmem.budget import budget_bytes
from fxmem.error_boundary import public
from fxmem.errors import FxmemError, InfeasibleBudgetError
from fxmem.trace.call_check import check_model
from fxmem.trace.capture import example_args

# the keywords of fxmem.optimize that a rank's plan takes (the rest plan one device's step)
RANK_OPTIONS = ("budget_gb", "plan", "target", "device", "optimizer", "time_limit_s")


@public
def optimize(model: torch.nn.Module, *, mesh: Any = None, example_inputs: Sequence[Any] = (),
             example_kwargs: dict[str, Any] | None = None, **options: Any) -> torch.nn.Module:
    """`fxmem.api.optimize(model, **options)` (one device's step, planned at the first call), or with
    `mesh` (a 1-D `DeviceMesh` over the job's ranks) the rank of an FSDP2 job: planned now, from
    `example_inputs` / `example_kwargs` (one rank's batch; FSDP2's optimizer is made from the sharded
    parameters, so sharding cannot wait for the first call), under `budget_gb` per rank, and returned
    `fully_shard`-ed (every block, then the root, the plan's block step in every block: `fxmem.fsdp.shard`).
    With `mesh`, `plan=` may be an `FsdpPlan` made offline (`fxmem.fsdp.plan_fsdp`) instead of a budget, and
    `optimizer` is a name ("adamw") or state bytes per parameter byte; every rank must call it, with the
    same arguments."""
    if mesh is None:
        if not (isinstance(example_inputs, (tuple, list)) and len(example_inputs) == 0) or example_kwargs is not None:
            raise ValueError("example_inputs= and example_kwargs= go with mesh= (an FSDP2 rank is planned before "
                             "training); one device's step is planned from the first call's inputs")
        return api.optimize(model, **options)
    return _sharded(model, mesh, example_args(example_inputs), dict(example_kwargs or {}), options)


optimize.__signature__ = inspect.signature(api.optimize).replace(parameters=[  # type: ignore[attr-defined]
    *[p for p in inspect.signature(api.optimize).parameters.values() if p.kind is not p.VAR_KEYWORD],
    *[inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
      for name, default in (("mesh", None), ("example_inputs", ()), ("example_kwargs", None))],
    inspect.Parameter("spellings", inspect.Parameter.VAR_KEYWORD)],
    return_annotation="OptimizedModule | PlacedModule | torch.nn.Module")
optimize.__doc__ = f"{optimize.__doc__}\n\n    One device's step, as `fxmem.api.optimize`:\n\n    {api.optimize.__doc__}"


def _sharded(model: torch.nn.Module, mesh: Any, args: tuple, kwargs: dict, options: dict) -> torch.nn.Module:
    import torch.distributed as dist

    from fxmem.fsdp import FsdpPlan, block_list, shard
    check_model(model)
    other = next((k for k, v in options.items() if k not in RANK_OPTIONS and v != _default(k)), None)
    if other is not None:
        raise ValueError(f"{other}= plans one device's step; with mesh= fxmem.optimize plans an FSDP2 rank and "
                         f"takes {', '.join(k + '=' for k in RANK_OPTIONS)} example_inputs= and example_kwargs=")
    if getattr(mesh, "ndim", None) != 1:
        raise ValueError(f"mesh= must be a 1-D DeviceMesh over the ranks that shard the model (FSDP2), got {mesh!r}")
    budget_gb, given, optimizer = options.get("budget_gb"), options.get("plan"), options.get("optimizer")
    time_limit_s = api.check_time_limit(options.get("time_limit_s", api.OPTIMIZE_SPELLINGS["time_limit_s"]))
    if (budget_gb is None) == (given is None):
        raise ValueError("with mesh=, pass exactly one of budget_gb= (per rank, planned now) or plan= "
                         "(an FsdpPlan from fxmem.fsdp.plan_fsdp)")
    if given is not None and not isinstance(given, FsdpPlan):
        raise TypeError(f"with mesh=, plan= is an fxmem.fsdp.FsdpPlan (FsdpPlan.load), got {type(given).__name__}")
    if given is not None and given.world_size != mesh.size():
        raise ValueError(f"plan= was made for {given.world_size} ranks and mesh= has {mesh.size()}; "
                         f"plan again with world_size={mesh.size()}")
    if optimizer is not None and (isinstance(optimizer, bool) or not isinstance(optimizer, (str, int, float))):
        raise TypeError("with mesh=, optimizer= is a name such as \"adamw\" or state bytes per parameter byte: "
                        "the optimizer is made from the sharded model's parameters")
    if given is None:
        if not args and not kwargs:
            raise ValueError("mesh= plans the rank now, before training: pass example_inputs= (and example_kwargs=), "
                             "one rank's batch")
        budget_bytes(budget_gb), block_list(model)  # what every rank can check is refused on every rank
        spec = api.device_spec(options.get("target") or options.get("device"), model=model)
        group = mesh.get_group()
        payload = [_plan_in_child(model, args, kwargs, budget_gb, {"world_size": mesh.size(), "optimizer": optimizer,
                                                                   "target": spec, "time_limit_s": time_limit_s})
                   if dist.get_rank(group) == 0 else None]
        dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
        given = FsdpPlan(**json.loads(_raise_if_error(payload[0])))
    sharded = shard(model, mesh, given)
    sharded.fxmem_plan = given  # the plan this rank runs, the same on every rank
    return sharded


def _default(keyword: str) -> Any:
    """The default of an `fxmem.api.optimize` keyword (a spelling's from OPTIMIZE_SPELLINGS)."""
    params = inspect.signature(api.optimize).parameters
    return params[keyword].default if keyword in params else api.OPTIMIZE_SPELLINGS.get(keyword)


def _plan_in_child(model: torch.nn.Module, args: tuple, kwargs: dict, budget_gb: float, settings: dict) -> dict:
    """Rank 0's plan as {"plan": its JSON} or {"error": ...}: planned in a fresh process (no process group
    there), from a CPU copy of the model and batch; never raises, so every rank hears the outcome."""
    try:
        buffer = io.BytesIO()
        torch.save((model, args, kwargs), buffer)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(plan_rank, buffer.getvalue(), budget_gb, settings).result()
    except Exception as exc:  # noqa: BLE001 - reported on every rank by _raise_if_error
        return _error(exc)


def plan_rank(saved: bytes, budget_gb: float, settings: dict) -> dict:
    """In the planning process: `plan_fsdp` on the model and batch `torch.save` wrote to `saved`."""
    from fxmem.fsdp import plan_fsdp
    try:
        model, args, kwargs = torch.load(io.BytesIO(saved), map_location="cpu", weights_only=False)
        return {"plan": plan_fsdp(model, args, budget_gb, example_kwargs=kwargs, **settings).to_json()}
    except Exception as exc:  # noqa: BLE001 - an exception object may not survive the trip back
        return _error(exc)


def _error(exc: Exception) -> dict:
    if isinstance(exc, InfeasibleBudgetError):
        return {"error": "infeasible", "budget": exc.budget_bytes, "least": exc.min_budget_bytes,
                "breakdown": exc.breakdown, "proven": exc.proven, "lower_bound": exc.lower_bound_bytes}
    first = (str(exc).strip().splitlines() or [""])[0]
    return {"error": "other", "message": f"planning the rank on rank 0 failed: {type(exc).__name__}: {first}"}


def _raise_if_error(payload: dict) -> str:
    """The plan's JSON, or the error rank 0's planning met, raised here as there (one line)."""
    if payload.get("error") == "infeasible":
        raise InfeasibleBudgetError(payload["budget"], payload["least"], payload["breakdown"],
                                    lower_bound_bytes=payload["lower_bound"], proven=payload["proven"])
    if "error" in payload:
        raise FxmemError(payload["message"])
    return payload["plan"]
