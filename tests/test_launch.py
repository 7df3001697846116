"""Direct launches (runtime/launcher.py): each kernel's launcher is bound once and reused; a
changed argument layout is caught by the per-call layout key and binds the specialization
Triton's JIT would pick; the compiled-Triton branch passes the driver exactly what
``JITFunction.run`` would (checked with a kernel compiled for sm_90, no GPU needed)."""

import json
import os
import subprocess
import sys
import textwrap

import compiler
import pytest
import torch
from runtime.launcher import DirectLauncher, IndexedLauncher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launches(compiled):
    entry = compiled.last_entry
    return [k for region in entry.trace.regions if region.compiled is not None
            for program in (region.compiled.forward, region.compiled.backward) if program is not None
            for k in program.kernels]


def test_the_bound_launcher_is_reused_across_calls():
    f = compiler.compile(lambda x, y: torch.sigmoid(x * y) + 1)
    x, y = torch.randn(5, 7), torch.randn(5, 7)
    f(x, y)  # the recording (eager)
    for _ in range(3):
        torch.testing.assert_close(f(x, y), torch.sigmoid(x * y) + 1)
    launch, = _launches(f)
    launcher = launch._launchers[False]
    assert isinstance(launcher, IndexedLauncher)  # the interpreter's launch, bound once
    f(x, y)
    assert launch._launchers[False] is launcher and launcher.binds == 1


def test_a_new_input_layout_gives_eager_results():
    """Strides are not in the guard key: a transposed input replays the same recording, its
    kernel sees another layout key (and on a GPU binds another specialization)."""
    f = compiler.compile(lambda x: torch.exp(x) * 2)
    x = torch.randn(6, 4)
    f(x)
    keys = []
    misaligned = torch.randn(25)[1:].view(6, 4)  # 4 bytes into its storage
    for t in (x, x.t().contiguous().t(), misaligned, x):
        torch.testing.assert_close(f(t), torch.exp(t) * 2)
        launch, = _launches(f)
        keys.append(launch.arguments([t, None], t.device)[1])
    assert keys[0] != keys[1] and keys[0] == keys[3]
    assert keys[0][0] == 0 and keys[2][0] != 0 and keys[2][1:] == keys[0][1:]


class _FakeKernel:
    """What DirectLauncher needs of a CompiledKernel, for the launch logic without a GPU."""

    def __init__(self, key):
        self.key, self.function, self.packed_metadata = key, f"function{key}", ("metadata", key)

    def launch_metadata(self, grid, stream, *args):
        return {"grid": grid}


def _direct(launch, compiled, ran):
    def compile(args):
        compiled.append(len(args))
        return _FakeKernel(len(compiled))

    def runner(kernel):
        return lambda *arguments: ran.append((kernel.key, arguments))
    return DirectLauncher(None, launch.grid, launch.xblock, launch.rblock, launch.num_warps,
                          compile=compile, stream=lambda index: 77, runner=runner)


def _exp_kernel_bound_directly():
    """A compiled ``exp(x) * 2``'s one launch, with a direct launcher recording what it would compile
    and run: (x, the launch, compiled, ran, the launcher)."""
    f = compiler.compile(lambda x: torch.exp(x) * 2)
    x = torch.randn(6, 4)
    f(x)
    launch, = _launches(f)
    compiled, ran = [], []
    return x, launch, compiled, ran, _direct(launch, compiled, ran)


def test_a_changed_layout_rebinds_and_a_known_one_does_not():
    x, launch, compiled, ran, direct = _exp_kernel_bound_directly()
    cpu = torch.device("cpu")
    misaligned = torch.randn(25)[1:].view(6, 4)
    layouts = [x, x, x.t().contiguous().t(), x, misaligned, x.t().contiguous().t()]
    for t in layouts:
        env = [t, None]
        args, key, _ = launch.arguments(env, cpu)
        direct.launch(args, key, cpu)
    # compiled once per layout: contiguous, column-major, misaligned; the others are remembered
    assert len(compiled) == 3 and direct.binds == 3
    assert [k for k, _ in ran] == [1, 1, 2, 1, 3, 2]
    grid, one, one_, stream, function, metadata, launch_metadata, enter, exit_, *passed = ran[0][1]
    assert (grid, one, one_, stream, function, metadata) == (launch.grid, 1, 1, 77, "function1", ("metadata", 1))
    assert passed[-2:] == [launch.xblock, launch.rblock] and passed[0] is x and passed[1:3] == [4, 1]


