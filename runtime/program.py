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
import functools
import re
import threading
from dataclasses import dataclass, field

import torch
from torch.autograd.profiler import record_function

from runtime import backends
from runtime.kernels import load_kernel
from runtime.launcher import make_launcher
from runtime.triton_math import INTERPRETING

_profiler_enabled = torch.autograd._profiler_enabled

# NOTE: Triton's interpreter patches triton.language's globals while a kernel runs, so two
# threads interpreting at once corrupt each other; compiled GPU kernels need no such lock.
_NO_GUARD = contextlib.nullcontext()
interpreter_lock = threading.Lock() if INTERPRETING else _NO_GUARD


@dataclass(frozen=True)
class ViewStep:
    """One view applied to a real tensor on the host: ``op.apply(value, **params)``, where
    ``op`` is the compiler's view op (the runtime knows only that it has ``apply``)."""
    op: object
    params: tuple = ()     # (name, value) pairs: the view node's kwargs

    def __post_init__(self):  # the call made once (a partial: no frame of ours per apply)
        object.__setattr__(self, "apply", functools.partial(self.op.apply, **dict(self.params)))


@dataclass(frozen=True)
class ValueRef:
    slot: int
    views: tuple = ()      # ViewSteps, applied in order

    def resolve(self, env):
        value = env[self.slot]
        for step in self.views:
            value = step.apply(value)
        return value


def apply_views(value, views):
    """Apply recorded view steps to a real tensor with PyTorch's own view functions."""
    for step in views:
        value = step.apply(value)
    return value


def views_source(text: str, views, names: dict, prefix: str) -> str:
    """Generated code applying ``views`` (ViewSteps) to the tensor source ``text`` evaluates to:
    a view op that is one tensor method in line (``env[3].permute((1, 0))``, the op's
    ``method_call``), any other through its apply, bound in ``names`` as ``{prefix}_{j}``."""
    for j, step in enumerate(views):
        inline = getattr(step.op, "method_call", None)
        method = inline(text, dict(step.params)) if inline is not None else None
        if method is None:
            names[f"{prefix}_{j}"] = step.apply
            method = f"{prefix}_{j}({text})"
        text = method
    return text


def state_without(obj, *names) -> dict:
    """``obj``'s attributes for pickling, less ``names`` (code generated at run time). Copied in one
    step (``dict.copy``, atomic under the GIL), not iterated: another thread running the same
    program may add its generated code meanwhile (a region cache being written while the region
    runs), and iterating a dict that grows raises."""
    state = obj.__dict__.copy()
    for name in names:
        state.pop(name, None)
    return state


# Element offsets at or past this need 64-bit index math (Triton multiplies int32 in int32).
INT32_LIMIT = 2**31

# The words of the message of a kernel's index check (``tl.device_assert``, written by
# ``compiler.codegen.triton_kernel``), by which a launch knows the error it raised for what it is.
INDEX_ASSERT = "index out of bounds for a dimension"


