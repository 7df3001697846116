"""Every op of the foundation, float32 and float64: value and gradient parity with eager,
through the generated Triton kernels (interpreter), forward and backward."""

import copy

import pytest
import torch
import torch.nn.functional as F

import compiler
from tests.devices import KERNELS, BACKENDS  # noqa: E402  (the CUDA test mode's: tests/devices.py)
from compiler.ir.graph import meta_of
from tests.parity import TOLERANCE as TOL
from tests.parity import check_parity

DTYPES = [torch.float32, torch.float64]


def positive(*shape):
    return lambda dtype: (torch.rand(*shape, dtype=dtype) + 0.5)


def normal(*shape):
    return lambda dtype: torch.randn(*shape, dtype=dtype)


def inside_one(*shape):
    return lambda dtype: torch.rand(*shape, dtype=dtype) * 1.8 - 0.9


def above_one(*shape):
    return lambda dtype: torch.rand(*shape, dtype=dtype) * 3 + 1.1


UNARY = {
    "neg": (lambda x: -x, normal(5, 7)),
    "exp": (torch.exp, normal(5, 7)),
    "log": (torch.log, positive(5, 7)),
    "sqrt": (torch.sqrt, positive(5, 7)),
    "rsqrt": (torch.rsqrt, positive(5, 7)),
    "sin": (torch.sin, normal(5, 7)),
    "cos": (lambda x: x.cos(), normal(5, 7)),
    "tanh": (torch.tanh, normal(5, 7)),
    "sigmoid": (torch.sigmoid, normal(5, 7)),
    "relu": (F.relu, normal(5, 7)),
    "gelu": (F.gelu, normal(5, 7)),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), normal(5, 7)),
    "silu": (F.silu, normal(5, 7)),
    "abs": (torch.abs, normal(5, 7)),
    "pow_scalar": (lambda x: x ** 3, normal(5, 7)),
    "pow_fractional": (lambda x: torch.pow(x, 2.5), positive(5, 7)),
    "rpow": (lambda x: 2.0 ** x, normal(5, 7)),
    "reciprocal": (lambda x: 1 / x, positive(5, 7)),
    "scalar_chain": (lambda x: (x * 3 - 1.5) / 2 + 0.25, normal(5, 7)),
    "rsub": (lambda x: 1 - x, normal(5, 7)),
    "clamp": (lambda x: x.clamp(-0.5, 0.5) + torch.clamp(x, min=0.0) + x.clamp_max(0.25), normal(5, 7)),
    "zeros_like_where": (lambda x: torch.where(x > 0, x, torch.zeros_like(x)), normal(5, 7)),
    "ones_full_like": (lambda x: x * torch.ones_like(x) + torch.full_like(x, 0.5) * x, normal(5, 7)),
    "to_dtype": (lambda x: x.to(torch.float64).sin().to(x.dtype), normal(5, 7)),
    # trigonometric, hyperbolic, exponential and logarithmic relatives
    "tan": (torch.tan, inside_one(5, 7)),
    "asin": (torch.asin, inside_one(5, 7)),
    "acos": (torch.arccos, inside_one(5, 7)),
    "atan": (torch.atan, normal(5, 7)),
    "sinh_cosh": (lambda x: torch.sinh(x) + x.cosh(), normal(5, 7)),
    "asinh": (torch.asinh, normal(5, 7)),
    "acosh": (torch.acosh, above_one(5, 7)),
    "atanh": (torch.atanh, inside_one(5, 7)),
    "log1p_expm1": (lambda x: torch.log1p(x.abs()) + torch.expm1(x), normal(5, 7)),
    "log2_log10_exp2": (lambda x: torch.log2(x) + torch.log10(x) + torch.exp2(x), positive(5, 7)),
    "erf_erfc": (lambda x: torch.erf(x) + torch.special.erfc(x), normal(5, 7)),
    "sign_and_rounding": (lambda x: torch.sign(x) * x + x.floor() + x.ceil() * 2 + torch.round(x * 3) + x.trunc()
                          + x.frac() * x, normal(5, 7)),
    # activations: eager's backward at the boundaries
    "softplus": (lambda x: F.softplus(x) + F.softplus(x * 10, beta=2, threshold=5), normal(5, 7)),
    "leaky_relu": (lambda x: F.leaky_relu(x, 0.2) + F.leaky_relu(torch.where(x > 1, 0.0, x)), normal(5, 7)),
    "elu_selu_celu": (lambda x: F.elu(x) + F.selu(x) + F.celu(x, 0.5), normal(5, 7)),
    "hardtanh_relu6": (lambda x: F.hardtanh(x) + F.relu6(x * 4) + F.hardtanh(x.round()), normal(5, 7)),
    "hardswish": (lambda x: F.hardswish(x * 2) + F.hardswish((x * 2).round()), normal(5, 7)),
    "mish_logsigmoid_softsign": (lambda x: F.mish(x) + F.logsigmoid(x) + F.softsign(x), normal(5, 7)),
    "activation_modules": (lambda x: torch.nn.Sequential(torch.nn.LeakyReLU(), torch.nn.ELU(), torch.nn.Softplus(),
                                                         torch.nn.Mish(), torch.nn.Hardswish())(x), normal(5, 7)),
}