def test_launch_metadata_is_computed_only_while_a_hook_is_installed():
    from triton import knobs

    x, launch, compiled, ran, direct = _exp_kernel_bound_directly()
    cpu = torch.device("cpu")
    args, key, _ = launch.arguments([x, None], cpu)
    direct.launch(args, key, cpu)
    hook = knobs.runtime.launch_enter_hook
    seen = []
    hook.add(seen.append)
    try:
        direct.launch(args, key, cpu)
    finally:
        hook.remove(seen.append)
    assert ran[0][1][6] is None and ran[1][1][6] == {"grid": (launch.grid, 1, 1)}


def test_the_generated_launch_runs_the_usual_layout_and_hands_others_to_the_general_path(monkeypatch):
    """After the first launch, the kernel's generated straight-line launch checks the layout and
    calls the driver launcher itself; another layout (transposed, misaligned) returns to the
    general path and its own specialization, and the usual layout still finds the first one."""
    from runtime import program

    monkeypatch.setattr(program, "interpreter_lock", program._NO_GUARD)  # as on a GPU: no interpreter
    x, launch, compiled, ran, direct = _exp_kernel_bound_directly()
    direct.fn = launch.kernel()
    launch._launchers[False] = direct
    cpu = torch.device("cpu")
    general = []
    arguments = launch.arguments
    monkeypatch.setattr(launch, "arguments", lambda env, device: general.append(1) or arguments(env, device))
    misaligned = torch.randn(25)[1:].view(6, 4)
    outputs = []
    for t in [x, x, x.t().contiguous().t(), x, misaligned, x]:
        env = [t, None]
        launch.run(env, cpu)
        outputs.append(env[1])
    assert "not t0.is_contiguous()" in launch._straight.source
    assert len(general) == 3  # the first launch, the transposed one, the misaligned one
    assert [k for k, _ in ran] == [1, 1, 2, 1, 3, 1] and len(compiled) == 3
    # the generated launch passes exactly what the general path passes: x, its strides, the new output
    first, second = ran[0][1], ran[1][1]
    assert first[:9] == second[:9] and second[9] is x and list(second[10:12]) == [4, 1]
    assert second[12] is outputs[1] and outputs[1].shape == x.shape and outputs[1] is not outputs[0]
    assert list(second[13:]) == list(first[13:]) == [launch.xblock, launch.rblock]


