"""Regressions found by the autograd-API fuzzer (tests/fuzz_api, issue 32), each as a plain test:
compiled (recording, then replays through the kernels) against eager on the same inputs, with every
hook call logged and compared."""

import pytest
import torch

import compiler


LOG: list = []  # (hook name, its gradient) per hook call, in order


def _run(fn, make, calls=3, backend="interpret"):
    """``fn`` eagerly and compiled on ``make()``'s inputs, ``calls`` times: equal results and hook
    logs (``LOG``). Returns the compiled function."""
    compiled = compiler.compile(fn, backend=backend)
    for call in range(calls):
        torch.manual_seed(call)
        LOG.clear()
        want = fn(*make())
        want_log = list(LOG)
        torch.manual_seed(call)
        LOG.clear()
        got = compiled(*make())
        got_log = list(LOG)
        assert [name for name, _ in got_log] == [name for name, _ in want_log], (call, got_log, want_log)
        for (_, a), (_, b) in zip(got_log, want_log):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b)
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b)
    assert compiled.stats["replays"] == calls - 1 and compiled.stats["divergences"] == 0, compiled.stats
    return compiled


def _leaves(*shapes):
    return lambda: [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in shapes]


def _note(name):
    return lambda g: LOG.append((name, None if g is None else g.detach().clone()))


def test_a_hook_registered_after_the_only_use_sees_the_whole_gradient():
    def f(x):
        y = x * x
        z = torch.sin(y)
        y.register_hook(_note("y"))
        z.sum().backward()
        return (x.grad.clone(),)
    compiled = _run(f, _leaves((3,)))
    assert compiled.stats["kernel_launches"] > 0


def test_retain_grad_between_two_uses():
    def f(x):
        v0 = torch.relu(x)
        v1 = x + v0
        v0.retain_grad()
        loss = ((v1 + v0) ** 2).sum()
        loss.backward()
        return v0.grad, x.grad.clone()
    _run(f, _leaves((4, 3)))


def test_hooks_the_loss_does_not_reach_are_not_called():
    def f(x0, x1):
        x0.register_hook(_note("leaf"))
        x0.register_post_accumulate_grad_hook(lambda p: LOG.append(("accumulated", p.grad)))
        torch.sin(x0)  # (dead: x0 reaches no output of the region)
        b = torch.exp(x1)
        a2 = torch.cos(x1)
        a2.register_hook(_note("intermediate"))
        loss = (b * b).sum()
        loss.backward()
        return x1.grad.clone(), a2
    _run(f, _leaves((3,), (3,)))


def test_hooks_of_a_leaf_read_only_by_outputs_the_loss_does_not_reach():
    def f(x0, x1):
        x0.register_hook(_note("leaf"))
        a = torch.sin(x0)
        b = torch.exp(x1)
        loss = (b * b).sum() + a.detach().sum()  # (a is an output of the region, off the loss's graph)
        loss.backward()
        return (x1.grad.clone(),)
    _run(f, _leaves((3,), (3,)))


def test_a_region_making_values_on_and_off_the_losss_path_connects_each_to_its_own_inputs():
    """API fuzz seed 920: the layer's output (off the loss's path) and a value on it come from one
    region; the layer's bias hook is not called (one Node per output group)."""
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2).double()
    m.bias.register_hook(_note("bias"))

    def f(x0, x1):
        v0 = x1 * x0
        v1 = m(v0)
        v3 = x0 + v0
        v5 = v3.t()
        loss = (v5 * v5).sum()
        loss.backward()
        return x0.grad.clone(), v1.detach(), m.bias.grad
    compiled = _run(f, lambda: [torch.randn(2, 3, dtype=torch.float64, requires_grad=True),
                                torch.randn((), dtype=torch.float64)])
    assert compiled.stats["kernel_launches"] > 0


def test_backward_with_inputs_off_the_path_calls_no_hook():
    def f(x0, x1):
        a = torch.exp(x0)
        b = torch.sin(x1)
        a.register_hook(_note("a"))
        loss = (a * a).sum()
        loss.backward(inputs=[b])
        return (b.grad,)
    _run(f, _leaves((4,), (4,)))


def test_a_second_backward_through_sums_runs_as_in_eager():
    def f(x):
        loss = x.sum(-1).sum()
        loss.backward()
        loss.backward()
        return (x.grad.clone(),)
    _run(f, _leaves((3, 1)))


def test_an_inference_tensor_read_by_a_region_that_recomputes_from_it():
    def f(x0, x1):
        with torch.inference_mode():
            v = x1 * 2
        d = v - torch.tanh(x0)
        loss = (d * d).sum()
        loss.backward()
        return loss.detach(), x0.grad.clone()
    compiled = _run(f, lambda: [torch.randn(4, 3, requires_grad=True), torch.randn(4, 3)])
    assert compiled.stats["kernel_launches"] > 0


@pytest.mark.allows_eager("an in-place write through a view whose base is outside its region runs eagerly (a "
                          "deliberate fallback)")
def test_a_view_output_of_a_region_written_in_place_later():
    torch.manual_seed(0)
    m = torch.nn.Linear(2, 3)

    def f(x):
        v0 = m(x)  # (a 3-d view of the 2-d matmul's result)
        v1 = v0.sum(-1)
        v1.retain_grad()
        v0.mul_(2)
        loss = (v1 * v0.sum(-1)).sum()
        loss.backward()
        return v1.grad, x.grad.clone(), v0.detach()
    _run(f, lambda: [torch.randn(4, 2, 2, requires_grad=True)])


