"""In-place ops inside compiled functions are captured (compiled, not run eagerly), give
eager's values and gradients, and leave the real tensors as eager leaves them: same object,
new value, bumped version counter; tensors changed after the compiled forward raise eager's
error in backward when (and only when) backward needs them. Each behaviour holds on the
recording call (eager by construction) as on replays (``call``)."""

import pytest
import torch

import compiler
from tests.call_modes import CALLS, assert_ran_as, compiled as compile_for
from tests.parity import check_parity, clone_inputs

F64 = torch.float64


def in_place_cases():
    return {
        "add_": lambda x, y: (lambda h: (h.add_(y, alpha=2), h.exp().sum())[1])(x * 2),
        "mul_then_relu_": lambda x, y: (lambda h: (h.mul_(3), h.relu_(), (h * y).sum())[2])(x.sin()),
        "iadd_imul": lambda x, y: (lambda h: (h.__iadd__(y), h.__imul__(2), h.sum())[2])(x.cos()),
        "masked_fill_": lambda x, y: (x * 1).masked_fill_(y < 0, -1.0).sum() + x.masked_fill(x > 0, 0.5).sum(),
        "copy_": lambda x, y: (lambda h: (h.copy_(y * 2), (h * x).sum())[1])(x * 2),
        "relu_inplace_module": lambda x, y: torch.nn.ReLU(inplace=True)(x * y).sum(),
        "sub_div_": lambda x, y: (lambda h: (h.sub_(1.5), h.div_(y.abs() + 1), h.tanh())[2])(x + 0),
        "slice_assign_scalar": lambda x, y: (lambda h: (h.__setitem__((slice(None), 0), 0.0), h.sum())[1])(x * y),
        "slice_assign_tensor": lambda x, y: (lambda h: (h.__setitem__(slice(1, 3), y[:2] * 2),
                                                         (h * h).sum())[1])(x.sin()),
        "row_assign_broadcast": lambda x, y: (lambda h: (h.__setitem__(2, y[0]), h.tanh().sum())[1])(x * 1),
        "strided_slice_assign": lambda x, y: (lambda h: (h.__setitem__((slice(None, None, 2), slice(1, 4)), y[:2, :3]),
                                                          h.exp().sum())[1])(x + 1),
    }


@pytest.mark.parametrize("name", sorted(in_place_cases()))
def test_in_place_ops_are_compiled_with_eager_values_and_gradients(name):
    fn = in_place_cases()[name]
    x = torch.randn(4, 5, dtype=F64, requires_grad=True)
    y = torch.randn(4, 5, dtype=F64, requires_grad=True)
    compiled = check_parity(fn, [x, y])
    assert compiled.last_entry.report.fallbacks == []


@pytest.mark.parametrize("name", sorted(in_place_cases()))
def test_in_place_ops_on_the_recording_call_are_eagers(name):
    """The recording call: values, gradients and version counters exactly eager's."""
    fn = in_place_cases()[name]
    x = torch.randn(4, 5, dtype=F64, requires_grad=True)
    y = torch.randn(4, 5, dtype=F64, requires_grad=True)
    results = []
    for run in (fn, compile_for(fn, "first_call")):
        inputs = clone_inputs([x, y])
        out = run(*inputs)
        out.sum().backward()
        results.append((out.detach(), [t.grad for t in inputs], out._version, type(out.grad_fn).__name__))
    (mine, my_grads, my_version, my_node), (theirs, their_grads, their_version, their_node) = results
    assert torch.equal(mine, theirs) and (my_version, my_node) == (their_version, their_node)
    for g, r in zip(my_grads, their_grads):
        assert (g is None and r is None) or torch.equal(g, r)


@pytest.mark.parametrize("call", CALLS)
def test_input_changed_in_place_is_the_same_object_with_a_new_version(call):
    def f(a, w):
        a.mul_(2)
        return (a * w).sum()
    w = torch.randn(5, dtype=F64, requires_grad=True)
    a, a_ref = torch.randn(5, dtype=F64), None
    a_ref = a.clone()
    compiled = compile_for(f, call, fullgraph=True)
    compiled(a, w)
    f(a_ref, w)
    before, ref_before = a._version, a_ref._version
    out = compiled(a, w)
    expected = f(a_ref, w)
    torch.testing.assert_close(a, a_ref)          # the caller's tensor holds the new value
    assert a._version - before == a_ref._version - ref_before == 1  # ... and its version moved as eager's
    torch.testing.assert_close(out, expected)
    assert_ran_as(compiled, call)


