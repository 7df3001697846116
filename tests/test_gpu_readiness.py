"""What a CUDA run would hit, checked without a GPU (issue 35): each test fails before its fix.

- A region with no tensor inputs (a factory-only region: ``torch.arange`` positions, a causal mask,
  rotary tables) has no input to take its device from: it runs where its values were recorded, not
  on the CPU, whose tensors the next CUDA kernel would be handed.
- The fused optimizer step never runs inside a CUDA graph capture (its host scalars would be baked
  in): the optimizer's own step does, as eager's.
"""

from __future__ import annotations

import contextlib

import pytest

import compiler  # noqa: F401  (first: it chooses Triton's interpreter on a machine without a GPU)

import torch  # noqa: E402

from compiler.fusion.fuse import fuse  # noqa: E402
from compiler.ir.graph import GraphBuilder, update_meta  # noqa: E402
from compiler.ir.ops import catalog as C  # noqa: E402
from compiler.lower.program import lower  # noqa: E402
from runtime import program as P  # noqa: E402


def _factory_only_program(device: torch.device):
    """positions * 2 + 1 from iota alone, its nodes recorded on ``device`` (as capture records them)."""
    b = GraphBuilder()
    positions = C.emit_iota(b, (4, 8), 1, torch.float32)
    out = C.emit_pointwise(b, "add", [C.emit_pointwise(b, "mul", [positions, 2.0], dtype=torch.float32), 1.0],
                           dtype=torch.float32)
    for node in b.created:
        update_meta(node, device=device)
    b.output([out])
    return lower(b.graph, fuse(b.graph))[0]


class _DeviceSeen(P.StepRunner):
    """Records the device each step is run on, and runs nothing."""

    def __init__(self, inner):
        super().__init__(inner)
        self.devices = []

    def kernel(self, step, env, device, torch_path, fresh_loads):
        self.devices.append(device)
        for slot, shape, dtype in step.stores:
            env[slot] = torch.empty(shape, dtype=dtype, device="meta")


def test_a_region_without_tensor_inputs_runs_where_its_values_were_recorded(monkeypatch):
    program = _factory_only_program(torch.device("cuda", 0))
    assert program.num_inputs == 0 and program.recorded_device == torch.device("cuda", 0)
    monkeypatch.setattr(P, "on_device", lambda device: contextlib.nullcontext())   # (no CUDA runtime here)
    seen = _DeviceSeen(P.installed_runner())
    with P.steps_run_by(seen):
        program.run([])
    assert seen.devices and all(d == torch.device("cuda", 0) for d in seen.devices), seen.devices


def test_a_region_without_tensor_inputs_still_runs_on_the_cpu_when_recorded_there():
    program = _factory_only_program(torch.device("cpu"))
    out, = program.run([])
    torch.testing.assert_close(out, torch.arange(8.0).expand(4, 8) * 2 + 1)


# ------------------------------------------------------------------------------ CUDA graph capture
def _sgd_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x):
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, step


def test_the_fused_optimizer_step_never_runs_inside_a_cuda_graph_capture(monkeypatch):
    """Under CUDA graph capture eager's ``step()`` raises unless its groups are capturable, and a
    capturable step keeps its scalars on the device; the fused step reads the learning rate and step
    count on the host, which a captured graph would bake in. So while the current stream captures,
    the step is left to the optimizer itself (its own check raises or it captures correctly); the
    fused kernels run again after. (A fake capture: this machine has no CUDA.)"""
    model, step = _sgd_step()
    reference, reference_step = _sgd_step()
    compiled = compiler.compile(step, backend="interpret")
    x = torch.randn(5, 4)
    for _ in range(2):
        compiled(x)
        reference_step(x)
    launches = compiled.stats["kernel_launches"]
    compiled(x)
    reference_step(x)
    per_step = compiled.stats["kernel_launches"] - launches
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    launches = compiled.stats["kernel_launches"]
    compiled(x)
    reference_step(x)
    assert compiled.stats["kernel_launches"] - launches < per_step   # (the optimizer's kernels did not run)
    monkeypatch.undo()
    compiled(x)
    reference_step(x)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs)
    assert compiled.stats["divergences"] == 0, compiled.stats


# ------------------------------------------------------------------------- no tensor arguments
def _closes_over(w):
    @compiler.compile
    def step():   # (no tensor arguments: the parameter it reads is reached from outside)
        return (w.sin() * 2).sum()
    return step


