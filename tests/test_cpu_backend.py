"""The CPU path (backend="torch"): the same capture, SymPy backward and runtime, with each fused
kernel run as a generated function of PyTorch ops. Eager PyTorch is the oracle: values,
gradients, hooks, saved-tensor checks, double backward and whole training steps.

The rest of the suite runs the generated Triton kernels in Triton's interpreter (conftest sets
SYMGRAD_CPU_BACKEND=interpret); these tests name backend="torch" and check that no Triton
kernel was launched."""

import copy

import pytest
import torch
import torch.nn.functional as F

import compiler
from tests.parity import check_cpu_backend
from tests.training import train_step
import compiler.build
import runtime.program as program
from runtime import backends

_make_launcher = program.make_launcher


@pytest.fixture(autouse=True)
def no_triton(monkeypatch):
    """Every kernel of these tests runs as PyTorch ops: launching a Triton kernel fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a Triton kernel was launched on the CPU path")
    monkeypatch.setattr(program, "make_launcher", refuse)


def check(fn, args, tol=None, calls=3):
    """``fn`` compiled with backend="torch": every call's value and gradients equal eager's."""
    return check_cpu_backend(fn, args, "torch", tol, calls)


def test_auto_picks_cpp_where_a_compiler_works_else_the_torch_path_said_once(monkeypatch, caplog):
    from runtime import cpp_build

    monkeypatch.delenv(backends.CPU_BACKEND_ENV, raising=False)
    backend, why = backends.choose("auto", "cpu")
    if cpp_build.available()[0]:
        assert backend == "cpp" and "compiled to C++" in why
    else:
        assert backend == "torch" and "PyTorch CPU ops" in why
    monkeypatch.setenv(backends.CPU_BACKEND_ENV, "torch")
    assert backends.choose("auto", "cpu")[0] == "torch"
    monkeypatch.delenv(backends.CPU_BACKEND_ENV)
    # no working compiler: the torch path, and a warning saying why, once
    monkeypatch.setattr(cpp_build, "available", lambda: (False, "no working C++ compiler with OpenMP (g++: not found)"))
    backends._default_cpu_backend.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="symgrad"):
            assert [backends.choose("auto", "cpu")[0] for _ in range(3)] == ["torch"] * 3
        warned = [r.getMessage() for r in caplog.records if "torch path" in r.getMessage()]
        assert len(warned) == 1 and "g++: not found" in warned[0], warned
    finally:
        backends._default_cpu_backend.cache_clear()
    monkeypatch.setenv(backends.CPU_BACKEND_ENV, "interpret")
    assert backends.choose("auto", "cpu")[0] == "interpret"
    monkeypatch.setenv(backends.CPU_BACKEND_ENV, "numpy")
    with pytest.raises(ValueError, match="SYMGRAD_CPU_BACKEND"):
        backends.choose("auto", "cpu")
    with pytest.raises(backends.BackendUnavailable, match="CUDA tensors"):
        backends.choose("torch", "cuda")


def test_explain_says_which_backend_ran(monkeypatch):
    monkeypatch.setenv(backends.CPU_BACKEND_ENV, "torch")
    f = compiler.compile(lambda x: torch.tanh(x) * 2)
    x = torch.randn(8)
    f(x)
    f(x)
    assert f.last_backend == "torch"
    report = compiler.explain(f, x)
    assert report.backend == "torch" and "PyTorch CPU ops" in report.backend_reason
    assert "backend: torch" in str(report)


def test_pointwise_and_reductions():
    def f(x, w):
        y = torch.sigmoid(x) * w + torch.exp(-x * x)
        return y.sum(-1) + y.mean(0).amax() + torch.logsumexp(x, -1)
    check(f, [torch.randn(6, 10, requires_grad=True), torch.randn(10, requires_grad=True)])


def test_softmax_layer_norm_and_integer_math():
    def f(x, g, b, idx):
        h = F.layer_norm(x, (x.shape[-1],), g, b)
        return F.softmax(h, -1)[..., :3].sum(-1) + (idx % 3).float() * torch.where(x[:, 0] > 0, 1.0, -2.0)
    idx = torch.arange(5)
    check(f, [torch.randn(5, 16, requires_grad=True), torch.randn(16, requires_grad=True),
              torch.randn(16, requires_grad=True), idx])


def test_views():
    def f(x):
        y = x.permute(1, 0, 2).reshape(4, -1)[:, 1::2] * 3
        return y.flip(0).t().expand(2, -1, -1) + x.sum()
    check(f, [torch.randn(3, 4, 5, requires_grad=True)])


def test_outputs_are_fresh_tensors_not_views_of_inputs():
    def f(x):
        return x.reshape(2, 3) + 0, x.t().reshape(-1) * 1
    compiled = compiler.compile(f, backend="torch")
    x = torch.randn(3, 2)
    for _ in range(2):
        a, b = compiled(x)
    before = x.clone()
    a.add_(1)
    b.add_(1)
    assert torch.equal(x, before) and a.is_contiguous() and b.is_contiguous()


def test_complex():
    def f(z, w):
        return ((z * w.conj() + torch.exp(z)).abs() ** 2).sum(-1)
    z = torch.randn(4, 5, dtype=torch.complex64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.complex64, requires_grad=True)
    check(f, [z, w], tol=dict(rtol=1e-4, atol=1e-4))


def test_half_precision_is_computed_in_float32():
    def f(x):
        return F.gelu(x) * x
    x = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    check(f, [x], tol=dict(rtol=2e-2, atol=2e-2))


@pytest.mark.allows_eager("nn.MultiheadAttention runs eagerly (multi_head_attention_forward is not in the catalog)")
def test_transformer_block_values_and_grads():
    torch.manual_seed(0)
    block = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True,
                                             activation="gelu")
    reference = copy.deepcopy(block)
    compiled = compiler.compile(lambda x: block(x).square().mean(), backend="torch")
    x = torch.randn(2, 5, 16)
    for _ in range(3):
        loss = compiled(x)
        loss.backward()
        ref = reference(x).square().mean()
        ref.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
        for p, q in zip(block.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    assert compiled.last_backend == "torch" and compiled.stats["replays"] == 2


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam"])
def test_mlp_training_step_with_optimizer(optimizer):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    reference = copy.deepcopy(model)

    def make(params):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9) if optimizer == "sgd_momentum" \
            else torch.optim.Adam(params, lr=1e-2)
    opt, ref_opt = make(model.parameters()), make(reference.parameters())

    step = train_step
    compiled = compiler.compile(step, backend="torch")
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    for _ in range(5):
        torch.testing.assert_close(compiled(model, opt, x, y), step(reference, ref_opt, x, y), rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
            assert p.grad is None
    assert compiled.last_backend == "torch" and compiled.stats["replays"] >= 3
    assert compiled.stats["divergences"] == 0


def test_hooks_and_retain_grad_run_as_in_eager():
    seen = []

    def f(x, w):
        h = torch.tanh(x * w)
        h.register_hook(lambda g: seen.append(g.clone()))
        return (h * h).sum()
    compiled = compiler.compile(f, backend="torch")
    x, w = torch.randn(8), torch.randn(8, requires_grad=True)
    for _ in range(2):
        compiled(x, w).backward()
    eager_seen = seen[-1]
    seen.clear()
    f(x, w.detach().clone().requires_grad_()).backward()
    assert compiled.last_backend == "torch"
    torch.testing.assert_close(eager_seen, seen[0])


def test_saved_tensor_modified_in_place_raises_as_in_eager():
    def f(x):
        return torch.exp(x)
    compiled = compiler.compile(f, backend="torch")
    for _ in range(2):
        x = torch.randn(4, requires_grad=True)
        y = compiled(x)
    assert compiled.last_backend == "torch"
    with torch.no_grad():
        y.mul_(2)  # exp saves its output: eager's version check must fire
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_double_backward():
    def f(x):
        return (torch.sin(x) * x).sum()
    compiled = compiler.compile(f, backend="torch")
    for _ in range(2):
        x = torch.randn(6, requires_grad=True)
        (g,) = torch.autograd.grad(compiled(x), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
    assert compiled.last_backend == "torch"
    xe = x.detach().clone().requires_grad_()
    (ge,) = torch.autograd.grad(f(xe), xe, create_graph=True)
    (gge,) = torch.autograd.grad(ge.sum(), xe)
    torch.testing.assert_close(g, ge)
    torch.testing.assert_close(gg, gge)


def test_a_region_loaded_from_the_disk_cache_keeps_its_cpu_path(monkeypatch, tmp_path):
    """A region loaded from the on-disk cache (``compiler.reuse.persist``) runs the CPU path too: its
    kernels' PyTorch functions are stored with them."""
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path / "cache"))
    builds = []
    partition = compiler.build.partition
    monkeypatch.setattr(compiler.build, "partition", lambda *a, **k: builds.append(1) or partition(*a, **k))

    def f(x):
        return (torch.tanh(x).sum(0) * 2).softmax(-1)
    x = torch.randn(5, 7, requires_grad=True)
    compiler.compile(f, backend="torch")(x)
    loaded = compiler.compile(f, backend="torch")  # another function, the same graph: loaded
    for _ in range(2):
        xs = x.detach().clone().requires_grad_()
        out = loaded(xs)
        out.backward(torch.arange(7.0))
    assert len(builds) == 1 and loaded.last_backend == "torch"
    xe = x.detach().clone().requires_grad_()
    ref = f(xe)
    ref.backward(torch.arange(7.0))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(xs.grad, xe.grad)