def asserts_indices(source: str) -> bool:
    """Whether a kernel's source checks indices (then it is compiled with Triton's ``debug``)."""
    return "tl.device_assert(" in source


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
    # A shape-generic kernel's size (and constant) arguments, passed after the outputs: fixed for
    # this build (its program is for these shapes), so bound once, as literals in the generated launch
    sizes: tuple = ()
    # (store index, load slot): the output written into that input's memory, an input that dies
    # at this launch and that the kernel reads at the output's own index (the compiler's
    # ``compiler.lower.program._donations``); used when the tensor there is contiguous and fits, as Inductor's
    # in-place buffers. Fewer bytes allocated at once.
    reuse: tuple = ()
    # The CPU path's function of this kernel (``compiler.codegen.torch_kernel.TorchKernel``): run in
    # place of the Triton kernel (``run_torch``) by a program built for backend="torch".
    torch_kernel: object = None
    # The kernel asserts its gathered indices in range (None: it gathers unchecked, or not at all):
    # compiled with Triton's ``debug`` option, and on CPU a failed assert is explained by these
    # host checks of the index buffers it loads (``IndexCheck``), for eager's error and message.
    index_checks: tuple | None = None
    # (shape, dtype) of each buffer loaded, as the program's graph recorded it: the launch compiled
    # ahead of the first call assumes them contiguous and aligned (``ahead_of_time``)
    expected_loads: tuple = ()
    _fn: object = None
    _wide_fn: object = None

    _launchers: dict = field(default_factory=dict)  # wide -> runtime.launcher.Launcher, bound once
    _wide: dict = field(default_factory=dict)       # layout key -> whether it needs the 64-bit twin
    # The generated straight-line launch of the first layout that has one (runtime.launcher's
    # ``GeneratedLaunch``); None: none yet, False: this kernel's launcher never has one.
    _straight: object = None
    # what a profile calls its launches (``name_in_profiles``; None: "symgrad kernel <name>")
    profile_name: str | None = field(default=None, init=False, repr=False, compare=False)

    def name_in_profiles(self, name: str) -> None:
        """Its launches appear as ``name`` in a profile (the compiler names them after the ops fused)."""
        self.profile_name = name

    def arguments(self, env, device) -> tuple:
        """(arguments, layout key, wide) for this launch: each input with its strides, then each
        output, allocated (contiguous) into ``env``. The layout key is what Triton specializes a
        kernel on that can change between calls: every stride and whether each input's address
        is 16-byte aligned (outputs are fresh allocations, aligned far beyond 16 bytes).
        ``wide`` when some offset the strides give passes int32 (the 64-bit twin is launched)."""
        args = []
        key = []
        for slot in self.loads:
            t = env[slot]
            if t.is_complex():  # interleaved (real, imag): the kernel indexes the real view
                t = torch.view_as_real(t.resolve_conj())
                strides = t.stride()[:-1]
            else:
                strides = t.stride()
            args.append(t)
            args.extend(strides)
            key.append(t.data_ptr() & 15)
            key.extend(strides)
        key = tuple(key)
        donors = dict(self.reuse)
        for k, (slot, shape, dtype) in enumerate(self.stores):
            out = reused_memory(env[donors[k]], shape, dtype) if k in donors else None
            if out is None:
                out = torch.empty(shape, dtype=dtype, device=device)
            env[slot] = out
            args.append(torch.view_as_real(out) if dtype.is_complex else out)
        # NOTE: the inputs' shapes are the program's, so the last offset each input's strides
        # reach is a function of the layout key: computed once per key, not per launch
        wide = self._wide.get(key)
        if wide is None:
            wide = self._wide_for(args, key)
        if self.sizes:
            args.extend(self.sizes)
        return args, key, wide

    def __getstate__(self):  # generated code is made again after unpickling
        return state_without(self, "_straight") | {"_straight": None}

    def _wide_for(self, args, key) -> bool:
        if len(self._wide) >= 64:  # layouts seen (rarely more than two): keep the memo small
            self._wide.clear()
        # (the pointer passed is the element at the storage offset; the kernel adds index · stride)
        wide = self._wide[key] = any(_last_offset(a) >= INT32_LIMIT for a in args[:len(args) - len(self.stores)]
                                     if isinstance(a, torch.Tensor))
        return wide

    def run(self, env, device, fresh_loads=frozenset()):
        """Launch the Triton kernel on ``env``'s input slots, allocating the output slots. The caller
        makes ``device`` current (``Program.run`` does): the generated launch does not switch.
        ``fresh_loads``: the loads that are outputs of earlier launches of the same program
        (``Program.fresh_loads``), whose layout the generated launch need not check."""
        try:
            straight = self._straight
            if straight and straight.run(env, device):
                return  # the usual layout: generated code checked it and launched
            args, key, wide = self.arguments(env, device)
            if self.launch_arguments(args, key, wide, device) and straight is None:
                self._straight = self.launcher(wide).straight_line(self.loads, self.stores, key,
                                                                   [env[slot] for slot in self.loads], fresh_loads,
                                                                   self.sizes, self.reuse)
        except Exception as error:
            if self.index_checks is not None:
                self._raise_index_error(env, device, error)
            raise

    def launch_arguments(self, args, key, wide, device) -> bool:
        """Launch the kernel with ``arguments``'s result (the general path: no generated code).
        True where it launched compiled Triton on the current device, with no lock: a generated
        launch can take over there (``run``)."""
        if not self.grid:  # an empty iteration space: outputs stay empty
            return False
        launcher = self.launcher(wide)
        guard = on_device(device)
        if guard is _NO_GUARD and interpreter_lock is _NO_GUARD:
            launcher.launch(args, key, device)   # compiled Triton on the current device: no context
            return True
        # the tensors' device (and its current stream), not whichever device is current
        with guard, interpreter_lock:
            launcher.launch(args, key, device)
        return False

    def run_torch(self, env, device) -> None:
        """The CPU path (backend="torch"): this kernel's PyTorch function on ``env``; a failed index
        check raises eager's IndexError, as ``run`` does."""
        try:
            self.torch_kernel.run(env)
        except Exception as error:
            if self.index_checks is not None:
                self._raise_index_error(env, device, error)
            raise

    def _raise_index_error(self, env, device, error) -> None:
        """Eager's IndexError for the launch that failed with ``error``, where that is an index out of
        range: the host checks find the first bad index (as eager's message gives it); an assert
        of an index these cannot see (computed in the kernel) is raised with the assert's words.
        Any other error is left to propagate as it is. (On a GPU the assert is asynchronous, a
        device-side assert as eager's own indexing kernels raise: nothing reaches here.)"""
        for check in self.index_checks:
            check.run(env, device)
        text = str(error)
        found = re.search(rf"[\w.]+: {INDEX_ASSERT}[\w ]*", text)
        if found is not None:
            raise IndexError(f"{found.group(0)} (raised by the compiled region, as eager would)") from error
        if self.torch_kernel is not None and re.search(r"index .*out of (range|bounds)", text):
            raise IndexError(f"{text} (raised by the compiled region, as eager would)") from error

    def direct_cpu_call(self):
        """The CPU path's function of this kernel, ``fn(env)`` (what ``run_torch`` calls), or None."""
        if self.torch_kernel is None or self.index_checks is not None:
            return None  # (a kernel that checks indices runs through ``run_torch``, which explains a failure)
        return self.torch_kernel.function()

    def ahead_of_time(self, device) -> list:
        """The launch to compile before the first call (``runtime.ahead_of_time``): its inputs
        contiguous at their recorded shapes and 16-byte aligned, as fresh buffers and parameters
        are; the layout key and arguments such a launch computes (``arguments``), with stand-in
        tensors. Nothing for a kernel with no programs to launch, or complex buffers (their real
        views' strides: left to the first launch)."""
        from runtime.ahead_of_time import Job, stand_in

        if not self.grid or len(self.expected_loads) != len(self.loads) \
                or any(dtype.is_complex for _, dtype in self.expected_loads) \
                or any(dtype.is_complex for _, _, dtype in self.stores):
            return []
        args, key = [], []
        for shape, dtype in self.expected_loads:
            strides = _contiguous_strides(shape)
            args += [stand_in(dtype, device), *strides]
            key += [0, *strides]
        args += [stand_in(dtype, device) for _, _, dtype in self.stores]
        key = tuple(key)
        # (contiguous: an input's last element is numel - 1 elements from its first)
        wide = self._wide[key] = any(_numel(shape) - 1 >= INT32_LIMIT for shape, _ in self.expected_loads)
        return [Job(self.wide_name if wide and self.wide_source else self.name, self.launcher(wide),
                    args + list(self.sizes), key)]

    def launcher(self, wide: bool = False):
        """The bound launcher of the kernel to launch (``kernel(wide)``), made at its first use."""
        launcher = self._launchers.get(wide)
        if launcher is None:
            launcher = self._launchers[wide] = make_launcher(self.kernel(wide), self.grid, self.xblock, self.rblock,
                                                             self.num_warps, debug=self.index_checks is not None)
        return launcher

    def kernel(self, wide: bool = False):
        """The jit function to launch: the 64-bit twin when ``wide`` and there is one."""
        if wide and self.wide_source is not None:
            if self._wide_fn is None:
                self._wide_fn = load_kernel(self.wide_name, self.wide_source)
            return self._wide_fn
        if self._fn is None:
            self._fn = load_kernel(self.name, self.source)
        return self._fn


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def reused_memory(t, shape, dtype):
    """``t``'s memory as a fresh output of ``shape``, when it is exactly that (contiguous, from its
    storage's start: as aligned as a new allocation); else None. Neither ``t`` nor a view of it: a
    region's output that is a view of (or is) a tensor its autograd Function got or made is one
    PyTorch refuses to write in place later ("a view created inside a custom Function", "one of
    several views a function returns"), where eager's output is a tensor of its own."""
    if t.dtype != dtype or not t.is_contiguous() or t.storage_offset() != 0 or t.numel() != _numel(shape):
        return None
    return torch.empty(0, dtype=dtype, device=t.device).set_(t.untyped_storage(), 0, shape)


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _last_offset(t: torch.Tensor) -> int:
    """The offset of ``t``'s last element from its first, in elements: sum((size - 1) · stride)."""
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 1)