def test_a_call_without_tensor_arguments_runs_with_the_backend_of_the_device_it_recorded_on(monkeypatch):
    """``auto`` chooses by the device of the call's tensors. A training step that takes none (its
    model and batch reached from outside) used to be chosen as a CPU call whatever its tensors were:
    in a CUDA process its regions were built for the CPU path. The recording's device decides now.
    (No CUDA here: the recording is said to be on cuda, and Triton said not to interpret; the kernels
    built for ``triton`` then run through the interpreter's launcher, as any ``fn[grid]`` kernel.)"""
    from compiler import api

    recorded = api._recorded_device_type
    monkeypatch.setattr(api, "_recorded_device_type", lambda r: {"cpu": "cuda"}.get(recorded(r)))
    monkeypatch.setattr(api.backends, "interpreting", lambda: False)
    w = torch.randn(4, requires_grad=True)
    step = _closes_over(w)
    for _ in range(3):
        out = step()
    assert step.last_entry.report.backend == "triton", step.last_entry.report.backend
    assert "no tensor arguments" in step.last_entry.report.backend_reason
    assert step.last_backend == "triton" and step.stats["kernel_launches"] >= 2, step.stats
    torch.testing.assert_close(out, (w.sin() * 2).sum())


def test_a_call_without_tensor_arguments_on_the_cpu_takes_the_cpu_path():
    w = torch.randn(4, requires_grad=True)
    step = _closes_over(w)
    out = step()
    out.backward()
    from runtime.backends import auto_cpu_backend

    assert step.last_entry.report.backend == auto_cpu_backend() and step.stats["captures"] == 1
    torch.testing.assert_close(w.grad, 2 * w.detach().cos())


def test_an_explicit_backend_without_tensor_arguments_is_checked_only_against_the_process():
    """``backend='triton'`` with no tensor arguments cannot be refused for "inputs on the CPU": there
    are none. Here it is refused because Triton interprets, which is true of the process."""
    from runtime.backends import BackendUnavailable

    step = compiler.compile(lambda: torch.ones(3).sum(), backend="triton")
    try:
        step()
    except BackendUnavailable as e:
        assert "interpreter" in str(e) and "cpu" not in str(e).split(";")[0], e
    else:
        raise AssertionError("backend='triton' ran with Triton interpreting")


# ------------------------------------------------------------------ GPU arithmetic in the optimizer
def test_the_fp32_adam_update_rounds_its_divisions_and_roots_as_eager_does_on_hopper(tmp_path):
    """Triton's fp32 ``/`` compiles to div.full.f32 (2 ulp) on a GPU, where eager's foreach Adam
    (``_foreach_sqrt``, ``addcdiv_``) rounds as IEEE does, and the interpreter the tests run is exact:
    an update's error lands in the parameters and compounds over every step. The fused Adam kernel
    compiled for sm_90 has no approximate division or root left (it had two before)."""
    from benchmarks.sm90 import Launch, compile_launches
    from compiler.optimizers.combo import BLOCK, combo_source
    from compiler.optimizers.rules import AdamRule

    rule, key = AdamRule(), (False, True, True, True)   # AdamW, amsgrad
    name, source, scalars, _ = combo_source(rule, key, torch.float32, (4096, 64))
    pointers = [["ptr", "torch.float32", 0]] * (2 * (2 + len(rule.state_names(key))))
    args = pointers + [["int", 1] if s == "lerp_low" else ["float", 0.37] for s in scalars]
    result, = compile_launches([Launch(name, source, args, {"BLOCK": BLOCK})], processes=1, cache_dir=str(tmp_path))
    assert result["error"] is None, result["error"]
    assert result["approximate_math"] == 0, result