@pytest.mark.parametrize("hooks", ["identity", "save_on_cpu"])
def test_a_value_saved_under_hooks_and_written_in_place_reads_as_eagers(hooks):
    """Eager's backward reads the written value (no version check under hooks: fuzz seeds 687,
    7551); the op that saved it runs eagerly, so ours does too."""
    def scope():
        if hooks == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu()
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    def f(x):
        with scope():
            y = torch.tanh(x)
            p = torch.softmax(x * 3, dim=-1)
        y.mul_(2)
        p.mul_(2)
        ((y * y).sum() + p.sum()).backward()
        return x.grad.clone(), y.detach()
    compiled = _run(f, _leaves((4,)))
    assert compiled.stats["kernel_launches"] > 0


def test_a_second_backward_through_one_output_group_of_a_region_that_saves_for_another():
    """API fuzz seed 7312: the loss's path (a difference, a mean) saves nothing in eager, so its
    second backward runs; the region also makes a layer's output, whose Node saves."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(1, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3)).double()

    def f(x0, x1):
        v0 = x0 - x0 + 1
        v1 = m(x1)
        v1.register_hook(_note("v1"))
        loss = v0.mean()
        loss.backward()
        loss.backward()
        return x0.grad.clone(), v1.detach()
    _run(f, _leaves((1,), (1,)))


def test_double_backward_through_output_groups():
    def f(x0, x1, w):
        a = (x0 * x0).sin().sum()  # depends on x0
        b = (x1 * w).exp()         # on x1 and w: a Node of its own
        g0, = torch.autograd.grad(a, x0, create_graph=True)
        (g0.pow(2).sum() + b.sum()).backward()
        return x0.grad.clone(), x1.grad.clone(), w.grad.clone(), b.detach()
    compiled = _run(f, _leaves((3,), (3,), (3,)))
    assert compiled.stats["kernel_launches"] > 0
    groups = [r.compiled.output_groups for r in compiled.last_entry.trace.regions if r.compiled is not None]
    assert any(groups), groups


def test_an_inference_tensor_read_by_a_region_of_output_groups_under_hooks():
    """API fuzz seed 2581: a region of two output groups read an inference tensor that needs no
    gradient; handed to a group's Node as a detached alias, it no longer said it was one, and
    saving it raised 'Inference tensors cannot be saved for backward'."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)).double()

    def f(x0, x2):
        with torch.inference_mode():
            v0 = x0 * x0
        v2 = v0 * v0
        v3 = x2.exp()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            v4 = m(v2)
        loss = v4.sum() + v3.sum()
        return torch.autograd.grad(loss, inputs=[x2], allow_unused=True)[0], v4.detach()
    _run(f, lambda: [torch.randn(2, dtype=torch.float64), torch.randn(3, dtype=torch.float64, requires_grad=True)])


def test_an_input_relu_read_then_written_in_place():
    def f(x, v0):
        v2 = torch.relu(v0)
        v0.mul_(2)
        v5 = v0 - v2
        (v5 * v5).sum().backward()
        return (x.grad.clone(),)

    def make():
        x = torch.randn(4, requires_grad=True)
        return [x, x * 2]
    # (API fuzz seed 687: our relu's backward reads its input, eager's its result; the forward now
    # saves a copy of the input for it, and eager's backward runs after the write, as ours)
    compiled = _run(f, make)
    assert compiled.stats["kernel_launches"] > 0


def test_an_input_eager_saved_then_written_in_place_is_eager_error():
    def f(v0):
        v2 = torch.sin(v0)  # eager's sin saves its input: the write below is its error at backward
        v0.mul_(2)
        return v0 - v2

    compiled = compiler.compile(f, backend="interpret")
    for _ in range(3):
        for fn in (f, compiled):
            x = torch.randn(4, requires_grad=True)
            out = fn(x * 2)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.sum().backward()
    assert compiled.stats["replays"] == 2 and compiled.stats["kernel_launches"] > 0, compiled.stats


@pytest.mark.allows_eager("the write into the layer's output runs eagerly: its base is a buffer inside ATen's "
                          "linear, which the recording never sees")
@pytest.mark.parametrize("shape", [(3,), (2, 2, 3)], ids=["1-d", "3-d"])
def test_a_layer_output_written_in_place_is_a_view_as_eager(shape):
    # (API fuzz seed 9544) eager's linear output is a view of its matmul's buffer: mul_ on it makes
    # CopySlices, and the regenerated Node's hooks get the buffer's gradient
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 4).double()

    def f(x):
        v = layer(torch.sin(x))
        v.retain_grad()  # (ends the region: the write is in the next one)
        v.mul_(2)
        v.grad_fn.register_hook(lambda grad_in, grad_out: LOG.append(("node", grad_in[0].detach().clone())))
        return v

    compiled = compiler.compile(f, backend="interpret")
    for call in range(3):
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        results = []
        for fn in (f, compiled):
            LOG.clear()
            out = fn(x)
            (out * out).sum().backward()
            results.append((type(out.grad_fn).__name__, out._base is not None, [g for _, g in LOG], x.grad.clone()))
            x.grad = None
        (want_fn, want_view, want_log, want_grad), (got_fn, got_view, got_log, got_grad) = results
        assert (got_fn, got_view) == (want_fn, want_view)
        assert [g.shape for g in got_log] == [g.shape for g in want_log]
        for a, b in zip(got_log, want_log):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(got_grad, want_grad)
    assert compiled.stats["replays"] == 2 and compiled.stats["kernel_launches"] > 0, compiled.stats
