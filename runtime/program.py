"""A compiled program: kernel launches and matmuls over numbered value slots.

The compiler builds ``Program`` objects; the runtime runs them. A program reads its inputs
into slots ``0..num_inputs-1``, runs its steps in order (each writes new slots), frees each
slot after its last use, and returns its outputs. An output or matmul operand may be a
*view* of a slot, applied on the host by the compiler's view op itself (``ViewStep``: PyTorch's
view function, so no copy; a flip copies, as in eager). Matmuls and the like are called
through the function the compiler's op hands over (``ExternCall.fn``): the runtime keeps no
table of ops and imports nothing from the compiler.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch

from runtime.kernels import load_kernel
from runtime.triton_math import INTERPRETING

# NOTE: Triton's interpreter patches triton.language's globals while a kernel runs, so two
# threads interpreting at once corrupt each other; compiled GPU kernels need no such lock.
_interpreter_lock = threading.Lock() if INTERPRETING else contextlib.nullcontext()


@dataclass(frozen=True)
class ViewStep:
    """One view applied to a real tensor on the host: ``op.apply(value, **params)``, where
    ``op`` is the compiler's view op (the runtime knows only that it has ``apply``)."""
    op: object
    params: tuple = ()     # (name, value) pairs: the view node's kwargs

    def __post_init__(self):  # the keyword arguments made once, not on every call's apply
        object.__setattr__(self, "_kwargs", dict(self.params))

    def apply(self, value):
        return self.op.apply(value, **self._kwargs)


@dataclass(frozen=True)
class ValueRef:
    slot: int
    views: tuple = ()      # ViewSteps, applied in order

    def resolve(self, env):
        return apply_views(env[self.slot], self.views)


def apply_views(value, views):
    """Apply recorded view steps to a real tensor with PyTorch's own view functions."""
    for step in views:
        value = step.apply(value)
    return value


# Element offsets at or past this need 64-bit index math (Triton multiplies int32 in int32).
INT32_LIMIT = 2**31


@dataclass
class KernelLaunch:
    name: str
    source: str
    loads: list            # slots read
    stores: list           # (slot, shape, dtype) written, allocated contiguous
    grid: int
    xblock: int
    rblock: int
    bytes_moved: int
    num_warps: int = 4
    # The same kernel with strides multiplied in int64 (None: ``source`` is 64-bit already).
    # Strides are not part of the guard key, so the launch picks it when an input's offsets
    # need it (a view with a large stride), rather than computing wrapped addresses.
    wide_name: str | None = None
    wide_source: str | None = None
    _fn: object = None
    _wide_fn: object = None

    def arguments(self, env, device) -> tuple:
        """(arguments, wide) for this launch: each input with its strides, then each output,
        allocated (contiguous) into ``env``; ``wide`` when some offset the strides give passes
        int32 (the 64-bit twin is launched)."""
        args = []
        wide = False  # whether some offset the strides give passes int32: launch the 64-bit twin
        for slot in self.loads:
            t = env[slot]
            if t.is_complex():  # interleaved (real, imag): the kernel indexes the real view
                t = torch.view_as_real(t.resolve_conj())
                args.append(t)
                args.extend(t.stride()[:-1])
            else:
                args.append(t)
                args.extend(t.stride())
            # NOTE: a view's offsets stay inside its storage (PyTorch checks), so only a storage
            # of 2 GiB or more needs the exact last offset (the pointer passed is the element
            # at the storage offset; the kernel adds index · stride to it)
            if not wide and t.untyped_storage().nbytes() >= INT32_LIMIT:
                wide = _last_offset(t) >= INT32_LIMIT
        for slot, shape, dtype in self.stores:
            out = torch.empty(shape, dtype=dtype, device=device)
            env[slot] = out
            args.append(torch.view_as_real(out) if dtype.is_complex else out)
        return args, wide

    def run(self, env, device):
        args, wide = self.arguments(env, device)
        if self.grid:  # an empty iteration space: outputs stay empty
            fn = self.kernel(wide)
            # the tensors' device (and its current stream), not whichever device is current
            with _on_device(device), _interpreter_lock:
                fn[(self.grid,)](*args, XBLOCK=self.xblock, RBLOCK=self.rblock, num_warps=self.num_warps)

    def kernel(self, wide: bool = False):
        """The jit function to launch: the 64-bit twin when ``wide`` and there is one."""
        if wide and self.wide_source is not None:
            if self._wide_fn is None:
                self._wide_fn = load_kernel(self.wide_name, self.wide_source)
            return self._wide_fn
        if self._fn is None:
            self._fn = load_kernel(self.name, self.source)
        return self._fn


def _last_offset(t: torch.Tensor) -> int:
    """The offset of ``t``'s last element from its first, in elements: sum((size - 1) · stride)."""
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 1)


def _on_device(device: torch.device):
    """Launches on CUDA go to the tensors' device: Triton launches on the current one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@dataclass
class ExternCall:
    """A call of a PyTorch function (a matmul, a convolution, a gather's scatter-add gradient):
    ``fn`` is the compiler's op's own torch function (the runtime keeps no table of ops)."""
    name: str              # the op's name, for reports
    fn: object             # fn(*args, **kwargs) -> the result tensor
    args: list             # ValueRefs
    out: int
    kwargs: dict = field(default_factory=dict)  # constant parameters (dim, shape, ...)

    def run(self, env, device):
        env[self.out] = self.fn(*[a.resolve(env) for a in self.args], **self.kwargs)


@dataclass
class IndexCheck:
    """Eager's error for an index out of range, before a kernel gathers with it. On CPU it
    raises here; on CUDA it is an asynchronous device-side assert (no synchronization), as
    eager's own CUDA indexing kernels do."""
    args: list             # [ValueRef of the index tensor]
    size: int              # the indexed dim's size
    wrap: bool             # negative indices count from the end (x[idx])
    what: str              # the op, for the message

    def run(self, env, device):
        index = self.args[0].resolve(env)
        if index.numel() == 0:
            return
        low = -self.size if self.wrap else 0
        ok = ((index >= low) & (index < self.size)).all()
        if index.device.type == "cuda":
            torch._assert_async(ok, f"{self.what}: index out of range")
        elif not ok:
            bad = index[(index < low) | (index >= self.size)].flatten()[0].item()
            raise IndexError(f"{self.what}: index {bad} is out of bounds for a dimension of size {self.size} "
                             "(raised by the compiled region, as eager would)")


@dataclass
class Program:
    num_inputs: int
    num_slots: int
    steps: list
    outputs: list                          # ValueRef or None (no value, e.g. no gradient)
    frees: list = field(default_factory=list)  # per step: slots dead after it

    @property
    def kernels(self):
        return [s for s in self.steps if isinstance(s, KernelLaunch)]

    def run(self, inputs, stats=None, consume=False) -> list:
        """Run the steps on ``inputs``; return the outputs. ``consume``: the caller hands its
        references over (``inputs``, a list, is emptied): each input is freed after its last use."""
        env = list(inputs) + [None] * (self.num_slots - self.num_inputs)
        device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
        if consume:
            inputs.clear()
        for step, dead in zip(self.steps, self.frees):
            step.run(env, device)
            for slot in dead:
                env[slot] = None
        if stats is not None:
            stats["kernel_launches"] = stats.get("kernel_launches", 0) + len(self.kernels)
        return [o.resolve(env) if o is not None else None for o in self.outputs]