@pytest.mark.parametrize("call", CALLS)
def test_version_counter_moves_once_per_in_place_op_as_in_eager(call):
    def f(a, w):
        a.mul_(2)
        a.add_(1)
        a[0] = 3.0
        return (a * w).sum()
    w = torch.randn(5, dtype=F64, requires_grad=True)
    compiled = compile_for(f, call, fullgraph=True)
    compiled(torch.randn(5, dtype=F64), w)
    a = torch.randn(5, dtype=F64)
    a_ref = a.clone()
    before, ref_before = a._version, a_ref._version
    compiled(a, w)
    f(a_ref, w)
    assert a._version - before == a_ref._version - ref_before == 3
    torch.testing.assert_close(a, a_ref)
    assert_ran_as(compiled, call)


@pytest.mark.parametrize("call", CALLS)
def test_views_of_inputs_changed_in_place_update_their_base(call):
    def f(base, w):
        v = base.view(2, 3)
        v.mul_(w)
        return v.sum()
    w = torch.randn(2, 3, dtype=F64)
    base, base_ref = torch.randn(6, dtype=F64), None
    base_ref = base.clone()
    compiled = compile_for(f, call)
    compiled(base, w)
    f(base_ref, w)
    compiled(base, w)
    f(base_ref, w)
    torch.testing.assert_close(base, base_ref)


@pytest.mark.parametrize("call", CALLS)
def test_modified_after_forward_raises_eagers_error_only_when_needed(call):
    w = torch.randn(3, dtype=F64, requires_grad=True)
    needs_x = compile_for(lambda x, w: (x * w).sum(), call)   # backward reads x
    x = torch.randn(3, dtype=F64)
    needs_x(x, w)
    out = needs_x(x, w)
    with torch.no_grad():
        x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()

    no_need = compile_for(lambda x, w: (x + w).sum(), call)   # backward reads nothing
    x = torch.randn(3, dtype=F64)
    no_need(x, w)
    out = no_need(x, w)
    with torch.no_grad():
        x.add_(1)
    out.backward()  # no error, as in eager


def test_in_place_on_a_leaf_that_requires_grad_raises_eagers_error():
    # (only ever a first call: the recording raises, so nothing is recorded to replay)
    x = torch.randn(3, requires_grad=True)
    compiled = compiler.compile(lambda x: x.add_(1), backend="interpret")
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        compiled(x)


@pytest.mark.parametrize("call", CALLS)
def test_slice_assignment_into_an_input_changes_the_callers_tensor(call):
    def f(x, v):
        x[:, 1] = v
        x[0] *= 2
        return x
    v = torch.randn(3)
    a = torch.randn(3, 4)
    compiled = compile_for(f, call, fullgraph=True)
    compiled(a.clone(), v)
    mine, theirs = a.clone(), a.clone()
    out = compiled(mine, v)
    f(theirs, v)
    assert out is mine                      # returns the caller's tensor, changed in place
    torch.testing.assert_close(mine, theirs)
    assert_ran_as(compiled, call)


@pytest.mark.parametrize("call", CALLS)
def test_activation_in_place_given_positionally_changes_the_input(call):
    """F.leaky_relu(x, slope, True): in place, as eager, whether inplace is named or not."""
    f = compile_for(lambda x: torch.nn.functional.leaky_relu(x, 0.2, True).sum(), call)
    base = torch.randn(6)
    for _ in range(2):
        x = base.clone()
        f(x)
        torch.testing.assert_close(x, torch.nn.functional.leaky_relu(base, 0.2))
    assert_ran_as(f, call)


def _buffer_cases():
    """Functions that change a tensor that needs no gradient in place (a module's buffer, from
    values taken out of the graph as batch norm's statistics are), some reading its old value
    elsewhere too."""
    return {
        # the new value from a reduction, the old read only there: stored into the buffer itself
        "running_average": lambda x, buf: (buf.mul_(0.9).add_(x.detach().mean(0), alpha=0.1), (x * 2).sum())[1],
        # the old value read by a later kernel of another shape: the write must wait for it
        "read_elsewhere_later": lambda x, buf: (lambda y: (buf.add_(1), (y * x).sum())[1])(x + buf),
        # the old value read at other elements (reversed): not stored in place
        "reversed": lambda x, buf: (buf.copy_(buf.flip(0) * 0.5 + x.detach().sum(0)), x.sum())[1],
        "counter": lambda x, buf: (buf.add_(1), (x * x).sum())[1],
    }


