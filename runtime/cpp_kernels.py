"""One C++ kernel of a program built for ``backend="cpp"``, run on the program's slots.

A ``CppKernel`` stands where the torch path's ``TorchKernel`` stands (``KernelLaunch.torch_kernel``:
``run(env)``, ``function()``): it reads its load slots, allocates its outputs (contiguous, as every
kernel's are) and calls the compiled function (``runtime.cpp_build``) with each input's address and
strides and each output's address. The function is built at the region's build, ahead of the first
call (``prepare``, in ``runtime.ahead_of_time``'s pool), or at its first run.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field

import torch

from runtime import cpp_build
from runtime.cpu_memory import MIN_BYTES, POOL


@dataclass
class CppKernel:
    name: str
    source: str            # the C++ translation unit (``compiler.codegen.cpp_kernel``)
    loads: tuple           # slots read, in argument order
    load_dims: tuple       # dims of each (one stride argument per dim)
    stores: tuple          # (slot, shape, dtype) written, in argument order
    vectorized: bool = False   # its source includes ATen's vector headers (``runtime.cpp_build.VECTOR_HEADER``)
    index_error: str | None = None   # what a gathered index out of range raises (as the Triton kernels' assert)
    _fn: object = field(default=None, repr=False, compare=False)

    def prepare(self, args=None, key=None) -> None:
        """Build (or find) and load the compiled function now (``runtime.ahead_of_time``'s job)."""
        if self._fn is None:
            self._fn = self._load()

    def run(self, env) -> None:
        self.function()(env)

    def function(self):
        """``kernel(env)``: what ``run`` calls (a program on the CPU path calls it directly)."""
        fn = self.__dict__.get("_call")
        if fn is None:
            fn = self._call = self._generate()
        return fn

    def __getstate__(self):  # the loaded library and the generated call are made again after unpickling
        state = self.__dict__.copy()
        state["_fn"] = None
        state.pop("_call", None)
        return state

    def _load(self):
        """(the contiguous inputs' function, the any-layout one), loaded with their argument types."""
        pointer, integer = ctypes.c_void_p, ctypes.c_int64
        contiguous = cpp_build.load(self.name, self.source, [pointer] * (len(self.loads) + len(self.stores)),
                                    vectorized=self.vectorized)
        each_input = [t for dims in self.load_dims for t in [pointer] + [integer] * dims]
        strided = cpp_build.load(self.name, self.source, each_input + [pointer] * len(self.stores),
                                 f"{self.name}_strided", self.vectorized)
        return contiguous, strided

    def _generate(self):
        """``kernel(env)`` written out once (``inline_lines``'s body in a function of its own)."""
        names: dict = {}
        lines = ["def kernel(env):", *self.inline_lines(names, "")]
        exec(compile("\n".join(lines) + "\n", f"<symgrad C++ call of {self.name}>", "exec"), names)
        return names["kernel"]

    def inline_lines(self, names: dict, prefix: str) -> list:
        """This call as lines of a generated function taking ``env`` (indented one level), its
        objects bound in ``names`` and its locals named with ``prefix`` (a program writes its C++
        calls in line, ``Program._step_call``: no function, code object and globals of their own to
        reach each step). Each output allocated, then the contiguous function where every input is
        contiguous (the usual case) or copied into that layout (``_copied_contiguous``), else (a
        broadcast input) the strided one with the strides. Its locals are deleted at its end: none
        keeps a tensor alive past the slot the program frees."""
        if self._fn is None:
            self._fn = self._load()
        # (outputs from the pool of large buffers: no fresh pages to fault in each step, ``runtime.cpu_memory``)
        # (below the pool's MIN_BYTES, which sizes that are fixed here say, torch.empty itself: the pool
        # would hand them to it anyway, a Python call later)
        p = prefix
        names.update({f"{p}fn": self._fn[0], f"{p}strided": self._fn[1], f"{p}empty": POOL.empty,
                      f"{p}small_empty": torch.empty})
        lines, pointers, strides, local = [], [], [], []
        for k, (slot, dims) in enumerate(zip(self.loads, self.load_dims)):
            lines.append(f"    {p}a{k} = env[{slot}]")
            pointers.append(f"{p}a{k}.data_ptr()")
            strides.append([f"{p}a{k}.data_ptr()"] + [f"{p}a{k}.stride({d})" for d in range(dims)])
            local.append(f"{p}a{k}")
        outputs = []
        for j, (slot, shape, dtype) in enumerate(self.stores):
            names[f"{p}dtype{j}"] = dtype
            allocate = "small_empty" if math.prod(shape) * dtype.itemsize < MIN_BYTES else "empty"
            lines.append(f"    {p}o{j} = env[{slot}] = {p}{allocate}({tuple(shape)!r}, dtype={p}dtype{j})")
            outputs.append(f"{p}o{j}.data_ptr()")
            local.append(f"{p}o{j}")
        strided_call = f"{p}strided({', '.join([a for group in strides for a in group] + outputs)})"
        if self.loads:
            every_contiguous = " and ".join(f"{p}a{k}.is_contiguous()" for k in range(len(self.loads)))
            lines.append(f"    if {every_contiguous}:")
            lines.append(f"        {p}bad = {p}fn({', '.join(pointers + outputs)})")
            # (an input another op left in another layout, such as attention's gradients in the layout of
            # its transposed inputs, is copied into this one: ATen's copy and the vector body take a
            # fraction of the strided function's time, a scalar loop doing index arithmetic per element
            # (1.0 ms against 0.1 on the transformer step's); a broadcast input is not copied, it would be
            # materialized whole)
            names[f"{p}copied"] = _copied_contiguous
            lines.append("    else:")
            lines += [f"        {p}a{k} = {p}copied({p}a{k})" for k in range(len(self.loads))]
            lines.append(f"        if {every_contiguous}:")
            lines.append(f"            {p}bad = {p}fn({', '.join(pointers + outputs)})")
            lines.append(f"        else:\n            {p}bad = {strided_call}")
        else:
            lines.append(f"    {p}bad = {p}fn({', '.join(outputs)})")
        # (an index out of range, found by a gather: the program's host checks then raise eager's error,
        # ``KernelLaunch.run_torch``; the kernel clamped it, reading nothing outside memory)
        names[f"{p}message"] = self.index_error or "a gathered index out of range"
        lines.append(f"    if {p}bad:\n        raise IndexError({p}message)")
        if local:
            lines.append(f"    del {', '.join(local)}")
        return lines


def _copied_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where it is contiguous or broadcast along some dim (a stride of 0: its copy
    would be the whole expanded tensor), else its contiguous copy."""
    if t.is_contiguous() or any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        return t
    return POOL.empty(tuple(t.shape), t.dtype).copy_(t)   # (a large copy: pooled memory, no page faults)


@dataclass
class CppComboLaunch:
    """A fused optimizer step's update of several parameters in one C++ call (``backend="cpp"``),
    where a ``runtime.optimizer_step.ComboLaunch`` launches a Triton combo kernel: the same
    ``launch(tensors, scalars, device)``, ``members`` and ``bytes_moved``. ``tensors`` are, per
    member, its parameter, gradient and state tensors (contiguous, of the kernel's dtype)."""
    name: str
    source: str              # ``compiler.optimizers.cpp_combo.cpp_combo_source``'s
    members: list
    scalar_names: list
    integer_scalars: tuple   # those passed as int64 (the others in the kernel's dtype)
    dtype: torch.dtype
    chunks: tuple            # (member, begin, end) per chunk, flattened (``cpp_combo.chunk_table``)
    parallel: bool           # the chunks spread over threads
    bytes_moved: int
    profile_name: str | None = field(default=None, repr=False, compare=False)
    _fn: object = field(default=None, repr=False, compare=False)
    _table: object = field(default=None, repr=False, compare=False)

    def name_in_profiles(self, name: str) -> None:
        self.profile_name = name

    def prepare(self, args=None, key=None) -> None:
        """Build (or find) and load the function now (``runtime.ahead_of_time``'s job)."""
        if self._fn is None:
            real = ctypes.c_float if self.dtype == torch.float32 else ctypes.c_double
            scalars = [ctypes.c_int64 if n in self.integer_scalars else real for n in self.scalar_names]
            self._fn = cpp_build.load(self.name, self.source,
                                      [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, *scalars])
            self._table = (ctypes.c_int64 * len(self.chunks))(*self.chunks)

    def launch(self, tensors: list, scalars: dict, device) -> None:
        if not self.chunks:  # parameters with no elements
            return
        if self._fn is None:
            self.prepare()
        pointers = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
        numbers = [scalars[n] for n in self.scalar_names]
        if torch.autograd._profiler_enabled():   # (named as the Triton combo kernels are)
            from torch.autograd.profiler import record_function

            with record_function(self.profile_name or f"symgrad kernel {self.name}"):
                self._fn(pointers, self._table, len(self.chunks) // 3, int(self.parallel), *numbers)
            return
        self._fn(pointers, self._table, len(self.chunks) // 3, int(self.parallel), *numbers)

    def __getstate__(self):   # (the loaded library is loaded again after unpickling)
        state = self.__dict__.copy()
        state["_fn"] = state["_table"] = None
        return state


@dataclass
class CppFunctionInfo:
    """What ``explain`` lists of one C++ function of a fused call (``KernelInfo``'s fields)."""
    name: str
    source: str
    bytes_moved: int
    members: list
    profile_name: str | None = None

    def name_in_profiles(self, name: str) -> None:
        self.profile_name = name


@dataclass
class CppClip:
    """``clip_grad_norm_``'s fused call in C++ (``backend="cpp"``): a norm function (the total norm
    and the clip coefficient) and a scale function (``compiler.optimizers.cpp_combo.cpp_clip_sources``),
    over the gradients' chunk table."""
    norm: CppFunctionInfo
    scale: CppFunctionInfo
    dtype: torch.dtype
    chunks: tuple            # (member, begin, end) per chunk, flattened
    firsts: tuple            # per member its first chunk, then the count
    parallel: bool
    _fns: object = field(default=None, repr=False, compare=False)

    @property
    def functions(self) -> list:
        return [self.norm, self.scale]

    def prepare(self, args=None, key=None) -> None:
        if self._fns is None:
            pointer, integer = ctypes.c_void_p, ctypes.c_int64
            real = ctypes.c_float if self.dtype == torch.float32 else ctypes.c_double
            head = [pointer, pointer, integer, integer]
            norm = cpp_build.load(self.norm.name, self.norm.source,
                                  head + [pointer, pointer, integer, pointer, pointer, real, real])
            scale = cpp_build.load(self.scale.name, self.scale.source, head + [pointer])
            tables = ((ctypes.c_int64 * len(self.chunks))(*self.chunks),
                      (ctypes.c_int64 * len(self.firsts))(*self.firsts))
            self._fns = (norm, scale, tables)

    def norm_and_coefficient(self, grads: list, max_norm: float, eps: float):
        """(the total norm, a 1-element tensor holding the clip coefficient), both new tensors."""
        if self._fns is None:
            self.prepare()
        norm, _, (chunks, firsts) = self._fns
        count = len(self.chunks) // 3
        pointers = (ctypes.c_void_p * len(grads))(*[g.data_ptr() for g in grads])
        partials = torch.empty(max(count, 1), dtype=torch.float64)
        total, coef = torch.empty((), dtype=self.dtype), torch.empty(1, dtype=self.dtype)
        norm(pointers, chunks, count, int(self.parallel), partials.data_ptr(), firsts, len(grads),
             total.data_ptr(), coef.data_ptr(), max_norm, eps)
        return total, coef, pointers

    def scale_by(self, pointers, coef) -> None:
        """Every gradient (``pointers``: as ``norm_and_coefficient`` gave them) times ``coef``."""
        _, scale, (chunks, _) = self._fns
        scale(pointers, chunks, len(self.chunks) // 3, int(self.parallel), coef.data_ptr())

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_fns"] = None
        return state