def test_gelu_and_its_derivative_run_as_pytorchs_own_kernels():
    """SymPy's GELU (0.5·x·(1 + erf(x/√2))) and its expanded derivative print as one PyTorch op
    each (``gelu``, ``gelu_backward``), not five and ten: the CPU path's speed depends on it."""
    from compiler.codegen import torch_kernel

    sources = []
    write = torch_kernel._Writer.write

    def recording(self, name, store_slots):
        kernel = write(self, name, store_slots)
        sources.append(kernel.source)
        return kernel
    import unittest.mock
    with unittest.mock.patch.object(torch_kernel._Writer, "write", recording):
        lin = torch.nn.Linear(8, 8)
        check(lambda x: F.gelu(lin(x)).sum(), [torch.randn(4, 8, requires_grad=True)])
    text = "\n".join(sources)
    assert "torch.nn.functional.gelu(" in text and "torch.ops.aten.gelu_backward(" in text, text
    assert "erf" not in text, text


def test_a_kernel_the_printer_cannot_write_keeps_its_triton_form(monkeypatch):
    from compiler.codegen import torch_kernel

    def fail(self, name, store_slots):
        raise NotImplementedError("a gap of the printer")
    monkeypatch.setattr(torch_kernel._Writer, "write", fail)
    monkeypatch.setattr(program, "make_launcher", _make_launcher)  # (this test launches Triton kernels)
    f = compiler.compile(lambda x: torch.tanh(x) * 3, backend="torch")
    x = torch.randn(5)
    f(x)
    torch.testing.assert_close(f(x), torch.tanh(x) * 3)
    assert f.last_backend == "torch" and f.stats["kernel_launches"] > 0


