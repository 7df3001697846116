"""The basic ops real model code calls (issue 16): same-device ``Tensor.to``, ``addmm``,
grouped-query attention, ``Tensor.new_*``, ``clone``, ``all``/``any``, ``max``/``min`` with and
without dim, ``argmax``/``argmin``, and the ``if mask.all():`` split. Each compiles whole
(``fullgraph=True``: a fallback raises) and gives eager's values, integer outputs, dtypes and
gradients through the generated kernels (Triton's interpreter)."""

import pytest
import torch
import torch.nn.functional as F

import compiler
from tests.parity import TOLERANCE, clone_inputs


def _flat(out):
    return list(out) if isinstance(out, tuple) else [out]


def _loss(outs):
    """A scalar that reads every floating output that needs a gradient (a seed per element)."""
    total = None
    for i, o in enumerate(outs):
        if o.requires_grad:
            seed = torch.linspace(-1, 2, o.numel(), dtype=o.dtype).reshape(o.shape) + i
            term = (o * seed).sum()
            total = term if total is None else total + term
    return total


def check(fn, *args, tol=None):
    """fn compiled (recorded, then replayed through the kernels) against eager: every output's
    value and dtype, and the gradients of every input that requires one."""
    compiled = compiler.compile(fn, backend="interpret", fullgraph=True)
    eager_args = clone_inputs(args)
    ref = _flat(fn(*eager_args))
    compiled(*clone_inputs(args))                          # the recording
    launches = compiled.stats["kernel_launches"]
    mine_args = clone_inputs(args)
    out = _flat(compiled(*mine_args))                      # the replay
    assert compiled.stats["kernel_launches"] > launches, "no generated kernel ran"
    assert compiled.stats["divergences"] == 0
    assert len(out) == len(ref)
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype and o.shape == r.shape and o.requires_grad == r.requires_grad
        t = tol or TOLERANCE.get(r.dtype, dict(rtol=0, atol=0))
        torch.testing.assert_close(o, r, equal_nan=True, **t)
    ref_loss, loss = _loss(ref), _loss(out)
    if ref_loss is not None:
        ref_loss.backward()
        loss.backward()
        for a, e in zip(mine_args, eager_args):
            if isinstance(a, torch.Tensor) and a.requires_grad:
                torch.testing.assert_close(a.grad, e.grad, equal_nan=True, **(tol or TOLERANCE[e.dtype]))
    assert compiler.explain(fn, *clone_inputs(args)).fallbacks == []
    return compiled


