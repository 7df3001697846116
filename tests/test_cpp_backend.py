"""The C++ CPU backend (``backend="cpp"``): fused kernels printed as C++ from the same kernel plan and
SymPy expressions, built by the system compiler, run on the CPU path's programs. Eager PyTorch is
the oracle; each test also asserts that C++ kernels ran (not only the torch path's) and that no
Triton kernel was launched. Kernels the C++ printer does not print yet (reductions, gathers,
random numbers, half types, complex values) run as PyTorch ops in the same program."""

import os

import pytest
import torch

import compiler
import runtime.program as program
from runtime import cpp_build
from runtime.backends import BackendUnavailable
from runtime.cpp_kernels import CppKernel
from tests.parity import check_cpu_backend

_MAKE_LAUNCHER = program.make_launcher
pytestmark = pytest.mark.skipif(not cpp_build.available()[0], reason="no working C++ compiler here")


@pytest.fixture(autouse=True)
def no_triton(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a Triton kernel was launched on the C++ path")
    monkeypatch.setattr(program, "make_launcher", refuse)


def _kernels(compiled) -> list:
    return [k for r in compiled.last_entry.trace.regions if r.compiled is not None
            for p in (r.compiled.forward, r.compiled.backward) if p is not None for k in p.kernels]


def _body(source: str) -> str:
    """The contiguous-inputs function of a C++ kernel's source (not its prelude's helpers)."""
    return source.split('extern "C" int ')[1]


def check(fn, args, tol=None, calls=3, cpp_kernels=1):
    """``fn`` compiled with backend="cpp": every call's value and gradients equal eager's, and at
    least ``cpp_kernels`` of its kernels are C++."""
    compiled = check_cpu_backend(fn, args, "cpp", tol, calls)
    printed = [k for k in _kernels(compiled) if isinstance(k.torch_kernel, CppKernel)]
    assert len(printed) >= cpp_kernels, [type(k.torch_kernel).__name__ for k in _kernels(compiled)]
    return compiled


def test_a_pointwise_chain_forward_and_backward():
    x, y = torch.randn(64, 33, requires_grad=True), torch.randn(64, 33, requires_grad=True)
    check(lambda x, y: torch.sin(x) * y + torch.exp(-x) * torch.tanh(y) - x / (y * y + 1), [x, y], cpp_kernels=2)


def test_broadcasts_and_views():
    x, b = torch.randn(8, 6, 10, requires_grad=True), torch.randn(10, requires_grad=True)
    check(lambda x, b: ((x + b).transpose(0, 2).reshape(60, 8) * 2).sigmoid(), [x, b])
    check(lambda x: x.reshape(48, 10).t().unsqueeze(0).expand(3, 10, 48).relu() + 1, [x])


def test_special_values_keep_eagers_semantics():
    """NaN through maximum, minimum, relu and where; sign(0) = 0; infinities; a division by zero."""
    x = torch.tensor([float("nan"), 0.0, -0.0, 1.5, -2.0, float("inf"), float("-inf"), 3.0])
    y = torch.tensor([1.0, float("nan"), 0.0, -1.5, 2.0, 1.0, float("-inf"), 0.0])
    nan = {"equal_nan": True}
    check(lambda x, y: torch.maximum(x, y) + torch.minimum(x, y), [x, y], nan)
    check(lambda x, y: torch.relu(x) + torch.sign(x) * 2 + torch.where(x > y, x, y) + x / y, [x, y], nan)


def test_integer_and_boolean_kernels():
    a, b = torch.randint(-50, 50, (40, 7)), torch.randint(1, 9, (40, 7))
    check(lambda a, b: (a * 3 - b) * (a > b) + (a == 0), [a, b])
    check(lambda a, b: ((a > 0) & (b < 5)) | (a == b), [a, b])


def test_float64():
    x = torch.randn(17, 5, dtype=torch.float64, requires_grad=True)
    check(lambda x: torch.log1p(x * x) * torch.atan(x) + torch.cosh(x / 3), [x])


def test_an_input_in_another_layout_is_copied_into_the_contiguous_functions(monkeypatch):
    """The contiguous function has its strides as constants (the inner loop vectorizes). A transposed
    or sliced input is copied into that layout and read by it (attention's gradients, in the layout
    of its transposed inputs: ten times faster than the strided function's scalar loop); a broadcast
    input (a stride of 0, whose copy would be the whole expanded tensor) takes the function that reads
    the strides as arguments."""
    calls, load = [], CppKernel._load

    def counted(kernel):
        contiguous, strided = load(kernel)
        return (lambda *a: calls.append("contiguous") or contiguous(*a),
                lambda *a: calls.append("strided") or strided(*a))
    monkeypatch.setattr(CppKernel, "_load", counted)
    f = compiler.compile(lambda x, y: (x * y + 1).relu(), backend="cpp")
    x, y = torch.randn(32, 48), torch.randn(32, 48)
    f(x, y)
    cases = {"contiguous": (x, y), "transposed": (x.t().contiguous().t(), y),
             "sliced": (torch.randn(32, 96)[:, ::2], y), "broadcast": (x, torch.randn(48).expand(32, 48))}
    for name, (a, b) in cases.items():
        calls.clear()
        torch.testing.assert_close(f(a, b), (a * b + 1).relu())
        assert calls == ["strided" if name == "broadcast" else "contiguous"], (name, calls)
        assert a.stride() == cases[name][0].stride()   # (the caller's tensor is left in its layout)


def test_a_kernel_the_cpp_printer_cannot_write_runs_as_pytorch_ops():
    """A kernel the C++ printer does not print (``torch.polar``'s complex built from real parts) runs on the
    torch path in the same program, beside the C++ kernels (the tanh after the matmul, and its backward).
    (The tolerance: the matmul saturates the tanh, whose gradient 1 - tanh**2 then reads tanh's last
    bits; the vector tanh, a few ulp from eager's, is as far from float64's as eager's is.)"""
    torch.manual_seed(0)
    x, w = torch.randn(64, 32, requires_grad=True), torch.randn(32, 16, requires_grad=True)
    compiled = check(lambda x, w: ((torch.polar(x.abs() + 1, x) * 2).abs() @ w).tanh(), [x, w],
                     tol={"rtol": 1e-4, "atol": 5e-5})
    kinds = {type(k.torch_kernel).__name__ for k in _kernels(compiled)}
    assert kinds == {"CppKernel", "TorchKernel"}, kinds


def test_dropout_draws_the_triton_kernels_numbers(monkeypatch):
    """Random numbers are Triton's tl.rand (Philox4x32, 10 rounds, as triton/language/random.py),
    written in C++: the same seed drops the same elements as the Triton kernels do."""
    import torch.nn.functional as F

    monkeypatch.setattr(program, "make_launcher", _MAKE_LAUNCHER)   # (the interpreter's kernels, to compare)
    x = torch.randn(64, 48, requires_grad=True)
    results = {}
    for backend in ("interpret", "cpp"):
        f = compiler.compile(lambda x: F.dropout(x.sin(), 0.3, training=True) * 2, backend=backend)
        torch.manual_seed(0)
        f(x)
        torch.manual_seed(1)
        out = f(x)
        out.sum().backward()
        results[backend] = (out.detach(), x.grad)
        x.grad = None
        if backend == "cpp":
            assert all(isinstance(k.torch_kernel, CppKernel) for k in _kernels(f))
    (ours, our_grad), (triton, triton_grad) = results["cpp"], results["interpret"]
    assert torch.equal(ours == 0, triton == 0) and 0.2 < (ours == 0).float().mean().item() < 0.4
    torch.testing.assert_close(ours, triton)
    torch.testing.assert_close(our_grad, triton_grad)


def test_gathers_cross_entropy_embedding_and_indexing():
    """Gathers read their index, check it (a bad one makes the call raise eager's IndexError), wrap
    negative ones where they count from the end, and read the source there."""
    torch.manual_seed(0)
    x, t = torch.randn(40, 70, requires_grad=True), torch.randint(0, 70, (40,))
    ce = check(lambda x, t: torch.nn.functional.cross_entropy(x, t), [x, t], cpp_kernels=2)
    assert all(isinstance(k.torch_kernel, CppKernel) for k in _kernels(ce))
    bad = t.clone()
    bad[5] = 70
    with pytest.raises(IndexError, match="out of bounds"):
        ce(x, bad)
    w, idx = torch.randn(30, 8, requires_grad=True), torch.randint(0, 30, (6, 4))
    check(lambda w, idx: torch.nn.functional.embedding(idx, w).tanh(), [w, idx])
    rows = torch.tensor([3, -1, 0, -7])
    check(lambda x, rows: x[rows].sigmoid() * 2, [x, rows])


def test_every_cpp_kernel_is_built_when_its_region_is_built(monkeypatch):
    """Built ahead of the first replay (in the compile pool), not at the first call of each kernel."""
    built = []
    real = cpp_build.build
    monkeypatch.setattr(cpp_build, "build", lambda name, source, vectorized=False: built.append(name)
                        or real(name, source, vectorized))
    f = compiler.compile(lambda x, y: (x * y).sin() + y, backend="cpp")
    x, y = torch.randn(10, 3, requires_grad=True), torch.randn(10, 3, requires_grad=True)
    f(x, y)
    names = {k.torch_kernel.name for k in _kernels(f) if isinstance(k.torch_kernel, CppKernel)}
    assert names and names <= set(built), (names, built)
    count = len(built)
    f(x, y).sum().backward()
    assert len(built) == count


def test_a_damaged_library_in_the_cache_is_built_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path))
    source = 'extern "C" void probe_kernel(float* __restrict__ out0) { out0[0] = 2.5f; }\n'
    path = cpp_build.build("probe_kernel", source)
    with open(path, "r+b") as f:   # a flipped byte
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    again = cpp_build.build("probe_kernel", source)
    assert again == path and "did not match its stamp" in caplog.text
    with open(os.path.join(tmp_path, "cpp", "probe_kernel.cpp")) as f:
        assert f.read() == source


