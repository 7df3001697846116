"""``torch.nn.utils.clip_grad_norm_`` run as fused kernels where a compiled function calls it.

PyTorch gives ``optimizer.step()`` global hooks; ``clip_grad_norm_`` has none. So this module
puts a thin stand-in at ``torch.nn.utils.clip_grad_norm_`` (and ``torch.nn.utils.clip_grad.
clip_grad_norm_``, which the deprecated ``clip_grad_norm`` calls): outside a compiled function
it calls PyTorch's own function and nothing else. While a function is recorded, it tells the
recording where the call's recorded ops begin and end (``watch``); on a replay, where the
recording has a compiled call at that point (``Trace.fused_calls``), the replay runs its
kernels (``FusedClipGradNorm.run``) instead of PyTorch's ops. A call the plan does not fit
(other parameters, a gradient gone, another ``norm_type``) runs PyTorch's function, replayed
op by op as it was recorded.

NOTE: code that took the function before ``import compiler`` (``from torch.nn.utils import
clip_grad_norm_``) holds PyTorch's own: its calls stay correct, and run op by op eagerly.
"""

from __future__ import annotations

import functools
import math
import threading
import types
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.utils.clip_grad as _clip_grad_module

from runtime import backends, shards
from runtime.replay import active_replay

_hooks = threading.local()   # .recorder: the recording in this thread that notes calls


@dataclass
class FusedClipGradNorm:
    """One recorded ``clip_grad_norm_`` call compiled (``compiler.optimizers.clip``)."""
    end: int                     # the call index after its recorded calls: the replay goes on there
    output_id: object            # value id of the total norm it returns
    params: list                 # weak references to the parameters it was given, in order
    with_grad: list              # indices of those that had a gradient
    dtype: torch.dtype           # the gradients' dtype
    numels: list                 # their sizes (in ``with_grad``'s order)
    norm_type: float
    error_if_nonfinite: object
    foreach: object
    partial_launches: list       # ComboLaunch per chunk: gradients -> a partial per block
    finalize: object             # ComboLaunch: partials -> total norm and clip coefficient (None: C++)
    scale_launches: list         # ComboLaunch per chunk: gradients *= coefficient
    bounds: list                 # gradient i's partials are [bounds[i], bounds[i + 1])
    stats: dict | None = None
    # what it was built for (``runtime.backends``): "torch" leaves CPU gradients to PyTorch's own clip
    backend: str = field(default_factory=backends.chosen)
    cpp: object = None           # ``runtime.cpp_kernels.CppClip``: the C++ functions (backend="cpp", CPU)
    mesh: object = None          # DTensor gradients' device mesh: each rank's norm of its shards combines over it
    _bounds_on: dict = field(default_factory=dict, repr=False)  # device -> ``bounds`` as an int32 tensor

    @property
    def launches(self) -> list:
        if self.cpp is not None:
            return self.cpp.functions
        return self.partial_launches + [self.finalize] + self.scale_launches

    def run(self, params, max_norm, norm_type, error_if_nonfinite, foreach):
        """The total norm, with the gradients clipped, as eager's call gives them; None where
        this call is not the one compiled (then nothing has changed)."""
        if type(max_norm) not in (int, float) or error_if_nonfinite != self.error_if_nonfinite \
                or foreach != self.foreach:
            return None
        try:
            if float(norm_type) != self.norm_type:
                return None
        except (TypeError, ValueError):
            return None
        grads = self._gradients(params)
        if grads is None:
            return None
        device = grads[0].device
        if self.cpp is not None:   # (built for C++ only: gradients moved off the CPU run eagerly)
            return self._run_cpp(grads, max_norm, error_if_nonfinite) if device.type == "cpu" else None
        if device.type == "cpu" and backends.cpu_path(self.backend):
            return None   # the torch path: PyTorch's own clip (its foreach kernels)
        bounds = self._bounds_on.get(device)
        if bounds is None:
            bounds = self._bounds_on[device] = torch.tensor(self.bounds, dtype=torch.int32, device=device)
        count = self.bounds[-1]
        scratch = torch.empty(count + 1, dtype=self.dtype, device=device)  # partials, then the coefficient
        total = torch.empty((), dtype=self.dtype, device=device)  # a new tensor per call, as eager's
        base = 0
        for launch in self.partial_launches:
            launch.launch([grads[m] for m in launch.members] + [scratch[base:]], {}, device)
            base += launch.grid
        scalars = {"max_norm": _rounded(float(max_norm), self.dtype), "eps": _rounded(1e-6, self.dtype)}
        self.finalize.launch([scratch, bounds, total, scratch[count:]], scalars, device)
        launches = len(self.partial_launches) + 1
        if self.mesh is not None:
            total, coef = self._across_ranks(total, max_norm)
            scratch[count:].copy_(coef)
        if error_if_nonfinite and not math.isfinite(total.item()):  # (eager reads it too)
            self._count(launches)
            raise self._non_finite()
        for launch in self.scale_launches:
            launch.launch([grads[m] for m in launch.members] + [scratch[count:]], {}, device)
        torch._C._increment_version(grads)  # as eager's grad.mul_ (the kernels write unseen)
        self._count(launches + len(self.scale_launches))
        return total if self.mesh is None else shards.replicated(total, self.mesh)

    def _run_cpp(self, grads, max_norm, error_if_nonfinite):
        """``run`` with the C++ functions (``runtime.cpp_kernels.CppClip``): the same checks and errors."""
        scalars = (_rounded(float(max_norm), self.dtype), _rounded(1e-6, self.dtype))
        total, coef, pointers = self.cpp.norm_and_coefficient(grads, *scalars)
        if self.mesh is not None:
            total, coef = self._across_ranks(total, max_norm)
        if error_if_nonfinite and not math.isfinite(total.item()):
            self._count(1)
            raise self._non_finite()
        self.cpp.scale_by(pointers, coef)
        torch._C._increment_version(grads)  # as eager's grad.mul_ (the function writes unseen)
        self._count(2)
        return total if self.mesh is None else shards.replicated(total, self.mesh)

    def _across_ranks(self, local_total, max_norm):
        """(the total norm over every rank's shards, its clip coefficient) from this rank's norm: one
        all-reduce, then the coefficient as eager's ops round it (on the replicated total norm)."""
        total = shards.combine_norms(local_total, self.norm_type, self.mesh)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return total, coef.reshape(1)

    def _non_finite(self) -> RuntimeError:
        """Eager's error for a non-finite total norm with ``error_if_nonfinite=True``, word for word."""
        return RuntimeError(
            f"The total norm of order {self.norm_type} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`")

    def _gradients(self, params):
        """The gradients to clip, or None where the parameters or gradients are not the recorded ones."""
        if len(params) != len(self.params):
            return None
        for p, ref in zip(params, self.params):
            if ref() is not p:
                return None
        grads, expected, device = [], iter(self.with_grad), None
        following = next(expected, None)
        for i, p in enumerate(params):
            g = p.grad
            if i != following:
                if g is not None:
                    return None  # a gradient the recording did not have
                continue
            following = next(expected, None)
            if self.mesh is not None and g is not None:
                if shards.refuse_norm(p, g) or g.device_mesh != self.mesh:
                    return None
                g = shards.local(g)
            if g is None or type(g) is not torch.Tensor or g.dtype != self.dtype or g.layout != torch.strided \
                    or g.numel() != self.numels[len(grads)] or not g.is_contiguous() or g.is_conj() or g.is_neg():
                return None   # (a conjugate or negative view: the kernels would read its memory as it is)
            device = device or g.device
            if g.device != device:
                return None
            grads.append(g)
        return grads

    def _count(self, launches):
        if self.stats is not None:
            self.stats["kernel_launches"] = self.stats.get("kernel_launches", 0) + launches
            self.stats["clip_launches"] = self.stats.get("clip_launches", 0) + launches


