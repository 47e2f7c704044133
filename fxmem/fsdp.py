"""FSDP2 ranks: fxmem's block plan run inside `fully_shard`-ed blocks, planned under a per-rank budget.

Reads an unsharded model, its example inputs and a world size; writes nothing (an `FsdpPlan` is JSON that
`save` writes where asked). `plan_fsdp` plans one block's step with fxmem, chosen for the rank (`fxmem.dist.fsdp_search`), and
simulates one rank's whole step under torch's fake process group (one process, no communication: every
collective returns buffers of the right size) on fake tensors (`fxmem.dist.fsdp_fake`: no weights needed, a
meta model works), metered by MemTracker, with 2, 3 and 4 of its blocks where they are identical and
extrapolated along the line they lie on (`fxmem.dist.fsdp_depth`); `shard` applies FSDP2 as torchtitan does (every block,
then the root) with the block plan's compiled step installed in every block and, where the plan has one,
the root's planned step after the last block (final norm, head, loss in chunks: `fxmem.dist.fsdp_root`;
`docs/fsdp.md`). Both serve
offline plans; inside a job, `fxmem.optimize(model, budget_gb=..., mesh=mesh)` (`fxmem.ranks`) plans with
`plan_fsdp` on rank 0 and shards every rank with `shard`.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from fxmem import api
from fxmem.budget import budget_bytes as to_bytes
from fxmem.errors import FxmemError, InfeasibleBudgetError, fmt_bytes
from fxmem.dist.fsdp_depth import depths_for, extrapolate, shallow
from fxmem.dist.fsdp_fake import fake_copy
from fxmem.dist.fsdp_counts import counter_bytes, keyword_input_bytes, sharded_bytes, unit_bytes
from fxmem.dist.fsdp_memory import RankParts, rank_parts
from fxmem.dist.fsdp_root import RootTail, run_tail
from fxmem.dist.fsdp_search import Search
from fxmem.measure import measure_peak_bytes
from fxmem.trace.loss import Boundary
from fxmem.trace.meta_device import is_meta_model
from fxmem.price.optimizer_state import bytes_per_param_byte
from fxmem.planner.plan import Plan
from fxmem.run import joint_cache

MAX_ROUNDS = 5  # block budgets solved per plan beyond whole-step's (each simulated where it may fit)


@dataclass(frozen=True)
class FsdpPlan:
    """One rank's plan: the block plan every block runs (None: blocks run eagerly) and what it gives."""
    world_size: int
    blocks: str                   # module path of the ModuleList whose children are the FSDP units
    reshard_after_forward: bool
    budget_bytes: int | None
    predicted_peak_bytes: int     # the rank's step, optimizer state included
    parts: dict[str, int] = field(default_factory=dict)
    block_plan: dict | None = None
    eager_peak_bytes: int = 0     # the same rank with eager blocks (FSDP2 alone)
    checkpoint_blocks: bool = False  # torch's checkpoint on every block (where no fxmem block plan fits)
    root_plan: dict | None = None  # the root's step after the blocks (norm, head, loss); None: eager

    def root(self) -> Plan | None:
        return None if self.root_plan is None else Plan.from_dict(self.root_plan, source="FsdpPlan.root_plan")

    def block(self) -> Plan | None:
        return None if self.block_plan is None else Plan.from_dict(self.block_plan, source="FsdpPlan.block_plan")

    def table(self) -> str:
        """Per rank (every rank holds the same): shards, gathered units, activations, predicted peak."""
        rows = [("world size", str(self.world_size)), ("FSDP units", f"{self.blocks}.* + root")]
        rows += [(name.replace("_", " "), fmt_bytes(n)) for name, n in self.parts.items()]
        rows += [("predicted peak per rank", fmt_bytes(self.predicted_peak_bytes)),
                 ("FSDP2 eager blocks, per rank", fmt_bytes(self.eager_peak_bytes))]
        if self.budget_bytes is not None:
            rows.insert(2, ("budget per rank", fmt_bytes(self.budget_bytes)))
        block = self.block()
        rows.append(("block step", "torch checkpoint on every block" if self.checkpoint_blocks else "eager"
                     if block is None else f"fxmem plan, {block.extra_flops_pct:.1f}% extra FLOPs in each block"))
        root = self.root()
        rows.append(("root after the blocks", "eager" if root is None else "fxmem plan, loss in "
                     f"{root.loss_chunks} chunk{'s' * (root.loss_chunks > 1)}, {root.extra_flops_pct:.1f}% extra FLOPs"))
        from tabulate import tabulate
        return tabulate(rows, tablefmt="plain")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "FsdpPlan":
        with open(path) as f:
            return cls(**json.load(f))


