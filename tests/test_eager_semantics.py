"""Eager autograd semantics kept under compile: saved tensors and their hooks, grad modes,
graph retention, custom autograd.Functions, non-deterministic ops, threads. Each check
runs the same code eagerly and compiled (interpreter backend) and expects the same
results and the same errors, on the recording call and on replays (``call``)."""

import gc
import threading
import weakref

import pytest
import torch

import compiler
from tests.call_modes import CALLS, assert_ran_as, compiled

F64 = torch.float64


def warm(fn, *args):
    """Call once (the recording) so later calls run compiled (or record again: "first_call")."""
    fn(*args)
    return fn


@pytest.fixture(params=CALLS)
def call(request):
    return request.param


# -- saved tensors ------------------------------------------------------------------------

def test_saved_tensor_hooks_pack_once_per_saved_tensor_and_unpack_when_needed(call):
    x = torch.randn(8, dtype=F64, requires_grad=True)
    w = torch.randn(8, dtype=F64, requires_grad=True)
    f = warm(compiled(lambda x, w: (x.sin() * w).sum(), call), x, w)
    packed, unpacked = [], []

    def pack(t):
        packed.append(t.shape)
        return ("box", t.clone())

    def unpack(box):
        unpacked.append(box[1].shape)
        return box[1] * 1  # the unpacked value is the one used

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = f(x, w)
    assert len(packed) >= 1 and all(s == (8,) for s in packed)
    assert unpacked == []
    out.backward()
    assert len(unpacked) == len(packed)  # each saved tensor unpacked once by this backward
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (x.sin() * w).sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


def test_unpacked_value_is_what_backward_uses(call):
    x = torch.randn(5, dtype=F64, requires_grad=True)
    f = warm(compiled(lambda x: (x * x).sum(), call), x)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: torch.zeros_like(t)):
        out = f(x)
    out.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))  # eager gives zeros too
    x2 = x.detach().clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: torch.zeros_like(t)):
        (x2 * x2).sum().backward()
    assert torch.equal(x2.grad, x.grad)


def test_save_on_cpu(call):
    x = torch.randn(6, dtype=F64, requires_grad=True)
    f = warm(compiled(lambda x: (x.exp() * x).sum(), call), x)
    with torch.autograd.graph.save_on_cpu():
        out = f(x)
    out.backward()
    torch.testing.assert_close(x.grad, (x.exp() * (x + 1)).detach())


def test_saved_tensors_are_released_no_growth_over_1000_iterations(call):
    x = torch.randn(16, requires_grad=True)
    f = warm(compiled(lambda x: (x.sin() * x).sum(), call), x)
    alive = weakref.WeakSet()

    class Box:
        def __init__(self, t):
            self.t = t

    def pack_box(t):
        box = Box(t)
        alive.add(box)
        return box

    counts = []
    calls = 1000 if call == "replay" else 100  # (a recording compiles: fewer of them)
    with torch.autograd.graph.saved_tensors_hooks(pack_box, lambda b: b.t):
        for i in range(calls):
            f(x).backward()
            if i % (calls // 4) == 0:
                gc.collect()
                counts.append(len(alive))
    gc.collect()
    assert len(alive) == 0 and max(counts) <= 1, counts


# -- grad modes ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "set_grad_enabled_false"])
def test_grad_modes_around_the_call(mode, call):
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
           "set_grad_enabled_false": lambda: torch.set_grad_enabled(False)}[mode]
    x = torch.randn(4, requires_grad=True)
    f = compiled(lambda x: x.sin() * 2, call)
    with ctx():
        f(x)
        out = f(x)
        ref = x.sin() * 2
    assert out.requires_grad == ref.requires_grad == False  # noqa: E712
    assert out.is_inference() == ref.is_inference()
    torch.testing.assert_close(out, ref)
    assert_ran_as(f, call)
    if mode == "inference_mode":  # eager's error for inference tensors saved for backward
        w = torch.randn(4, requires_grad=True)
        with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
            out * w


