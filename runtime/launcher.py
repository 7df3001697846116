"""Launching one kernel of a program: arguments bound once, a cheap check per call.

``fn[grid](*args, XBLOCK=..., RBLOCK=...)`` goes through ``JITFunction.run`` on every launch:
it binds the arguments to the kernel's signature, computes each argument's specialization
(an integer equal to 1 becomes a constant; integers divisible by 16 and 16-byte-aligned
pointers get a divisibility attribute), turns that into a cache key, looks the compiled
kernel up and only then calls the driver (3.6-11.9 µs of host work a launch, issue 13).

A ``KernelLaunch`` always passes the same kind of arguments: each input tensor with its
strides, then each output tensor; the grid, tiles and warps are fixed when the program is
built. So the compiled kernel can be looked up once and its launcher called directly, as
Inductor's generated wrappers do (``TritonCompileResult.make_launcher`` in
``torch/_inductor/runtime/triton_heuristics.py``): grid and constexprs bound, no binder, no
cache key. What can still change between calls is the specialization: a stride (a view
with another layout) or the alignment of an input's address (a view at an odd offset).
The caller passes a *layout key* (every stride and whether each input pointer is 16-byte
aligned), compared per call with the key the bound kernel was compiled for; a different key
binds again (``JITFunction.run`` compiles or finds that specialization) and is remembered too.

One code path, two final calls:
- compiled Triton (a ``JITFunction``): the ``CompiledKernel``'s launcher
  (``triton/backends/nvidia/driver.py``'s ``CudaLauncher``) with the arguments
  ``JITFunction.run`` itself would pass it (``triton/runtime/jit.py``);
- anything else (Triton's interpreter, ``TRITON_INTERPRET=1``, whose ``InterpretedFunction``
  has its own launch; a stand-in kernel in a test): ``fn[grid]``, bound once, called with
  the constexprs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

MAX_SPECIALIZATIONS = 8   # layouts bound per launch before the oldest is forgotten


# Triton's ``knobs.runtime`` (its launch hooks), looked up when the first kernel is bound: importing
# Triton here could come before ``compiler`` chose the interpreter mode
_RUNTIME_KNOBS = None


def _runtime_knobs():
    global _RUNTIME_KNOBS
    if _RUNTIME_KNOBS is None:
        from triton import knobs

        _RUNTIME_KNOBS = knobs.runtime
    return _RUNTIME_KNOBS


class Launcher:
    """One kernel at one grid, tiles and warps. ``launch(args, key, device)`` runs it. ``debug``:
    the kernel's ``tl.device_assert``s are compiled in (Triton drops them otherwise), without
    Triton's integer-overflow checks, as Inductor compiles kernels that check indirect indices
    (``torch/_inductor/runtime/triton_heuristics.py``: ``"debug"``, ``"sanitize_overflow": False``)."""

    def __init__(self, fn, grid: int, xblock: int, rblock: int, num_warps: int, debug: bool = False,
                 constexprs: dict | None = None):
        self.fn = fn
        self.grid = grid
        # (a graph kernel's tiles; another kernel, a fused optimizer step's, names its own)
        self.constexprs = dict(constexprs) if constexprs is not None else {"XBLOCK": xblock, "RBLOCK": rblock}
        self.num_warps = num_warps
        self.debug = debug
        self.binds = 0          # how many specializations were bound (the first call binds one)

    def straight_line(self, loads, stores, key, inputs, fresh=frozenset(), sizes=(), reuse=()):
        """A generated launch for the layout ``key`` (see ``generate_launch``); ``False``: never
        (only compiled Triton's driver launcher is called directly)."""
        return False

    def prepare(self, args, key) -> None:
        """Compile the specialization a launch with ``args`` (layout ``key``) needs, before that
        launch (``runtime.ahead_of_time``): nothing here, where nothing is compiled."""


class IndexedLauncher(Launcher):
    """The interpreter's (or any ``fn[grid]`` kernel's) launch: the grid proxy made once."""

    def __init__(self, fn, grid, xblock, rblock, num_warps, debug=False, constexprs=None):
        super().__init__(fn, grid, xblock, rblock, num_warps, debug, constexprs)
        self._call = fn[(grid,)]
        self._kwargs = dict(self.constexprs, num_warps=num_warps)
        self.binds = 1
        self._options = _interpreter_debug_options() if debug else None

    def launch(self, args, key, device):
        if self._options is None:
            self._call(*args, **self._kwargs)
            return
        # NOTE: the interpreter reads ``debug`` from its one builder's options (a frozen dataclass,
        # not a launch argument), so Triton's own object is patched for this launch only: Triton
        # offers no other way in. The caller holds the interpreter's lock.
        from triton.runtime.interpreter import interpreter_builder

        saved, interpreter_builder.options = interpreter_builder.options, self._options
        try:
            self._call(*args, **self._kwargs)
        finally:
            interpreter_builder.options = saved


def _interpreter_debug_options():
    """The interpreter's options with asserts on and overflow checks off (None outside the interpreter)."""
    import dataclasses

    try:
        from triton.runtime.interpreter import interpreter_builder
    except ImportError:
        return None
    return dataclasses.replace(interpreter_builder.options, debug=True, sanitize_overflow=False)


class BoundKernel:
    """One compiled specialization and what its driver launcher takes besides the arguments."""

    __slots__ = ("kernel", "runner", "function", "metadata", "constants")

    def __init__(self, kernel, constexprs: tuple, runner=None):
        self.kernel = kernel
        # NOTE: ``kernel.run`` loads the binary onto the current device (a driver call): a test
        # without a GPU passes a ``runner`` of its own.
        self.runner = kernel.run if runner is None else runner
        self.function = kernel.function
        self.metadata = kernel.packed_metadata
        self.constants = constexprs   # XBLOCK, RBLOCK: passed last, dropped by the launcher
        _runtime_knobs()

    def launch(self, grid: int, stream, args) -> None:
        """Call the driver launcher with what ``JITFunction.run`` passes it for these kernel
        arguments: grid, stream, function, metadata, hooks, then every parameter in order
        (XBLOCK and RBLOCK last; the launcher drops constexprs and integers specialized to 1)."""
        # NOTE: the hooks are read at every launch, as JITFunction.run reads them: a profiler
        # started after the kernel was bound installs its hook then (Triton 3.9 adds it to a chain
        # kept in one place; older Triton assigns a new function to the knob).
        enter, exit_ = _RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook
        metadata = None
        if enter is not None and getattr(enter, "calls", True):   # (metadata only while a hook listens)
            metadata = self.kernel.launch_metadata((grid, 1, 1), stream, *args, *self.constants)
        self.runner(grid, 1, 1, stream, self.function, self.metadata, metadata, enter, exit_, *args, *self.constants)


class DirectLauncher(Launcher):
    """Compiled Triton: the driver launcher called directly while the layout key matches.

    ``compile(args)`` returns the ``CompiledKernel`` for these arguments (default: what
    ``JITFunction.run(..., warmup=True)`` compiles or finds in its cache), ``stream(index)``
    the device's current raw CUDA stream, ``runner(kernel)`` the kernel's driver launcher;
    tests without a GPU replace them."""

    def __init__(self, fn, grid, xblock, rblock, num_warps, compile=None, stream=None, runner=None, debug=False,
                 constexprs=None):
        super().__init__(fn, grid, xblock, rblock, num_warps, debug, constexprs)
        self._compile = compile or self._jit_compile
        self._stream = stream   # resolved at the first bind: a driver exists only on a GPU machine
        self._runner = runner
        # (layout key, BoundKernel) of the last bound specialization: one tuple, replaced whole,
        # so a thread never sees one layout's key with another's kernel
        self._current = (None, None)
        self._known: dict = {}  # layout key -> BoundKernel
        self._lock = threading.Lock()  # binding is rare; replays in several threads may meet there

    def _jit_compile(self, args):
        options = {"debug": True, "sanitize_overflow": False} if self.debug else {}
        return self.fn.run(*args, grid=(self.grid,), warmup=True, num_warps=self.num_warps, **options,
                           **self.constexprs)

    def bind(self, args, key) -> BoundKernel:
        """The specialization for ``key``: remembered, or compiled by Triton's JIT for ``args``."""
        with self._lock:
            if self._stream is None:
                self._stream = _current_stream_of_driver()
            bound = self._known.get(key)
            if bound is None:
                kernel = self._compile(args)
                bound = BoundKernel(kernel, tuple(self.constexprs.values()),
                                    None if self._runner is None else self._runner(kernel))
                if len(self._known) >= MAX_SPECIALIZATIONS:
                    del self._known[next(iter(self._known))]
                self._known[key] = bound
                self.binds += 1
            self._current = (key, bound)
            return bound

    def prepare(self, args, key) -> None:
        """Compile and bind the specialization for ``key`` now (``args``: stand-ins with its
        dtypes and alignment), so that the first launch with that layout finds it."""
        with self._lock:
            if key in self._known:
                return
        self.bind(args, key)

    def straight_line(self, loads, stores, key, inputs, fresh=frozenset(), sizes=(), reuse=()):
        """The generated launch of the specialization bound for ``key`` (just launched with
        ``inputs``), or None where this layout gets none (see ``generate_launch``)."""
        current_key, bound = self._current
        if current_key != key:
            return None
        return generate_launch(loads, stores, inputs, bound, self.grid, self._stream, fresh, sizes, reuse)

    def launch(self, args, key, device):
        # the cheap per-call check: the layout key the bound kernel was specialized for
        current_key, bound = self._current
        if key != current_key:
            bound = self.bind(args, key)
        bound.launch(self.grid, self._stream(device.index), args)


@dataclass(frozen=True, slots=True)
class GeneratedLaunch:
    """A launch written out for one layout (``generate_launch``): ``run(env, device) -> bool``."""
    run: object
    source: str   # what runs, for a reader (and a test)


def generate_launch(loads, stores, inputs, bound: BoundKernel, grid: int, stream, fresh=frozenset(), sizes=(),
                    reuse=()) -> GeneratedLaunch | None:
    """One straight-line Python function for a launch at one layout, as Inductor generates its
    wrappers' launch code: ``run(env, device) -> bool`` reads the input slots, checks each
    input's layout against this one's and that every input address is 16-byte aligned, then
    allocates the outputs into ``env`` and calls the driver launcher with the arguments written
    out (strides as literals). It returns False, with nothing allocated or launched, when the
    layout differs: the caller takes the general path (layout key, another specialization).
    ``loads`` are slots, ``stores`` (slot, shape, dtype), ``inputs`` the input tensors of the
    launch just bound (their layout is the one generated); ``fresh``: the slots that are outputs
    of earlier launches of the same program (contiguous, freshly allocated: nothing to check);
    ``sizes``: a shape-generic kernel's size arguments (after the outputs), written as literals;
    ``reuse``: (store index, slot) pairs, an output written into the memory of a buffer that dies
    here where it fits (``runtime.program.reused_memory``), as the general path allocates it.

    The layout check per input is the cheapest that decides it (on this CPU a tensor method call
    costs ~0.4 µs): ``is_contiguous()`` where the bound layout was contiguous (the program fixes
    the shape, so a contiguous tensor has these strides but on size-1 dims, whose stride is never
    multiplied by a nonzero index), else one compare of ``stride()`` with the literal tuple.

    A complex tensor is passed as itself where the general path passes its real view: the
    driver reads only its address (``data_ptr()``, the view's), and the strides are written as the
    view's (twice the complex ones, without the view's last 1): no view made per launch (~1 µs
    each). An input with its conjugate bit set takes the general path (which materializes it).

    None where this layout gets no generated code (the general path handles it): an input
    misaligned (rare: the generated check is "all aligned") or conjugate, a launch hook installed
    (its launch metadata is computed by the general path)."""
    import torch

    knobs = _runtime_knobs()
    enter, exit_ = knobs.launch_enter_hook, knobs.launch_exit_hook
    hook_calls = getattr(enter, "calls", None) if enter is not None else []
    if hook_calls is None or hook_calls:
        return None
    if any(t.data_ptr() & 15 or t.is_conj() for t in inputs):
        return None
    names = {"runner": bound.runner, "function": bound.function, "metadata": bound.metadata, "enter": enter,
             "exit": exit_, "hook_calls": hook_calls, "stream": stream, "empty": torch.empty, "knobs": knobs}
    checked = [i for i, slot in enumerate(loads) if slot not in fresh]
    lines = ["def launch(env, device):"]
    lines += [f"    t{i} = env[{slot}]" for i, slot in enumerate(loads)]
    checks = [f"not t{i}.is_contiguous()" if inputs[i].is_contiguous() else f"t{i}.stride() != {inputs[i].stride()!r}"
              for i in checked]
    checks += [f"t{i}.is_conj()" for i in checked if inputs[i].is_complex()]
    if checked:
        checks.append("(" + " | ".join(f"t{i}.data_ptr()" for i in checked) + ") & 15")
    # a hook installed since (added to the chain, or a new knob value on older Triton): the general
    # path computes launch metadata and passes the hooks
    checks.append("knobs.launch_enter_hook is not enter")
    if enter is not None:
        checks.append("hook_calls")
    if checks:
        lines += ["    if " + " or ".join(checks) + ":", "        return False"]
    arguments = []
    for i, t in enumerate(inputs):
        arguments += [f"t{i}", *map(repr, tuple(2 * n for n in t.stride()) if t.is_complex() else t.stride())]
    donors = dict(reuse)
    if donors:
        from runtime.program import reused_memory
        names["reused"] = reused_memory
    for j, (slot, shape, dtype) in enumerate(stores):
        names[f"dtype{j}"] = dtype
        output = f"empty({tuple(shape)!r}, dtype=dtype{j}, device=device)"
        if j in donors:  # the donor's memory where it fits, else a fresh output
            lines.append(f"    o{j} = reused(env[{donors[j]}], {tuple(shape)!r}, dtype{j})")
            output = f"{output} if o{j} is None else o{j}"
        lines.append(f"    o{j} = env[{slot}] = {output}")
        arguments.append(f"o{j}")  # (a complex output too: its address is its real view's)
    arguments += map(repr, sizes)
    arguments += map(repr, bound.constants)
    lines += [f"    runner({grid}, 1, 1, stream(device.index), function, metadata, None, enter, exit, "
              + ", ".join(arguments) + ")", "    return True"]
    source = "\n".join(lines) + "\n"
    exec(compile(source, f"<symgrad launch of {getattr(bound.kernel, 'name', 'a kernel')}>", "exec"), names)
    return GeneratedLaunch(names["launch"], source)


def _current_stream_of_driver():
    """index -> the device's current stream, as Triton's active driver reads it (with torch:
    torch's current raw CUDA stream), looked up once rather than per launch."""
    from triton.runtime import driver

    active = driver.active
    stream, device = active.get_current_stream, active.get_current_device
    return lambda index: stream(device() if index is None else index)


def make_launcher(fn, grid: int, xblock: int = 0, rblock: int = 0, num_warps: int = 4, debug: bool = False,
                  constexprs: dict | None = None) -> Launcher:
    """The launcher for ``fn``: direct for a compiled ``JITFunction``, ``fn[grid]`` otherwise.
    ``constexprs``: a kernel's own (``BLOCK``), in place of a graph kernel's ``XBLOCK``/``RBLOCK``."""
    from triton.runtime.jit import JITFunction

    kind = DirectLauncher if isinstance(fn, JITFunction) else IndexedLauncher
    return kind(fn, grid, xblock, rblock, num_warps, debug=debug, constexprs=constexprs)


def specialization_key(tensors, numbers) -> tuple:
    """What Triton specializes a launch on, for arguments of fixed types: each pointer's 16-byte
    alignment, and each integer's being 1 (a constant) or a multiple of 16 (floats: nothing)."""
    key = [t.data_ptr() & 15 for t in tensors]
    key += [(n == 1, n % 16 == 0) for n in numbers if type(n) is int]
    return tuple(key)
