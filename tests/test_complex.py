"""Complex numbers through the whole pipeline: values and Wirtinger gradients equal eager
PyTorch's (the autograd notes' convention), complex64 and complex128, through the kernels."""

import pytest
import torch

import compiler
from tests.devices import KERNELS  # noqa: E402  (the CUDA test mode's: tests/devices.py)
from tests.parity import check_parity

CDTYPES = [torch.complex64, torch.complex128]
TOL = {torch.complex64: dict(rtol=1e-4, atol=1e-4), torch.complex128: dict(rtol=1e-9, atol=1e-9)}

# f(z, w) for complex z, w of shape (4, 5)
OPS = {
    "add": lambda z, w: z + w,
    "sub": lambda z, w: z - w * 2,
    "mul": lambda z, w: z * w,
    "div": lambda z, w: z / w,
    "neg": lambda z, w: -z,
    "conj": lambda z, w: z.conj() * w,
    "real": lambda z, w: z.real * 3,
    "imag": lambda z, w: torch.imag(z) - z.real,
    "abs": lambda z, w: z.abs(),
    "angle": lambda z, w: torch.angle(z),
    "exp": lambda z, w: torch.exp(z),
    "log": lambda z, w: torch.log(z),
    "sqrt": lambda z, w: torch.sqrt(z),
    "sin": lambda z, w: torch.sin(z),
    "cos": lambda z, w: torch.cos(z),
    "tanh": lambda z, w: torch.tanh(z),
    "sigmoid": lambda z, w: torch.sigmoid(z),
    "pow_int": lambda z, w: z ** 3,
    "pow_fractional": lambda z, w: z ** 2.5,
    "pow_tensor": lambda z, w: z ** w,
    "reciprocal": lambda z, w: torch.reciprocal(z),
    "complex_scalar": lambda z, w: z * (1 - 2j) + 0.5j,
    "sum": lambda z, w: (z * w).sum(),
    "sum_dim": lambda z, w: (z * w).sum(1),
    "mean": lambda z, w: (z.exp() * w).mean(0),
    "matmul": lambda z, w: z @ w.t(),
    "view_as_real": lambda z, w: torch.view_as_real(z * w) * 2,
    "view_as_complex": lambda z, w: torch.view_as_complex(torch.view_as_real(z).exp()),
    "broadcast": lambda z, w: z * w.mean(0, keepdim=True) + w.sum(1, keepdim=True),
}


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(OPS))
def test_complex_op_parity(name, dtype):
    torch.manual_seed(0)
    z = torch.randn(4, 5, dtype=dtype, requires_grad=True)
    w = torch.randn(4, 5, dtype=dtype, requires_grad=True)
    out = OPS[name](z, w)
    seed = torch.randn(out.shape, dtype=out.dtype)  # a general grad_output, not just ones
    check_parity(OPS[name], [z, w], grad_seed=seed, tol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_real_to_complex_ops(dtype):
    """R→C: torch.complex, torch.polar, a real times a complex; real inputs keep the real part."""
    cdtype = dtype.to_complex()
    x = torch.randn(4, 5, dtype=dtype, requires_grad=True)
    y = torch.randn(4, 5, dtype=dtype, requires_grad=True)
    z = torch.randn(4, 5, dtype=cdtype, requires_grad=True)
    tol = TOL[cdtype]
    for fn, args in [(lambda x, y: torch.complex(x, y) ** 2, [x, y]),
                     (lambda x, y: torch.polar(x.abs() + 0.1, y) * 3, [x, y]),
                     (lambda x, z: x * z, [x, z])]:
        out = fn(*args)
        check_parity(fn, args, grad_seed=torch.randn(out.shape, dtype=out.dtype), tol=tol)


def test_notes_worked_example_grad_is_c():
    """The notes: f(z) = c·z with real c gives ∂L/∂z* = c for grad_output 1."""
    c = 2.5
    z = torch.randn(6, dtype=torch.complex128, requires_grad=True)
    f = compiler.compile(lambda z: c * z, backend=KERNELS, fullgraph=True)
    f(z)
    out = f(z)
    out.backward(torch.ones_like(out))
    torch.testing.assert_close(z.grad, torch.full_like(z, c))


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
def test_holomorphic_nonholomorphic_and_real_loss(dtype):
    z = torch.randn(8, dtype=dtype, requires_grad=True)
    tol = TOL[dtype]
    check_parity(lambda z: (z * z + torch.exp(z)).sum(), [z], grad_seed=torch.tensor(1 - 2j, dtype=dtype), tol=tol)
    check_parity(lambda z: (z.conj() * z + z.real).sum(), [z], grad_seed=torch.tensor(0.5 + 1j, dtype=dtype), tol=tol)
    # a real loss of a complex computation: |z|² gives 2z
    f = check_parity(lambda z: (z.abs() ** 2).sum(), [z], tol=tol)
    z2 = z.detach().clone().requires_grad_()
    f(z2).backward()
    torch.testing.assert_close(z2.grad, 2 * z2.detach(), **tol)


def test_abs_and_angle_at_zero_follow_eager():
    # NOTE: products with constants are simplified symbolically, so the sign of a zero part
    # may differ from eager's (-0.0 vs 0.0: angle π vs 0 on the negative real axis); the
    # inputs here avoid that ambiguity.
    z = torch.tensor([0j, 1 + 1j, -2 + 0.5j], dtype=torch.complex128, requires_grad=True)
    check_parity(lambda z: z.abs() + torch.angle(z) + (z * 0.5).abs(), [z])


@pytest.mark.parametrize("dtype", CDTYPES, ids=str)
def test_abs_of_huge_and_tiny_values_does_not_overflow(dtype):
    """|z| is a true hypot (scaled by max(|re|, |im|)), as eager's: re² + im² of complex64 parts
    near 1e30 overflows float32 (|z| would print as inf, its gradient as 0), and parts near 1e-30
    underflow to 0 (a gradient of NaN or 0)."""
    big = 1e30 if dtype == torch.complex64 else 1e300
    tiny = 1e-30 if dtype == torch.complex64 else 1e-300
    z = torch.tensor([big + big * 1j, -big + 0.5j, tiny - tiny * 1j, 3 + 4j, 0j, complex("inf") + 1j],
                     dtype=dtype, requires_grad=True)
    check_parity(lambda z: z.abs() * 2, [z], tol=TOL[dtype])


def test_real_hypot_of_huge_values_does_not_overflow():
    a = torch.tensor([1e30, -3e30, 1e-30, 3.0, 0.5], requires_grad=True)
    b = torch.tensor([1e30, 4e30, 2e-30, 4.0, 0.0], requires_grad=True)
    check_parity(lambda a, b: torch.hypot(a, b) * 2, [a, b])


def test_complex_chain_is_one_kernel_each_way():
    def f(z, w):
        return (torch.exp(z) * w + z.conj() * 0.5).abs().sum()
    z = torch.randn(16, 8, dtype=torch.complex64, requires_grad=True)
    w = torch.randn(16, 8, dtype=torch.complex64, requires_grad=True)
    report = compiler.explain(f, z, w)
    assert report.fallbacks == []
    assert len(report.forward_kernels) == 1
    assert len(report.backward_kernels) == 1
    check_parity(f, [z, w], tol=TOL[torch.complex64])


@pytest.mark.parametrize("fn", [
    lambda z, w: (torch.exp(z) * w.conj() + z.abs()).sum(),
    lambda z, w: torch.sigmoid(z) / (w * w + 2),
    lambda z, w: (z @ w.t()).real,
], ids=["chain", "quotient", "matmul_real"])
def test_gradcheck_on_compiled_complex_functions(fn):
    compiled = compiler.compile(fn, backend=KERNELS, fullgraph=True)
    z = torch.randn(3, 2, dtype=torch.complex128, requires_grad=True)
    w = torch.randn(3, 2, dtype=torch.complex128, requires_grad=True)
    compiled(z, w)
    assert torch.autograd.gradcheck(compiled, (z, w))
    assert compiled.stats["replays"] > 0 and compiled.stats["divergences"] == 0


@pytest.mark.parametrize("backend", ["interpret", "torch", "cpp"])
def test_conjugate_and_negative_views_passed_in_are_read_as_their_values(backend):
    """``z.conj()`` and ``z.conj().imag`` are views whose conjugation or negation PyTorch applies
    lazily (a bit on the tensor, the memory unchanged). Our kernels read memory by address: such an
    input is materialized first, on every backend (the C++ kernels read the conjugate's memory
    as it was, and the Triton kernels a negative view's, before)."""
    from runtime import cpp_build
    if backend == "cpp" and not cpp_build.available()[0]:
        pytest.skip("no working C++ compiler here")
    torch.manual_seed(0)
    base = torch.randn(16, 24, dtype=torch.complex64, requires_grad=True)
    f = compiler.compile(lambda z: z * 2 + z * z, backend=backend)
    g = compiler.compile(lambda x: x * 3 + x.exp(), backend=backend)
    f(torch.randn(16, 24, dtype=torch.complex64))
    g(torch.randn(16, 24))
    for z in (base.conj(), base.detach().conj(), base.conj().t()):
        got, want = f(z), z * 2 + z * z
        torch.testing.assert_close(got, want)
        if z.requires_grad:
            (got_grad,) = torch.autograd.grad(got.abs().sum(), base)
            (want_grad,) = torch.autograd.grad(want.abs().sum(), base)
            torch.testing.assert_close(got_grad, want_grad)
    x = base.detach().conj().imag
    assert x.is_neg()
    torch.testing.assert_close(g(x), x * 3 + x.exp())
    for compiled in (f, g):
        assert compiled.stats["divergences"] == 0 and compiled.stats["kernel_launches"] > 0, compiled.stats