# -- the compiled-Triton branch, with a kernel compiled for sm_90 ---------------------------------
SM90_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature
    from runtime.launcher import DirectLauncher
    from runtime.program import KernelLaunch

    spec = json.loads(sys.argv[1])
    launch = KernelLaunch(spec["name"], spec["source"], [0], [(1, tuple(spec["shape"]), torch.float32)],
                          spec["grid"], spec["xblock"], spec["rblock"], 0, spec["num_warps"])
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    compiled = []

    def compile_sm90(args):  # what JITFunction.run(..., warmup=True) does, for an H100
        fn = launch.kernel()
        kwargs = dict(XBLOCK=launch.xblock, RBLOCK=launch.rblock, num_warps=launch.num_warps)
        bound, specialization, options = create_function_from_signature(fn.signature, fn.params, backend)(
            *args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        kernel = compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
        compiled.append((bound, sorted(str(k) for k in constexprs), sorted(str(k) for k in attrs)))
        return kernel

    ran = []
    launcher = launch.launcher()
    assert isinstance(launcher, DirectLauncher), type(launcher)
    launcher._compile, launcher._stream = compile_sm90, lambda index: 1234
    launcher._runner = lambda kernel: (lambda *arguments: ran.append((kernel, arguments)))
    x = torch.randn(*spec["shape"])
    cpu = torch.device("cpu")
    for t in (x, x, x.t().contiguous().t()):
        launch.run([t, None], cpu)
    assert launch._straight and "not t0.is_contiguous()" in launch._straight.source  # the second launch's
    out = []
    for (kernel, arguments), in zip(ran):
        grid, one, one_, stream, function, metadata, launch_metadata, enter, exit_, *passed = arguments
        out.append(dict(grid=[grid, one, one_], stream=stream, same_metadata=metadata is kernel.packed_metadata,
                        launch_metadata=launch_metadata, passed=[p if isinstance(p, int) else "tensor" for p in passed],
                        kernel=id(kernel), arch=kernel.metadata.target.arch))
    bound = [[v if isinstance(v, int) else "tensor" for v in b.values()] for b, _, _ in compiled]
    print(json.dumps(dict(launches=out, compiles=len(compiled), bound=bound,
                          constexprs=[c for _, c, _ in compiled], attrs=[a for _, _, a in compiled])))
""")


def test_the_gpu_branch_passes_the_driver_what_jit_run_would():
    f = compiler.compile(lambda x: torch.exp(x) * 2)
    x = torch.randn(6, 40)
    f(x)
    launch, = _launches(f)
    spec = dict(name=launch.name, source=launch.source, grid=launch.grid, xblock=launch.xblock,
                rblock=launch.rblock, num_warps=launch.num_warps, shape=list(x.shape))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    done = subprocess.run([sys.executable, "-c", SM90_SCRIPT, json.dumps(spec)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    first, second, transposed = result["launches"]
    assert result["compiles"] == 2  # the second launch reused the bound kernel
    assert first["kernel"] == second["kernel"] != transposed["kernel"] and first["arch"] == 90
    assert second["passed"] == first["passed"]  # the generated launch's arguments are the general path's
    assert first["grid"] == [launch.grid, 1, 1] and first["stream"] == 1234 and first["same_metadata"]
    assert first["launch_metadata"] is None  # no launch hook installed
    # exactly JITFunction.run's arguments: every parameter bound, XBLOCK and RBLOCK last
    assert first["passed"] == result["bound"][0] == ["tensor", 40, 1, "tensor", launch.xblock, launch.rblock]
    assert transposed["passed"] == result["bound"][1] == ["tensor", 1, 6, "tensor", launch.xblock, launch.rblock]
    # Triton's own specialization: the stride equal to 1 is a constant, 40 is not divisible by 16
    assert any("(2,)" in c for c in result["constexprs"][0]) and any("(1,)" in c for c in result["constexprs"][1])


def test_the_launch_benchmark_times_our_launch_and_the_jit_path():
    from benchmarks import launch, measure
    from benchmarks.workloads import WORKLOADS

    results = launch.launches_of(WORKLOADS["overhead_step"], "tiny", compiler, measure, torch, iterations=3, rounds=1)
    assert len(results) >= 4  # each of the step's launches (forward and backward of 4 layers)
    for r in results:
        assert r["launch_us"] == r["ours_us"] - r["alloc_us"] and r["jit_launch_us"] == r["jit_us"] - r["alloc_us"]
        assert min(r["alloc_us"], r["args_us"], r["ours_us"], r["jit_us"]) > 0
    assert launch.mean_us(results) == pytest.approx(sum(r["launch_us"] for r in results) / len(results))


def test_loads_of_an_earlier_launch_s_output_are_not_checked():
    """Slots are written once: a slot stored by an earlier launch of the program is that launch's
    fresh contiguous output wherever it is loaded, so its generated launch checks only the others."""
    from runtime.launcher import BoundKernel, generate_launch
    from runtime.program import KernelLaunch, Program, ValueRef

    f32 = torch.float32
    first = KernelLaunch("a", "", [0], [(1, (6, 4), f32)], 1, 32, 1, 0)
    second = KernelLaunch("b", "", [0, 1], [(2, (6, 4), f32)], 1, 32, 1, 0)
    program = Program(1, 3, [first, second], [ValueRef(2)])
    assert program.fresh_loads == (frozenset(), {1})
    bound = BoundKernel(_FakeKernel(1), (32, 1), runner=lambda *arguments: ran.append(arguments))
    ran = []
    x = torch.randn(4, 6).t()   # the program's input, column-major: its strides are checked
    launch = generate_launch(second.loads, second.stores, [x, torch.randn(6, 4)], bound, 1, lambda index: 0,
                             program.fresh_loads[1])
    assert "t0.stride() != (1, 6)" in launch.source and "t1." not in launch.source.split("return False")[0]
    env = [x, torch.randn(6, 4), None]
    assert launch.run(env, torch.device("cpu")) and ran[0][9:] == (x, 1, 6, env[1], 4, 1, env[2], 32, 1)
    assert not launch.run([x.contiguous(), env[1], None], torch.device("cpu")) and len(ran) == 1


def test_the_generated_launch_writes_into_a_donated_buffer_as_the_general_path_does():
    """An output the program lets a kernel write into a dying buffer's memory (``reuse``: an
    elementwise kernel's dead input, a buffer's new value stored into it) is placed there by the
    generated launch too; a donor that does not fit (another dtype) gets a fresh allocation."""
    from runtime.launcher import BoundKernel, generate_launch

    f32 = torch.float32
    bound = BoundKernel(_FakeKernel(1), (32, 1), runner=lambda *arguments: ran.append(arguments))
    ran = []
    x = torch.randn(6, 4)
    launch = generate_launch([0], [(1, (6, 4), f32)], [x], bound, 1, lambda index: 0, reuse=((0, 0),))
    env = [x, None]
    assert launch.run(env, torch.device("cpu")) and env[1].data_ptr() == x.data_ptr() and env[1] is not x
    ints = torch.zeros(6, 4, dtype=torch.int32)
    env = [ints, None]
    assert launch.run(env, torch.device("cpu")) and env[1].data_ptr() != ints.data_ptr() and env[1].dtype == f32


def test_the_generated_launch_passes_complex_tensors_at_their_real_views_addresses():
    """The general path passes a complex tensor as its real view (strides in real elements, without
    the view's last); the generated launch passes the tensor itself (the driver reads only its
    address) with the view's strides as literals: the same pointers and numbers, no view made per
    launch. A conjugate input, which the general path materializes first, is handed back to it."""
    from runtime.launcher import BoundKernel, generate_launch
    from runtime.program import KernelLaunch

    c64 = torch.complex64
    step = KernelLaunch("c", "", [0, 1], [(2, (6, 4), c64)], 1, 32, 1, 0)
    z = torch.randn(6, 4, dtype=c64)
    w = torch.randn(4, 6, dtype=c64).t()  # column-major: its strides are checked as literals
    env = [z, w, None]
    general, _, _ = step.arguments(env, torch.device("cpu"))
    ran = []
    bound = BoundKernel(_FakeKernel(1), (32, 1), runner=lambda *arguments: ran.append(arguments))
    launch = generate_launch(step.loads, step.stores, [z, w], bound, 1, lambda index: 0)
    assert "view_as_real" not in launch.source and "t1.stride() != (1, 6)" in launch.source
    env = [z, w, None]
    assert launch.run(env, torch.device("cpu"))
    passed = ran[0][9:-2]  # (after grid, stream, function, metadata, hooks; before the constexprs)
    assert env[2].dtype == c64 and env[2].shape == (6, 4)
    assert [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in passed] == \
        [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in general[:-1]] + [env[2].data_ptr()]
    assert list(passed[1:3]) == [8, 2] and list(passed[4:6]) == [2, 12]  # the real view's strides
    assert not launch.run([z.conj(), w, None], torch.device("cpu")) and len(ran) == 1


def test_a_stubbed_step_checks_indices_a_skipped_kernel_computed():
    """Cross entropy's target (ignore_index masked) is computed by a kernel, then index-checked:
    with launches stubbed that kernel's integer output must still hold valid indices (zeros), or
    the benchmark's stubbed step raises the compiled region's IndexError."""
    from benchmarks import measure
    from benchmarks.workloads import WORKLOADS

    case = WORKLOADS["cross_entropy"].build("tiny", torch.device("cpu"))
    run = compiler.compile(case.fn)
    args = case.make_args(torch.float32)
    case.step(run, args)  # the recording
    with measure.kernels_stubbed():
        for _ in range(2):
            case.step(run, args)


def test_stubbed_steps_flush_denormals_and_put_the_flag_back():
    """A stubbed launch's outputs are uninitialized memory; the matmuls reading them must not time
    denormal arithmetic that real kernels' values would not make (measure.kernels_stubbed)."""
    from benchmarks import measure

    tiny = torch.tensor([1e-40], dtype=torch.float32)  # a float32 denormal
    assert (tiny * 1.0).item() != 0.0
    with measure.kernels_stubbed():
        assert (tiny * 1.0).item() == 0.0
    assert (tiny * 1.0).item() != 0.0