def test_without_a_working_compiler_the_backend_says_so(monkeypatch):
    monkeypatch.setattr(cpp_build, "_found", {"compiler": (None, "no working C++ compiler with OpenMP (g++: not "
                                                                 "found); set CXX to one")})
    f = compiler.compile(lambda x: x + 1, backend="cpp")
    with pytest.raises(BackendUnavailable, match="set CXX.*backend='torch'"):
        f(torch.randn(3))


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adamw"])
def test_an_mlp_training_step(optimizer):
    """A whole step (forward, loss, backward, optimizer): the optimizer's own step on the CPU path."""
    import copy

    from tests.training import train_step

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.SiLU(),
                                torch.nn.Linear(64, 1))
    reference = copy.deepcopy(model)

    def make(params):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9) if optimizer == "sgd_momentum" \
            else torch.optim.AdamW(params, lr=1e-2)
    opt, ref_opt = make(model.parameters()), make(reference.parameters())
    compiled = compiler.compile(train_step, backend="cpp")
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for _ in range(5):
        torch.testing.assert_close(compiled(model, opt, x, y), train_step(reference, ref_opt, x, y), rtol=1e-5,
                                   atol=1e-6)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert compiled.last_backend == "cpp" and compiled.stats["divergences"] == 0
    assert any(isinstance(k.torch_kernel, CppKernel) for k in _kernels(compiled))