def on_device(device: torch.device):
    """Launches on CUDA go to the tensors' device: Triton launches on the current one. Every
    launcher of ours (these programs, the optimizer's combo kernels) enters this and
    ``interpreter_lock``."""
    if device.type != "cuda":
        return _NO_GUARD
    try:
        if device.index == torch.cuda.current_device():
            return _NO_GUARD  # already current: no guard (a device switch costs microseconds a launch)
    except (AssertionError, RuntimeError):  # no CUDA runtime (a test standing in for it): guard anyway
        pass
    return torch.cuda.device(device)


def in_plain_memory(t):
    """``t`` with its values in its memory: a conjugate view's conjugation, a negative view's
    negation (``x.conj()``, ``x.conj().imag``: PyTorch applies them lazily, as a bit on the
    tensor) done into a new tensor; ``t`` itself where there is none."""
    if t is None or not (t.is_conj() or t.is_neg()):
        return t
    return t.resolve_conj().resolve_neg()


@dataclass
class ExternCall:
    """A call of a PyTorch function (a matmul, a convolution, a gather's scatter-add gradient):
    ``fn`` is the compiler's op's own torch function (the runtime keeps no table of ops)."""
    name: str              # the op's name, for reports
    fn: object             # fn(*args, **kwargs) -> the result tensor
    args: list             # ValueRefs
    out: int
    kwargs: dict = field(default_factory=dict)  # constant parameters (dim, shape, ...)
    # more output slots: ``fn`` returns a tuple, (out, *also) in order (one PyTorch call that makes
    # several of the program's values: a convolution's input and weight gradients)
    also: tuple = ()
    kernels: int = 0        # our own kernels the call launches (flash attention's), counted as launches

    def run(self, env, device):
        (self.__dict__.get("_call") or self.direct_call())(env)

    def direct_call(self):
        """``call(env)``, what ``run`` calls (generated at its first use)."""
        call = self.__dict__.get("_call")
        if call is None:
            call = self._call = self._generate()
        return call

    def __getstate__(self):  # the generated call is made again after unpickling
        return state_without(self, "_call")

    def _generate(self):
        """``call(env)``: this call written out once (``inline_line`` in a function of its own)."""
        names: dict = {}
        source = f"def call(env):\n{self.inline_line(names, '')}\n"
        exec(compile(source, f"<symgrad call of {self.name}>", "exec"), names)
        return names["call"]

    def inline_line(self, names: dict, prefix: str) -> str:
        """This call as a line of a generated function taking ``env`` (indented), as Inductor's
        generated wrappers call their externs: ``env[out] = fn(env[2], v0(env[5]), **kwargs)``, each
        view step a partial; its objects bound in ``names`` with ``prefix`` (a program writes its
        calls in line, ``Program._step_call``)."""
        names[f"{prefix}fn"] = self.fn
        arguments = [views_source(f"env[{arg.slot}]", arg.views, names, f"{prefix}v{i}")
                     for i, arg in enumerate(self.args)]
        if self.kwargs:
            names[f"{prefix}kwargs"] = self.kwargs
            arguments.append(f"**{prefix}kwargs")
        targets = ", ".join(f"env[{slot}]" for slot in (self.out, *self.also))
        return f"    {targets} = {prefix}fn({', '.join(arguments)})"


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
        if index.device.type == "cuda":
            ok = ((index >= low) & (index < self.size)).all()
            torch._assert_async(ok, f"{self.what}: index out of range")
            return
        # on the host: one reduction (the smallest and largest index), not four operators
        smallest, largest = (v.item() for v in torch.aminmax(index))
        if smallest < low or largest >= self.size:
            bad = index[(index < low) | (index >= self.size)].flatten()[0].item()
            raise IndexError(f"{self.what}: index {bad} is out of bounds for a dimension of size {self.size} "
                             "(raised by the compiled region, as eager would)")