def test_an_installed_step_runner_sees_every_step_and_programs_need_no_other_seam():
    """Benchmarks stub, record and log launches through ``runtime.program.steps_run_by``: while a
    StepRunner is installed every program hands it each kernel launch (with the path its program was
    built for) and each matmul, a runner stacked on another hands them on, and outside the block
    programs run their own generated steps again."""
    from runtime import program

    class Seen(program.StepRunner):
        def __init__(self, inner):
            super().__init__(inner)
            self.seen = []

        def kernel(self, step, env, device, torch_path, fresh_loads):
            self.seen.append(("kernel", step.name, torch_path))
            super().kernel(step, env, device, torch_path, fresh_loads)

        def extern(self, step, env, device):
            self.seen.append(("extern", step.name))
            super().extern(step, env, device)

    def f(x, w):
        return torch.relu(x @ w).sum()
    compiled = compiler.compile(f, backend="interpret")
    x, w = torch.randn(4, 6), torch.randn(6, 5, requires_grad=True)
    compiled(x, w)  # the recording
    with program.steps_run_by(Seen(None)) as outer:
        with program.steps_run_by(Seen(program.installed_runner())) as inner:
            out = compiled(x, w)
            out.backward()
        assert program.installed_runner() is outer
    assert program.installed_runner() is None
    kernels = [k.name for k in _launches(compiled)]
    assert inner.seen == outer.seen and [name for kind, name, *_ in outer.seen if kind == "kernel"] == kernels
    assert all(not on_torch for kind, _, *on_torch in outer.seen if kind == "kernel" for on_torch in on_torch)
    assert any(kind == "extern" for kind, *_ in outer.seen)
    grad = w.grad.clone()
    w.grad = None
    f(x, w).backward()
    torch.testing.assert_close(out, f(x, w))
    torch.testing.assert_close(grad, w.grad)