BINARY = {
    "add": (torch.add, (5, 7), (5, 7)),
    "add_alpha": (lambda a, b: torch.add(a, b, alpha=0.5), (5, 7), (5, 7)),
    "sub": (lambda a, b: a - b, (5, 7), (5, 7)),
    "mul": (torch.mul, (5, 7), (5, 7)),
    "div": (lambda a, b: a / (b.abs() + 1), (5, 7), (5, 7)),
    "pow_tensor": (lambda a, b: (a.abs() + 0.5) ** b, (5, 7), (5, 7)),
    "maximum": (torch.maximum, (5, 7), (5, 7)),
    "minimum": (torch.minimum, (5, 7), (5, 7)),
    "broadcast_row": (lambda a, b: a * b, (5, 7), (7,)),
    "broadcast_col": (lambda a, b: a + b, (5, 7), (5, 1)),
    "broadcast_both": (lambda a, b: a * b.exp(), (5, 1), (1, 7)),
    "broadcast_rank": (lambda a, b: a - b, (3, 5, 7), (7,)),
    "where": (lambda a, b: torch.where(a > b, a * 2, b.sin()), (5, 7), (5, 7)),
    "comparison_mask": (lambda a, b: (a >= b) * a + (a < b).to(a.dtype) * b, (5, 7), (5, 7)),
    "atan2_hypot": (lambda a, b: torch.atan2(a, b) + torch.hypot(a, b), (5, 7), (7,)),
    "logaddexp": (lambda a, b: torch.logaddexp(a, b) + torch.logaddexp(a, a), (5, 7), (5, 7)),
    "xlogy": (lambda a, b: torch.xlogy(torch.where(a > 0.5, 0.0, a), b.abs() + 0.1), (5, 7), (5, 7)),
    "lerp": (lambda a, b: torch.lerp(a, b, 0.3) + a.lerp(b, b.sigmoid()), (5, 7), (5, 7)),
    "addcmul_addcdiv": (lambda a, b: torch.addcmul(a, a, b, value=0.5) + a.addcdiv(b, b.abs() + 1, value=2),
                        (5, 7), (7,)),
}

REDUCTIONS = {
    "sum_all": lambda x: x.sum(),
    "sum_dim0": lambda x: x.sum(0),
    "sum_dim1_keepdim": lambda x: x.sum(dim=1, keepdim=True),
    "sum_dims": lambda x: torch.sum(x, dim=(0, 2)),
    "mean_all": lambda x: x.mean(),
    "mean_dim": lambda x: x.mean(-1),
    "mean_of_chain": lambda x: (x.sin() * x).mean(dim=(1,)),
}