def test_row_reductions_softmax_norms_and_a_loss():
    """Kernels reducing their trailing dims: a loop per reduction in each row (one reading another's
    value after it: softmax's sum after its max, a variance after its mean), then the row's elements."""
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(48)
    x = torch.randn(20, 48, requires_grad=True)
    check(lambda x: torch.softmax(x * 1.5, -1), [x], cpp_kernels=2)
    norm = check(lambda x: ln(x), [x], tol={"rtol": 1e-5, "atol": 1e-5}, cpp_kernels=3)
    assert all(isinstance(k.torch_kernel, CppKernel) for k in _kernels(norm))   # (its weight's: column sums)
    check(lambda x: (x.sin() * 2).sum(0), [x], cpp_kernels=2)
    check(lambda x: x.reshape(4, 5, 48).mean((0, 1)), [x], cpp_kernels=1)
    check(lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), [x])
    check(lambda x: x.reshape(4, 5, 48).amax(-1) + x.reshape(4, 5, 48).sum((1, 2), keepdim=True).squeeze(-1),
          [x], cpp_kernels=1)
    t = torch.randint(0, 48, (20,))
    check(lambda x, t: torch.nn.functional.cross_entropy(x, t), [x, t], cpp_kernels=1)


def test_a_row_max_keeps_nan_as_eagers_does():
    x = torch.randn(6, 10)
    x[2, 3] = float("nan")
    x[4] = float("-inf")
    check(lambda x: x - x.amax(-1, keepdim=True), [x], tol={"equal_nan": True})