def test_a_generic_launch_takes_a_kernels_own_fields(monkeypatch):
    """``benchmarks.sm90.generic_launch`` builds a launch from a ``KernelSource``'s signature, blocks
    and warps; a kernel known only by its file gives the same from the values its module declares."""
    import compiler.api as api
    from benchmarks.sm90 import declared, generic_launch
    from compiler.build import build_region

    sources = []

    def build(graph, *args, **kwargs):
        region, details = build_region(graph, *args, **kwargs)
        sources.extend(details["forward_kernels"] + details["backward_kernels"])
        return region, details
    monkeypatch.setattr(api, "build_region", build)
    monkeypatch.setenv("SYMGRAD_REGION_CACHE", "0")  # (built here, never loaded)
    compiler.explain(lambda x: (torch.sigmoid(x) * 2).sum(-1), torch.randn(4, 300, requires_grad=True))
    assert sources
    for kernel in sources:
        launch = generic_launch(kernel.name, kernel.source, kernel=kernel)
        assert launch == generic_launch(kernel.name, kernel.source)
        assert launch.constexprs == {"XBLOCK": kernel.xblock, "RBLOCK": kernel.rblock}
        assert launch.num_warps == kernel.num_warps == declared(kernel.source).num_warps
        assert len(launch.args) == sum(1 for kind in kernel.signature.values() if kind != "constexpr")