def randn(*shape, dtype=torch.float32, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


DTYPES = [torch.float32, torch.float64]


# ----------------------------------------------------------------------------- clone, to, new_*
@pytest.mark.parametrize("dtype", DTYPES)
def test_clone(dtype):
    def f(x):
        h = x * 3
        return h.clone() * 2, torch.clone(h.t()) + 1, h.clone(memory_format=torch.contiguous_format).sin()
    check(f, randn(4, 5, dtype=dtype))


def test_clone_of_an_input_without_grad():
    check(lambda x, i: x * i.clone(), randn(3, 4), torch.arange(12).reshape(3, 4))


def test_clone_of_a_grad_input_or_an_input_view_compiles():
    # (kept eager until issue 11 fixed the replay of views written in place)
    f = lambda x: x.clone() * 2 + x[0].clone()  # noqa: E731
    check(f, randn(3, 4))
    assert compiler.explain(f, randn(3, 4)).fallbacks == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_to_on_the_same_device(dtype):
    def f(x, other):
        return (x.to(dtype) * 2, x.to("cpu").exp(), x.to(torch.device("cpu"), torch.float64) + 1,
                x.to(other) * 3, x.to(dtype=torch.float32, copy=True), x.to(x.device, non_blocking=True).cos(),
                (x > 0).to(torch.int64))
    check(f, randn(4, 5, dtype=dtype), torch.zeros(2, dtype=torch.float64))


def test_a_real_device_move_is_a_clear_fallback():
    if not torch.cuda.is_available():
        from compiler.capture.bindings.elementwise import _same_device
        from compiler.ir.graph import GraphBuilder
        b = GraphBuilder()
        x = b.placeholder("x", (2,), torch.float32, device=torch.device("cpu"))
        from compiler.capture.bindings.registry import Unsupported
        with pytest.raises(Unsupported, match="between devices"):
            _same_device(x, "cuda")
        _same_device(x, "cpu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_new_ones_zeros_full_empty(dtype):
    def f(x):
        return (x * x.new_ones(4, 5) + x.new_zeros((4, 5)), x.new_full((5,), 2.5) + x,
                x.new_empty(4, 5).fill_(1.0) * x, x.new_ones(3, dtype=torch.int64), x.new_zeros(()))
    check(f, randn(4, 5, dtype=dtype))


# ----------------------------------------------------------------------------- addmm, attention
@pytest.mark.parametrize("dtype", DTYPES)
def test_addmm(dtype):
    def f(b, x, w, c):
        return (torch.addmm(b, x, w), c.addmm(x, w, beta=0.5, alpha=2.0), torch.addmm(c, x, w, beta=0))
    check(f, randn(5, dtype=dtype), randn(3, 4, dtype=dtype), randn(4, 5, dtype=dtype), randn(3, 5, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_attention(dtype, causal):
    q, k, v = randn(2, 4, 5, 8, dtype=dtype), randn(2, 2, 5, 8, dtype=dtype), randn(2, 2, 5, 8, dtype=dtype)
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True), q, k, v)


def test_grouped_query_attention_with_a_mask_and_one_group():
    q, k, v = randn(4, 3, 8), randn(1, 3, 8), randn(1, 3, 8)
    mask = torch.tensor([[True, False, True]] * 3)
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), q, k, v)
    q, k, v = randn(2, 3, 8), randn(2, 3, 8), randn(2, 3, 8)
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), q, k, v)


# ----------------------------------------------------------------------------- all, any
@pytest.mark.parametrize("make", [
    lambda: randn(4, 5, grad=False),
    lambda: torch.tensor([[1.0, float("nan"), 0.0], [2.0, 3.0, 4.0]]),
    lambda: torch.rand(3, 4) > 0.3,
    lambda: torch.randint(0, 3, (3, 4), dtype=torch.uint8),
    lambda: torch.zeros(0, 3),
], ids=["float", "nan", "bool", "uint8", "empty"])
def test_all_and_any(make):
    check(lambda x: (x.all(), x.any(), torch.all(x, 1), x.any(dim=0, keepdim=True), x.all(dim=(0, 1)),
                     (x * 1).sum() + x.any().to(torch.float32)), make())