def test_grad_modes_inside_the_function(call):
    x = torch.randn(4, requires_grad=True)

    def f(x):
        with torch.no_grad():
            a = x * 2
        with torch.enable_grad():
            b = x.exp()
        with torch.set_grad_enabled(False):
            c = x + 1
        return a, b, c
    cf = warm(compiled(f, call), x)
    for mine, theirs in zip(cf(x), f(x)):
        assert mine.requires_grad == theirs.requires_grad
        torch.testing.assert_close(mine, theirs)
    with torch.no_grad():  # enable_grad inside no_grad, as in eager
        cf(x)
        mine, theirs = cf(x), f(x)
    assert [t.requires_grad for t in mine] == [t.requires_grad for t in theirs] == [False, True, False]


def test_frozen_parameters_get_no_grad_and_backward_skips_them(call):
    lin = torch.nn.Linear(4, 3)
    f = compiled(lambda x: lin(x).tanh().sum(), call)
    x = torch.randn(2, 4)
    f(x)
    f(x).backward()
    assert lin.weight.grad is not None
    lin.zero_grad(set_to_none=True)
    lin.weight.requires_grad_(False)
    f(x)
    f(x).backward()
    assert lin.weight.grad is None and lin.bias.grad is not None
    report = compiler.explain(f, x)
    assert "permute" not in str(report.backward_graph).split("return")[-1]  # no weight gradient


def test_eval_and_train_stay_orthogonal(call):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    f = compiled(lambda x: model(x), call)
    x = torch.randn(64, 4)
    model.eval()
    f(x)
    torch.testing.assert_close(f(x), model(x))  # dropout off in eval
    model.train()
    f(x)
    out = f(x)
    assert (out == 0).float().mean() > 0.2  # dropout on in train


# -- graph retention ----------------------------------------------------------------------

def test_second_backward_raises_unless_retain_graph_and_then_accumulates(call):
    x = torch.randn(5, dtype=F64, requires_grad=True)
    f = warm(compiled(lambda x: (x.sin() * x).sum(), call), x)
    out = f(x)
    out.backward()
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        out.backward()
    x.grad = None
    out = f(x)
    out.backward(retain_graph=True)
    once = x.grad.clone()
    out.backward()
    torch.testing.assert_close(x.grad, 2 * once)


def test_inplace_on_a_saved_output_outside_the_loss_is_no_error(call):
    """exp saves its result; a later in-place op on it matters only where exp's backward runs:
    not when the loss reads the other output alone (eager), an error when it reads this one."""
    def f(x):
        return x.exp(), x.sin() * x

    x = torch.randn(4, dtype=F64, requires_grad=True)
    g = warm(compiled(f, call), x)
    for fn in (f, g):
        a, b = fn(x)
        a.mul_(2)
        (gx,) = torch.autograd.grad(b.sum(), x)
        torch.testing.assert_close(gx, x.sin() + x * x.cos())
        a, b = fn(x)
        a.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad((a + b).sum(), x)


# -- custom autograd.Function -------------------------------------------------------------

class ScaleAndFlag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x)
        ctx.set_materialize_grads(False)
        flag = (x > 0).to(x.dtype)
        ctx.mark_non_differentiable(flag)
        return x * 3 + y, flag

    @staticmethod
    def backward(ctx, g, g_flag):
        (x,) = ctx.saved_tensors
        gx = g * 3 if ctx.needs_input_grad[0] else None
        gy = g if ctx.needs_input_grad[1] else None
        return gx, gy


class AddOneInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.add_(1)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        return g * 2


def test_custom_function_inside_a_compiled_function(call):
    def f(x, y):
        out, flag = ScaleAndFlag.apply(x.sin(), y)
        z = AddOneInPlace.apply(out * 1)
        return (z * flag + z.exp()).sum(), flag
    x = torch.randn(6, dtype=F64, requires_grad=True)
    y = torch.randn(6, dtype=F64)   # needs_input_grad[1] is False
    cf = warm(compiled(f, call), x, y)
    out, flag = cf(x, y)
    assert not flag.requires_grad
    out.backward()
    mine = x.grad.clone()
    x.grad = None
    ref, _ = f(x, y)
    ref.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(mine, x.grad)
    assert cf.last_entry.report.fallbacks == []