def _rounded(value: float, dtype) -> float:
    """A Python scalar as an op of ``dtype`` reads it (float32: rounded to it)."""
    return float(np.float32(value)) if dtype == torch.float32 else value


class _Watch:
    """The handle ``watch`` returns: ``remove()`` stops noting calls for that recording."""

    def __init__(self, recorder):
        self.previous = getattr(_hooks, "recorder", None)
        self.recorder = recorder
        _hooks.recorder = recorder

    def remove(self):
        if getattr(_hooks, "recorder", None) is self.recorder:
            _hooks.recorder = self.previous


def watch(recorder) -> _Watch:
    """While a function is recorded in this thread: ``recorder.clip_begins(params, max_norm,
    norm_type, error_if_nonfinite, foreach)`` before each ``clip_grad_norm_`` call runs (its
    answer is handed back to ``recorder.clip_ends(token, total_norm)`` after it returned)."""
    return _Watch(recorder)


# PyTorch's own (a reloaded module must not wrap its own stand-in)
_original = getattr(_clip_grad_module.clip_grad_norm_, "pytorch_function", _clip_grad_module.clip_grad_norm_)


@functools.wraps(_original)
def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    if torch.compiler.is_compiling():  # traced by Dynamo: PyTorch's own, as Dynamo knows it
        return _original(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    recorder = getattr(_hooks, "recorder", None)
    replay = active_replay()
    if recorder is None and replay is None:
        return _original(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    given = parameters
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if isinstance(given, types.GeneratorType):
        given = (p for p in params)  # (eager warns about an empty generator: it still sees one)
    elif not isinstance(given, torch.Tensor):
        given = params
    if recorder is not None:
        token = recorder.clip_begins(params, max_norm, norm_type, error_if_nonfinite, foreach)
        total = _original(given, max_norm, norm_type, error_if_nonfinite, foreach)
        recorder.clip_ends(token, total)
        return total
    total = replay.run_fused_call(params, max_norm, norm_type, error_if_nonfinite, foreach)
    if total is not None:
        return total
    return _original(given, max_norm, norm_type, error_if_nonfinite, foreach)


clip_grad_norm_.pytorch_function = _original


def install() -> None:
    """Put ``clip_grad_norm_`` in PyTorch's namespaces (once; idempotent)."""
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    _clip_grad_module.clip_grad_norm_ = clip_grad_norm_


install()
