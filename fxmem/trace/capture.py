"""Capture: a model and example inputs -> a torch.fx GraphModule.

Tries `torch.fx.symbolic_trace` first and `torch.export` (non-strict) where it fails.
Writes `meta["val"]` (a FakeTensor) on every node and `tag(gm, CAPTURE)`
(the method used); no real memory is used. Failures become a `TraceError` that names the construct.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import random
import re
import sys
from typing import Any, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._dynamo.eval_frame import _set_in_optimized_module
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxmem.trace.module_path import module_path
from fxmem.error_boundary import is_library_file, public
from fxmem.errors import FxmemError, TraceError
from fxmem.trace.torch_output import held_output
from fxmem.meta_keys import CAPTURE, INPUT_NAMES, tag, tags
from fxmem.stage_times import stage

METHODS = ("auto", "symbolic_trace", "export")


@public
def capture(model: torch.nn.Module, example_inputs: Sequence[Any] = (),
            example_kwargs: dict[str, Any] | None = None, *, method: str = "auto") -> torch.fx.GraphModule:
    """Capture `model` as a GraphModule whose parameters and buffers are the model's own tensors.
    Tracing runs forward; the buffers it updates and the random numbers it draws are given back, so the
    step that follows (or Dynamo's, where this capture fails) sees what eager would."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fxmem captures torch.nn.Module instances, got {type(model).__name__}")
    if method not in METHODS:
        raise ValueError(f"capture method {method!r} is not one of {METHODS}")
    args, kwargs = example_args(example_inputs), dict(example_kwargs or {})
    with stage("capture"), untouched(model), _set_in_optimized_module():  # meters built on ModTracker (MemTracker) step aside:
        gm = _capture(model, args, kwargs, method)  # the modules run on fake stand-ins, holding no memory
    _constants_as_buffers(gm)
    return gm


def example_args(example_inputs: Any) -> tuple:
    """The model's positional example inputs as a tuple; one tensor is one input (as torch.jit.trace takes it)."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, dict):
        raise TypeError("example_inputs is a dict: pass keyword inputs as example_kwargs={...} and positional "
                        "ones as example_inputs=(x, ...)")
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError(f"example_inputs must be the model's positional inputs, a tuple such as (x,) or (x, y), "
                        f"got {type(example_inputs).__name__}")
    return tuple(example_inputs)


def _constants_as_buffers(gm: torch.fx.GraphModule) -> None:
    """Tensor constants the tracer folded (e.g. `self.freqs[None]`) become non-persistent buffers, so
    AOTAutograd receives them as inputs like every other tensor."""
    state = {id(t) for t in gm.parameters()} | {id(t) for t in gm.buffers()}
    for node in gm.graph.find_nodes(op="get_attr"):
        owner_path, _, attr = node.target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        value = getattr(owner, attr)
        if isinstance(value, torch.Tensor) and id(value) not in state:
            delattr(owner, attr)
            owner.register_buffer(attr, value, persistent=False)


def _capture(model: torch.nn.Module, args: tuple, kwargs: dict, method: str) -> torch.fx.GraphModule:
    first_error: Exception | None = None
    if method in ("auto", "symbolic_trace"):
        try:
            gm = _symbolic_trace(model, args, kwargs)
            tags(gm)[CAPTURE] = "symbolic_trace"
            return gm
        except TraceError:
            if method == "symbolic_trace":
                raise
        except FxmemError:  # the user's own code refused (e.g. a loss_fn that returns no scalar)
            raise
        except Exception as exc:  # symbolic_trace fails on many real models: fall back to export
            if method == "symbolic_trace":
                raise _explain(exc) from exc
            first_error = exc
    try:
        gm = _export(model, args, kwargs)
    except FxmemError:
        raise
    except Exception as exc:
        raise _explain(exc, first_error) from exc
    finally:  # the first error's traceback holds this frame and its callers': let them go now, not at the
        first_error = None  # next garbage collection (the caller's real inputs and outputs would live as long)
    tags(gm)[CAPTURE] = "export"
    return gm


def _symbolic_trace(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    concrete = {k: v for k, v in bound.arguments.items() if v is None or isinstance(v, (bool, int, float, str))}
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in bound.signature.parameters.values()):
        raise ValueError("forward takes *args/**kwargs")
    versions = [t._version for t in _state_tensors(model)]
    gm = torch.fx.symbolic_trace(model, concrete_args=concrete or None)
    if versions != [t._version for t in _state_tensors(model)]:
        # e.g. `self.steps.add_(1)`: fx ran it once on the real buffer and left it out of the graph
        raise ValueError("forward updates a parameter or buffer in place outside the traced graph")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = [n.target.lstrip("*") for n in placeholders]
    if set(names) - set(bound.arguments):
        raise ValueError(f"traced placeholders {names} do not match forward's arguments")
    flat = [bound.arguments[name] for name in names]
    tags(gm)[INPUT_NAMES] = names
    _propagate_fake(gm, flat)
    _check_same_outputs(model, gm, args, kwargs)
    return gm


def _state_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return list(model.parameters()) + list(model.buffers())


def _export(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
    with held_output():  # a failed export prints partial graphs; the TraceError says what failed
        ep = torch.export.export(model, args, kwargs, strict=False)
    gm = ep.module()
    if any("val" not in n.meta for n in gm.graph.nodes if n.op in ("call_function", "placeholder")):
        _propagate_fake(gm, flat_graph_inputs(gm, args, kwargs))
    return gm


def flat_graph_inputs(gm: torch.fx.GraphModule, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The values of gm's placeholders, in order, for a call gm(*args, **kwargs)."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and info.in_spec is not None:
        from torch.export._tree_utils import reorder_kwargs

        return pytree.tree_leaves((tuple(args), reorder_kwargs(dict(kwargs), info.in_spec)))
    names = tag(gm, INPUT_NAMES)
    if names is None:
        names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    signature = inspect.signature(gm.forward)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return [bound.arguments.get(name) for name in names]


def structure_outputs(gm: torch.fx.GraphModule, raw: Any) -> Any:
    """Outputs as gm(*args) returns them, from what the graph's output node yields: plain dicts and
    lists, not the immutable ones the output node holds."""
    return _plain(gm.graph.process_outputs(raw))


def _plain(value: Any) -> Any:
    """immutable_dict / immutable_list as dict / list, through plain tuples, lists and dicts; other
    types (namedtuples, ModelOutput) as they are."""
    if isinstance(value, immutable_dict) or type(value) is dict:
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, immutable_list) or type(value) is list:
        return [_plain(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


def _propagate_fake(gm: torch.fx.GraphModule, flat_inputs: list[Any]) -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in flat_inputs]
    FakeTensorProp(gm, mode).propagate(*fake)


def _check_same_outputs(model: torch.nn.Module, gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """symbolic_trace silently bakes in Python decisions; compare output structure and shapes on fakes."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
        want = model(*fake_args, **fake_kwargs)
        got = gm(*fake_args, **fake_kwargs)
    want_leaves, want_spec = pytree.tree_flatten(want)
    got_leaves, got_spec = pytree.tree_flatten(got)
    same = want_spec == got_spec and all(
        (a.shape, a.dtype) == (b.shape, b.dtype) if isinstance(a, torch.Tensor) else type(a) is type(b)
        for a, b in zip(want_leaves, got_leaves))
    if not same:
        raise ValueError("symbolic_trace changed the model's outputs")


@contextlib.contextmanager
def untouched(model: torch.nn.Module):
    """Run code that calls `model` without a trace: its buffers and the torch, CUDA, Python and
    NumPy random states are put back afterwards (transformers' SpecAugment masks draw from NumPy's)."""
    with _restored_buffers(model), torch.random.fork_rng(devices=_cuda_devices()), _restored_python_rng():
        yield


def _cuda_devices() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []


@contextlib.contextmanager
def _restored_python_rng():
    numpy = sys.modules.get("numpy")  # only where imported: a model drawing from it imported it
    state, numpy_state = random.getstate(), numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        random.setstate(state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


class _restored_buffers:
    """Put buffer values back after fake runs: FakeTensorMode lets in-place updates of 0-dim CPU
    buffers (BatchNorm's num_batches_tracked += 1) through to the real tensor."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __enter__(self) -> None:
        self.saved = [(buf, buf.detach().clone()) for buf in self.model.buffers()]

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for buf, value in self.saved:
                buf.copy_(value)


_KNOWN = (
    (("cache_utils", "DynamicCache", "past_key_values"),
     "the model returns a key/value cache (transformers' DynamicCache) with its outputs",
     "pass use_cache=False: example_kwargs={'use_cache': False}, or model.config.use_cache = False"),
    (("data-dependent", "guard_on_data_dependent", "GuardOnDataDependentSymNode", "Could not guard on",
      "Could not extract specialized integer", "symbolically traced variables cannot be used as inputs to control flow"),
     "data-dependent control flow (a Python `if`, `while` or `int()` on a tensor's value)",
     "compute both branches and select with torch.where, use torch.cond, or move the decision out of forward "
     "(pass it as a Python argument); fxmem.optimize plans such a model through Dynamo's graphs instead"),
    (("item()", "aten._local_scalar_dense", "tolist"),
     "reading a tensor value into Python (.item() / .tolist())",
     "keep the value as a tensor, or pass it as a Python argument"),
    (("nonzero", "unique", "masked_select", "data-dependent output shape"),
     "an op whose output shape depends on tensor values (nonzero, unique, masked_select, boolean indexing)",
     "use a fixed-shape formulation (torch.where with a mask), or mark the size with torch._check"),
)


def _explain(exc: Exception, first: Exception | None = None) -> TraceError:
    text = f"{type(exc).__name__}: {exc}"
    if first is not None:
        text += f" | {type(first).__name__}: {first}"
    for needles, construct, fix in _KNOWN:
        if any(n in text for n in needles):
            return TraceError(construct, fix, str(exc))
    where = _innermost_user_frame(exc)
    return TraceError(
        f"{type(exc).__name__} while tracing{where}",
        "make forward traceable by torch.export (no Python side effects on tensor values, no unsupported "
        "third-party calls). Torch's full error is this error's __cause__; fxmem.capture(model, example_inputs, "
        "method='export') (or method='symbolic_trace') tries one tracer alone",
        str(exc))


def _innermost_user_frame(exc: BaseException) -> str:
    tb, last = exc.__traceback__, None
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not is_library_file(filename):
            last = f" at {filename}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    return last or ""


def data_dependent_error(exc: Exception, gm: torch.fx.GraphModule) -> TraceError:
    """One line for an op whose output shape depends on the data (`nonzero`, boolean indexing,
    `masked_select`): the op, the module and the source line, and what to write instead."""
    text = str(exc)
    op = text.split("\n", 1)[0].strip() or type(exc).__name__
    node_name = re.search(r"While executing %(\w+)", text)
    node = next((n for n in gm.graph.nodes if node_name and n.name == node_name.group(1)), None)
    where = f"module {module_path(node)}" if node is not None and module_path(node) else ""
    frames = [f for f in re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s*(.+)', text)
              if not is_library_file(f[0])]
    line = f" at {os.path.basename(frames[-1][0])}:{frames[-1][1]} ({frames[-1][2].strip()})" if frames else ""
    where = where or "the model's own forward"
    return TraceError(f"{op} has an output whose shape depends on the data, in {where}{line}; "
                      "fxmem plans graphs of known shapes",
                      "write it with a fixed shape (torch.where(mask, x, 0) instead of x[mask], a padded "
                      "index instead of nonzero()), or compute it outside the optimized module")


def describe_input(x: Any) -> str:
    """`float32[8,32]+grad` for a tensor, each element so in a tuple or list (a block's rotary
    `position_embeddings`: the same signature for real and fake tensors), repr otherwise."""
    if isinstance(x, torch.Tensor):
        dtype = str(x.dtype).replace("torch.", "")
        return f"{dtype}[{','.join(map(str, x.shape))}]" + ("+grad" if x.requires_grad else "")
    if isinstance(x, (tuple, list)) and any(isinstance(e, torch.Tensor) for e in x):
        inner = ", ".join(map(describe_input, x))
        return f"({inner},)" if isinstance(x, tuple) and len(x) == 1 else \
            f"({inner})" if isinstance(x, tuple) else f"[{inner}]"
    return repr(x)