def test_column_sums_beside_rows_are_summed_per_chunk_of_rows():
    """At 1024 rows a layer norm's backward computes its weight's and bias's gradients as partial
    column sums beside its rows (a chunk of rows a thread), added up by the next kernel."""
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(32)
    x, seed = torch.randn(1024, 32, requires_grad=True), torch.randn(1024, 32)
    compiled = check(lambda x: ln(x) * 2, [x], tol={"rtol": 1e-5, "atol": 1e-5}, cpp_kernels=3)
    partials = [k for k in _kernels(compiled) if any(shape == (4, 32) for _, shape, _ in k.stores)]
    assert partials and all(isinstance(k.torch_kernel, CppKernel) for k in _kernels(compiled)), partials
    grads = []
    for run in (compiled, lambda x: ln(x) * 2):
        for p in ln.parameters():
            p.grad = None
        run(x).backward(seed)
        grads.append([p.grad.clone() for p in ln.parameters()])
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)


def test_reductions_over_middle_dims_and_slice_scatters_are_cpp():
    """A batch norm's statistics reduce N, H and W of NCHW (kept: C, in the middle): per channel a
    scalar loop over the reduced dims, elementwise outputs stored at their contiguous position. A
    slice's gradient (and an in-place write into a slice) is a slice_scatter read inside a kernel."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(6)
    x = torch.randn(3, 6, 5, 4, requires_grad=True)
    compiled = check(lambda x: bn(x).relu(), [x], tol={"rtol": 1e-5, "atol": 1e-5}, cpp_kernels=2)
    assert all(isinstance(k.torch_kernel, CppKernel) for k in _kernels(compiled))
    middle = check(lambda x: (x.exp() * x.mean((0, 2), keepdim=True)).sum((1, 3)), [x], cpp_kernels=1)
    assert all(isinstance(k.torch_kernel, CppKernel) for k in _kernels(middle))
    y = torch.randn(8, 12, requires_grad=True)
    for fn in (lambda y: y[:, 2:9:3].sin() * 2, lambda y: y[1:6].tanh().sum(-1)):
        sliced = check(fn, [y], cpp_kernels=1)
        assert all(isinstance(k.torch_kernel, CppKernel) for k in _kernels(sliced))


def test_the_optimizer_and_clip_loops_and_column_sums_are_vectorized_by_the_compiler():
    """The compiler's own vectorization report (``-fopt-info-vec-optimized``) on the fused optimizer
    step's loop, clip_grad_norm_'s norm and scale loops, and a weight-gradient kernel's columns."""
    import subprocess

    from compiler.optimizers.cpp_combo import cpp_clip_sources, cpp_combo_source
    from compiler.optimizers.rules import AdamRule
    from runtime import cpp_build

    compiler_path, _ = cpp_build.compiler_path()
    adam = AdamRule()
    sources = [cpp_combo_source(adam, (False, True, True, False), torch.float32)[1]]
    sources += [text for _, text in cpp_clip_sources(2.0, torch.float32)]
    for source in sources:
        done = subprocess.run([compiler_path, *cpp_build.FLAGS, "-fopt-info-vec-optimized", "-x", "c++", "-",
                               "-o", os.devnull], input=source, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "loop vectorized" in done.stderr, (source, done.stderr)
    # a weight's gradient summed over the batch: its columns' vector body (at::vec), not a scalar loop
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 64)
    x = torch.randn(32, 16)
    compiled = check(lambda x: torch.nn.functional.gelu(lin(x)), [x], cpp_kernels=2)
    columns = [k.torch_kernel for k in _kernels(compiled) if any(tuple(shape) == (1, 64) for _, shape, _ in k.stores)]
    assert columns and all(k.vectorized and "V::loadu(acc" in k.source for k in columns), columns