STRUCTURAL = {
    "reshape": lambda x: (x.reshape(4, 30).sin() * 2).reshape(-1),
    "view": lambda x: x.view(12, 10).exp(),
    "transpose": lambda x: x.transpose(0, 2).sin(),
    "permute": lambda x: x.permute(2, 0, 1) * 3,
    "expand": lambda x: x[0:1].expand(4, 3, 10) if False else x.sum(0, keepdim=True).expand(6, 3, 10) * 2,
    "flatten_unsqueeze": lambda x: x.flatten(1).unsqueeze(0).squeeze(0).cos(),
    "t_matmul": lambda x: x.reshape(12, 10).t() @ x.reshape(12, 10),
    "view_after_pointwise": lambda x: (x * x).view(3, 40).tanh(),
    "getitem_int_slice": lambda x: x[1, :, 2:8:3].exp() * x[-1, 0, :2],
    "getitem_none_ellipsis": lambda x: (x[..., 0][None] * 2).sum(0),
    "narrow_select": lambda x: x.narrow(2, 1, 4).sin() + x.select(0, 2)[None, :, 1:5],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name, dtype):
    fn, make = UNARY[name]
    x = make(dtype).requires_grad_()
    check_parity(fn, [x], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary(name, dtype):
    fn, sa, sb = BINARY[name]
    a = torch.randn(*sa, dtype=dtype, requires_grad=True)
    b = torch.randn(*sb, dtype=dtype, requires_grad=True)
    check_parity(fn, [a, b], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reduction(name, dtype):
    x = torch.randn(4, 6, 5, dtype=dtype, requires_grad=True)
    check_parity(REDUCTIONS[name], [x], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(STRUCTURAL))
def test_structural(name, dtype):
    x = torch.randn(4, 3, 10, dtype=dtype, requires_grad=True)
    check_parity(STRUCTURAL[name], [x], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matmul_and_linear(dtype):
    x = torch.randn(6, 4, 8, dtype=dtype, requires_grad=True)
    w = torch.randn(5, 8, dtype=dtype, requires_grad=True)
    b = torch.randn(5, dtype=dtype, requires_grad=True)
    check_parity(lambda x, w, b: F.linear(x, w, b).relu().sum(-1), [x, w, b], dtype=dtype)
    m = torch.randn(8, 3, dtype=dtype, requires_grad=True)
    check_parity(lambda x, m: torch.matmul(x, m).tanh(), [x, m], dtype=dtype)
    bm = torch.randn(6, 8, 3, dtype=dtype, requires_grad=True)
    check_parity(lambda x, m: (x @ m).sigmoid(), [x, bm], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss(dtype, reduction):
    a = torch.randn(8, 3, dtype=dtype, requires_grad=True)
    t = torch.randn(8, 3, dtype=dtype)
    check_parity(lambda a, t: F.mse_loss(a, t, reduction=reduction), [a, t], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_modules_forward(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 12),
                                torch.nn.ReLU(), torch.nn.Linear(12, 2)).to(dtype)
    reference = copy.deepcopy(model)
    x = torch.randn(9, 6, dtype=dtype)
    compiled = compiler.compile(lambda x: model(x), backend=KERNELS, fullgraph=True)
    compiled(x)
    model.zero_grad()
    out = compiled(x)
    out.pow(2).sum().backward()
    expected = reference(x)
    expected.pow(2).sum().backward()
    torch.testing.assert_close(out, expected, **TOL[dtype])
    # the parameters are graph inputs reached inside the function: gradients reach them
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL[dtype])
    assert compiled.stats["captures"] == 1 and compiled.stats["kernel_launches"] > 0


def test_gelu_tanh_module():
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    check_parity(lambda x: torch.nn.GELU(approximate="tanh")(x).sum(), [x])


def test_input_without_grad_and_integer_free_args():
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    y = torch.randn(5, 7, dtype=torch.float64)  # no grad: backward computes only x's
    check_parity(lambda x, y, scale: (x * y * scale).sum(), [x, y, 0.5])


def test_hardsigmoid():
    """Eager's hardsigmoid backward scales by 1/6 rounded to float32, even for doubles: the
    compiled gradient (1/6 in full precision) differs from it by ~1e-8 relative."""
    for dtype in DTYPES:
        x = (torch.randn(5, 7, dtype=dtype) * 3).requires_grad_()
        check_parity(lambda x: F.hardsigmoid(x) + F.hardsigmoid(x.round()), [x], dtype=dtype,
                     tol=dict(rtol=1e-7, atol=1e-7) if dtype == torch.float64 else None)


def test_python_scalars_promote_by_kind():
    """1, 1.0 and True are equal (and hash alike) in Python; bool * 3 is int64, bool * 3.0
    float32, whichever the compiler saw first."""
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    fn = lambda x: ((x > 0) * 2.0).to(x.dtype) * x + ((x < 0) * 3).to(x.dtype) + ((x > 0) * True).to(x.dtype)
    compiled = check_parity(fn, [x])
    # (bool * True is a logical and: eager's bool arithmetic is logic)
    dtypes = {n.name: meta_of(n).dtype for n in compiled.last_entry.report.graph.nodes
              if n.name.startswith(("mul", "logical_and"))}
    assert torch.int64 in dtypes.values() and torch.float32 in dtypes.values() and torch.bool in dtypes.values()


def test_noncontiguous_inputs():
    base = torch.randn(7, 5, dtype=torch.float64)
    x = base.t().requires_grad_()  # a transposed leaf: kernels read it through its strides
    assert not x.is_contiguous()
    check_parity(lambda x: (x.sin() * 2).sum(0), [x])


ARANGE = torch.arange(10.0)
TARGET = torch.tensor([1, 0, 9, -100, 4, 4])
LAYER_NORMS = {torch.float32: torch.nn.LayerNorm(10), torch.float64: torch.nn.LayerNorm(10).double()}

NORMS_AND_LOSSES = {
    "amax_max": lambda x, w, b: x.amax(1) * 2 + x.max(),
    "softmax": lambda x, w, b: F.softmax(x, dim=1) * ARANGE.to(x.dtype),
    "log_softmax": lambda x, w, b: x.log_softmax(-1).sum(0),
    "logsumexp": lambda x, w, b: torch.logsumexp(x * w, 1),
    "layer_norm": lambda x, w, b: F.layer_norm(x, (10,), w, b),
    "layer_norm_module": lambda x, w, b: LAYER_NORMS[x.dtype](x) * w,
    "rms_norm": lambda x, w, b: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w,
    "cross_entropy": lambda x, w, b: F.cross_entropy(x * w, TARGET),
    "cross_entropy_sum": lambda x, w, b: F.cross_entropy(x, TARGET, reduction="sum"),
    "cross_entropy_none": lambda x, w, b: F.cross_entropy(x, TARGET.clamp(min=0), reduction="none"),
    "cross_entropy_probabilities": lambda x, w, b: F.cross_entropy(x, F.softmax(b.detach().expand(6, 10), 1)),
    "nll_loss": lambda x, w, b: F.nll_loss(F.log_softmax(x, 1), TARGET),
}
if hasattr(F, "rms_norm"):
    NORMS_AND_LOSSES["rms_norm_functional"] = lambda x, w, b: F.rms_norm(x, (10,), w, eps=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(NORMS_AND_LOSSES))
def test_norms_softmax_and_losses(name, dtype):
    torch.manual_seed(0)
    x = torch.randn(6, 10, dtype=dtype, requires_grad=True)
    w = torch.randn(10, dtype=dtype, requires_grad=True)
    b = torch.randn(10, dtype=dtype, requires_grad=True)
    compiled = check_parity(NORMS_AND_LOSSES[name], [x, w, b], dtype=dtype)
    assert compiled.last_entry.report.fallbacks == []


def test_amax_propagates_nan_and_splits_ties():
    x = torch.tensor([[1.0, 3.0, 3.0], [float("nan"), 0.0, 2.0]], dtype=torch.float64, requires_grad=True)
    check_parity(lambda x: x.amax(1), [x])


CAUSAL = torch.ones(6, 6, dtype=torch.bool).triu(1)

JOIN_AND_SPLIT = {
    "split": lambda x, y: sum(p.sin().sum() * (i + 1) for i, p in enumerate(x.split(3, dim=1))),
    "chunk": lambda x, y: (lambda a, b: a * b)(*x.chunk(2, dim=0)),
    "unbind": lambda x, y: (lambda r: r[0] + r[5] * 2)(x.unbind(0)),
    "cat": lambda x, y: torch.cat([x, y.exp()], dim=1).tanh(),
    "cat_dim0_three": lambda x, y: torch.cat((x[:2], y, x * 2), 0).sum(1),
    "stack": lambda x, y: torch.stack([x, y], dim=1).sigmoid(),
    "tril_triu": lambda x, y: torch.tril(x) + torch.triu(y, diagonal=1),
    "causal_attention_scores": lambda x, y: F.softmax((x @ y.t()).masked_fill(CAUSAL, float("-inf")), -1),
    "inverted_causal_mask": lambda x, y: F.softmax((x @ y.t()).masked_fill(~CAUSAL.logical_not(), float("-inf")), -1),
    "boolean_logic": lambda x, y: torch.where((~(x > 0) & (y < 0.5)) | ((x > y) ^ (y > 1)), x, y * 2)
    + torch.logical_and(x > 0, y > 0) * x + torch.logical_or(x < 0, y < 0) * 3 + torch.logical_xor(x > 0, y > 0),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(JOIN_AND_SPLIT))
def test_split_cat_and_masks(name, dtype):
    torch.manual_seed(0)
    x = torch.randn(6, 8, dtype=dtype, requires_grad=True)
    y = torch.randn(6, 8, dtype=dtype, requires_grad=True)
    compiled = check_parity(JOIN_AND_SPLIT[name], [x, y], dtype=dtype)
    assert compiled.last_entry.report.fallbacks == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("padding_idx", [None, 2, -1])
def test_embedding(dtype, padding_idx):
    """Rows gathered by (repeated) indices; the gradient sums repeats and skips padding_idx."""
    torch.manual_seed(0)
    weight = torch.randn(11, 6, dtype=dtype, requires_grad=True)
    pos = torch.randn(5, 6, dtype=dtype, requires_grad=True)
    idx = torch.tensor([[1, 2, 3, 2, 10], [0, 0, 4, 5, 2]])
    fn = lambda weight, pos: (F.embedding(idx, weight, padding_idx=padding_idx) + pos).sin() * 2
    compiled = check_parity(fn, [weight, pos], dtype=dtype)
    report = compiled.last_entry.report
    assert report.fallbacks == [] and len(report.kernels) == 2  # the gather fused; the scatter-add is PyTorch's


def test_embedding_module_and_its_double_backward():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(11, 6, padding_idx=2).double()
    idx = torch.tensor([[1, 2, 3, 2, 10], [0, 0, 4, 5, 2]])
    check_parity(lambda w: emb(idx).tanh().sum(1), [emb.weight])
    compiled = compiler.compile(lambda w: F.embedding(idx, w).tanh(), backend=KERNELS, fullgraph=True)
    w = torch.randn(11, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(compiled, (w,)) and torch.autograd.gradgradcheck(compiled, (w,))
    assert compiled.stats["replays"] > 0 and compiled.stats["eager_calls"] == 0


@pytest.mark.allows_eager("a fallback with its reason: what it tests")
def test_embedding_options_not_supported_fall_back_with_a_reason():
    idx = torch.tensor([1, 2])
    w = torch.randn(4, 3, requires_grad=True)
    compiled = compiler.compile(lambda w: F.embedding(idx, w, max_norm=1.0).sum(), backend=KERNELS)
    report = compiler.explain(compiled, w.detach().clone().requires_grad_())
    assert any("max_norm" in reason for reason in report.fallbacks)


GATHER_INDEX = torch.randint(0, 8, (6, 5), generator=torch.Generator().manual_seed(0))
GATHER_ROWS = torch.randint(0, 6, (4, 8), generator=torch.Generator().manual_seed(1))
ROWS = torch.tensor([2, 0, 2, 5])
COLUMNS = torch.tensor([3, 0, 3, -1, 5])

GATHERS = {
    "gather": lambda x: torch.gather(x.sin(), 1, GATHER_INDEX) * 2,
    "gather_dim0": lambda x: x.gather(0, GATHER_ROWS[:, 1:]).exp(),
    "index_select": lambda x: torch.index_select(x * 3, 1, ROWS).tanh(),
    "getitem_rows_and_negative_columns": lambda x: x[ROWS].sin() + x[:, COLUMNS].sum(),
    "getitem_2d_index": lambda x: x[torch.stack([ROWS, 5 - ROWS])].cos(),  # index computed in the region
    "getitem_0d_index": lambda x: x[ROWS[1]] * x[..., COLUMNS[3]][:, None],
    "log_softmax_gather": lambda x: -F.log_softmax(x, 1).gather(1, GATHER_INDEX[:, :1]).mean(),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(GATHERS))
def test_gather_index_select_and_tensor_indexing(name, dtype):
    """Indexed loads inside the kernels; repeated indices sum in the gradient (scatter-add)."""
    torch.manual_seed(0)
    x = torch.randn(6, 8, dtype=dtype, requires_grad=True)
    compiled = check_parity(GATHERS[name], [x], dtype=dtype)
    assert compiled.last_entry.report.fallbacks == []


def test_gather_double_backward():
    index = GATHER_INDEX
    compiled = compiler.compile(lambda x: torch.gather(x, 1, index).sin(), backend=KERNELS, fullgraph=True)
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(compiled, (x,)) and torch.autograd.gradgradcheck(compiled, (x,))
    assert compiled.stats["eager_calls"] == 0 and compiled.stats["replays"] > 0


def test_index_out_of_range_raises_as_in_eager():
    compiled = compiler.compile(lambda x, i: x[i].sum() + torch.gather(x, 0, i), backend=KERNELS)
    x = torch.randn(4)
    compiled(x, torch.tensor([0, 3]))
    compiled(x, torch.tensor([0, 3]))
    assert compiled.last_backend == KERNELS
    with pytest.raises(IndexError, match="torch.gather: index -1 is out of bounds"):
        compiled(x, torch.tensor([0, -1]))          # fine for x[i], not for gather
    with pytest.raises(IndexError, match="index 7 is out of bounds"):
        compiled(x, torch.tensor([0, 7]))


def _programs(compiled):
    entry = compiled.last_entry
    return [(phase, program) for region in entry.trace.regions if region.compiled is not None
            for phase, program in (("forward", region.compiled.forward), ("backward", region.compiled.backward))
            if program is not None]


@pytest.mark.parametrize("backend", BACKENDS)
def test_indices_are_checked_in_the_kernel_that_gathers(backend):
    """A forward gather asserts its indices in its own kernel (``tl.device_assert``, as Inductor's
    kernels check indirect indices), not by a reduction over them on the host first; a failed
    assert is still eager's IndexError with the bad index, on either CPU path."""
    from runtime.program import IndexCheck

    compiled = compiler.compile(lambda w, i: (w[i] * 2).sum(), backend=backend)
    w, i = torch.randn(5, 3, requires_grad=True), torch.tensor([[0, 4], [-5, 2]])
    for _ in range(2):
        compiled(w, i).backward()
    programs = _programs(compiled)
    assert [phase for phase, _ in programs] == ["forward", "backward"]
    for phase, program in programs:
        assert not any(isinstance(step, IndexCheck) for step in program.steps)
        asserting = [k for k in program.kernels if "tl.device_assert(" in k.source]
        assert [k.index_checks is not None for k in program.kernels] == [k in asserting for k in program.kernels]
        assert len(asserting) == (1 if phase == "forward" else 0)  # the backward's indices were checked
    for bad in (5, -6):
        with pytest.raises(IndexError, match=f"index {bad} is out of bounds for a dimension of size 5"):
            compiled(w, torch.tensor([[0, bad], [1, 2]]))
    assert compiled.stats["eager_calls"] == 0


def test_an_index_computed_in_the_kernel_is_checked_there_too():
    """Cross entropy's target with ``ignore_index`` masked is computed inline where it is gathered
    with: no buffer holds it to check on the host, the kernel's assert still raises."""
    compiled = compiler.compile(lambda x, t: F.cross_entropy(x, t), backend=KERNELS)
    x = torch.randn(4, 5)
    assert torch.allclose(compiled(x, torch.tensor([0, 1, -100, 4])), F.cross_entropy(x, torch.tensor([0, 1, -100, 4])))
    with pytest.raises(IndexError, match="cross_entropy: index out of bounds for a dimension of size 5"):
        compiled(x, torch.tensor([0, 1, 5, 4]))
    with pytest.raises(IndexError):
        F.cross_entropy(x, torch.tensor([0, 1, 5, 4]))


def test_an_empty_gather_eager_checks_is_checked_on_the_host():
    """``index_select`` of a tensor with no columns gathers nothing, so no kernel runs to check, but
    eager still checks the indices: that check stays on the host."""
    from runtime.program import IndexCheck

    compiled = compiler.compile(lambda x, i: x.index_select(0, i) + 1, backend=KERNELS)
    x = torch.randn(4, 0)
    assert compiled(x, torch.tensor([1, 3])).shape == (2, 0)
    assert compiled(x, torch.tensor([1, 3])).shape == (2, 0)
    assert any(isinstance(step, IndexCheck) for _, program in _programs(compiled) for step in program.steps)
    with pytest.raises(IndexError, match="index 7 is out of bounds"):
        compiled(x, torch.tensor([1, 7]))


def test_a_bad_index_leaves_a_buffer_updated_in_place_as_it_was():
    """A buffer from outside written in place from a gather (``buf.add_(table[idx])``): the kernel
    that checks the indices does not store into the buffer's memory, or its programs before the
    bad index would have written part of it; eager's error leaves the buffer as it was."""
    buf, table = torch.zeros(8192, 4), torch.randn(10, 4)

    def update(idx):
        buf.add_(table[idx])
        return idx + 1
    compiled = compiler.compile(update, backend=KERNELS)
    idx = torch.randint(0, 10, (8192,))
    compiled(idx)
    compiled(idx)
    before, bad = buf.clone(), idx.clone()
    bad[-1] = 99
    with pytest.raises(IndexError, match="index 99 is out of bounds for a dimension of size 10"):
        compiled(bad)
    assert torch.equal(buf, before)
    compiled(idx)
    torch.testing.assert_close(buf, before + table[idx])


def test_a_kernel_that_checks_indices_is_compiled_with_its_asserts():
    """Triton drops ``tl.device_assert`` unless compiled with ``debug``: the launcher of a kernel that
    checks indices asks for it (without Triton's integer-overflow checks), others do not."""
    from runtime.launcher import DirectLauncher

    class Recording:
        def __init__(self):
            self.options = []

        def run(self, *args, **kwargs):
            self.options.append({k: kwargs[k] for k in ("debug", "sanitize_overflow") if k in kwargs})

    fn = Recording()
    DirectLauncher(fn, 4, 128, 1, 4, debug=True)._jit_compile(())
    DirectLauncher(fn, 4, 128, 1, 4)._jit_compile(())
    assert fn.options == [{"debug": True, "sanitize_overflow": False}, {}]


@pytest.mark.allows_eager("a fallback with its reason: what it tests")
def test_indexing_not_compiled_yet_says_why():
    x = torch.randn(6, 8)
    reasons = compiler.explain(lambda x: x[x[:, 0] > 0].sum() + x[ROWS, COLUMNS[:4]].sum(), x).fallbacks
    assert len(reasons) == 1 and "boolean mask" in reasons[0]  # several index tensors compile (aten.index)


MASK_WITH_EMPTY_ROW = torch.rand(5, 6, generator=torch.Generator().manual_seed(2)) > 0.3
MASK_WITH_EMPTY_ROW[2] = False
ADDED_MASK = torch.randn(5, 6, generator=torch.Generator().manual_seed(3))

ATTENTION = {
    "plain": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
    "causal": lambda q, k, v: F.scaled_dot_product_attention(q, k[:, :, :5], v[:, :, :5], is_causal=True),
    "bool_mask_with_an_empty_row": lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=MASK_WITH_EMPTY_ROW),
    "float_mask_and_scale": lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=ADDED_MASK.to(q.dtype), scale=0.3),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_scaled_dot_product_attention(name, dtype):
    """Eager's math backend: masked-out rows give 0 (values and gradients, no NaN)."""
    torch.manual_seed(0)
    q = torch.randn(2, 3, 5, 8, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 3, 6, 8, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 3, 6, 4, dtype=dtype, requires_grad=True)
    compiled = check_parity(ATTENTION[name], [q, k, v], dtype=dtype)
    assert compiled.last_entry.report.fallbacks == []


CONVOLUTIONS = {
    "conv2d_bias_relu": lambda x, w, b: F.relu(F.conv2d(x, w, b, padding=1)),
    "conv2d_stride_dilation": lambda x, w, b: F.conv2d(x.sin(), w, b, stride=2, dilation=(1, 2)).tanh(),
    "conv2d_same": lambda x, w, b: F.conv2d(x, w, None, padding="same").sum((2, 3)),
    "conv2d_groups": lambda x, w, b: F.conv2d(x, w[:3, :1].contiguous(), None, groups=3),
    "conv1d_strided_input": lambda x, w, b: F.conv1d(x.sum(2).transpose(1, 2).contiguous().transpose(1, 2),
                                                     w[:, :, 0], b),
    "batch_norm_eval": lambda x, w, b: F.batch_norm(x, RUNNING_MEAN.to(x.dtype), RUNNING_VAR.to(x.dtype),
                                                    w[:3, 0, 0, 0], b[:3], training=False),
    "batch_norm_batch_statistics": lambda x, w, b: F.batch_norm(x, None, None, w[:3, 0, 0, 0], None, training=True),
}
RUNNING_MEAN, RUNNING_VAR = torch.randn(3), torch.rand(3) + 0.5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(CONVOLUTIONS))
def test_convolution_and_batch_norm(name, dtype):
    """Convolutions run as PyTorch's kernels (cuDNN on GPU), their bias and what follows fuse."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 8, dtype=dtype, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=dtype, requires_grad=True)
    b = torch.randn(4, dtype=dtype, requires_grad=True)
    compiled = check_parity(CONVOLUTIONS[name], [x, w, b], dtype=dtype)
    assert compiled.last_entry.report.fallbacks == []


def test_a_convolutions_two_gradients_are_one_call():
    """The input's and weight's gradients of a convolution come from one ``convolution_backward``
    (as eager's autograd calls it), not one call each: the backward program's extern writes both."""
    from runtime.program import ExternCall

    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 8, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    compiled = check_parity(lambda x, w: F.conv2d(x.sin(), w, padding=1).tanh(), [x, w])
    backward = compiled.last_entry.trace.regions[0].compiled.backward
    calls = [s for s in backward.steps if isinstance(s, ExternCall) and s.name == "conv_backward"]
    assert len(calls) == 1 and len(calls[0].also) == 1
    with torch.profiler.profile() as prof:
        compiled(x, w).sum().backward()
    assert sum(e.name == "aten::convolution_backward" for e in prof.events()) == 1
    w.grad = None
    compiled(x.detach(), w).sum().backward()   # only the weight's gradient: one call, one output
    backward = compiled.last_entry.trace.regions[0].compiled.backward
    calls = [s for s in backward.steps if isinstance(s, ExternCall) and s.name == "conv_backward"]
    assert len(calls) == 1 and calls[0].also == ()
    w_grad = w.grad
    w.grad = None
    F.conv2d(x.detach().sin(), w, padding=1).tanh().sum().backward()
    torch.testing.assert_close(w_grad, w.grad)


@pytest.mark.parametrize("stride", [1, 2])
def test_double_backward_through_a_convolution_matches_eager(stride):
    torch.manual_seed(0)
    x = torch.randn(2, 2, 7, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64, requires_grad=True)

    def penalty(x, w):  # a gradient penalty: second derivatives through both of conv's gradients
        gx, gw = torch.autograd.grad(F.conv2d(x, w, stride=stride, padding=1).tanh().sum(), (x, w),
                                     create_graph=True)
        return gx.pow(2).sum() + gw.pow(2).sum()
    compiled = compiler.compile(penalty, backend=KERNELS, fullgraph=True)
    compiled(x, w)
    ours = torch.autograd.grad(compiled(x, w), (x, w))
    theirs = torch.autograd.grad(penalty(x, w), (x, w))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)


POOLS = {
    "avg_pool2d": lambda x: F.avg_pool2d(x.relu(), 2),
    "avg_pool2d_rectangular": lambda x: F.avg_pool2d(x, (4, 3), stride=(4, 3)),
    "avg_pool1d": lambda x: F.avg_pool1d(x.sum(2), 3),
    "adaptive_avg_pool2d_global": lambda x: F.adaptive_avg_pool2d(x, 1).flatten(1),
    "adaptive_avg_pool2d_module": lambda x: torch.nn.AdaptiveAvgPool2d((4, None))(x) * 2,
    "max_pool2d": lambda x: F.max_pool2d(x, 2),
    "max_pool2d_ties_after_relu": lambda x: F.max_pool2d(x.relu(), 2) + F.max_pool2d(x * 0, 2),
    "max_pool2d_rectangular_module": lambda x: torch.nn.MaxPool2d((2, 3))(x.round()),
    "max_pool1d": lambda x: F.max_pool1d(x.sum(2), 3),
    "max_pool2d_resnet_stem": lambda x: F.max_pool2d(x.relu(), 3, 2, 1),
    "max_pool2d_overlapping_ties": lambda x: F.max_pool2d(x.round(), (3, 2), stride=1),
    "max_pool1d_padded": lambda x: F.max_pool1d(x.sum(2), 3, 1, 1),
    "avg_pool2d_overlapping_padded": lambda x: F.avg_pool2d(x, 3, 2, 1),
    "avg_pool2d_excluding_padding": lambda x: F.avg_pool2d(x, 3, 1, 1, count_include_pad=False),
    "unfold": lambda x: x.unfold(2, 3, 2).sum(-1) * x.unfold(3, 2, 2).sin().mean(),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(POOLS))
def test_pooling(name, dtype):
    """Windows that tile the input: a reshape and one reduction, fused with what feeds them;
    max pooling sends each window's gradient to its first maximum, as eager does at ties."""
    x = torch.randn(2, 3, 8, 6, dtype=dtype, requires_grad=True)
    compiled = check_parity(POOLS[name], [x], dtype=dtype)
    assert compiled.last_entry.report.fallbacks == []
    assert compiled.last_entry.report.fallbacks == []


def test_pooling_with_ceil_mode_and_dilation_compiles():
    # (average pooling whose ceil_mode adds windows fell back until 0811d0a; max pooling with
    # dilation, ceil_mode and return_indices compiles: tests/test_ops_basic_coverage.py)
    x = torch.randn(2, 3, 7, 6, requires_grad=True)
    check_parity(lambda x: F.avg_pool2d(x, 3, ceil_mode=True).sum() + F.max_pool2d(x, 2, dilation=2).sum(), [x])


def test_a_ceil_mode_window_reaching_past_the_padded_input_compiles():
    """With ceil_mode a window may reach past the padded input by less than a stride, and eager keeps
    it (a 2-wide input: 4 elements 2 apart, padding 2, stride 3; a 1-long input, 4 wide, padding 1):
    the binding said eager raises and ran it eagerly (found by the fuzz's pools, seed 124)."""
    x = torch.randn(2, 3, 5, 2, requires_grad=True)
    compiled = check_parity(lambda x: F.max_pool2d(x, (1, 4), (2, 3), (0, 2), dilation=(1, 2), ceil_mode=True)
                            .sum() + F.avg_pool1d(x[..., 0, :1], 4, 2, 1, ceil_mode=True).sum(), [x])
    assert compiled.last_entry.report.fallbacks == []


def test_max_pool_propagates_nan():
    x = torch.tensor([[[[1.0, float("nan")], [3.0, 3.0]]]], requires_grad=True)
    check_parity(lambda x: F.max_pool2d(x, 2), [x])


KL_TARGET = torch.softmax(torch.randn(6, 10, generator=torch.Generator().manual_seed(4)), 1)

STATISTICS_NORMS_AND_LOSSES = {
    "var_std": lambda x, y: x.var(1) + torch.std(x, 0, keepdim=True).sum() + x.var(correction=0)
    + x.std(1, unbiased=False),
    "var_mean_std_mean": lambda x, y: torch.var_mean(x, 1)[0] * torch.std_mean(x, dim=1)[1],
    "norm_vector_norm": lambda x, y: x.norm(dim=1) + torch.linalg.vector_norm(x * torch.where(x > 1, 0.0, 1.0))
    + torch.norm(x),
    "normalize_with_a_zero_vector": lambda x, y: F.normalize(x, dim=1) + F.normalize(x * 0, dim=0),
    "cosine_similarity": lambda x, y: F.cosine_similarity(x, y, dim=1),
    "l1_loss": lambda x, y: F.l1_loss(x, y) + F.l1_loss(x, x.detach(), reduction="sum"),
    "smooth_l1_loss": lambda x, y: F.smooth_l1_loss(x, y) + F.smooth_l1_loss(x, y, beta=0.5, reduction="sum")
    + F.smooth_l1_loss(x, y, beta=0.0),
    "huber_loss": lambda x, y: F.huber_loss(x, y, delta=0.7),
    "binary_cross_entropy_with_logits": lambda x, y: F.binary_cross_entropy_with_logits(x, y.sigmoid())
    + F.binary_cross_entropy_with_logits(x, (y > 0).to(x.dtype), pos_weight=torch.full((10,), 2.0, dtype=x.dtype),
                                         reduction="sum"),
    "kl_div": lambda x, y: F.kl_div(F.log_softmax(x, 1), KL_TARGET.to(x.dtype), reduction="batchmean")
    + F.kl_div(x.log_softmax(1), F.log_softmax(y, 1), reduction="sum", log_target=True),
    "group_norm": lambda x, y: F.group_norm(x.reshape(2, 6, 5), 3, y[0, :6], y[1, :6]),
    "pad_and_crop": lambda x, y: F.pad(x, (1, 2)).sum(0) + F.pad(x, (0, 0, 2, -1), value=3.0).sum(1).sum()
    + F.pad(x, (-2, 1, 1, 1)).sum(),
    "repeat": lambda x, y: x.repeat(2, 1).sin() + x.repeat(1, 2)[:, :10].repeat(2, 1),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(STATISTICS_NORMS_AND_LOSSES))
def test_statistics_norms_and_more_losses(name, dtype):
    torch.manual_seed(0)
    x = torch.randn(6, 10, dtype=dtype, requires_grad=True)
    y = torch.randn(6, 10, dtype=dtype, requires_grad=True)
    compiled = check_parity(STATISTICS_NORMS_AND_LOSSES[name], [x, y], dtype=dtype)
    assert compiled.last_entry.report.fallbacks == []


UPSAMPLING = {
    "interpolate_nearest_scale": lambda x: F.interpolate(x, scale_factor=2).sin(),
    "interpolate_nearest_size": lambda x: F.interpolate(x, size=(8, 15), mode="nearest") * 2,
    "upsample_module": lambda x: torch.nn.Upsample(scale_factor=(3, 1))(x).sum(1),
    "repeat_interleave": lambda x: x.repeat_interleave(2, dim=1)[:, 1::2].exp()
    * torch.repeat_interleave(x, 3)[::3].reshape(2, 3, 4, 5),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(UPSAMPLING))
def test_nearest_upsampling_and_repeat_interleave(name, dtype):
    x = torch.randn(2, 3, 4, 5, dtype=dtype, requires_grad=True)
    compiled = check_parity(UPSAMPLING[name], [x], dtype=dtype)
    assert compiled.last_entry.report.fallbacks == []
