"""Memory: what a compiled region keeps for backward, and that nothing outlives its step.

Eager PyTorch is the oracle: every gradient is compared with eager's. A compiled function's
first call records (eagerly); the checks here are on later calls, which run the compiled
regions (``compiled_calls``).
"""

import gc
import weakref

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import compiler


def compiled_calls(fn, make_args, calls=2):
    """Call ``compiler.compile(fn)`` once to record, and return it ready to replay."""
    f = compiler.compile(fn)
    for _ in range(calls):
        f(*make_args())
    return f


def block(x, w):
    return (torch.tanh(x @ w) * x.sigmoid()).sum()


def test_input_backward_does_not_read_is_freed_when_dropped():
    # backward of x * 3 + 1 reads nothing of x, nor does the double backward: the region must
    # not keep x (it used to, on ctx, for create_graph)
    f = compiled_calls(lambda x: (x * 3 + 1).sum(), lambda: (torch.randn(64, requires_grad=True).exp(),))
    base = torch.randn(64, requires_grad=True)
    x = base.exp()  # a non-leaf: only the caller holds it
    alive = weakref.ref(x)
    loss = f(x)
    del x
    gc.collect()
    assert alive() is None, "the compiled region kept an input its backward does not read"
    loss.backward()
    torch.testing.assert_close(base.grad, 3 * base.detach().exp())


class PackHooks:
    """Saved-tensor hooks that pack a clone and keep a weak reference to each original."""

    def __init__(self):
        self.originals = []
        self.packed = 0

    def pack(self, t):
        self.originals.append(weakref.ref(t))
        self.packed += 1
        return t.detach().clone(), t.requires_grad

    def unpack(self, packed):
        return packed[0]

    def context(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _args():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=gen).requires_grad_()
    w = torch.randn(16, 16, generator=gen).requires_grad_()
    return x, w


def test_everything_kept_for_backward_goes_through_saved_tensor_hooks():
    f = compiled_calls(block, _args)
    x, w = _args()
    eager_x, eager_w = _args()
    block(eager_x, eager_w).backward()

    hooks = PackHooks()
    with hooks.context():
        loss = f(x, w)
    assert hooks.packed > 0
    gc.collect()
    # the inputs are the caller's; every other original must be gone: only the clones are kept
    held = {id(x), id(w)}
    survivors = [ref() for ref in hooks.originals if ref() is not None and id(ref()) not in held]
    assert not any(t.untyped_storage().data_ptr() not in (x.untyped_storage().data_ptr(),
                                                          w.untyped_storage().data_ptr()) for t in survivors)
    loss.backward()
    torch.testing.assert_close(x.grad, eager_x.grad)
    torch.testing.assert_close(w.grad, eager_w.grad)


def test_intermediate_input_reaches_backward_only_through_the_hooks():
    # x comes from an eager op and backward needs it (x @ w): with cloning hooks the region
    # keeps only the clone, so x itself dies when the caller drops it
    f = compiled_calls(block, _args)
    base, w = _args()
    eager_base, eager_w = _args()
    block(eager_base * 2, eager_w).backward()

    hooks = PackHooks()
    x = base * 2
    alive = weakref.ref(x)
    with hooks.context():
        loss = f(x, w)
    del x
    gc.collect()
    assert alive() is None, "the region kept an input outside the saved-tensor hooks"
    loss.backward()
    torch.testing.assert_close(base.grad, eager_base.grad)
    torch.testing.assert_close(w.grad, eager_w.grad)


def test_double_backward_inputs_go_through_the_hooks():
    f = compiled_calls(lambda x: torch.exp(x).sum(), lambda: (torch.randn(16, requires_grad=True) * 2,))
    base = torch.randn(16, requires_grad=True)
    hooks = PackHooks()
    x = base * 2
    alive = weakref.ref(x)
    with hooks.context():
        loss = f(x)
    del x
    gc.collect()
    assert alive() is None
    (g,) = torch.autograd.grad(loss, base, create_graph=True)
    g.sum().backward()
    expected = torch.exp(base.detach() * 2)
    torch.testing.assert_close(g, 2 * expected)
    torch.testing.assert_close(base.grad, 4 * expected)


@pytest.mark.parametrize("create_graph", [False, True])
def test_save_on_cpu(create_graph):
    f = compiled_calls(block, _args)
    x, w = _args()
    eager_x, eager_w = _args()
    with torch.autograd.graph.save_on_cpu():
        loss = f(x, w)
        expected = block(eager_x, eager_w)
    grads = torch.autograd.grad(loss, (x, w), create_graph=create_graph)
    eager_grads = torch.autograd.grad(expected, (eager_x, eager_w), create_graph=create_graph)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e)
    if create_graph:
        (sum(g.sum() for g in grads)).backward()
        (sum(e.sum() for e in eager_grads)).backward()
        torch.testing.assert_close(x.grad, eager_x.grad)
        torch.testing.assert_close(w.grad, eager_w.grad)