def test_values_the_same_for_every_lane_are_scalars_in_vector_bodies():
    """A row's target (cross entropy's backward: ``iota == target`` over the classes), an embedding
    row's index, a random seed: read once per row as scalars inside the vector body, so those kernels
    are vectorized, with eager's values (ignored targets, out-of-range indices included)."""
    torch.manual_seed(0)
    x = torch.randn(24, 40, requires_grad=True)
    t = torch.randint(0, 40, (24,))
    t[3] = -100
    ce = check(lambda x, t: torch.nn.functional.cross_entropy(x, t, label_smoothing=0.1), [x, t], cpp_kernels=2)
    assert any("V::arange" in k.torch_kernel.source and k.torch_kernel.vectorized for k in _kernels(ce))
    emb, ln = torch.nn.Embedding(50, 32), torch.nn.LayerNorm(32)
    ids = torch.randint(0, 50, (6, 9))
    looked_up = check(lambda ids: ln(emb(ids)).tanh(), [ids], tol={"rtol": 1e-5, "atol": 1e-5}, cpp_kernels=2)
    gathers = [k.torch_kernel for k in _kernels(looked_up) if "bad |=" in k.torch_kernel.source]
    assert gathers and all(k.vectorized and "V::loadu" in k.source for k in gathers), gathers
    bad = compiler.compile(lambda ids: emb(ids).sum(), backend="cpp")
    bad(ids)
    bad(ids)
    with pytest.raises(IndexError):
        bad(torch.full((6, 9), 50))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_complex_kernels_are_cpp_with_eagers_values(dtype):
    """Complex values as their interleaved parts, the math as the Triton kernels' real arithmetic on
    parts (``realify``; |z| is C's hypot), a broadcast gain's and bias's gradients as complex column
    sums, over few rows and over chunks of many; in vector bodies, each register's parts
    deinterleaved after the load and interleaved again for the store. A real view of a complex value
    (``view_as_real``) reads the part its index names."""
    torch.manual_seed(0)
    w = torch.randn(16, dtype=dtype, requires_grad=True)
    b = torch.randn(16, dtype=dtype, requires_grad=True)

    def gate(z, w, b):
        u = z * w + b
        return u * torch.sigmoid(u.abs()) + u.conj() * 0.5
    for rows in (8, 1024):
        z = torch.randn(rows, 16, dtype=dtype, requires_grad=True)
        compiled = check(gate, [z, w, b], cpp_kernels=2)
        assert all(isinstance(k.torch_kernel, CppKernel) for k in _kernels(compiled))
        assert all(k.torch_kernel.vectorized and "deinterleave2" in k.torch_kernel.source
                   for k in _kernels(compiled)), [k.torch_kernel.source for k in _kernels(compiled)]
    z = torch.randn(8, 16, dtype=dtype, requires_grad=True)
    r = torch.randn(8, 16, dtype=dtype.to_real(), requires_grad=True)
    parts = check(lambda z, r: torch.view_as_real(z * 2).sum(-1) * r, [z, r], cpp_kernels=1)
    assert all(isinstance(k.torch_kernel, CppKernel) for k in _kernels(parts))


def test_a_module_compiled_directly_replays_at_a_second_call():
    """``compiler.compile(module)``: a callable without ``__name__`` (logs name it by its class)."""
    ln = torch.nn.LayerNorm(16)
    compiled = compiler.compile(ln, backend="cpp")
    x = torch.randn(4, 16, requires_grad=True)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), ln(x))
    assert compiled.__name__ == "LayerNorm" and compiled.last_backend == "cpp"


def test_a_batch_norms_sums_share_one_vectorized_loop():
    """A batch norm sums several expressions of one element over N, H and W: one loop computes the
    element once for the sums that do not wait for another (not a loop each), and with W in whole
    registers each loop has a vector body, its float lanes summed in runs into double totals (the
    scalar loop's precision)."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(4)
    x = torch.randn(8, 4, 16, 32, requires_grad=True)
    compiled = check(lambda x: (bn(x).relu() * x).sum(), [x], tol={"rtol": 1e-5, "atol": 1e-5}, cpp_kernels=2)
    fast = [_body(k.torch_kernel.source) for k in _kernels(compiled)]
    # (the backward's four sums in two loops; the forward's mean, then the variance that reads it:
    # two loops, the mean computed once)
    shared = [s for s in fast if s.count("_d = 0;") > s.count("for (; r + V::size() <=") >= 1]
    assert len(shared) == 1 and shared[0].count("_d = 0;") == 4, fast
    forward = [s for s in fast if s.count("_d = 0;") == 2]
    assert len(forward) == 1 and forward[0].count("for (; r + V::size() <=") == 2, fast
    assert all("for (int64_t r = 0;" not in s for s in fast), fast   # (no scalar-only loop over a row)


def test_slices_and_strided_reads_in_vector_bodies():
    """A slice_scatter whose dim is not the inner loop's, or is in whole registers, is chosen once for
    a register's lanes; a strided read (a transposed or every-other element) fills a register lane by
    lane: those kernels keep their vector body, with eager's values."""
    torch.manual_seed(0)
    x = torch.randn(6, 64, requires_grad=True)
    y = torch.randn(64, 6, requires_grad=True)
    fns = {"rows": lambda x, y: x[1:5].tanh().exp(),
           "registers": lambda x, y: x[:, 16:48].sigmoid() * 3,
           "transposed": lambda x, y: (x * y.t()).sin(),
           "strided": lambda x, y: x[:, ::2].cos() + y[::2].t()}
    for name, fn in fns.items():
        compiled = check(fn, [x, y], cpp_kernels=1)
        kernels = [k.torch_kernel for k in _kernels(compiled)]
        assert all(isinstance(k, CppKernel) for k in kernels), name
        assert any(k.vectorized for k in kernels), (name, [k.source for k in kernels])
    rows = check(fns["registers"], [x, y], cpp_kernels=1)
    assert any("? V(" in k.torch_kernel.source or "? t" in k.torch_kernel.source.split("_strided")[0]
               for k in _kernels(rows))