# ---------------------------------------------------------------------------- launch hooks
def test_a_launch_hook_installed_after_the_kernel_was_bound_is_called(monkeypatch):
    """A profiler started mid-training installs its launch hook after our kernels were bound. Triton
    before 3.9 installs it by assigning a new function to ``knobs.runtime.launch_enter_hook``; a hook
    read once at bind time never saw it, and neither did the generated straight-line launch. Both read
    the knob at each launch now, and pass the hook and the launch metadata it needs."""
    from triton import knobs

    from runtime import program
    from tests.test_launch import _exp_kernel_bound_directly

    monkeypatch.setattr(program, "interpreter_lock", program._NO_GUARD)  # as on a GPU: no interpreter
    x, launch, compiled, ran, direct = _exp_kernel_bound_directly()
    direct.fn = launch.kernel()
    launch._launchers[False] = direct
    cpu = torch.device("cpu")
    for _ in range(2):   # the first binds, the second runs the generated launch
        launch.run([x, None], cpu)
    assert launch._straight and len(ran) == 2 and ran[1][1][6] is None
    seen = []

    def profiler_hook(metadata):
        seen.append(metadata)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", profiler_hook)
    launch.run([x, None], cpu)
    grid, one, one_, stream, function, metadata, launch_metadata, enter, exit_, *passed = ran[2][1]
    assert enter is profiler_hook and launch_metadata == {"grid": (launch.grid, 1, 1)}


# ------------------------------------------------------------------- the optimizer's launches
def test_the_fused_optimizer_step_calls_the_driver_launcher_directly(monkeypatch):
    """The optimizer's combo kernels launched through ``JITFunction.run`` (10-20 µs of binding and
    specialization per launch on a GPU). They go through runtime.launcher now, as the graph kernels
    do: the specialization is compiled once, then each step calls the driver's launcher with the
    parameters, gradients, state and scalars. (No GPU: the compile and the driver are stand-ins.)"""
    from runtime import optimizer_step
    from runtime.launcher import DirectLauncher
    from tests.test_launch import _FakeKernel

    compiled, ran = [], []

    def direct(fn, grid, num_warps=4, constexprs=None, **_):
        def compile(args):
            compiled.append(len(args))
            return _FakeKernel(len(compiled))
        return DirectLauncher(fn, grid, 0, 0, num_warps, constexprs=constexprs, compile=compile,
                              stream=lambda index: 0, runner=lambda kernel: lambda *a: ran.append(a))
    monkeypatch.setattr(optimizer_step, "make_launcher", direct)
    monkeypatch.setattr(optimizer_step, "interpreter_lock", contextlib.nullcontext())
    model, step = _sgd_step()
    fused = compiler.compile(step, backend="interpret")
    x = torch.randn(5, 4)
    for _ in range(4):
        fused(x)
    assert len(compiled) == 1, compiled              # one combo kernel (both parameters), bound once
    assert len(ran) >= 2, len(ran)                   # launched by the driver launcher at each replayed step
    grid, *_, enter, exit_ = ran[-1][:9]
    passed = ran[-1][9:]
    tensors = [a for a in passed if isinstance(a, torch.Tensor)]
    assert any(t is model.weight for t in tensors) and any(t is model.bias for t in tensors)
    assert passed[-1] == 1024   # BLOCK, last


# ------------------------------------------------------------------ compiled ahead of time
def _compiles_recorded(monkeypatch, fail=None):
    """Compiled Triton's launchers with a stand-in compile (no GPU): each compile waits 50 ms and
    records (kernel, thread); ``fail``: a kernel name part whose compile raises. Ahead-of-time
    compiling is on for the interpreter's builds too (what the GPU's builds would do)."""
    import threading
    import time

    from runtime import ahead_of_time, optimizer_step
    from runtime.launcher import DirectLauncher
    from tests.test_launch import _FakeKernel

    compiles = []

    def make(fn, grid, xblock=0, rblock=0, num_warps=4, debug=False, constexprs=None):
        name = getattr(fn, "__name__", "?")

        def compile(args):
            time.sleep(0.05)
            compiles.append((name, threading.get_ident()))
            if fail and fail in name:
                raise RuntimeError(f"PassManager::run failed for {name}")
            return _FakeKernel(len(compiles))
        return DirectLauncher(fn, grid, xblock, rblock, num_warps, compile=compile, stream=lambda index: 0,
                              runner=lambda kernel: lambda *a: None, debug=debug, constexprs=constexprs)
    monkeypatch.setattr(P, "make_launcher", make)
    monkeypatch.setattr(optimizer_step, "make_launcher", make)
    monkeypatch.setattr(P, "interpreter_lock", P._NO_GUARD)
    monkeypatch.setattr(optimizer_step, "interpreter_lock", contextlib.nullcontext())
    monkeypatch.setattr(ahead_of_time, "BACKENDS", frozenset({"interpret"}))
    monkeypatch.setenv(ahead_of_time.WORKERS_ENV, "4")
    return compiles


