"""User-defined elementwise ops: one scalar function, a SymPy-derived backward, fused
inside compiled functions, eager outside; checked against eager PyTorch evaluating the same
formula with its own autograd."""

import math

import pytest
import torch

import compiler
from tests.devices import KERNELS  # noqa: E402  (the CUDA test mode's: tests/devices.py)
from compiler import math as cm
from tests.parity import check_parity


@compiler.elementwise(name="squareplus")
def squareplus(x, b=4.0):
    return (x + cm.sqrt(x * x + b)) / 2


def squareplus_torch(x, b=4.0):
    return (x + torch.sqrt(x * x + b)) / 2


@compiler.elementwise
def smooth_clip(x, lo, hi):
    return cm.where(x < lo, lo + cm.tanh(x - lo), cm.where(x > hi, hi + cm.tanh(x - hi), x))


def smooth_clip_torch(x, lo, hi):
    return torch.where(x < lo, lo + torch.tanh(x - lo), torch.where(x > hi, hi + torch.tanh(x - hi), x))


@compiler.elementwise(name="abs2")
def abs2(z):
    return cm.real(z * cm.conj(z))


@compiler.elementwise(name="phase_gate")
def phase_gate(z, theta):
    return z * (cm.cos(theta) + 1j * cm.sin(theta)) * cm.sigmoid(cm.abs(z))


def phase_gate_torch(z, theta):
    return z * torch.polar(torch.ones_like(theta), theta) * torch.sigmoid(z.abs())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_eager_values_and_gradients_match_the_torch_formula(dtype):
    x = torch.randn(6, 5, dtype=dtype, requires_grad=True)
    b = torch.rand(5, dtype=dtype, requires_grad=True) + 1  # broadcasts
    out = squareplus(x, b)
    ref = squareplus_torch(x, b)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, [x, b], g), torch.autograd.grad(ref, [x, b], g))


