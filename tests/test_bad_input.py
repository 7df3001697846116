"""Bad or unusual input gets eager's answer: eager's values or eager's exception, never
wrong values. Every check runs the compiled function (backend="interpret") more than once,
so both the recording call and replays through the kernels are compared with eager."""

from __future__ import annotations

import pytest
import torch

import compiler


def _outcome(fn, args):
    try:
        return "ok", fn(*args)
    except Exception as e:  # noqa: BLE001
        return "error", f"{type(e).__name__}: {e}"


def assert_like_eager(fn, make_args, calls=3):
    """Compiled ``fn`` on fresh ``make_args()`` equals eager ``fn``: values, inputs after the
    call, or the same exception type and message. Where eager returns, the replays (every call
    after the first) ran the compiled kernels: launches rose, nothing diverged."""
    compiled = compiler.compile(fn, backend="interpret")
    torch.manual_seed(0)
    want_args = make_args()
    want = _outcome(fn, want_args)
    for call in range(calls):
        torch.manual_seed(0)  # the same argument values each call
        args = make_args()
        launches = compiled.stats["kernel_launches"]
        got = _outcome(compiled, args)
        assert got[0] == want[0], (got, want)
        if want[0] == "error":
            assert got[1] == want[1]
            continue
        torch.testing.assert_close(got[1], want[1], equal_nan=True)
        for a, b in zip(args, want_args):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a, b, equal_nan=True)
        if call:  # (the first call records, eagerly)
            assert compiled.stats["kernel_launches"] > launches, f"call {call}: no kernel ran ({compiled.stats})"
            assert compiled.last_backend == "interpret", compiled.last_backend
    assert compiled.stats["divergences"] == 0, compiled.stats
    return compiled


# -- shapes and dtypes that change between calls ---------------------------------------------
def test_other_shapes_and_dtypes_record_again():
    def f(x, y):
        return (torch.sin(x) * y).sum(-1)

    compiled = compiler.compile(f, backend="interpret")
    for shape_x, shape_y, dtype in [((3, 4), (4,), torch.float32), ((3, 4), (4,), torch.float32),
                                    ((2, 5), (5,), torch.float32), ((2, 5), (1,), torch.float64),
                                    ((3, 4), (4,), torch.float64), ((3, 4), (4,), torch.float32)]:
        x, y = torch.randn(shape_x, dtype=dtype), torch.randn(shape_y, dtype=dtype)
        torch.testing.assert_close(compiled(x, y), f(x, y))
    assert compiled.stats["captures"] == 4  # one per (shapes, dtype); repeats replay


def test_shapes_that_stop_broadcasting_raise_eagers_error():
    f = lambda x, y: x + y  # noqa: E731
    compiled = compiler.compile(f, backend="interpret")
    x, y = torch.randn(3, 4), torch.randn(4)
    compiled(x, y), compiled(x, y)
    bad = torch.randn(5)
    with pytest.raises(RuntimeError) as got:
        compiled(x, bad)
    with pytest.raises(RuntimeError) as want:
        f(x, bad)
    assert str(got.value) == str(want.value)
    torch.testing.assert_close(compiled(x, y), f(x, y))  # the good recording still works


def test_mixed_dtypes_promote_as_eager():
    assert_like_eager(lambda x, i: (x * i + i).sum(), lambda: [torch.randn(4), torch.arange(4)])
    assert_like_eager(lambda x, y: x * y, lambda: [torch.randn(4), torch.randn(4, dtype=torch.float64)])


def test_matmul_dtype_mismatch_raises_eagers_error():
    assert_like_eager(lambda a, b: a @ b, lambda: [torch.randn(2, 3), torch.randn(3, 2, dtype=torch.float64)])


@pytest.mark.allows_eager("a call on meta tensors has no backend: it runs eagerly")
def test_other_device_records_again_or_runs_eagerly():
    f = lambda x: torch.exp(x) + 1  # noqa: E731
    compiled = compiler.compile(f)
    x = torch.randn(4)
    compiled(x), compiled(x)
    meta = torch.randn(4, device="meta")
    out = compiled(meta)  # no kernels for "meta": eager's result (shape and dtype only)
    assert out.device.type == "meta" and out.shape == (4,)