def block_list(model: torch.nn.Module, blocks: str | None = None) -> tuple[str, torch.nn.ModuleList]:
    """The ModuleList whose children become FSDP units: `blocks` (a module path), else the longest one."""
    if blocks is not None:
        found = model.get_submodule(blocks)
        if not isinstance(found, torch.nn.ModuleList) or not len(found):
            raise ValueError(f"blocks={blocks!r} is not a non-empty ModuleList of {type(model).__name__}")
        return blocks, found
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no ModuleList of blocks to shard; pass blocks='path.to.list'")
    return max(lists, key=lambda item: len(item[1]))


def shard(model: torch.nn.Module, mesh: Any, plan: FsdpPlan | None = None, blocks: str | None = None,
          reshard_after_forward: bool = True, steps: dict | None = None) -> torch.nn.Module:
    """`fully_shard` every block, then the root (torchtitan's wrapping), in place; with a plan whose blocks
    recompute, every block runs the plan's block step (FSDP2 gathers its parameters around it). `steps`: the
    compiled block and root steps of earlier `shard`s (simulated ranks', kept by the caller), by their plans,
    taken instead of compiling again where the plan is the same; filled where empty."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import fully_shard
    if plan is not None:
        blocks, reshard_after_forward = plan.blocks, plan.reshard_after_forward
    _, units = block_list(model, blocks)
    block_plan = plan.block() if plan is not None else None
    steps = {} if steps is None else steps
    block_key = ("block", json.dumps(plan.block_plan, sort_keys=True)) if block_plan is not None else None
    first = steps.get(block_key)
    for block in units:
        cls = type(block)
        if plan is not None and plan.checkpoint_blocks:
            checkpoint(block)  # torch's composable checkpoint: the parameters keep their names
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
        if block_plan is not None:
            first = steps[block_key] = _install(block, cls, block_plan, first)
    if plan is not None and plan.root_plan is not None:  # after the last block, the root's planned step runs
        root = plan.root()
        keep = {"keep_outputs": False} if root.loss == Boundary("field").text(keep_outputs=False) else {}
        step = api.optimize(RootTail(model, blocks), plan=root, **keep)
        _share(step, steps.setdefault(("root", json.dumps(plan.root_plan, sort_keys=True)), step))
        run_tail(model, blocks, step)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def _install(block: torch.nn.Module, cls: type, block_plan: Plan, first: Any = None) -> Any:
    """Run `block_plan`'s compiled step as `block`'s forward. FSDP2's hooks stay on `block` (gather before,
    reshard after, reduce-scatter after backward); the step runs on a twin of the block of its own class
    sharing its parameter, buffer and submodule dicts, so it reads the parameters FSDP2 gathered. The
    blocks share the `first` block's compiled steps (a step takes the parameters at each call): identical
    blocks compile once."""
    twin = cls.__new__(cls)
    torch.nn.Module.__init__(twin)
    for key, value in block.__dict__.items():
        if key in ("_parameters", "_buffers", "_modules") or not key.startswith("_"):
            twin.__dict__[key] = value
    with quiet():
        step = api.optimize(twin, plan=block_plan, model_loss=False)
    _share(step, first or step)
    block.forward = lambda *args, **kwargs: _quiet_call(step, args, kwargs)
    block.__dict__["fxmem_step"] = step  # what `forward` runs (its `.plan`); not a submodule: it shares the dicts
    return first if first is not None else step


def _share(step: torch.nn.Module, first: torch.nn.Module) -> None:
    """`step` runs `first`'s compiled steps (a step takes the parameters at each call)."""
    object.__setattr__(step, "_steps", first._steps)
    object.__setattr__(step, "_backward_ran", first._backward_ran)