@pytest.mark.parametrize("name", list(_buffer_cases()))
def test_a_buffer_changed_in_place_is_left_as_eager_leaves_it(name):
    fn = _buffer_cases()[name]
    torch.manual_seed(0)
    x = torch.randn(6, 8, requires_grad=True)
    ours_buf = torch.randn(8)   # read from outside (as a module's buffer is)
    eager_buf = ours_buf.clone()
    compiled = compiler.compile(lambda x: fn(x, ours_buf), backend="interpret")
    for _ in range(3):
        address, version = ours_buf.data_ptr(), ours_buf._version
        eager_version = eager_buf._version
        out = compiled(x)
        expected = fn(x, eager_buf)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(ours_buf, eager_buf)
        assert ours_buf.data_ptr() == address and ours_buf._version - version == eager_buf._version - eager_version
    assert compiled.stats["replays"] == 2 and compiled.stats["divergences"] == 0
    # stored into the buffer by its kernel only where the old value is read nowhere else
    stored_in_place = any(getattr(s, "reuse", ()) for s in compiled.last_entry.trace.regions[0].compiled.forward.steps)
    assert stored_in_place == (name in ("running_average", "counter"))


@pytest.mark.allows_eager("a region writing a tensor that shares memory with another input leaves the recording: what "
                          "it tests")
def test_a_buffer_passed_in_as_an_argument_too_is_not_written_early():
    """A buffer the region updates in place (its kernel stores into it) handed to the same call
    as an argument viewing it too: the kernels would read the new value where the recording read
    the old. The replay sees the shared memory and runs that call eagerly: eager's values."""
    buf = torch.randn(8)
    fn = _buffer_cases()["running_average"]

    def f(x, view):
        return fn(x, buf) + (view * 3).sum()
    x = torch.randn(6, 8, requires_grad=True)
    compiled = compiler.compile(f, backend="interpret")
    other = torch.randn(8)
    compiled(x, other)
    compiled(x, other)
    assert compiled.last_entry.trace.regions[0].compiled.donated_inputs
    eager_buf = buf.clone()
    expected = (fn(x, eager_buf) + (eager_buf * 3).sum()).detach()   # (the view is read after the update)
    divergences = compiled.stats["divergences"]
    torch.testing.assert_close(compiled(x, buf[:]), expected)
    torch.testing.assert_close(buf, eager_buf)
    assert compiled.stats["divergences"] == divergences + 1


def test_batch_norms_running_statistics_are_stored_in_place_by_its_kernels():
    """Batch norm's running statistics and num_batches_tracked are stored into the buffers by
    the kernels that compute them: no write-back copy after the region (three a layer before)."""
    from benchmarks import measure

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    x = torch.randn(4, 3, 8, 8)
    compiled = compiler.compile(lambda m, x: (m(x) ** 2).mean(), backend="interpret")
    compiled(model, x)
    donated = [s for s in compiled.last_entry.trace.regions[0].compiled.forward.steps if getattr(s, "reuse", ())]
    assert len(donated) == 2   # the counter's kernel; the statistics' (both running statistics)
    with measure.kernels_stubbed(), torch.profiler.profile() as prof:
        compiled(model, x)
    assert compiled.stats["replays"] == 1
    assert [e.name for e in prof.events() if e.name == "aten::copy_"] == []


@pytest.mark.parametrize("backend", ["interpret", "torch"])
def test_batch_norms_running_statistics_keep_their_version_as_eagers_operator_does(backend):
    """Eager's batch norm writes its running statistics inside the operator: their version counters
    do not move (num_batches_tracked's `+= 1` is an in-place op: one bump). Ours move as eager's,
    on both CPU paths (kernels storing in place, or a write-back copy), with eager's values."""
    def versions(bn):
        return bn.running_mean._version, bn.running_var._version, bn.num_batches_tracked._version

    x = torch.randn(4, 3, 8, 8)
    runs = []
    for fn in (None, compiler.compile(lambda m, x: m(x).square().mean(), backend=backend)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8))
        step = fn or (lambda m, x: m(x).square().mean())
        start, moved = versions(model[1]), []
        for _ in range(3):
            step(model, x).backward()
            moved.append(tuple(b - a for a, b in zip(start, versions(model[1]))))
        runs.append((moved, model[1].running_mean.clone(), model[1].running_var.clone()))
        if fn is not None:
            assert fn.stats["replays"] == 2
    (eager, eager_mean, eager_var), (ours, mean, var) = runs
    assert ours == eager == [(0, 0, 1), (0, 0, 2), (0, 0, 3)]
    torch.testing.assert_close(mean, eager_mean)
    torch.testing.assert_close(var, eager_var)