def test_in_place_change_to_an_input_only_double_backward_reads_is_no_error():
    # exp's backward reads its result (an output, saved), not x; the double backward reads x:
    # eager runs a first-order backward after x changes in place, and so must we
    f = compiled_calls(torch.exp, lambda: (torch.randn(16, requires_grad=True) * 2,))
    base = torch.randn(16, requires_grad=True)
    x = base * 2
    out = f(x)
    with torch.no_grad():
        x.add_(1)
    out.backward(torch.ones(16))
    torch.testing.assert_close(base.grad, 2 * torch.exp(base.detach() * 2))


def _training_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, target = torch.randn(16, 32), torch.randn(16, 8)

    def step(model, opt, x, target):
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step, (model, opt, x, target)


def test_nothing_of_one_call_is_alive_when_the_next_starts():
    step, args = _training_step()
    f = compiler.compile(step)
    for _ in range(3):
        f(*args)
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = f(*args)
        del loss
        gc.collect()  # Triton's interpreter leaves a reference cycle holding a launch's arguments
    allocated = sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    assert allocated == 0, f"{allocated} bytes of the call are still allocated after it"


def test_value_read_by_backward_from_an_input_changed_in_place_later_is_saved():
    # hypot(x0, x1)'s backward for x0 is g * x0 / hypot: eager saved the result, so eager's
    # backward runs after x1 (no grad) is changed in place; ours must not recompute it from x1
    # (fuzz seed 3643, "recomputed-from-input-changed-in-place-refused")
    def fn(x0, x1):
        v0 = torch.hypot(x0, x1)
        v1 = x1.masked_fill_(x1 < 0, 0.5)
        return v1, v0

    f = compiler.compile(fn)
    for _ in range(3):
        x0 = torch.randn(1, 1, dtype=torch.float64, requires_grad=True)
        eager_x0 = x0.detach().clone().requires_grad_()
        v1, v0 = f(x0, torch.tensor(-1.0))
        eager_v1, eager_v0 = fn(eager_x0, torch.tensor(-1.0))
        v0.sum().backward()
        eager_v0.sum().backward()
        torch.testing.assert_close(v1, eager_v1)
        torch.testing.assert_close(x0.grad, eager_x0.grad)


@pytest.mark.parametrize("memory", ["balanced", "min"])
def test_memory_policies_match_eager(memory):
    f = compiler.compile(block, memory=memory)
    for _ in range(2):
        x, w = _args()
        eager_x, eager_w = _args()
        f(x, w).backward()
        block(eager_x, eager_w).backward()
        torch.testing.assert_close(x.grad, eager_x.grad)
        torch.testing.assert_close(w.grad, eager_w.grad)


def test_unknown_memory_policy_is_refused():
    with pytest.raises(ValueError, match="balanced"):
        compiler.compile(block, memory="tiny")


def _launches(f):
    """The kernel launches of the regions ``f`` ran last, forward and backward."""
    from runtime.program import KernelLaunch
    regions = [plan.compiled for plan in f.last_entry.trace.regions if plan.compiled is not None]
    programs = [p for r in regions for p in (r.forward, r.backward) if p is not None]
    return [s for p in programs for s in p.steps if isinstance(s, KernelLaunch)]


@pytest.mark.parametrize("transposed", [False, True])
def test_elementwise_output_written_into_a_dying_buffer(transposed):
    # backward of gelu(y) @ w: the GELU gradient is written into the memory of the backward's
    # matmul result that only it reads (an in-place buffer). Read transposed as well (the
    # gradient of y.t() + y), it must not be: other programs of the kernel still read it.
    def fn(x, w):
        y = x @ w
        return (torch.nn.functional.gelu(y.t() + y if transposed else y) @ w).sum()

    def args():
        gen = torch.Generator().manual_seed(2)
        return [(torch.randn(64, 64, generator=gen) / 8).requires_grad_() for _ in range(2)]
    f = compiler.compile(fn)
    for _ in range(3):
        (x, w), (eager_x, eager_w) = args(), args()
        f(x, w).backward()
        fn(eager_x, eager_w).backward()
        torch.testing.assert_close(x.grad, eager_x.grad)
        torch.testing.assert_close(w.grad, eager_w.grad)
    if not transposed:
        assert any(launch.reuse for launch in _launches(f))


def test_a_region_loaded_from_the_region_cache_keeps_its_buffer_reuse(tmp_path, monkeypatch):
    # the compiled-region cache (compiler.reuse.persist) stored kernel launches without ``reuse``: a
    # step compiled in an earlier process allocated every output anew (transformer_step: 30 KB
    # above its fresh peak, over torch.compile's)
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SYMGRAD_REGION_CACHE", "1")

    def fn(x, w):
        return (torch.nn.functional.gelu(x @ w) @ w).sum()

    def reuses():
        f = compiler.compile(fn)
        gen = torch.Generator().manual_seed(2)
        x, w = [(torch.randn(64, 64, generator=gen) / 8).requires_grad_() for _ in range(2)]
        for _ in range(2):
            f(x, w).backward()
        return [launch.reuse for launch in _launches(f)]

    built = reuses()
    assert any(built)
    assert reuses() == built   # the second wrapper loads the region stored by the first