# -- NaN and infinities ----------------------------------------------------------------------
SPECIAL = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e38, -1e-45, 3.0])


@pytest.mark.parametrize("fn", [
    lambda x: torch.exp(x) * torch.sigmoid(x),
    lambda x: torch.log(x.abs()) + torch.sqrt(x.abs()),
    lambda x: torch.maximum(x, x.flip(0)) - torch.minimum(x, 0.5 * x),
    lambda x: x.amax(),
    lambda x: torch.softmax(x, 0),
    lambda x: torch.relu(x) * torch.tanh(x),
    lambda x: x.sum() / x.numel(),
    lambda x: torch.where(x > 0, x, -x) ** 2,
], ids=["exp-sigmoid", "log-sqrt", "max-min", "amax", "softmax", "relu-tanh", "mean", "where-pow"])
def test_nan_and_inf_give_eagers_values_and_grads(fn):
    compiled = assert_like_eager(fn, lambda: [SPECIAL.clone()])
    x = SPECIAL.clone().requires_grad_()
    xe = SPECIAL.clone().requires_grad_()
    compiled(x).sum().backward()
    fn(xe).sum().backward()
    torch.testing.assert_close(x.grad, xe.grad, equal_nan=True)


# -- layouts and aliasing ------------------------------------------------------------------------
def test_non_contiguous_and_expanded_inputs():
    f = lambda x, y: (x * 2 + y).sum(0)  # noqa: E731
    assert_like_eager(f, lambda: [torch.randn(4, 3).t(), torch.randn(3, 1).expand(3, 4)])
    assert_like_eager(f, lambda: [torch.randn(3, 8)[:, ::2], torch.randn(1).expand(3, 4)])


