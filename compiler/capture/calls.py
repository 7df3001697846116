"""What capture decides about a torch call, apart from compiling it: which eager calls belong
to a training step, which calls show the user an autograd Node or differentiate with respect
to a value, and which values the user still holds after the call (reference counts)."""

from __future__ import annotations

import functools
import os
import sys
import threading
import types
import weakref

import torch

from runtime.torch_functions import function_name, is_profiler_range, is_state_read
from runtime.trace import CallKind

# Eager calls that are part of a training step, not gaps in the compiled graph.
AUTOGRAD_CALLS = {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad,
                  torch._C._set_grad_enabled, torch.Tensor.requires_grad_, torch.Tensor.retain_grad,
                  torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook,
                  torch.Tensor.detach, torch.Tensor.zero_}
FACTORIES = {torch.ones, torch.zeros, torch.full, torch.empty, torch.arange, torch.eye, torch.tensor,
             torch.as_tensor, torch.linspace, torch.ones_like, torch.zeros_like, torch.full_like,
             torch.empty_like, torch.randn, torch.rand, torch.randint, torch.randn_like, torch.rand_like}
STORAGE_CALLS = {torch.Tensor.untyped_storage, torch.as_strided}
# GradScaler's bookkeeping: its scale, growth tracker and found-inf flags, updated in place
# (no math of the model's). (`torch.device(...)` is metadata: runtime.torch_functions.)
AMP_STATE_CALLS = {torch._amp_update_scale_, torch._amp_foreach_non_finite_check_and_unscale_}
VALUE_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "__format__",
               "__repr__", "__str__", "__array__", "equal", "allclose", "is_nonzero", "__contains__"}


def value_read_break(func, value) -> str:
    """The graph break a read of a tensor's value into Python makes, with where and why."""
    if type(value) is bool:
        then = ("replay checks the bool and takes the recording of the branch it steers (a new one is "
                "recorded for a branch not seen yet)")
    else:
        then = ("replay checks the value: where it differs (a loss for a log line), the calls after it are "
                "checked one by one where a region writes in place, and a call Python does not make leaves the "
                "recording")
    return (f"{function_name(func)} reads a tensor's value into Python at {user_frame()}: the region before ends "
            f"with the value, only the read runs eagerly and what follows compiles again; {then}")


FUNCTIONS = (types.FunctionType, types.MethodType, functools.partial)


def user_frame() -> str:
    """file:line of the user's code that made the current torch call."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not any(part in path for part in LIBRARY_PATHS):
            return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


LIBRARY_PATHS = (os.sep + "torch" + os.sep, os.sep + "compiler" + os.sep, os.sep + "runtime" + os.sep)
DISTRIBUTED_PATHS = tuple(os.sep + os.path.join("torch", *parts) + os.sep
                          for parts in (("distributed",), ("nn", "parallel")))


def made_by_distributed() -> bool:
    """Whether the torch call being recorded was made by torch.distributed's own code (FSDP2's
    copies into and views of its all-gather buffers, in its hooks around a module's forward;
    DDP's bucket views), not by a model's: the nearest caller outside torch's (and our) internals."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if any(part in path for part in DISTRIBUTED_PATHS):
            return True
        if not any(part in path for part in LIBRARY_PATHS):
            return False  # the model's code (or the user's) made it
        frame = frame.f_back
    return False


_FUNCTION_APPLY = os.path.join("torch", "autograd", "function.py")


def inside_custom_function() -> bool:
    """Whether the torch call being recorded runs inside a custom ``torch.autograd.Function``'s
    forward (which autograd runs under no_grad): its math is the Function's own, whose saved
    tensors and outputs its ``backward`` reads, so it runs eagerly as the Function does."""
    frame = sys._getframe(2)
    for _ in range(64):  # (a forward nests a few frames deep at most; bounded: this runs per call)
        if frame is None:
            return False
        if frame.f_code.co_name == "apply" and frame.f_code.co_filename.endswith(_FUNCTION_APPLY):
            return True
        frame = frame.f_back
    return False


def gradient_inputs(func, args, kwargs) -> list:
    """The tensors a ``grad``/``backward`` call differentiates with respect to (``inputs``)."""
    position = INPUTS_POSITION.get(func)
    if position is None:
        return []
    inputs = args[position] if len(args) > position else kwargs.get("inputs")
    if isinstance(inputs, torch.Tensor):
        return [inputs]
    return [t for t in inputs or () if isinstance(t, torch.Tensor)]