def test_a_value_stored_and_summed_over_chunks_of_rows_is_computed_once():
    """A bias's gradient summed over chunks of rows beside the input's gradient it sums (GELU's
    backward): the value is read at the reshape's index for the sum and at the row for the store;
    both are one value of the kernel, so its exp and erf are computed once per element."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 64)
    x = torch.randn(4, 512, 16)
    compiled = check(lambda x: torch.nn.functional.gelu(lin(x)).sum(), [x], cpp_kernels=2)
    chunked = [_body(k.torch_kernel.source) for k in _kernels(compiled)
               if "task" in k.torch_kernel.source and "erf" in k.torch_kernel.source]
    assert chunked and all(s.count(").exp()") == 1 and s.count(".erf()") == 1 for s in chunked), chunked


def test_a_softmax_computes_its_max_once_and_each_exp_once():
    """Softmax's row: its max in one loop, then exp(x - max) summed and kept in a row buffer, then
    the outputs divided from that buffer, in the vector body as in the scalar tail (the loops a
    kernel's outputs read are written before them): one max and one exp per element."""
    torch.manual_seed(0)
    x = torch.randn(64, 1024, requires_grad=True)
    compiled = check(lambda x: torch.softmax(x, -1), [x], cpp_kernels=2)
    forward = [_body(k.torch_kernel.source) for k in _kernels(compiled) if ").exp()" in _body(k.torch_kernel.source)]
    assert len(forward) == 1, forward
    assert forward[0].count(").exp()") == 1 and forward[0].count("at::vec::maximum(acc") == 1, forward[0]
    assert forward[0].count("V::loadu(acc") == 1, forward[0]   # (the division reads the kept row)


def test_the_vector_tanh_is_within_a_few_ulp_and_keeps_its_special_values():
    """A vector body's float tanh (``cpp_kernel.VECTOR_HELPERS``: a Taylor polynomial near 0, 1 - 2 /
    (1 + exp(2z)) beyond): within 3e-7 of float64's tanh relative to the value (eager's Sleef tanh:
    6e-8), over magnitudes from 1e-30 to 100, both sides of the switch at 0.55; +-0, +-inf, NaN and
    saturation as eager's."""
    torch.manual_seed(0)
    x = torch.cat([torch.randn(20000) * s for s in (1e-30, 1e-6, 1e-2, 0.3, 0.55, 1, 4, 20, 100)])
    x = torch.cat([x, torch.tensor([0.55, -0.55, 0.5499999, 9.0, 44.0, 89.0, -89.0])])
    f = compiler.compile(torch.tanh, backend="cpp")
    f(x)
    y = f(x)
    assert any(k.torch_kernel.vectorized and "symgrad_tanh(" in _body(k.torch_kernel.source) for k in _kernels(f))
    ref = torch.tanh(x.double())
    assert ((y.double() - ref).abs() / ref.abs()).max().item() < 3e-7
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")] * 4)
    got, want = f(special), torch.tanh(special)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(torch.signbit(got), torch.signbit(want))


def test_heads_put_back_side_by_side_are_read_a_register_at_a_time():
    """Attention's heads (B, heads, T, d) put back side by side (B, T, heads * d) and concatenated (q,
    k and v's gradients): a register's lanes read d consecutive elements of one head, which the
    writer finds by evaluating the index at each lane (``lanes_consecutive``), so the kernel loads
    whole registers, not each lane's element on its own."""
    torch.manual_seed(0)
    a, b = (torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(2))

    def heads(t):
        return t.transpose(1, 2).reshape(2, 8, 64)
    compiled = check(lambda a, b: torch.cat([heads(a), heads(b)], -1).sin(), [a, b], cpp_kernels=1)
    forward = [_body(k.torch_kernel.source) for k in _kernels(compiled) if "sin()" in k.torch_kernel.source]
    assert forward and all("V::loadu(in" in s and "lanes" not in s for s in forward), forward
    odd = torch.randn(2, 4, 8, 12, requires_grad=True)   # (12 elements a head: a register spans two heads)
    spans = check(lambda a: a.transpose(1, 2).reshape(2, 8, 48).sin(), [odd], cpp_kernels=1)
    forward = [_body(k.torch_kernel.source) for k in _kernels(spans) if "sin()" in k.torch_kernel.source]
    assert forward and all("lanes" in s for s in forward), forward


def test_what_the_cpp_fuzz_run_found():
    """Programs the C++ fuzz run found (``SYMGRAD_FUZZ_BACKEND=cpp python -m tests.fuzz``, seeds 249,
    1464, 134 and 3169): a complex elementwise output of a kernel that also sums rows (the gradient of a
    complex plus a broadcast real) was an internal error, its store having no complex form; on the
    torch path a max over an empty dim (logsumexp of an empty row) raised (``torch.amax``), where eager
    and the Triton kernels give -inf, and a gather of no elements checked its indices, which eager
    does not."""
    torch.manual_seed(0)
    z = torch.randn(3, dtype=torch.complex64, requires_grad=True)
    r = torch.randn(1, requires_grad=True)
    check(lambda z, r: z + r.expand(1).squeeze(), [z, r], cpp_kernels=1)
    empty = torch.randn(2, 0, dtype=torch.float64, requires_grad=True)
    rows = torch.randn(1, 0, dtype=torch.float64, requires_grad=True)
    other = torch.randn(1, 0, requires_grad=True)

    def picked(x, y):   # (seed 3169: rows picked past the end of a tensor with no elements: eager checks no index)
        v = x[torch.tensor([1, 1])]
        return torch.where(v > 0, v, y @ y.mT)
    for backend in ("cpp", "torch"):
        check_cpu_backend(lambda x: torch.logsumexp(x.reshape(0, 2).norm(dim=1), dim=0), [empty], backend)
        check_cpu_backend(lambda x: torch.log_softmax(x.abs() ** 1.5, dim=-1), [empty.float()], backend)
        check_cpu_backend(picked, [rows, other], backend)


def _pool_input(special: str) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 64)
    if special == "ties":   # (a window's first maximum gets the gradient, as eager's)
        x = torch.randint(-2, 3, x.shape).float()
    elif special == "nan":
        x.view(-1)[::37] = float("nan")
    elif special == "inf":
        x.view(-1)[::11] = float("-inf")
        x.view(-1)[5::13] = float("inf")
    return x.requires_grad_(True)