# -- non-deterministic ops (rule 6 of the notes) ------------------------------------------

@pytest.mark.allows_eager("torch.bernoulli runs eagerly (random ops other than dropout: a listed fallback)")
def test_non_deterministic_op_gradient_as_in_eager(call):
    # bernoulli is not a mathematical function of p: eager gives it no gradient
    p = torch.full((8,), 0.5, requires_grad=True)
    f = compiled(lambda p: torch.bernoulli(p * 1) * 2 + p, call)
    f(p)
    f(p).sum().backward()
    mine = p.grad.clone()
    p.grad = None
    (torch.bernoulli(p * 1) * 2 + p).sum().backward()
    torch.testing.assert_close(mine, p.grad)


# -- threads ------------------------------------------------------------------------------

def test_eight_threads_hogwild_style(call):
    def train_fn(results, i):
        x = torch.full((5, 5), float(i), requires_grad=True)
        y = step(x)
        y.sum().backward()
        results[i] = (y.detach(), x.grad.clone())

    step = compiled(lambda x: (x + 3) * (x + 4) * 0.5, call)  # the notes' example
    step(torch.ones(5, 5, requires_grad=True))            # record once
    results = {}
    threads = [threading.Thread(target=train_fn, args=(results, i)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(8):
        x = torch.full((5, 5), float(i), requires_grad=True)
        y = (x + 3) * (x + 4) * 0.5
        y.sum().backward()
        torch.testing.assert_close(results[i][0], y.detach())
        torch.testing.assert_close(results[i][1], x.grad)
    assert step.stats["divergences"] == 0
    assert step.stats["replays" if call == "replay" else "captures"] >= 8


def test_threads_recording_different_shapes_concurrently():
    f = compiler.compile(lambda x: (x.sin() * 2).sum(), backend="interpret")  # recordings in threads
    errors = []

    def run(n):
        try:
            for _ in range(3):
                x = torch.randn(n, requires_grad=True)
                out = f(x)
                out.backward()
                torch.testing.assert_close(x.grad, 2 * x.detach().cos())
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=run, args=(n,)) for n in range(3, 11)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_shared_graph_between_threads_needs_retain_graph(call):
    x = torch.randn(4, requires_grad=True)
    f = warm(compiled(lambda x: x.exp() * 2, call), x)
    shared = f(x)  # the first part of the graph, shared by the threads
    errors = []

    def run():
        try:
            shared.sum().backward()
        except RuntimeError as e:
            errors.append(str(e))
    for _ in range(2):  # one after the other: the second finds the shared part freed
        t = threading.Thread(target=run)
        t.start()
        t.join()
    assert len(errors) == 1 and "retain_graph=True" in errors[0]


# -- anomaly detection --------------------------------------------------------------------

def test_anomaly_detection_names_the_forward_op(call):
    x = torch.tensor([0.0, 1.0], dtype=F64, requires_grad=True)

    def g(x):
        return (torch.sqrt(x) * 0).sum()  # d/dx = 0 * inf = NaN at x = 0
    c = warm(compiled(g, call), x)

    def backward_error(fn):
        with pytest.warns(UserWarning), torch.autograd.detect_anomaly(check_nan=True):
            out = fn(x)
            with pytest.raises(RuntimeError, match="returned nan values") as err:
                out.backward()
        return str(err.value)
    mine, theirs = backward_error(c), backward_error(g)  # eager raises too
    if call == "first_call":
        assert mine == theirs
    else:  # a compiled backward names the forward op and the user's line
        assert "sqrt" in mine and "test_eager_semantics.py" in mine


# -- views written in place inside a region stay views -------------------------------------

def _break():
    torch.tensor(1.0).item()  # a graph break: the region ends here


def _write_view_of_argument(x):
    e = x[0]
    o = e * 1
    e.copy_(o - 0.5)   # the region writes x through the view e
    _break()
    e.copy_(o + 7)     # eager: e is still a view of x, so x changes again
    return x * 1


def _write_view_of_intermediate(x):
    y = x * 2
    e = y[1:].view(2, 1)
    e.mul_(3)
    _break()
    e.add_(1)          # y changes too
    return y


def _write_view_of_data(x):  # the pattern of torch.autograd.gradcheck's perturbations
    xd = x.data
    e = xd[0]
    o = e * 1
    e.copy_(o - 0.5)
    _break()
    e.copy_(o)
    return (x * 3).sum()


@pytest.mark.parametrize("fn", [_write_view_of_argument, _write_view_of_intermediate, _write_view_of_data])
@pytest.mark.allows_eager("an in-place write through a view whose base is outside its region runs eagerly (a "
                          "deliberate fallback)")
def test_view_written_in_place_in_a_region_still_views_its_base_afterwards(fn, call):
    f = compiled(fn, call)
    for _ in range(3):  # the recording, then replays
        x = torch.arange(1.0, 4.0, dtype=F64, requires_grad=fn is _write_view_of_data)
        expected_x = x.detach().clone().requires_grad_(x.requires_grad)
        expected = fn(expected_x)
        out = f(x)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(x.detach(), expected_x.detach())


@pytest.mark.allows_eager("an in-place write through a view whose base is outside its region runs eagerly (a "
                          "deliberate fallback)")
def test_view_of_a_region_value_written_in_place_after_the_region(call):
    # y and its view e both leave the region: e must be a view of y that PyTorch lets one write
    # in place (not one of several views a custom Function returned), and gradients see the write
    def fn(x):
        y = x * 2
        e = y[1:].view(2, 1)
        _break()
        e.mul_(x[0])
        return y, e

    _check_view_written_after_the_region(fn, call)


def _check_view_written_after_the_region(fn, call):
    """``fn(x)`` returns ``y, e, *rest``, ``e`` a view of ``y`` written in place after a region:
    values, ``rest``, ``e._base is y`` and gradients as eager's, on the recording and replays."""
    f = compiled(fn, call)
    for _ in range(3):  # the recording, then replays
        x = torch.arange(1.0, 4.0, dtype=F64, requires_grad=True)
        expected_x = x.detach().clone().requires_grad_(True)
        expected = fn(expected_x)
        out = f(x)
        torch.testing.assert_close(out[:2], expected[:2])
        assert out[2:] == expected[2:]
        assert out[1]._base is out[0]
        grads = torch.autograd.grad(out[0].sum() + out[1].sum(), x)
        torch.testing.assert_close(grads, torch.autograd.grad(expected[0].sum() + expected[1].sum(), expected_x))


@pytest.mark.allows_eager("an in-place write through a view whose base is outside its region runs eagerly (a "
                          "deliberate fallback)")
def test_view_of_a_value_of_a_split_region_written_in_place_after_the_region(call):
    # as above, in a region rebuilt around an op whose Node the user reads (run eagerly, the
    # region split around it): the rebuilt region must still make e from the real y
    def fn(x):
        z = x.exp()
        y = z * 2
        e = y[1:].view(2, 1)
        _break()
        e.mul_(x[0])
        name = type(z.grad_fn).__name__  # z's Node shown: exp runs eagerly, the region splits
        assert name == "ExpBackward0"
        return y, e, name

    _check_view_written_after_the_region(fn, call)


@pytest.mark.allows_eager("gradcheck's own calls (Tensor.stride, torch.promote_types) run eagerly")
def test_gradcheck_inside_a_compiled_function(call):
    # gradcheck perturbs its input through views of x.data and restores it: every write must
    # reach the input, or the numerical gradient (and the input afterwards) is wrong (the
    # pattern of the view tests above; here the perturbing writes fall back, through .data)
    def f(x):
        ok = torch.autograd.gradcheck(lambda t: (t.sin() * t).sum(), (x,))
        return x.cos(), ok

    cf = compiled(f, call)
    for _ in range(3):  # the recording, then replays
        x = torch.randn(4, dtype=F64, requires_grad=True)
        before = x.detach().clone()
        out, ok = cf(x)
        assert ok
        torch.testing.assert_close(x.detach(), before)
        torch.testing.assert_close(out, before.cos())