def _region_kernels(compiled):
    return [k for region in compiled.last_entry.trace.regions if region.compiled is not None
            for program in (region.compiled.forward, region.compiled.backward) if program is not None
            for k in program.kernels]


def test_every_forward_and_backward_kernel_compiles_in_parallel_before_the_first_replay(monkeypatch):
    """Compiled Triton bound each kernel at its first launch: forward kernels inside the first
    replay, backward kernels inside loss.backward(), one at a time. A region built for compiled
    Triton now compiles all of them while it is built, in a thread pool; the replays and the
    backward compile nothing."""
    import threading

    compiles = _compiles_recorded(monkeypatch)
    f = compiler.compile(lambda x, w: ((x.sin() * w).exp().sum(1) / 3).tanh().sum(), backend="interpret")
    x, w = torch.randn(8, 16), torch.randn(8, 16, requires_grad=True)
    f(x, w)   # the recording: the region is built, its kernels compiled
    kernels = _region_kernels(f)
    region = f.last_entry.trace.regions[0].compiled
    forward, backward = len(region.forward.kernels), len(region.backward.kernels)
    assert forward >= 1 and backward >= 1, (forward, backward)
    assert len(compiles) == len(kernels), (compiles, kernels)
    threads = {t for _, t in compiles}
    assert threading.get_ident() not in threads and len(threads) >= 2, threads   # (in the pool, at once)
    for _ in range(2):
        f(x, w).backward()
    assert len(compiles) == len(kernels) and f.stats["kernel_launches"] >= 2 * len(kernels), f.stats


def test_the_fused_optimizer_step_compiles_its_kernels_when_it_is_built(monkeypatch):
    compiles = _compiles_recorded(monkeypatch)
    model, step = _sgd_step()
    fused = compiler.compile(step, backend="interpret")
    x = torch.randn(5, 4)
    fused(x)
    combos = [name for name, _ in compiles if name.startswith("optimizer_")]
    assert len(combos) == 1, compiles
    for _ in range(3):
        fused(x)
    assert [name for name, _ in compiles if name.startswith("optimizer_")] == combos


@pytest.mark.allows_eager("a kernel that does not compile: its region runs eagerly")
def test_a_kernel_that_does_not_compile_makes_its_region_run_eagerly_with_the_reason(monkeypatch):
    """Never mid-step: the failure is met while the region is built (after the recording, which ran
    eagerly), where the compiler's handling of a bug applies: eager's values, the reason in explain."""
    monkeypatch.setenv("SYMGRAD_STRICT", "0")
    _compiles_recorded(monkeypatch, fail="fused")
    f = compiler.compile(lambda x: (x.sin() * 2).sum(), backend="interpret")
    x = torch.randn(6, requires_grad=True)
    for _ in range(3):
        out = f(x)
        torch.testing.assert_close(out, (x.sin() * 2).sum())
    report = f.last_entry.report
    assert any("did not compile" in e and "PassManager::run failed" in e for e in report.internal_errors), report
    assert f.stats["kernel_launches"] == 0


def test_under_strict_mode_a_kernel_that_does_not_compile_raises_when_the_region_is_built(monkeypatch):
    from runtime.fallback import InternalCompilerError

    _compiles_recorded(monkeypatch, fail="fused")
    f = compiler.compile(lambda x: (x.sin() * 2).sum(), backend="interpret")
    with pytest.raises(InternalCompilerError, match="did not compile"):
        f(torch.randn(6, requires_grad=True))


AHEAD_SM90_SCRIPT = """
import json, sys
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile, make_backend
from triton.runtime.jit import create_function_from_signature
from runtime.program import KernelLaunch

spec = json.loads(sys.argv[1])
shape = tuple(spec["shape"])
launch = KernelLaunch(spec["name"], spec["source"], [0], [(1, shape, torch.float32)], spec["grid"], spec["xblock"],
                      spec["rblock"], 0, spec["num_warps"], expected_loads=((shape, torch.float32),))
target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
specializations = []

def compile_sm90(args):  # what JITFunction.run(..., warmup=True) does, for an H100
    fn = launch.kernel()
    kwargs = dict(XBLOCK=launch.xblock, RBLOCK=launch.rblock, num_warps=launch.num_warps)
    bound, specialization, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    specializations.append([sorted(map(str, constexprs)), sorted(map(str, attrs.items()))])
    return compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)

launcher = launch.launcher()
launcher._compile, launcher._stream = compile_sm90, lambda index: 0
ran = []
launcher._runner = lambda kernel: (lambda *arguments: ran.append(kernel))
cpu = torch.device("cpu")
for job in launch.ahead_of_time(cpu):
    job.launcher.prepare(job.args, job.key)
ahead = len(specializations)
x = torch.randn(*shape)
launch.run([x, None], cpu)        # the first real launch: contiguous, aligned
x_out = torch.empty(shape)
compile_sm90([x, *x.stride(), x_out])   # what that launch's arguments specialize to, compiled apart
print(json.dumps(dict(ahead=ahead, compiles=len(specializations), launched=len(ran),
                      same=specializations[0] == specializations[-1], spec=specializations)))
"""