def test_an_infinite_constant_stays_real():
    # a product's constant was folded as a Python complex: 1+0j times inf is inf + nan*j, and the
    # real part of (inf + nan*j) * x is NaN (a variance with no degrees of freedom is total * inf)
    check(lambda x: x * float("inf") + x.exp(), [torch.tensor([0.5, -1.0, 2.0])])



def test_the_cpu_path_saves_pointwise_values_rather_than_recomputing_them():
    """A region the CPU path runs saves its pointwise values as eager does (saved-set policy "cpu"):
    recomputing a GELU in the backward costs a PyTorch op's full time there. Triton's kernels keep
    "balanced", which recomputes it inside the backward's memory-bound kernel."""
    lin = torch.nn.Linear(8, 8)

    def f(x):
        return lin(F.gelu(x)).sum()

    def saved(backend):
        compiled = compiler.compile(f, backend=backend)
        x = torch.randn(4, 8, requires_grad=True)
        compiled(x)
        graph = compiled.last_entry.report.backward_graph
        return {n.name for n in graph.nodes if n.op == "placeholder"}

    assert "saved_gelu" in saved("torch")
    program.make_launcher = _make_launcher  # (the interpreter's kernels: allowed for this half)
    assert "saved_gelu" not in saved("interpret")


def test_an_operand_the_kernel_does_not_load_is_zeros_in_its_cpu_function():
    """A kernel node may name a buffer its expression lost (a1 * 0 simplified away; the base of a
    slice_scatter covered whole) and that the Triton kernel therefore does not load: its CPU
    function stands zeros for it (it had refused to be written, and the kernel ran in Triton's
    interpreter; 39 such kernels in the 10,000 fuzz programs)."""
    from compiler.codegen.torch_kernel import render_torch_kernel
    from compiler.ir.graph import GraphBuilder
    from compiler.ir.ops.pointwise import DERIVED
    from compiler.ir.ops.symbols import REAL_ARGS

    b = GraphBuilder()
    a = b.placeholder("a", (3,), torch.float32)
    unread = b.placeholder("unread", (3,), torch.float32)
    out = b.call(DERIVED, [a, unread], shape=(3,), dtype=torch.float32, requires_grad=False,
                 expr=2 * REAL_ARGS[0])
    kernel = render_torch_kernel("k", [a], [0], [out], [2], {a, unread, out})
    assert kernel is not None
    env = [torch.tensor([1.0, 2.0, 3.0]), None, None]
    kernel.run(env)
    assert torch.equal(env[2], torch.tensor([2.0, 4.0, 6.0]))