class StepRunner:
    """Runs the steps programs hand it, for what must see each step: a benchmark that stubs,
    records or logs launches installs one (``steps_run_by``). This class runs each step as the
    programs' generated code does; a subclass changes what it needs and hands the rest to
    ``inner``, the runner installed before it (None: the runtime's own way)."""

    def __init__(self, inner: StepRunner | None = None):
        self.inner = inner

    def kernel(self, step: KernelLaunch, env, device, torch_path: bool, fresh_loads: frozenset) -> None:
        """One kernel launch. ``torch_path``: its program runs it as PyTorch ops (``run_torch``);
        ``fresh_loads``: ``Program.fresh_loads`` of the step."""
        if self.inner is not None:
            self.inner.kernel(step, env, device, torch_path, fresh_loads)
        elif torch_path:
            step.run_torch(env, device)
        else:
            step.run(env, device, fresh_loads)

    def extern(self, step: ExternCall, env, device) -> None:
        if self.inner is not None:
            self.inner.extern(step, env, device)
        else:
            step.run(env, device)

    def index_check(self, step: IndexCheck, env, device) -> None:
        if self.inner is not None:
            self.inner.index_check(step, env, device)
        else:
            step.run(env, device)

    def combo(self, launch, tensors: list, scalars: dict, device) -> None:
        """One launch of a fused optimizer step's or clip's combo kernel
        (``runtime.optimizer_step.ComboLaunch``)."""
        if self.inner is not None:
            self.inner.combo(launch, tensors, scalars, device)
        else:
            launch.launch_now(tensors, scalars, device)