def test_default_arguments_and_scalars():
    x = torch.randn(7, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(squareplus(x), squareplus_torch(x))
    torch.testing.assert_close(smooth_clip(x, -0.5, 0.5), smooth_clip_torch(x, -0.5, 0.5))


def test_double_backward_where_twice_differentiable():
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    g, = torch.autograd.grad(squareplus(x).sum(), x, create_graph=True)
    gg, = torch.autograd.grad(g.sum(), x)
    xr = x.detach().clone().requires_grad_()
    gr, = torch.autograd.grad(squareplus_torch(xr).sum(), xr, create_graph=True)
    ggr, = torch.autograd.grad(gr.sum(), xr)
    torch.testing.assert_close(gg, ggr)
    assert torch.autograd.gradgradcheck(lambda x: squareplus(x, 2.0), (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_fuses_inside_compiled_functions(dtype):
    def f(x, b):
        return (squareplus(torch.sin(x), b) * smooth_clip(x, -1.0, 1.0)).sum()

    def f_torch(x, b):
        return (squareplus_torch(torch.sin(x), b) * smooth_clip_torch(x, -1.0, 1.0)).sum()
    x = torch.randn(8, 6, dtype=dtype, requires_grad=True)
    b = torch.rand(6, dtype=dtype, requires_grad=True) + 1
    report = compiler.explain(f, x, b)
    assert report.fallbacks == []
    assert len(report.forward_kernels) == 1 and len(report.backward_kernels) == 1
    assert "squareplus" in str(report.graph)
    compiled = check_parity(f, [x, b])
    # same values as the plain-torch formula
    torch.testing.assert_close(compiled(x, b), f_torch(x, b))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_complex_inputs(dtype):
    z = torch.randn(5, dtype=dtype, requires_grad=True)
    theta = torch.randn(5, dtype=dtype.to_real(), requires_grad=True)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.complex64 else dict(rtol=1e-9, atol=1e-10)
    # eager: C→R gives 2z for |z|², and a C×R→C op matches torch's own formula
    a = abs2(z)
    assert a.dtype == dtype.to_real()
    gz, = torch.autograd.grad(a.sum(), z)
    torch.testing.assert_close(gz, 2 * z.detach(), **tol)
    out, ref = phase_gate(z, theta), phase_gate_torch(z, theta)
    torch.testing.assert_close(out, ref, **tol)
    g = torch.randn_like(out)
    for mine, theirs in zip(torch.autograd.grad(out, [z, theta], g), torch.autograd.grad(ref, [z, theta], g)):
        torch.testing.assert_close(mine, theirs, **tol)
    # compiled: fused, Wirtinger gradients from SymPy
    check_parity(lambda z, t: abs2(phase_gate(z, t)).sum(), [z, theta], tol=tol)


def test_clear_errors_for_unsupported_expressions():
    with pytest.raises(ValueError, match="compiler.math"):
        compiler.elementwise(lambda x: math.exp(x), name="uses_math_exp")
    import sympy
    with pytest.raises(ValueError, match="`gamma` is not supported"):
        compiler.elementwise(lambda x: sympy.gamma(x), name="gamma_op")

    def branchy(x):
        if x > 0:
            return x
        return -x
    with pytest.raises(ValueError, match="where"):
        compiler.elementwise(branchy)
    with pytest.raises(TypeError, match="at least one tensor"):
        squareplus(1.0)
    with pytest.raises(TypeError):
        squareplus(torch.randn(2), 1.0, 2.0)


def test_more_math_functions_in_user_ops():
    """compiler.math's inverse-trigonometric, hyperbolic and accurate log/exp forms: gradients
    from SymPy (gradcheck), compiled and fused."""
    @compiler.elementwise(name="blend")
    def blend(x, y):
        return cm.log1p(cm.exp(x)) * cm.atan2(y, x) + cm.softplus(y, 2.0) + cm.asinh(x) * cm.hypot(x, y) \
            + cm.expm1(cm.atan(y)) + cm.logaddexp(x, y)

    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    y = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(blend, (x, y))
    f = compiler.compile(lambda x, y: blend(x.sin(), y).sum(), backend=KERNELS, fullgraph=True)
    f(x, y)
    torch.testing.assert_close(f(x, y), blend(x.sin(), y).sum())
    assert f.last_backend == KERNELS and len(f.last_entry.report.kernels) == 2


@pytest.mark.parametrize("backend", ["interpret", "torch", "cpp"])
def test_clamp_passes_no_gradient_to_a_nan(backend):
    """Eager's clamp backward is ``where(min <= x <= max, grad, 0)``: a NaN input gets 0, while its
    value stays NaN. Ours passed the gradient through the NaN (the fuzz's seed 3049: log of a
    negative number, then clamp_)."""
    from runtime import cpp_build
    if backend == "cpp" and not cpp_build.available()[0]:
        pytest.skip("no working C++ compiler here")
    fns = {"clamp": lambda x: torch.log(x).clamp(-1, 1) * 3,
           "clamp_min": lambda x: torch.log(x).clamp_min(-1) * 3,
           "clamp_max": lambda x: torch.log(x).clamp_max(1) * 3,
           "clamp_": lambda x: torch.log(x).clamp_(-1, 1) * 3}
    x = torch.tensor([[-0.5, 0.2, 4.0], [float("nan"), 1.0, -2.0]], dtype=torch.float64)
    for name, fn in fns.items():
        compiled = compiler.compile(fn, backend=backend)
        for _ in range(2):   # the recording call, then a replay
            a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
            got, want = compiled(a), fn(b)
            torch.testing.assert_close(got, want, equal_nan=True)
            got.sum().backward()
            want.sum().backward()
            torch.testing.assert_close(a.grad, b.grad, equal_nan=True, msg=name)
        assert compiled.stats["kernel_launches"] > 0 and compiled.stats["divergences"] == 0, name