@pytest.fixture
def paths_taken(monkeypatch):
    """Counts of kernels run as PyTorch ops (``"torch"``: each kernel's generated function) and in
    Triton's interpreter (``"triton"``), for kernels built after the fixture started."""
    from compiler.codegen import torch_kernel
    from runtime.launcher import IndexedLauncher

    ran = {"torch": 0, "triton": 0}
    load, launch = torch_kernel.TorchKernel._load, IndexedLauncher.launch

    def counted_load(self):
        fn = load(self)

        def counted(env):
            ran["torch"] += 1
            fn(env)
        return counted

    def counted_launch(self, args, key, device):
        ran["triton"] += 1
        launch(self, args, key, device)

    monkeypatch.setattr(torch_kernel.TorchKernel, "_load", counted_load)
    monkeypatch.setattr(IndexedLauncher, "launch", counted_launch)
    monkeypatch.setattr(program, "make_launcher", _make_launcher)  # (the interpreter's kernels: these tests use both)
    return ran


def _paths(ran, work) -> dict:
    """The kernels ``work()`` ran on each path."""
    before = dict(ran)
    work()
    return {path: ran[path] - before[path] for path in ran}


def test_two_functions_with_different_cpu_backends_each_run_their_own_kernels(paths_taken):
    """The backend is fixed when a region is built: a function compiled for the CPU path and one
    for the interpreter, called in turn in one thread, each run their own kernels, forward and
    backward, whichever ran last (a backward runs after the other function's call here)."""
    def fn(x):
        return (torch.sin(x) * x).sum()
    ours, interpreted = compiler.compile(fn, backend="torch"), compiler.compile(fn, backend="interpret")
    x = torch.randn(6, requires_grad=True)
    ours(x), interpreted(x)  # the recordings
    losses = {}
    assert _paths(paths_taken, lambda: losses.update(ours=ours(x))) == {"torch": 1, "triton": 0}
    assert _paths(paths_taken, lambda: losses.update(interpreted=interpreted(x))) == {"torch": 0, "triton": 1}
    grads = {}
    for name in ("ours", "interpreted"):
        x.grad = None
        grads[name] = _paths(paths_taken, losses[name].backward), x.grad.clone()
    assert grads["ours"][0] == {"torch": 1, "triton": 0} and grads["interpreted"][0] == {"torch": 0, "triton": 1}
    expected = torch.sin(x) + x * torch.cos(x)
    torch.testing.assert_close(grads["ours"][1], expected)
    torch.testing.assert_close(grads["interpreted"][1], expected)


def _in_a_thread(work):
    """``work()`` run in a new thread; its exception raised here."""
    import threading

    errors = []

    def run():
        try:
            work()
        except BaseException as e:  # noqa: BLE001 — handed to the test
            errors.append(e)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def test_a_backward_in_another_thread_keeps_its_forwards_backend(paths_taken):
    """A backward run later in a thread whose last compiled call chose the interpreter keeps its
    forward's CPU path: the backward built with the forward, a partial backward (one output outside
    the loss) and a create_graph backward, both built only when that backward first asks."""
    def two(x):
        return torch.sin(x) * 2, torch.cos(x) * 3

    def one(x):
        return (torch.sin(x) * x).sum()
    ours, ours_once, other = (compiler.compile(two, backend="torch"), compiler.compile(one, backend="torch"),
                              compiler.compile(lambda x: torch.tanh(x) * 2, backend="interpret"))
    x = torch.randn(5, requires_grad=True)
    ours(x), ours_once(x), other(x)  # the recordings
    a, b = ours(x)
    loss = a.sum() + 0 * b.sum()
    partial = ours(x)[0].sum()
    twice = ours_once(x)
    taken = {}

    def backwards():
        other(x.detach())  # this thread's last compiled call chose the interpreter
        taken["full"] = _paths(paths_taken, loss.backward)
        taken["partial"] = _paths(paths_taken, partial.backward)
        grad = {}
        taken["first"] = _paths(paths_taken, lambda: grad.update(
            g=torch.autograd.grad(twice, x, create_graph=True)[0]))
        taken["second"] = _paths(paths_taken, lambda: grad.update(gg=torch.autograd.grad(grad["g"].sum(), x)[0]))
        taken["values"] = grad
    _in_a_thread(backwards)
    for name in ("full", "partial", "first", "second"):
        assert taken[name]["triton"] == 0 and taken[name]["torch"] > 0, (name, taken)
    xe = x.detach().requires_grad_()
    (ge,) = torch.autograd.grad(one(xe), xe, create_graph=True)
    torch.testing.assert_close(taken["values"]["g"], ge)
    torch.testing.assert_close(taken["values"]["gg"], torch.autograd.grad(ge.sum(), xe)[0])
    torch.testing.assert_close(x.grad, 4 * torch.cos(x))  # (the full and the partial backward: 2·cos each)