INPUTS_POSITION = {torch.autograd.grad: 1, torch.autograd.backward: 5, torch.Tensor.backward: 4}

# calls that watch a tensor's whole gradient: a hook on it, its .grad kept
GRADIENT_WATCHERS = {torch.Tensor.register_hook, torch.Tensor.retain_grad}


def watched_gradient(func, args):
    """The tensor whose gradient ``func`` watches (``y.register_hook(h)``, ``y.retain_grad()``), or None."""
    if func in GRADIENT_WATCHERS and args and isinstance(args[0], torch.Tensor):
        return args[0]
    return None


def inspects_node(func, leaves) -> bool:
    """Whether ``func`` shows the user the autograd Node of its first argument: reading
    ``.grad_fn``, or printing a tensor that has one (``grad_fn=<MulBackward0>``)."""
    name = getattr(func, "__name__", None)
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None) == "grad_fn"
    if name not in ("__repr__", "__str__", "__format__") or not isinstance(leaves[0], torch.Tensor):
        return False
    t = leaves[0]
    # (f"{loss:.3f}" of a 0-d tensor formats its number: no Node shown, nothing to keep eager)
    return t.grad_fn is not None and (name != "__format__" or t.dim() > 0)


def expected_eager(func, reads_region_value: bool) -> bool:
    """Eager calls that belong to a training step rather than to the model's math: autograd
    calls, parameter state, and bookkeeping under no_grad (an optimizer's update) that reads
    nothing computed by a compiled region."""
    if func in AUTOGRAD_CALLS:
        return True
    if func in FACTORIES and not reads_region_value:
        return True  # a new constant tensor (a mask, positions): made eagerly, read by regions
    if func in AMP_STATE_CALLS:
        return True
    if func in STORAGE_CALLS and not reads_region_value:
        # FSDP2's parameter management: a storage handle to free or reallocate, and a parameter
        # viewed out of an all-gather buffer; no math, and the regions read their results as inputs
        return True
    if not torch.is_grad_enabled() and not reads_region_value:
        return True
    name = getattr(func, "__name__", "") or ""
    if name in ("__set__", "__delete__"):
        return True  # setting a tensor's attribute (.grad, hooks) is state, not math
    if name == "__get__":
        return is_state_read(func)
    return is_profiler_range(func)


class OptimizerSteps:
    """Where each ``optimizer.step()`` began and ended among the recorded calls. Its calls are
    all eager (an update under no_grad): the replay runs the step without watching it call by
    call, which is most of a small training step's host overhead."""

    def __init__(self, mode):
        self.mode = mode
        self.thread = threading.get_ident()
        self.open: list = []
        self.found: list = []

    def begin(self, optimizer, args, kwargs):
        if threading.get_ident() == self.thread:
            self.open.append(len(self.mode.calls))

    def end(self, optimizer, args, kwargs):
        if threading.get_ident() == self.thread and self.open:
            self.found.append((self.open.pop(), len(self.mode.calls)))

    def spans(self, calls) -> dict:
        """Where each optimizer step began -> where it ended, for those whose recorded ``calls`` are all
        plain eager updates (a step the replay may skip for its fused kernels)."""
        return {start: end for start, end in self.found
                if end > start and all(c.kind is CallKind.EAGER and c.reason is None for c in calls[start:end])}


class ModulesRun:
    """A global forward pre-hook for the recording: which modules ran, in which train/eval
    mode (dropout and batch norm read it in Python, so it is part of what was recorded)."""

    def __init__(self):
        self.thread = threading.get_ident()
        self.seen: set = set()
        self.modes: list = []

    def __call__(self, module, args):
        if threading.get_ident() == self.thread and id(module) not in self.seen:
            self.seen.add(id(module))
            self.modes.append((weakref.ref(module), module.training))


def python_references(t: torch.Tensor) -> int:
    """References to ``t``'s Python object, less the one C++ holds while anything there
    (autograd's saved tensors, a view's base) holds the tensor."""
    return sys.getrefcount(t) - (1 if t._use_count() > 1 else 0)


def _unreferenced_count() -> int:
    """What ``python_references`` counts for a tensor only its caller's variable holds
    (measured, not assumed: interpreters count borrowed references differently). Callers
    compare with it from the same position: one local variable, one call."""
    t = torch.empty(0)
    return python_references(t)


UNREFERENCED = _unreferenced_count()