# The installed StepRunner (``steps_run_by``); None: programs run their generated steps.
_runner: StepRunner | None = None
_OWN_WAY = StepRunner()


def _run_step(runner, step, fresh_loads, env, device, torch_path: bool, profiled: bool = False) -> None:
    """One step of a program handed to ``runner`` (``StepRunner``), as the generated steps run it;
    ``profiled``: each kernel launch in a ``record_function`` range of its own name."""
    if isinstance(step, KernelLaunch):
        if profiled:
            with record_function(step.profile_name or f"symgrad kernel {step.name}"):
                runner.kernel(step, env, device, torch_path and step.torch_kernel is not None, fresh_loads)
        else:
            runner.kernel(step, env, device, torch_path and step.torch_kernel is not None, fresh_loads)
    elif isinstance(step, ExternCall):
        runner.extern(step, env, device)
    elif isinstance(step, IndexCheck):
        runner.index_check(step, env, device)
    else:
        step.run(env, device)


class ProgramRun:
    """One run of a ``Program`` made a range of steps at a time (``until``), its slots kept between
    ranges: what a backward handed out in segments runs (``runtime.segments``). Each range runs as
    ``Program.run`` runs the whole: generated straight-line steps (``Program._steps_in_range``)."""

    def __init__(self, program: Program, inputs: list, stats):
        self.program = program
        self.env = list(inputs) + [None] * (program.num_slots - program.num_inputs)
        self.device = _device_of(inputs, program.recorded_device)
        inputs.clear()
        for slot in program._read_inputs:
            self.env[slot] = in_plain_memory(self.env[slot])
        self.next = 0
        if stats is not None:
            stats["kernel_launches"] = stats.get("kernel_launches", 0) + program._launch_count

    def until(self, last: int, outputs: tuple) -> list:
        """Run the steps up to ``last`` (included) not run yet; return the ``outputs`` (indices) then,
        final where ``Program.ready_after`` says so. The range runs as ``Program.run`` runs the whole:
        its generated code (each step handed to the installed StepRunner, if any), under a profiler
        each step in a ``record_function`` range of its own."""
        program, env, device, first = self.program, self.env, self.device, self.next
        self.next = max(first, last + 1)
        if _profiler_enabled():
            program._run_profiled_steps(range(first, last + 1), env, device)
            results = [None if program.outputs[k] is None else program.outputs[k].resolve(env) for k in outputs]
            for slot in program._handed_over(last, outputs):
                env[slot] = None
            return results
        with on_device(device):
            if _runner is not None:
                return program._steps_in_range(device, first, last, outputs, True)(env, device, _runner)
            return program._steps_in_range(device, first, last, outputs, False)(env, device)


def installed_runner() -> StepRunner | None:
    """The StepRunner installed now (``steps_run_by``), or None."""
    return _runner


@contextlib.contextmanager
def steps_run_by(runner: StepRunner):
    """Within the block, every program in this process hands each of its steps to ``runner``
    (generated code still: ``kernel(s3, env, device, ...)`` per step), and fused optimizer steps
    and clips their combo launches: the seam benchmarks stub, record and log launches with. A
    program's run checks this one global; nothing else is checked on the usual path. Pass the
    runner installed before (``installed_runner()``) as the new one's ``inner`` to stack them."""
    global _runner
    saved, _runner = _runner, runner
    try:
        yield runner
    finally:
        _runner = saved


_CPU = torch.device("cpu")


def _device_of(inputs, recorded=None) -> torch.device:
    """Where the program's kernels run: the first tensor input's device; with none (a region of
    factories alone: positions, a causal mask, rotary tables), the device its values were recorded
    on (``Program.recorded_device``), else the CPU."""
    for t in inputs:
        if isinstance(t, torch.Tensor):
            return t.device
    return recorded if recorded is not None else _CPU


