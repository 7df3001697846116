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

from runtime.backends import torch_on_cpu
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
    # place of the Triton kernel when ``runtime.backends`` says CPU kernels run as PyTorch ops.
    torch_kernel: object = None
    # The kernel asserts its gathered indices in range (None: it gathers unchecked, or not at all):
    # compiled with Triton's ``debug`` option, and on CPU a failed assert is explained by these
    # host checks of the index buffers it loads (``IndexCheck``), for eager's error and message.
    index_checks: tuple | None = None
    _fn: object = None
    _wide_fn: object = None

    _launchers: dict = field(default_factory=dict)  # wide -> runtime.launcher.Launcher, bound once
    _wide: dict = field(default_factory=dict)       # layout key -> whether it needs the 64-bit twin
    # The generated straight-line launch of the first layout that has one (runtime.launcher's
    # ``generate_launch``); None: none yet, False: this kernel's launcher never has one.
    _straight: object = None
    # Loads that are outputs of earlier launches of the same program (set by ``Program``): always
    # contiguous and freshly allocated, so the generated launch does not check their layout.
    fresh_loads: frozenset = frozenset()

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

    def run(self, env, device):
        """Launch on ``env``'s input slots, allocating the output slots. The caller makes
        ``device`` current (``Program.run`` does): the generated launch does not switch."""
        try:
            if device.type == "cpu" and self.torch_kernel is not None and torch_on_cpu():
                self.torch_kernel.run(env)  # the CPU path: PyTorch's kernels (backend="torch")
                return
            straight = self._straight
            if straight and straight(env, device):
                return  # the usual layout: generated code checked it and launched
            args, key, wide = self.arguments(env, device)
            if self.grid:  # an empty iteration space: outputs stay empty
                launcher = self.launcher(wide)
                guard = on_device(device)
                if guard is _NO_GUARD and interpreter_lock is _NO_GUARD:
                    launcher.launch(args, key, device)   # compiled Triton on the current device: no context
                    if straight is None:
                        self._straight = launcher.straight_line(self.loads, self.stores, key,
                                                                [env[slot] for slot in self.loads], self.fresh_loads,
                                                                self.sizes, self.reuse)
                    return
                # the tensors' device (and its current stream), not whichever device is current
                with guard, interpreter_lock:
                    launcher.launch(args, key, device)
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
        """The CPU path's function of this kernel, ``fn(env)`` (what ``run`` calls there), or None."""
        if self.torch_kernel is None or self.index_checks is not None:
            return None  # (a kernel that checks indices runs through ``run``, which explains a failure)
        return self.torch_kernel.function()

    def launcher(self, wide: bool = False):
        """The bound launcher of the kernel to launch (``kernel(wide)``), made at its first use.
        Rebound if ``kernel`` now gives another function (a benchmark recording launches)."""
        fn = self.kernel(wide)
        launcher = self._launchers.get(wide)
        if launcher is None or launcher.fn is not fn:
            launcher = self._launchers[wide] = make_launcher(fn, self.grid, self.xblock, self.rblock, self.num_warps,
                                                             debug=self.index_checks is not None)
            self._straight = None  # generated for the old launcher's kernel
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

    def run(self, env, device):
        (self.__dict__.get("_call") or self.direct_cpu_call())(env)

    def direct_cpu_call(self):
        """``call(env)``, what ``run`` calls (generated at its first use)."""
        call = self.__dict__.get("_call")
        if call is None:
            call = self._call = self._generate()
        return call

    def __getstate__(self):  # the generated call is made again after unpickling
        return state_without(self, "_call")

    def _generate(self):
        """``call(env)``: this call written out once, as Inductor's generated wrappers call their
        externs: ``env[out] = fn(env[2], v0(env[5]), **kwargs)``, each view step a partial."""
        names = {"fn": self.fn, "kwargs": self.kwargs}
        arguments = []
        for i, arg in enumerate(self.args):
            arguments.append(views_source(f"env[{arg.slot}]", arg.views, names, f"v{i}"))
        if self.kwargs:
            arguments.append("**kwargs")
        targets = ", ".join(f"env[{slot}]" for slot in (self.out, *self.also))
        source = f"def call(env):\n    {targets} = fn({', '.join(arguments)})\n"
        exec(compile(source, f"<symgrad call of {self.name}>", "exec"), names)
        return names["call"]


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


_KERNEL_RUN, _EXTERN_RUN = KernelLaunch.run, ExternCall.run  # (replaced by benchmarks that stub launches)
_CPU = torch.device("cpu")


def _device_of(inputs) -> torch.device:
    """The first tensor input's device (CPU where there is none): where the program's kernels run."""
    for t in inputs:
        if isinstance(t, torch.Tensor):
            return t.device
    return _CPU