def test_same_tensor_passed_twice():
    f = lambda x, y: torch.sin(x) * y  # noqa: E731
    compiled = compiler.compile(f, backend="interpret")
    for _ in range(3):
        x = torch.randn(5, requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        compiled(x, x).sum().backward()
        f(xe, xe).sum().backward()
        torch.testing.assert_close(x.grad, xe.grad)  # both uses' gradients add up


def test_in_place_on_an_argument_passed_twice():
    def f(x, y):
        x.mul_(2)
        return x + y  # y is x: it sees the doubled values

    def make():
        t = torch.arange(4.0)
        return [t, t]
    assert_like_eager(f, make)


@pytest.mark.allows_eager("an in-place op through a view of another argument is a deliberate fallback")
def test_in_place_through_a_view_of_another_argument_runs_eagerly_and_says_why():
    # NOTE: the compiled region cannot write v's base x, which it sees only as another input: the
    # region runs eagerly (eager's values, no kernel), and the reason is reported
    def f(x, v):
        v.add_(1)            # v views x's first row: x changes too
        return x.sum() + v.sum()

    def make():
        x = torch.arange(6.0).reshape(2, 3)
        return [x, x[0]]
    assert any("an in-place op on a view whose base is outside this region" in reason
               for reason in compiler.explain(f, *make()).fallbacks)
    compiled = compiler.compile(f, backend="interpret")
    for _ in range(3):
        args, want = make(), make()
        torch.testing.assert_close(compiled(*args), f(*want))
        torch.testing.assert_close(args[0], want[0])
    assert compiled.stats["kernel_launches"] == 0 and compiled.stats["replays"] == 2, compiled.stats


def test_in_place_on_an_expanded_input_raises_eagers_error():
    def f(x):
        x.add_(1)
        return x

    compiled = assert_like_eager(f, lambda: [torch.randn(1, 3).expand(4, 3)])
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor refers to a single"):
        compiled(torch.randn(1, 3).expand(4, 3))


def test_in_place_on_a_leaf_that_requires_grad_raises_eagers_error():
    def f(x):
        x.mul_(2)
        return x.sum()
    assert_like_eager(f, lambda: [torch.randn(3, requires_grad=True)])


# -- index arithmetic ----------------------------------------------------------------------------
@pytest.mark.parametrize("index", [[2**40], [-(2**40)], [2**31], [-5], [4]])
def test_out_of_range_indices_raise_eagers_error(index):
    def f(x, i):
        return x[i] * 2
    assert_like_eager(f, lambda: [torch.randn(4), torch.tensor(index)])
    assert_like_eager(lambda x, i: torch.gather(x, 0, i), lambda: [torch.randn(4), torch.tensor(index)])


def test_int32_index_values_wrap_as_eager():
    i32 = torch.tensor([2**31 - 1], dtype=torch.int32)
    assert_like_eager(lambda i: (i + 1) * 2, lambda: [i32.clone()])
    assert_like_eager(lambda i: i * 65536 * 65536, lambda: [torch.tensor([3, -7])])


def test_integer_arithmetic_is_exact_beyond_float_precision():
    # integer kernels printed constants as floats: `3.0 * t0` computed int64 values in fp32
    assert_like_eager(lambda i: i * 3 + 7, lambda: [torch.tensor([123456789123, 2**25 + 1, -(2**40) - 3])])
    assert_like_eager(lambda i: (i - 1) * -2, lambda: [torch.tensor([2**30 + 5], dtype=torch.int32)])


def test_large_strides_with_small_iteration_space():
    # a view whose element offsets are large although it has few elements
    base = torch.randn(3, 70000)
    assert_like_eager(lambda x: (x * 2).sum(), lambda: [base[:, ::23333]])


# -- tensors resized, replaced or freed between calls ---------------------------------------------
def test_argument_resized_between_calls():
    f = lambda x: torch.cos(x).sum(0)  # noqa: E731
    compiled = compiler.compile(f, backend="interpret")
    x = torch.randn(4, 3)
    compiled(x), compiled(x)
    x.resize_(2, 5)
    x.copy_(torch.randn(2, 5))
    torch.testing.assert_close(compiled(x), f(x))
    x.set_(torch.randn(6, 2))
    torch.testing.assert_close(compiled(x), f(x))


def test_closed_over_tensor_resized_or_set_between_calls():
    w = torch.randn(3)

    def f(x):
        return x * w

    compiled = compiler.compile(f, backend="interpret")
    x = torch.randn(3)
    compiled(x), compiled(x)
    w.resize_(1)
    w.copy_(torch.tensor([2.0]))
    torch.testing.assert_close(compiled(x), f(x))
    w.set_(torch.randn(3))
    torch.testing.assert_close(compiled(x), f(x))
    w.data = torch.randn(3, dtype=torch.float64)
    torch.testing.assert_close(compiled(x), f(x))


def test_closed_over_tensor_freed_and_replaced():
    holder = {"w": torch.randn(3)}

    def f(x):
        return x + holder["w"]

    compiled = compiler.compile(f, backend="interpret")
    x = torch.randn(3)
    compiled(x), compiled(x)
    holder["w"] = torch.randn(3)  # the old tensor is freed
    torch.testing.assert_close(compiled(x), f(x))


def test_gradient_with_respect_to_an_input_written_in_place():
    def f(x1, x2):
        x2.copy_(x1)
        return x2.norm(), x2

    compiled = compiler.compile(f, backend="interpret")
    compiled(torch.tensor([3.0, 4.0], requires_grad=True), torch.zeros(2))
    results = []
    for fn in (f, compiled):
        x1, x2 = torch.tensor([3.0, 4.0], requires_grad=True), torch.zeros(2)
        norm, y = fn(x1, x2)
        loss = norm * 3 + (y * torch.tensor([1.0, 2.0])).sum()
        results.append(torch.autograd.grad(loss, (x1, x2)))
    torch.testing.assert_close(results[1][0], results[0][0])  # the leaf: right
    torch.testing.assert_close(results[1][1], results[0][1])  # the written input: misses the norm's path