_POOLS = {
    "3x3, stride 2, padding 1": lambda x: torch.nn.functional.max_pool2d(x.relu(), 3, 2, 1),
    "3x3, stride 1": lambda x: torch.nn.functional.max_pool2d(x * 2, 3, 1, 1),
    "2x2": lambda x: torch.nn.functional.max_pool2d(x.sin(), 2),
    "dilation": lambda x: torch.nn.functional.max_pool2d(x.cos(), 3, 2, 1, dilation=2),
    "ceil_mode": lambda x: torch.nn.functional.max_pool2d(x.exp(), 3, 2, 0, ceil_mode=True),
    "1d": lambda x: torch.nn.functional.max_pool1d(x.flatten(2).tanh(), 5, 3, 2),
    "rectangular": lambda x: torch.nn.functional.max_pool2d(x.sigmoid(), (2, 4), (1, 3), (1, 2)),
}


@pytest.mark.parametrize("special", ["plain", "ties", "nan", "inf"])
@pytest.mark.parametrize("pool", sorted(_POOLS))
def test_a_small_max_pool_is_elementwise_in_vector_bodies(pool, special):
    """A max pool's window of at most 25 elements is scanned elementwise over the outputs (each
    window element a strided view of the padded input: lanes inside and outside the padding
    chosen lane by lane), its first maximum's position saved for the backward, which reads it at
    each element's view: every kernel has a vector body, none loops over a window, and eager's
    values and gradients come out, ties, NaN and infinities included."""
    compiled = check(_POOLS[pool], [_pool_input(special)], tol=dict(equal_nan=True), cpp_kernels=2)
    bodies = [_body(k.torch_kernel.source) for k in _kernels(compiled)]
    assert all(isinstance(k.torch_kernel, CppKernel) and k.torch_kernel.vectorized for k in _kernels(compiled)), bodies
    assert not any("for (int64_t r = 0;" in s for s in bodies), bodies
    if pool.endswith("padding 1"):
        assert any("mask" in s for s in bodies), bodies