# ----------------------------------------------------------------------------- max, min, argmax
TIES = torch.tensor([[1.0, 3.0, 3.0, -1.0], [2.0, 2.0, 2.0, 2.0], [0.0, float("nan"), 5.0, float("nan")]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_max_and_min_with_dim(dtype):
    def f(x):
        values, indices = torch.max(x, 1)
        low = x.min(dim=0, keepdim=True)
        return values * 2, indices, low.values.exp(), low.indices, torch.max(x, -1, True)[0]
    check(f, randn(4, 6, dtype=dtype))


def test_max_and_min_with_dim_ties_and_nan_as_eager():
    # ties: the first index and the gradient to it alone (eager's); NaN wins
    check(lambda x: (*torch.max(x, 1), *torch.min(x, 1), *x.max(0)), TIES.clone().requires_grad_())


@pytest.mark.parametrize("dtype", DTYPES)
def test_max_min_of_all_elements_and_of_two_tensors(dtype):
    check(lambda x, y: (torch.max(x), x.min(), torch.max(x, y), x.min(y), torch.amin(x, 1), x.amin()),
          randn(3, 4, dtype=dtype), randn(3, 4, dtype=dtype))
    check(lambda x: (x.max(), x.min(), torch.amin(x, 0)), TIES.clone().requires_grad_())


def test_max_min_of_integers_and_bools():
    i = torch.randint(-50, 50, (4, 5), dtype=torch.int32)
    m = torch.rand(4, 5) > 0.5
    check(lambda i, m: (i.max(), *i.min(1), i.argmax(1), *m.max(0), m.any(1), torch.amax(i, 0)), i, m)


def test_max_with_dim_of_a_0_dim_tensor():
    check(lambda x: (*x.max(0), *torch.min(x, -1, keepdim=True), x.argmax(), x.argmin(0)), randn(()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_argmin(dtype):
    check(lambda x: (x.argmax(), torch.argmin(x), x.argmax(1), x.argmin(dim=0, keepdim=True),
                     torch.argmax(x, keepdim=True), x.max(1).values), randn(4, 6, dtype=dtype))
    check(lambda x: (x.argmax(1), x.argmin(1), x.argmax(), x.argmin()), TIES.clone())


def test_max_with_dim_in_a_training_step_fuses_with_its_neighbours():
    # the values' backward is elementwise (the element at the index): no scatter kernel
    x = randn(8, 16)
    report = compiler.explain(lambda x: (x.max(1).values * x.sum(1)).sum(), x)
    assert report.fallbacks == [] and len(report.kernels) <= 4


# ----------------------------------------------------------------------------- if mask.all():
@pytest.mark.allows_eager("a bool read steers another branch: the replay leaves its recording, what it tests")
def test_a_mask_check_reads_only_the_bool():
    """``if mask.all():`` ends the region at the bool: ``all`` is computed in the region before,
    only ``__bool__`` runs eagerly (a graph break, not an eager op), and what follows is compiled again."""
    def f(x, mask):
        y = torch.sin(x) * 2
        if mask.all():
            y = y + 1
        else:
            y = y.masked_fill(~mask, 0.0)
        return (y * y).sum()

    x, full_mask = randn(4, 6), torch.ones(4, 6, dtype=torch.bool)
    report = compiler.explain(f, x, full_mask)
    assert report.eager_calls == [] and report.fallbacks == []
    assert [b.split(" reads ")[0] for b in report.graph_breaks] == ["Tensor.__bool__"]
    assert len(report.kernels) >= 3  # both regions compiled
    compiled = compiler.compile(f, backend="interpret")
    partial = full_mask.clone()
    partial[1, 2] = False
    for mask in (full_mask, full_mask, full_mask, partial, partial, partial):
        xs, xe = clone_inputs([x])[0], clone_inputs([x])[0]
        out = compiled(xs, mask)
        ref = f(xe, mask)
        out.backward()
        ref.backward()
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(xs.grad, xe.grad)
    assert compiled.stats["eager_calls"] == 0


# ----------------------------------------------------------------------------- max pooling
@pytest.mark.parametrize("dims,shape", [(1, (2, 3, 11)), (2, (2, 3, 9, 10)), (3, (1, 2, 7, 6, 8))])
@pytest.mark.parametrize("options", [dict(kernel_size=3, stride=2, ceil_mode=True),
                                     dict(kernel_size=2, dilation=2, padding=1),
                                     dict(kernel_size=3, stride=2, padding=1, dilation=2, ceil_mode=True,
                                          return_indices=True),
                                     dict(kernel_size=(2,), return_indices=True)],
                         ids=["ceil", "dilation", "all", "indices"])
def test_max_pool_ceil_mode_dilation_and_indices(dims, shape, options):
    pool = getattr(F, f"max_pool{dims}d")
    check(lambda x: pool(x, **options), randn(*shape, dtype=torch.float64))


# ----------------------------------------------------------------------------- x.long(), x.half(), ...
@pytest.mark.parametrize("name", ["half", "bfloat16", "long", "int", "short", "char", "bool", "cfloat", "cdouble"])
def test_dtype_shorthand_casts_compile(name):
    """``x.long()``, ``x.bool()``, ``x.half()``... are casts, as ``x.to(dtype)`` (they fell back)."""
    x = randn(5, 3, dtype=torch.float64).detach() * 4
    if name in ("long", "int", "short", "char", "bool"):
        check(lambda x: getattr(x * 2, name)().to(torch.float64) * 3, x)
    else:
        check(lambda x: (getattr(x * 2, name)() * 3).abs().to(torch.float64), x.requires_grad_(),
              tol=dict(rtol=1e-2, atol=1e-2))