@dataclass
class Program:
    num_inputs: int
    num_slots: int
    steps: list
    outputs: list                          # ValueRef or None (no value, e.g. no gradient)
    frees: list = field(default_factory=list)  # per step: slots dead after it

    def __post_init__(self):
        # Slots are written once: a slot a launch stores is, wherever it is loaded later, that
        # launch's contiguous fresh output (tell each launch which of its loads those are)
        stored: set = set()
        for step in self.steps:
            if isinstance(step, KernelLaunch):
                step.fresh_loads = frozenset(slot for slot in step.loads if slot in stored)
                stored.update(slot for slot, _, _ in step.stores)

    @property
    def kernels(self):
        return [s for s in self.steps if isinstance(s, KernelLaunch)]

    def run(self, inputs, stats=None, consume=False) -> list:
        """Run the steps on ``inputs``; return the outputs. ``consume``: the caller hands its
        references over (``inputs``, a list, is emptied): each input is freed after its last use."""
        if _profiler_enabled():  # (one C call: the unprofiled run pays nothing else)
            return self._run_profiled(inputs, stats, consume)
        env = list(inputs) + [None] * (self.num_slots - self.num_inputs)
        device = _device_of(inputs)
        if consume:
            inputs.clear()
        guard = on_device(device)
        if guard is _NO_GUARD:
            outputs = self._run_steps(env, device)
        else:  # once for the program: each launch then runs on the current device without a switch
            with guard:
                outputs = self._run_steps(env, device)
        if stats is not None:
            count = self.__dict__.get("_launch_count")
            if count is None:  # (counted once: the steps are fixed once the program runs)
                count = self._launch_count = len(self.kernels)
            stats["kernel_launches"] = stats.get("kernel_launches", 0) + count
        return outputs

    def _run_steps(self, env, device) -> list:
        """Run the steps (generated straight-line code) and return the outputs."""
        if device.type == "cpu" and KernelLaunch.run is _KERNEL_RUN and ExternCall.run is _EXTERN_RUN \
                and torch_on_cpu():
            run = self.__dict__.get("_cpu_straight")
            if run is None or run.frees is not self.frees or run.steps is not self.steps \
                    or run.outputs is not self.outputs:
                run = self._cpu_straight = self._generate(cpu=True)
            return run(env, device)
        run = self.__dict__.get("_straight")
        if run is None or run.frees is not self.frees or run.steps is not self.steps or run.outputs is not self.outputs:
            run = self._straight = self._generate()
        return run(env, device)

    def __getstate__(self):  # the generated steps are made again after unpickling
        return state_without(self, "_straight", "_cpu_straight")

    def prepare_cpu(self) -> None:
        """Generate now what the CPU path's first run would (each kernel's PyTorch function, the
        straight-line steps): a build's work, done while building, not in the first replayed call."""
        self._cpu_straight = self._generate(cpu=True)

    def _generate(self, cpu: bool = False):
        """The steps written out once: ``s3.run(env, device)`` then ``env[7] = None`` for each slot
        dead after it (no loop, no zip per step), then the list of outputs. ``sN.run`` is looked
        up per call, so a step class's ``run`` replaced later (a benchmark stubbing launches) is
        still what runs.
        ``cpu``: for the CPU path (kernels as PyTorch ops, ``torch_on_cpu``), each kernel's and
        matmul's own generated function is called directly, ``k3(env)``: two Python frames fewer
        a step, which on CPU is a fair part of what a small kernel costs (``_run_steps`` uses it
        while the step classes' ``run`` are not replaced)."""
        names = {f"s{i}": step for i, step in enumerate(self.steps)}
        lines = ["def run(env, device):"]
        for i, (step, dead) in enumerate(zip(self.steps, self.frees)):  # (as the loop it replaces ran)
            direct = step.direct_cpu_call() if cpu and isinstance(step, (KernelLaunch, ExternCall)) else None
            if direct is not None:
                names[f"k{i}"] = direct
                lines.append(f"    k{i}(env)")
            else:
                lines.append(f"    s{i}.run(env, device)")
            if dead:
                lines.append("    " + " = ".join(f"env[{slot}]" for slot in dead) + " = None")
        outputs = []  # each output read from its slot, its views applied (as ValueRef.resolve)
        for k, ref in enumerate(self.outputs):
            if ref is None:
                outputs.append("None")
                continue
            outputs.append(views_source(f"env[{ref.slot}]", ref.views, names, f"out{k}"))
        lines.append(f"    return [{', '.join(outputs)}]")
        exec(compile("\n".join(lines) + "\n", "<symgrad program steps>", "exec"), names)
        run = names["run"]
        # what it was written for (frees are set after construction)
        run.frees, run.steps, run.outputs = self.frees, self.steps, self.outputs
        return run

    def _run_profiled(self, inputs, stats, consume) -> list:
        """``run`` under a profiler: the program, and each kernel launch in it, as a
        ``record_function`` range named by the compiler (``compiler.api.name_for_profiler``:
        the region, the phase and the user ops each fused), so a profile reads like eager's."""
        from torch.autograd.profiler import record_function

        with record_function(getattr(self, "profile_name", "symgrad program")):
            env = list(inputs) + [None] * (self.num_slots - self.num_inputs)
            device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
            if consume:
                inputs.clear()
            with on_device(device):  # (as ``run``: the launches expect their device current)
                for step, dead in zip(self.steps, self.frees):
                    if isinstance(step, KernelLaunch):
                        with record_function(getattr(step, "profile_name", None) or f"symgrad kernel {step.name}"):
                            step.run(env, device)
                    else:
                        step.run(env, device)
                    for slot in dead:
                        env[slot] = None
            if stats is not None:
                stats["kernel_launches"] = stats.get("kernel_launches", 0) + len(self.kernels)
            return [o.resolve(env) if o is not None else None for o in self.outputs]