def test_a_max_pools_indices_and_a_large_window_keep_eagers_values():
    """``return_indices`` gives eager's flat indices from the elementwise scan; a window of more than
    25 elements is reduced over its dims, each of its three reductions (max, first position, the
    value there) in one loop over the window, not computed again inside the loop that reads it."""
    x = _pool_input("ties")
    compiled = compiler.compile(lambda x: torch.nn.functional.max_pool2d(x.abs(), 3, 2, 1, return_indices=True),
                                backend="cpp", fullgraph=True)
    for _ in range(2):
        (out, index), (ref, ref_index) = compiled(x), torch.nn.functional.max_pool2d(x.abs(), 3, 2, 1,
                                                                                    return_indices=True)
        torch.testing.assert_close(out, ref)
        assert torch.equal(index, ref_index)
    large = check(lambda x: torch.nn.functional.max_pool2d(x.relu(), 6, 4, 3), [_pool_input("ties")], cpp_kernels=2)
    forward = [_body(k.torch_kernel.source) for k in _kernels(large) if "-INFINITY" in k.torch_kernel.source]
    assert forward and all(s.count("for (int64_t r = 0;") <= 3 for s in forward), forward


def test_masks_combine_in_vector_bodies():
    """Comparisons joined by logical and/or/not stay masks in a vector body (their lanes' bits)."""
    torch.manual_seed(0)
    x = torch.randn(8, 64, requires_grad=True)
    compiled = check(lambda x: torch.where(((x > 0) | (x < -1)) & ~(x.abs() > 2), x.sin(), x * 3), [x], cpp_kernels=1)
    assert all(k.torch_kernel.vectorized for k in _kernels(compiled))


def test_kernels_alike_but_for_their_inputs_strides_are_two_libraries():
    """Two kernels whose bodies are the same but whose contiguous inputs have other strides (every
    other column of a [4, 4] and of a [4, 3] matrix, both [4, 2]): the strides are constants of the
    contiguous function, so they name the library too. They did not, and the second kernel loaded
    the first's, reading the wrong elements (past the end: garbage), silently (the pool fuzz's seeds
    358 then 556)."""
    torch.manual_seed(0)
    wide, narrow = torch.randn(4, 4, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    every_other = check(lambda x: x[:, ::2] * 3, [wide], cpp_kernels=1)
    again = check(lambda x: x[:, ::2] * 3, [narrow], cpp_kernels=1)
    names = {k.torch_kernel.name for k in _kernels(every_other)} & {k.torch_kernel.name for k in _kernels(again)}
    assert not names, names


def test_a_rows_values_the_same_along_it_are_computed_once_per_row():
    """Layer norm's rstd (a division by a square root of the row's statistics) and the row's mean are
    the same for every element of the row: a kernel over rows computes them once per row, before its
    loops, not in every register of them (GCC did not hoist them: the backward kernel spent ~20%
    more). (The weight's gradient, a kernel over columns, still divides in its loop.)"""
    torch.manual_seed(0)
    x = torch.randn(64, 256, requires_grad=True)
    w, b = torch.randn(256, requires_grad=True), torch.randn(256, requires_grad=True)
    compiled = check(lambda x, w, b: torch.nn.functional.layer_norm(x, (256,), w, b), [x, w, b], cpp_kernels=2)
    rows = [s for s in map(_body, (k.torch_kernel.source for k in _kernels(compiled))) if "for (int64_t x = 0;" in s]
    roots = [line for s in rows for line in s.splitlines() if "std::sqrt" in line]
    assert roots and all(len(line) - len(line.lstrip()) <= 8 for line in roots), roots   # (the row's scope)
    assert any(k.torch_kernel.vectorized for k in _kernels(compiled))
    # rows of one element: every value is the same along the row, but one an earlier loop kept in its
    # row buffer is read there at the loop's element (a softmax over a dim of size 1 did not compile:
    # the C++ fuzz's seeds 687-988 at the first version of this)
    check(lambda x: torch.softmax(x, dim=1) * 2, [torch.randn(2, 1, requires_grad=True)], cpp_kernels=1)
    check(lambda x: torch.atan2(x, x).max(dim=2).values, [torch.randn(2, 3, 1, requires_grad=True)], cpp_kernels=1)
