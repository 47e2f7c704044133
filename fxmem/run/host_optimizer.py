"""An optimizer whose state lives partly in host memory: ZeRO-Offload's principle, after the design of
torchao's `CPUOffloadOptimizer` (not a dependency).

Reads the user's optimizer (its class, param groups with their options, and any state it has) and the
parameters whose state the plan puts on the host (`place`). For those, each gradient is copied to a host
buffer as backward produces it (a post-accumulate-grad hook; on a GPU on a side stream into pinned
memory, on the CPU a plain copy), the update runs on the CPU on a host copy of the parameter and its
state, and the new values are copied back into the parameter. The other parameters are updated on their
device by an optimizer of the user's class. Writes the parameters (at `step`), their `.grad` (at
`zero_grad`, and with `offload_gradients` freed once copied) and its own state.

It is a `torch.optim.Optimizer` (learning-rate schedulers check that) whose `param_groups` are the user's:
a scheduler or the user changes their options there and `step` hands them on. `state` maps each parameter
to its state (host tensors for the host part), so `state_dict()` has torch's own format (a
`torch.optim.AdamW` loads it, and this loads one of theirs) and `load_state_dict` puts each part where the
placement says, without a detour through the device.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterable

import torch

SUPPORTED = ("adam", "adamw")  # state and update on the host; other optimizers keep their state on the device


def supports(optimizer: Any) -> bool:
    """Whether the state of `optimizer` (an instance, or a name such as "adamw") may live on the host."""
    if isinstance(optimizer, HostOptimizer):
        optimizer = optimizer.optimizer_class.__name__
    name = optimizer if isinstance(optimizer, str) else type(optimizer).__name__
    return name.lower() in SUPPORTED


class HostOptimizer(torch.optim.Optimizer):
    """`optimizer`'s training, with the state of the parameters given to `place` on the host.

    `offload_gradients`: free each host parameter's device gradient once copied (item 2 of the design: the
    device then holds no gradient for it; clip with `clip_grad_norm_` here, which sees the host copies)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, offload_gradients: bool = False):
        if isinstance(optimizer, HostOptimizer):
            raise TypeError("the optimizer is a HostOptimizer already; pass the torch optimizer it wraps")
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
                  for g in optimizer.param_groups]
        super().__init__(groups, optimizer.defaults)
        self.optimizer_class = type(optimizer)
        self.offload_gradients = bool(offload_gradients)
        self.said_host_gradients = False  # the log line saying where a plan's host gradients are, once
        for p, state in optimizer.state.items():
            self.state[p] = dict(state)
        self._host: dict[torch.nn.Parameter, torch.Tensor] = {}  # parameter -> its host copy
        self._grads: dict[torch.nn.Parameter, torch.Tensor] = {}  # parameter -> its gradient's host buffer
        self._copied: dict[torch.nn.Parameter, int] = {}  # copied this step: the gradient's version then
        self._values: dict[torch.nn.Parameter, int] = {}  # the parameter's version when its host copy was equal
        self._sunk: set[torch.nn.Parameter] = set()  # its host buffer holds backward's gradient (passes/host_gradients.py)
        self._staged: dict[torch.nn.Parameter, torch.Tensor] = {}  # a GPU micro-batch's copy, to add once landed
        self._hooks: list[Any] = []
        self._pending: list[torch.nn.Parameter] = []
        self._stream = None
        self._place(())
        optimizer.register_step_pre_hook(_stepped_instead)  # its state would grow beside ours, on the device

    # -- placement ---------------------------------------------------------------------------------------
    @property
    def host_parameters(self) -> list[torch.nn.Parameter]:
        return list(self._host)

    def place(self, host: Iterable[torch.nn.Parameter]) -> None:
        """Put the state of the parameters `host` on the host and every other one's on its device
        (state already made moves with it). An optimizer `supports` refuses has no host part."""
        host = list(host)
        if host and not supports(self.optimizer_class.__name__):
            raise ValueError(f"{self.optimizer_class.__name__}'s state stays on the device; host state is "
                             f"supported for {', '.join(SUPPORTED)}")
        self._place(host)

    def _place(self, host: list[torch.nn.Parameter]) -> None:
        for handle in self._hooks:
            handle.remove()
        ours = {p for g in self.param_groups for p in g["params"]}
        unknown = [p for p in host if p not in ours]
        if unknown:
            raise ValueError(f"{len(unknown)} parameter(s) to place on the host are not this optimizer's")
        chosen = set(host)
        self._host = {p: self._host.get(p) if p in self._host else self._host_copy(p)
                      for g in self.param_groups for p in g["params"] if p in chosen}
        self._grads = {p: buffer for p, buffer in self._grads.items() if p in self._host or p in self._sunk}
        for p in list(self.state):  # state follows its parameter
            where = torch.device("cpu") if p in self._host else p.device
            self.state[p] = {k: _moved(v, where) for k, v in self.state[p].items()}
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self._host]
        self._device_opt = self._inner([[p for p in g["params"] if p not in self._host] for g in self.param_groups])
        self._host_opt = self._inner([[self._host[p] for p in g["params"] if p in self._host]
                                      for g in self.param_groups])
        if self._host_opt is not None:
            for p, copy in self._host.items():
                if p in self.state:
                    self._host_opt.state[copy] = self.state[p]  # one dict: state_dict sees the host's state

    def _inner(self, params: list[list[torch.Tensor]]) -> torch.optim.Optimizer | None:
        """An optimizer of the user's class over `params` (one group per user group that has any)."""
        used = [i for i, group in enumerate(params) if group]
        if not used:
            return None
        opt = self.optimizer_class([{**self._options(i), "params": params[i]} for i in used])
        opt.fxmem_groups = used
        for group in opt.param_groups:
            for p in group["params"]:
                if p in self.state:
                    opt.state[p] = self.state[p]
        return opt

    def _options(self, i: int) -> dict[str, Any]:
        return {k: v for k, v in self.param_groups[i].items() if k != "params"}

    def _host_copy(self, p: torch.nn.Parameter) -> torch.Tensor:
        with host_memory(p):
            copy = p.detach().to("cpu", copy=True)
        self._values[p] = p._version
        return copy.pin_memory() if p.device.type == "cuda" else copy

    def _fresh_values(self, p: torch.nn.Parameter) -> None:
        """The host copy of `p` made again where `p` changed outside `step` (a checkpoint loaded into the model)."""
        if self._values.get(p) != p._version:
            self._host[p].copy_(p.detach())
            self._values[p] = p._version

    # -- gradients ---------------------------------------------------------------------------------------
    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        """Backward accumulated `p`'s gradient: start its copy to the host."""
        grad = p.grad
        if grad is None:
            return
        with host_memory(grad):
            self._copy_out(grad, self._buffer(p, grad))
        self._copied[p] = grad._version
        if self.offload_gradients:
            p.grad = None

    def receive(self, p: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """The planned backward graph hands over `p`'s gradient, which it then frees on the device
        (passes/host_gradients.py): copied into `p`'s host buffer, or added to what earlier micro-batches left
        there (on a GPU a micro-batch's copy lands in a staging buffer, added once the side stream is
        synchronized)."""
        with host_memory(grad), torch.no_grad():
            buffer = self._buffer(p, grad)
            if p not in self._sunk:
                self._copy_out(grad, buffer)
            elif grad.device.type != "cuda":
                buffer.add_(grad)
            else:
                if p in self._pending:  # its staging buffer still holds the last micro-batch's copy
                    self._settle()
                if p not in self._staged:
                    self._staged[p] = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=True)
                self._copy_out(grad, self._staged[p])
                self._pending.append(p)
        self._sunk.add(p)

    def _buffer(self, p: torch.nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        """`p`'s gradient's host buffer (pinned for a GPU's gradient), made at its first use."""
        if p not in self._grads:
            self._grads[p] = torch.empty(grad.shape, dtype=grad.dtype, device="cpu",
                                         pin_memory=grad.device.type == "cuda")
        return self._grads[p]

    def _copy_out(self, grad: torch.Tensor, target: torch.Tensor) -> None:
        """Copy `grad` into the host tensor `target`: on a GPU on the side stream, after the work that made it,
        without waiting (the allocator keeps `grad`'s memory until the copy is done)."""
        if grad.device.type != "cuda":
            target.copy_(grad)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(grad.device)
        self._stream.wait_stream(torch.cuda.current_stream(grad.device))
        with torch.cuda.stream(self._stream):
            target.copy_(grad, non_blocking=True)
        grad.record_stream(self._stream)

    def _settle(self) -> None:
        """Wait for the side stream's copies, and add the staged micro-batches into their host buffers."""
        self._sync()
        for p in self._pending:
            self._grads[p].add_(self._staged[p])
        self._pending.clear()

    def _host_grad(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """`p`'s gradient on the host: the copy backward started, copied again where the device gradient
        changed since (clipping, unscaling) or was never copied (None: no gradient this step). Where backward
        moved it to the host (`receive`), the host buffer, with any gradient a micro-batch planned otherwise
        left in `.grad` added in (and `.grad` let go)."""
        if p in self._sunk:
            self._settle()
            buffer = self._grads[p]
            if p.grad is not None:
                buffer.add_(p.grad.detach().to("cpu"))
                p.grad = None
            return buffer
        grad = p.grad
        if grad is not None and self._copied.get(p) != grad._version:
            self._grad_ready(p)
            if self._stream is not None:
                self._stream.synchronize()
        return self._grads[p] if p in self._copied else None

    def _sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over every parameter's gradient, the host copies included
        (needed with `offload_gradients`, where the device holds no gradient for the host part)."""
        self._sync()
        pairs = [(p, self._host_grad(p) if p in self._host or p in self._sunk else p.grad)
                 for g in self.param_groups for p in g["params"]]
        pairs = [(p, grad) for p, grad in pairs if grad is not None]
        total = torch.nn.utils.get_total_norm([grad for _, grad in pairs], norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch.nn.utils.clip_grad_norm_ scales
        for p, grad in pairs:
            grad.mul_(coef.to(grad.device))
            if p in self._host and p not in self._sunk and p.grad is not None:  # the device's too, where kept
                p.grad.mul_(coef.to(p.grad.device))
                self._copied[p] = p.grad._version
        return total

    # -- the optimizer's interface -----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in (self._device_opt, self._host_opt):
            if opt is not None:
                for i, group in zip(opt.fxmem_groups, opt.param_groups):
                    group.update(self._options(i))  # a scheduler's learning rate, the user's changes
        for p in [p for p in self._sunk if p not in self._host]:  # placed on the device since backward moved it
            p.grad = self._host_grad(p).to(p.device)
            self._sunk.discard(p)
        if self._device_opt is not None:
            self._device_opt.step()
        if self._host_opt is not None:
            self._sync()
            stepped = []
            for p, copy in self._host.items():
                copy.grad = self._host_grad(p)
                if copy.grad is not None:
                    self._fresh_values(p)
                    stepped.append(p)
            self._sync()
            self._host_opt.step()
            for p in stepped:
                p.detach().copy_(self._host[p], non_blocking=True)
                self._values[p] = p._version
                self.state[p] = self._host_opt.state[self._host[p]]
                self._host[p].grad = None
        if self._device_opt is not None:
            for group in self._device_opt.param_groups:
                for p in group["params"]:
                    if p in self._device_opt.state:
                        self.state[p] = self._device_opt.state[p]
        self._copied.clear()
        self._sunk.clear()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._copied.clear()
        self._sunk.clear()
        self._pending.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's format (this optimizer's or a torch optimizer's over the same parameters): the host part's
        state is read straight into host memory, the rest as torch reads it."""
        order = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        host_ids = {i for i, p in zip(ids, order) if p in self._host}
        saved = state_dict["state"]
        super().load_state_dict({**state_dict, "state": {i: s for i, s in saved.items() if i not in host_ids}})
        for i, p in zip(ids, order):
            if i in host_ids and i in saved:
                self.state[p] = {k: _moved(v, torch.device("cpu"), like=p) for k, v in saved[i].items()}
        self._place(list(self._host))


def place_for_plan(optimizer: HostOptimizer | None, module: torch.nn.Module, step: Any) -> None:
    """Put the optimizer state of the parameters the step's new plan names on the host, the rest on the
    device, and connect the step's backward graph to `optimizer` for the gradients it moves to the host
    (passes/host_gradients.py): done before the step's first backward."""
    plans = getattr(step, "plans", None)
    if optimizer is None or not plans:
        return
    params = dict(module.named_parameters())
    optimizer.place([params[name] for name in plans[-1].host_parameters])
    sink = getattr(getattr(step, "planner", None), "gradient_sink", None)
    if sink is not None:
        sink.connect(lambda name, grad: optimizer.receive(params[name], grad))
        if not optimizer.said_host_gradients:
            optimizer.said_host_gradients = True
            logging.getLogger("fxmem").warning(
                "fxmem: the gradients of %d parameters live on the host (Plan.host_gradients), their .grad None: clip "
                "with the module's fxmem_optimizer.clip_grad_norm_, which sees them", len(sink.names))


def host_memory(value: torch.Tensor) -> Any:
    """Where a host buffer or copy for `value` is made and written: outside any dispatch mode, so that on the
    CPU a device meter (MemTracker) sees host memory no more than CUDA's allocator sees pinned memory; under
    a fake mode (planning, fake-device meters) as any tensor, a fake host tensor."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import _disable_current_modes

    return contextlib.nullcontext() if isinstance(value, FakeTensor) else _disable_current_modes()


def _stepped_instead(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    raise RuntimeError(f"this {type(optimizer).__name__} is wrapped by fxmem's HostOptimizer (fxmem.optimize with "
                       "offload=True: the module's fxmem_optimizer); step that one, which keeps part of the state on "
                       "the host")


def _moved(value: Any, where: torch.device, like: torch.Tensor | None = None) -> Any:
    """A state value on `where` (a step counter as it is; a floating tensor in `like`'s dtype when given)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    dtype = like.dtype if like is not None and value.is_floating_point() else value.dtype
    moved = value.to(where, dtype=dtype, copy=value.device != where)
    return moved.pin_memory() if where.type == "cpu" and torch.cuda.is_available() and like is not None \
        and like.device.type == "cuda" else moved