def _quiet_call(step: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    with quiet():
        return step(*args, **kwargs)


def block_inputs(model: torch.nn.Module, path: str, inputs: Sequence[Any], kwargs: dict | None,
                 device: Any = None) -> tuple[tuple, dict]:
    """The first block's arguments in a forward of `model` on the example inputs, copied; the first (the
    hidden state) requires grad, as a block's input does in training. A meta model runs its forward on
    fakes (`fxmem.dist.fsdp_fake`, `device` as there) and its block's arguments are meta tensors."""
    return block_io(model, path, inputs, kwargs, device)[:2]


def block_io(model: torch.nn.Module, path: str, inputs: Sequence[Any], kwargs: dict | None,
             device: Any = None) -> tuple[tuple, dict, Any]:
    """`block_inputs`, and the last block's output (the root's tail's input) copied the same way."""
    seen: list = []
    meta = is_meta_model(model)
    with fake_copy(model, inputs, kwargs, device) if meta else contextlib.nullcontext((model, inputs, kwargs)) \
            as (run, run_inputs, run_kwargs):
        units = run.get_submodule(path)
        handles = [units[0].register_forward_pre_hook(lambda _, a, k: seen.append((a, k)) or None, with_kwargs=True),
                   units[-1].register_forward_hook(lambda _, a, out: seen.append(((out,), {})) or None)]
        try:
            with torch.no_grad():
                run(*run_inputs, **(run_kwargs or {}))
        finally:
            for handle in handles:
                handle.remove()
    (args, kw), ((last,), _) = seen[0], seen[-1]

    def prepare(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta") if meta else x.detach().clone()
    args, kw, last = torch.utils._pytree.tree_map(prepare, (tuple(args), dict(kw), last))
    for hidden in (args[0] if args else None, last):
        if isinstance(hidden, torch.Tensor) and hidden.is_floating_point():
            hidden.requires_grad_(True)  # the hidden state: the block's gradient flows back through it
    return args, kw, last


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """A block's output is the next block's input, not a loss: fxmem's warning that the loss is outside the
    plan does not apply (the rank's simulated step counts the whole step)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*returns no scalar loss.*")
        yield


@contextlib.contextmanager
def fake_group(world_size: int) -> Iterator[Any]:
    """One rank of `world_size` under torch's fake process group (no processes), and its 1-D CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise FxmemError("plan_fsdp simulates a rank under a fake process group and a process group is already "
                         "initialized here; plan before init_process_group (or offline) and load the plan on every rank")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def rank_peak(model: torch.nn.Module, inputs: Sequence[Any], kwargs: dict | None, plan: FsdpPlan,
              optimizer: Any = None, *, fake: bool = True, device: Any = None, whole: bool = False,
              checked: bool = True, memo: dict | None = None) -> tuple[int, RankParts]:
    """One rank's step peak (MemTracker, fake process group, a copy of `model`), optimizer state included.
    With `fake` (the default) the copy, its inputs and the whole step are fake tensors (`fxmem.dist.fsdp_fake`;
    `device`: the `DeviceSpec` a meta model is planned for); otherwise a real copy runs one real step. A rank
    of more than 4 identical blocks is simulated with 2, 3 and 4 of them and extrapolated along the line they
    lie on (`fxmem.dist.fsdp_depth`), unless `whole` (or they lie on no line): then with all of them. Without
    `checked`, with 2 and 3 only (the line assumed: a search's trials); `memo` keeps each depth's figures
    for the plan, so checking a trial later simulates depth 4 alone."""
    depths = None if whole else depths_for(model.get_submodule(plan.blocks))
    if depths is not None:
        memo = {} if memo is None else memo
        figures = {}
        for depth in depths if checked else depths[:2]:
            trial = replace(plan, budget_bytes=None, predicted_peak_bytes=0, parts={}, eager_peak_bytes=0).to_json()
            key, steps = (depth, trial), memo.setdefault("steps", {})  # the trials share compiled steps
            if key not in memo:
                peak, parts = _simulated(shallow(model, plan.blocks, depth), inputs, kwargs, plan, optimizer, fake,
                                         device, steps)
                memo[key] = {"peak": peak, **parts.as_dict()}
            figures[depth] = memo[key]
        line = extrapolate(figures, len(model.get_submodule(plan.blocks)))
        if line is not None:
            peak = line.pop("peak")
            return peak, RankParts(**line)
    return _simulated(model, inputs, kwargs, plan, optimizer, fake, device)


def _simulated(model: torch.nn.Module, inputs: Sequence[Any], kwargs: dict | None, plan: FsdpPlan,
               optimizer: Any, fake: bool, device: Any, steps: dict | None = None) -> tuple[int, RankParts]:
    """`rank_peak` of `model` as it is: one step of all its blocks (`steps`: as for `shard`)."""
    copied = fake_copy(model, inputs, kwargs, device) if fake else contextlib.nullcontext((copy.deepcopy(model), inputs, kwargs))
    with joint_cache.forgotten_after(), fake_group(plan.world_size) as mesh, copied as (model, inputs, kwargs):
        sharded = shard(model, mesh, plan, steps=steps)
        step = measure_peak_bytes(sharded, inputs, kwargs) + keyword_input_bytes(inputs, kwargs)
        parts = rank_parts(sharded_bytes(sharded), unit_bytes(sharded, plan.blocks), plan.world_size,
                           bytes_per_param_byte(optimizer), plan.reshard_after_forward, step,
                           counter_bytes(optimizer, sharded))
    return step + parts.optimizer_shards, parts


def full_checkpoint_peak(model: torch.nn.Module, inputs: Sequence[Any] = (), *, world_size: int,
                         kwargs: dict | None = None, optimizer: Any = None, blocks: str | None = None,
                         reshard_after_forward: bool = True, target: Any = None) -> int:
    """The baseline: one rank's simulated peak with every block checkpointed by torch (torchtitan's full
    activation checkpointing: torch's checkpoint on each block, then `fully_shard`), optimizer state
    included. `target`: as for `plan_fsdp`."""
    plan = FsdpPlan(world_size, block_list(model, blocks)[0], reshard_after_forward, None, 0, checkpoint_blocks=True)
    return rank_peak(model, inputs, kwargs, plan, optimizer, device=api.device_spec(target, model=model))[0]


def plan_fsdp(model: torch.nn.Module, example_inputs: Sequence[Any] = (), budget_gb: float | None = None, *,
              world_size: int, example_kwargs: dict | None = None, optimizer: Any = None, blocks: str | None = None,
              reshard_after_forward: bool = True, time_limit_s: float = 10.0, rounds: int = MAX_ROUNDS,
              target: Any = None, root: bool = True) -> FsdpPlan:
    """Plan one rank of an FSDP2 job of `world_size` ranks under `budget_gb` per rank. The rank runs
    eagerly where that fits; otherwise the root's step after the blocks (norm, head, loss) runs fxmem's
    plan at its least (the loss in chunks) where the simulated rank holds less with it, and where the rank
    still does not fit, every block runs one fxmem block plan, chosen for the rank's peak, not one block's
    (`fxmem.dist.fsdp_search`: a byte a block saves is held by every block; at most `rounds` block budgets
    solved beyond the whole-step plan, each simulated where it may fit), else torch's checkpoint on every block.
    `model` is unsharded, on the CPU or the meta device (built under `torch.device("meta")`: no weights; the
    rank is simulated on fake tensors either way, with 2, 3 and 4 of its blocks where they are identical,
    `rank_peak`); `target`: the device (`DeviceSpec` or preset name) the block plans are priced for, default
    the CPU; `time_limit_s`: each block and root plan's solver effort. `root=False` keeps the root eager (a
    transformers model then returns its logits beside the loss, which the planned root leaves out). Call
    before any process group exists (or offline) and give the plan to every rank (`FsdpPlan.save` / `load`),
    so every rank runs the same one."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return _plan_fsdp(model, example_inputs, to_bytes(budget_gb), world_size, example_kwargs, optimizer, blocks,
                      reshard_after_forward, time_limit_s, rounds, target, root)


def _plan_fsdp(model: torch.nn.Module, example_inputs: Sequence[Any], budget: int | None, world_size: int,
               example_kwargs: dict | None, optimizer: Any, blocks: str | None, reshard_after_forward: bool,
               time_limit_s: float, rounds: int, target: Any, root: bool) -> FsdpPlan:
    path, units = block_list(model, blocks)
    spec = api.device_spec(target, model=model)
    memo: dict = {}  # each depth's figures per trial: a trial checked later simulates depth 4 alone

    def simulate(trial: FsdpPlan, checked: bool = False) -> FsdpPlan:
        figures = rank_peak(model, example_inputs, example_kwargs, trial, optimizer, device=spec, checked=checked, memo=memo)
        return _with(trial, *figures, trial.block_plan, eager)
    eager = 0
    plan = simulate(FsdpPlan(world_size, path, reshard_after_forward, budget, 0), checked=True)
    eager = plan.predicted_peak_bytes
    plan = replace(plan, eager_peak_bytes=eager)
    if budget is None or eager <= budget:
        return plan
    args, kw, hidden = block_io(model, path, example_inputs, example_kwargs, spec)
    root_plan = plan_root(model, path, hidden, example_inputs, example_kwargs, spec, time_limit_s) if root else None

    def plan_block(block_budget: int | None = None, policy: str | None = None) -> Plan:
        with quiet():
            return api.plan(units[0], args, None if block_budget is None else block_budget / 2**30, example_kwargs=kw,
                            model_loss=False, time_limit_s=time_limit_s, target=spec, policy=policy)

    def with_blocks(block_plan: Plan) -> FsdpPlan:
        return simulate(replace(plan, block_plan=block_plan.to_dict(), root_plan=root_plan))

    def fitting(trial: FsdpPlan) -> FsdpPlan | None:  # checked at depth 4 (or simulated whole) and still fitting
        trial = simulate(trial, checked=True)
        return trial if trial.predicted_peak_bytes <= budget else None
    whole = plan_block(policy="whole-step")  # the least a block saves: every block's inputs
    keep_rank = eager
    # the planned root holds less than the eager one in its own step and returns the loss alone, so it is kept;
    # with eager blocks it is simulated where whole-step blocks fit with it (eager blocks hold more than they)
    if root_plan is not None and with_blocks(whole).predicted_peak_bytes <= budget:
        rooted = simulate(replace(plan, root_plan=root_plan))
        if rooted.predicted_peak_bytes <= budget and (found := fitting(rooted)) is not None:
            return found
        keep_rank = rooted.predicted_peak_bytes
    search = Search(len(units), budget, plan_block, with_blocks, rounds)
    chosen = search.run(whole, lambda: plan_block().predicted_peak_bytes, keep_rank)  # up to the block's keep-all peak
    ranks = [rank for _, rank in search.ranks]
    if chosen is not None and (found := fitting(with_blocks(chosen))) is not None:
        return found
    full = simulate(replace(plan, checkpoint_blocks=True, root_plan=root_plan))
    if full.predicted_peak_bytes <= budget and (found := fitting(full)) is not None:
        return found
    lowest = simulate(min([*ranks, full], key=lambda p: p.predicted_peak_bytes), checked=True)
    raise InfeasibleBudgetError(budget, lowest.predicted_peak_bytes, lowest.parts, proven=False)


def _with(plan: FsdpPlan, peak: int, parts: RankParts, block_plan: dict | None, eager: int = 0) -> FsdpPlan:
    """`plan` (its root's step and whether torch checkpoints the blocks) with what its simulated rank gives."""
    return replace(plan, predicted_peak_bytes=peak, parts=parts.as_dict(), block_plan=block_plan, eager_peak_bytes=eager)


def plan_root(model: torch.nn.Module, path: str, hidden: Any, inputs: Sequence[Any], kwargs: dict | None,
              spec: Any, time_limit_s: float = 10.0) -> dict | None:
    """The plan of the root's step after the blocks (`fxmem.dist.fsdp_root.RootTail`: final norm, head,
    loss) at its least peak, the loss in as many chunks as that needs; None where fxmem cannot plan it (a
    last block that returns no tensor, a model whose output has no loss: nothing to chunk)."""
    if not isinstance(hidden, torch.Tensor):
        return None
    tail, args = RootTail(model, path), (hidden, *inputs)
    options = {"example_kwargs": kwargs, "target": spec, "keep_outputs": False, "time_limit_s": time_limit_s}  # transformers' logits: left out
    try:
        try:  # a budget below any plan's: the refusal names the least
            api.plan(tail, args, 1 / 2**30, **options)
        except ValueError as exc:  # the output is the loss itself (keep_outputs= goes with a `loss` field)
            if isinstance(exc, InfeasibleBudgetError):
                raise
            del options["keep_outputs"]
            api.plan(tail, args, 1 / 2**30, **options)
        return None  # a plan under one byte: nothing to plan
    except InfeasibleBudgetError as exc:
        least = exc.min_budget_bytes
    except FxmemError:
        return None
    try:
        root = api.plan(tail, args, least / 2**30, **options)
    except FxmemError:  # the least named, not met again (a solver stopped by its time limit): the root stays eager
        return None
    return root.to_dict() if root.loss_chunks > 1 else None