@dataclass
class Program:
    num_inputs: int
    num_slots: int
    steps: list
    outputs: list                          # ValueRef or None (no value, e.g. no gradient)
    frees: list = field(default_factory=list)  # per step: slots dead after it
    # What its kernels run with on CPU tensors, fixed when it is built (``runtime.backends``):
    # "torch", each kernel's PyTorch function (``KernelLaunch.run_torch``); else the Triton kernels
    # (in Triton's interpreter on CPU). Launches read nothing else.
    backend: str = field(default_factory=backends.chosen)
    # where a program with no tensor inputs runs: the device capture recorded its values on (a
    # factory-only region of a CUDA model makes CUDA tensors, as eager's factories there do)
    recorded_device: torch.device | None = None
    # (shape, dtype) of each input as the graph recorded it (None: unknown), for what is compiled
    # before the first run (``runtime.ahead_of_time``)
    input_metas: tuple = ()
    # per step: the loads that are outputs of earlier launches of this program (``__post_init__``)
    fresh_loads: tuple = field(init=False, repr=False, compare=False)
    # the generated steps (``_steps_for``), made at their first run: (torch path, through a runner) -> run
    _generated: dict = field(init=False, default_factory=dict, repr=False, compare=False)
    # what a profile calls its runs (``name_in_profiles``)
    profile_name: str = field(default="symgrad program", init=False, repr=False, compare=False)

    def __post_init__(self):
        # Slots are written once: a slot a launch stores is, wherever it is loaded later, that
        # launch's contiguous fresh output (its generated launch does not check their layout)
        stored, fresh = set(), []
        for step in self.steps:
            if isinstance(step, KernelLaunch):
                fresh.append(frozenset(slot for slot in step.loads if slot in stored))
                stored.update(slot for slot, _, _ in step.stores)
            else:
                fresh.append(frozenset())
        self.fresh_loads = tuple(fresh)
        # the float and complex inputs a kernel of ours reads by address (a conjugate or negative
        # view's memory holds the values unconjugated, not negated: PyTorch applies the bit lazily,
        # our kernels do not; an integer or bool tensor has neither bit)
        metas = self.input_metas
        self._read_inputs = tuple(sorted(
            {slot for step in self.steps if isinstance(step, KernelLaunch) for slot in step.loads
             if slot < self.num_inputs and (slot >= len(metas) or metas[slot] is None
                                            or metas[slot][1].is_floating_point or metas[slot][1].is_complex)}))
        self._torch_on_cpu = backends.cpu_path(self.backend)
        self._launch_count = sum(1 if isinstance(step, KernelLaunch) else getattr(step, "kernels", 0)
                                 for step in self.steps)

    @property
    def kernels(self):
        return [s for s in self.steps if isinstance(s, KernelLaunch)]

    def name_in_profiles(self, name: str, kernel_names: dict) -> None:
        """Its runs appear as ``name`` in a profile, each kernel's launches as ``kernel_names[its
        name]`` where given (the compiler names them: region, phase, the user ops fused)."""
        self.profile_name = name
        for launch in self.kernels:
            if launch.name in kernel_names:
                launch.name_in_profiles(kernel_names[launch.name])

    def run(self, inputs, stats=None, consume=False) -> list:
        """Run the steps on ``inputs``; return the outputs. ``consume``: the caller hands its
        references over (``inputs``, a list, is emptied): each input is freed after its last use."""
        if _runner is not None or _profiler_enabled():  # (a global and one C call: the usual run pays nothing else)
            return self._run_observed(inputs, stats, consume)
        env = list(inputs) + [None] * (self.num_slots - self.num_inputs)
        device = _device_of(inputs, self.recorded_device)
        if consume:
            inputs.clear()
        guard = on_device(device)
        if guard is _NO_GUARD:
            outputs = self._steps_for(device)(env, device)
        else:  # once for the program: each launch then runs on the current device without a switch
            with guard:
                outputs = self._steps_for(device)(env, device)
        if stats is not None:
            stats["kernel_launches"] = stats.get("kernel_launches", 0) + self._launch_count
        return outputs

    def start(self, inputs: list, stats=None) -> "ProgramRun":
        """A run of this program made range by range (``ProgramRun.until``), for a backward handed out
        in segments (``runtime.segments``). Takes the caller's references (``inputs`` is emptied)."""
        return ProgramRun(self, inputs, stats)

    def ready_after(self) -> list:
        """Per output, the index of the step that writes its slot (-1: an input's slot; the last step
        where no step writes it): after that step the output is final, as slots are written once."""
        written = {}
        for i, step in enumerate(self.steps):
            if isinstance(step, KernelLaunch):
                slots = [slot for slot, _, _ in step.stores]
            elif isinstance(step, ExternCall):
                slots = [step.out, *step.also]
            else:
                slots = [getattr(step, "out", None)]
            for slot in slots:
                written[slot] = i
        last = len(self.steps) - 1
        return [None if ref is None else -1 if ref.slot < self.num_inputs else written.get(ref.slot, last)
                for ref in self.outputs]

    def _steps_for(self, device, through_runner: bool = False):
        """The generated steps that run on ``device``: the CPU path's where this program was built
        for it (backend="torch") and its inputs are on the CPU, else the Triton kernels';
        ``through_runner``: each step handed to a StepRunner, ``run(env, device, runner)``."""
        variant = (self._torch_on_cpu and device.type == "cpu", through_runner)
        run = self._generated.get(variant)
        if run is None:
            run = self._generated[variant] = self._generate(*variant)
        return run

    def __getstate__(self):  # the generated steps are made again after unpickling
        return state_without(self, "_generated") | {"_generated": {}}

    def ahead_of_time(self, device) -> list:
        """Every kernel's launch to compile before the first call (``KernelLaunch.ahead_of_time``)."""
        return [job for step in self.kernels for job in step.ahead_of_time(device)]

    def prepare_cpu(self) -> None:
        """Generate now what the CPU path's first run would (each kernel's PyTorch function, the
        straight-line steps): a build's work, done while building, not in the first replayed call."""
        self._steps_for(_CPU)

    def _steps_in_range(self, device, first: int, last: int, outputs: tuple, through_runner: bool):
        """The generated steps ``first`` to ``last`` (included) returning the ``outputs`` (indices),
        ``run(env, device[, runner])``, for a run made range by range (``ProgramRun``): each step and
        free as ``_steps_for``'s, without its prologue (the run made its inputs plain). Made at the
        range's first run."""
        variant = (self._torch_on_cpu and device.type == "cpu", through_runner, first, last, outputs)
        run = self._generated.get(variant)
        if run is None:
            run = self._generated[variant] = self._generate(*variant[:2], steps=range(first, last + 1),
                                                            returned=outputs)
        return run

    def _generate(self, torch_path: bool, through_runner: bool, steps: range | None = None, returned=None):
        """The steps written out once: ``s3(env, device)`` then ``env[7] = None`` for each slot dead
        after it (no loop, no zip per step), then the list of outputs. ``through_runner``: each
        step handed to the StepRunner passed, ``kernel(s3, env, device, ...)``. ``steps`` and
        ``returned``: only those steps, no prologue, those outputs (``_steps_in_range``)."""
        names: dict = {}
        if through_runner:
            lines = ["def run(env, device, runner):",
                     "    kernel, extern, check = runner.kernel, runner.extern, runner.index_check"]
            call = self._runner_call
        else:
            lines = ["def run(env, device):"]
            call = self._step_call
        for i in steps if steps is not None else range(len(self.steps)):  # (as the loop it replaces ran)
            lines.append("    " + call(i, self.steps[i], torch_path, names))
            if self.frees[i]:
                lines.append("    " + " = ".join(f"env[{slot}]" for slot in self.frees[i]) + " = None")
        if steps is None:
            names["plain"] = in_plain_memory
            lines[1:1] = [f"    if env[{slot}].is_conj() or env[{slot}].is_neg(): env[{slot}] = plain(env[{slot}])"
                          for slot in self._read_inputs]
        outputs = []  # each output read from its slot, its views applied (as ValueRef.resolve)
        for k in returned if returned is not None else range(len(self.outputs)):
            ref = self.outputs[k]
            outputs.append("None" if ref is None else views_source(f"env[{ref.slot}]", ref.views, names, f"out{k}"))
        handed = self._handed_over(steps[-1], returned) if steps else ()
        if handed:
            lines.append(f"    out = [{', '.join(outputs)}]")
            lines.append("    " + " = ".join(f"env[{slot}]" for slot in handed) + " = None")
            lines.append("    return out")
        else:
            lines.append(f"    return [{', '.join(outputs)}]")
        exec(compile("\n".join(lines) + "\n", "<symgrad program steps>", "exec"), names)
        return names["run"]

    def _handed_over(self, last: int, returned: tuple) -> list:
        """The slots of the ``returned`` outputs that a run made range by range lets go of once the
        range ending at step ``last`` returns them: none of its later steps reads them, no output
        it returns later shares them. NOTE (memory, speed): a gradient whose only reference is the
        engine's is stolen by AccumulateGrad as ``.grad``; one the run still held was copied (6 ms
        of a 50 ms DDP step at width 1024, measured on this CPU: each segment but the last)."""
        later_reads = set()
        for step in self.steps[last + 1:]:
            later_reads.update(step.loads if isinstance(step, KernelLaunch) else (a.slot for a in step.args))
        others = {ref.slot for k, ref in enumerate(self.outputs) if ref is not None and k not in returned}
        slots = {self.outputs[k].slot for k in returned if self.outputs[k] is not None}
        return sorted(slots - later_reads - others)

    def _step_call(self, i: int, step, torch_path: bool, names: dict) -> str:
        """The generated line(s) that run step ``i`` (its objects bound in ``names``). A matmul and,
        on the CPU path, a C++ kernel's call are written in line (``ExternCall.inline_line``,
        ``CppKernel.inline_lines``); any other kernel's own function is called directly, ``k3(env)``.
        NOTE (speed): each step of a small CPU program begins with its objects out of the caches (the
        step's kernels evict them); a frame, code object and globals per step were a fair part of
        what a program of small kernels costs there."""
        if isinstance(step, ExternCall):
            return step.inline_line(names, f"k{i}_").strip()
        if isinstance(step, KernelLaunch) and torch_path and step.torch_kernel is not None:
            direct = step.direct_cpu_call()
            if direct is not None:
                inline = getattr(step.torch_kernel, "inline_lines", None)
                if inline is not None:
                    return "\n".join(inline(names, f"k{i}_")).strip()
                names[f"k{i}"] = direct
                return f"k{i}(env)"
            names[f"s{i}"] = step.run_torch
            return f"s{i}(env, device)"
        names[f"s{i}"] = step.run
        if self.fresh_loads[i]:
            names[f"f{i}"] = self.fresh_loads[i]
            return f"s{i}(env, device, f{i})"
        return f"s{i}(env, device)"

    def _runner_call(self, i: int, step, torch_path: bool, names: dict) -> str:
        """The generated line that hands step ``i`` to the runner (``StepRunner``)."""
        names[f"s{i}"] = step
        if isinstance(step, KernelLaunch):
            names[f"f{i}"] = self.fresh_loads[i]
            return f"kernel(s{i}, env, device, {torch_path and step.torch_kernel is not None}, f{i})"
        if isinstance(step, ExternCall):
            return f"extern(s{i}, env, device)"
        if isinstance(step, IndexCheck):
            return f"check(s{i}, env, device)"
        return f"s{i}.run(env, device)"

    def _run_profiled_steps(self, steps: range, env: list, device) -> None:
        """``steps`` run one by one, each kernel launch in a ``record_function`` range of its own, each
        through the installed StepRunner (if any), each slot freed after its last reader: what a run
        under a profiler does (``_run_profiled``, ``ProgramRun.until``)."""
        runner = _runner or _OWN_WAY
        torch_path = self._torch_on_cpu and device.type == "cpu"
        with on_device(device):  # (as ``run``: the launches expect their device current)
            for i in steps:
                _run_step(runner, self.steps[i], self.fresh_loads[i], env, device, torch_path, profiled=True)
                for slot in self.frees[i]:
                    env[slot] = None

    def _run_observed(self, inputs, stats, consume) -> list:
        """``run`` where something sees each step: a StepRunner installed (``steps_run_by``), or a
        profiler (``_run_profiled``)."""
        if _profiler_enabled():
            return self._run_profiled(inputs, stats, consume)
        env = list(inputs) + [None] * (self.num_slots - self.num_inputs)
        device = _device_of(inputs, self.recorded_device)
        if consume:
            inputs.clear()
        with on_device(device):
            outputs = self._steps_for(device, through_runner=True)(env, device, _runner)
        if stats is not None:
            stats["kernel_launches"] = stats.get("kernel_launches", 0) + self._launch_count
        return outputs

    def _run_profiled(self, inputs, stats, consume) -> list:
        """``run`` under a profiler: the program, and each kernel launch in it, as a
        ``record_function`` range named by the compiler (``compiler.api.name_for_profiler``: the
        region, the phase and the user ops each fused), so a profile reads like eager's. Each
        step goes through the installed StepRunner, if any."""
        with record_function(self.profile_name):
            env = list(inputs) + [None] * (self.num_slots - self.num_inputs)
            device = _device_of(inputs, self.recorded_device)
            if consume:
                inputs.clear()
            for slot in self._read_inputs:
                env[slot] = in_plain_memory(env[slot])
            self._run_profiled_steps(range(len(self.steps)), env, device)
            if stats is not None:
                stats["kernel_launches"] = stats.get("kernel_launches", 0) + self._launch_count
            return [o.resolve(env) if o is not None else None for o in self.outputs]