def test_a_kernel_compiled_ahead_has_the_specialization_its_first_real_launch_asks_for():
    """The stand-ins ahead-of-time compiling passes (empty tensors at address 0, the recorded shapes'
    contiguous strides) give Triton's binder what a real contiguous, aligned launch gives it: the
    same constants and divisibility attributes, compiled for sm_90 here. The first real launch then
    finds the kernel bound and compiles nothing."""
    import json
    import os
    import subprocess
    import sys

    f = compiler.compile(lambda x: torch.exp(x) * 2)
    f(torch.randn(6, 40))
    launch, = _region_kernels(f)
    spec = dict(name=launch.name, source=launch.source, grid=launch.grid, xblock=launch.xblock,
                rblock=launch.rblock, num_warps=launch.num_warps, shape=[6, 40])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": root}
    done = subprocess.run([sys.executable, "-c", AHEAD_SM90_SCRIPT, json.dumps(spec)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ahead"] == 1 and result["launched"] == 1, result
    assert result["compiles"] == 2 and result["same"], result   # (the real launch compiled nothing)


# ------------------------------------------------------------------------------ offline install
def test_the_readme_s_offline_install_line_builds_without_an_index(tmp_path):
    """GPU machines this project may run on are offline: ``pip install -e .`` fails there, its build
    isolation fetching setuptools from an index. The README's line (no build isolation, no
    dependencies) builds with what is installed; the same build with isolation does not (here, as
    on such a machine, with no index to reach)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = open(os.path.join(root, "README.md")).read()
    assert "pip install --no-build-isolation --no-deps -e ." in readme

    def build(*options):
        return subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-index", "--no-deps", *options, "-w",
                               str(tmp_path), root], capture_output=True, text=True, timeout=300)
    offline = build("--no-build-isolation")
    assert offline.returncode == 0, offline.stdout[-2000:] + offline.stderr[-2000:]
    assert any(name.startswith("symgrad-") and name.endswith(".whl") for name in os.listdir(tmp_path))
    assert build().returncode != 0   # (isolation: setuptools from an index that is not there)


def test_flash_attention_kernels_are_found_for_compiling_ahead_with_the_arguments_a_real_call_passes():
    """Flash attention's kernels are launched by an extern call, not a KernelLaunch: running the
    programs on the meta device from their recorded input shapes collects each launch (kernel, grid,
    tiles, every integer and float argument: strides, sizes, scale) as the first real call makes it,
    so they compile ahead too."""
    import torch.nn.functional as F

    from runtime import ahead_of_time, extern_kernels

    f = compiler.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(),
                         backend="interpret")
    q, k, v = (torch.randn(2, 4, 64, 32, requires_grad=True) for _ in range(3))
    f(q, k, v)
    region = f.last_entry.trace.regions[0].compiled

    def described(name, grid, args, options):
        return (name, tuple(grid), [str(a.dtype) if isinstance(a, torch.Tensor) else a for a in args], options)
    predicted = [described(job.name, job.launcher.grid, job.args, job.launcher.options)
                 for program in (region.forward, region.backward)
                 for job in ahead_of_time.extern_kernel_jobs(program, torch.device("cpu"))]
    real = []
    with extern_kernels.launches_recorded(lambda kernel, grid, args, options, cost:
                                     real.append(described(kernel.fn.__name__, grid, args, options))):
        f(q, k, v).backward()
    assert [p[0] for p in predicted] == ["attention_forward", "attention_backward_dq", "attention_backward_dkv"]
    assert predicted == real
