"""What the replay leaves unchecked to cost less, and that it stays right: an optimizer's
zero_grad() (its p.grad reads and writes run as they are), the backend chosen once per device
type, the CPU path's kernels calling PyTorch directly."""

import copy

import pytest
import torch
import torch.nn.functional as F

import compiler
from runtime import backends
from runtime import replay as replay_module
from tests.training import train_step


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _sgd_twins():
    """A model and its copy, an SGD optimizer on each, a batch: a compiled step beside eager's."""
    model = _model()
    reference = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    return model, reference, opt, ref_opt, torch.randn(16, 4), torch.randn(16, 1)


def _checked_calls(monkeypatch) -> list:
    """The names of the calls the replay mode checks (fast path or full), as they come."""
    from runtime.torch_functions import function_name

    seen = []
    for name in ("_replay_flat", "_replay"):
        original = getattr(replay_module.Replay, name)

        def checking(self, rec_or_func, *rest, _original=original, _name=name):
            func = rest[0] if _name == "_replay_flat" else rec_or_func
            seen.append(function_name(func))
            return _original(self, rec_or_func, *rest)
        monkeypatch.setattr(replay_module.Replay, name, checking)
    return seen


def test_zero_grad_runs_unchecked_and_leaves_eagers_gradients(monkeypatch):
    model, reference = _model(), None
    reference = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    step = train_step

    compiled = compiler.compile(step, backend="interpret")
    for _ in range(3):
        torch.testing.assert_close(compiled(model, opt, x, y), step(reference, ref_opt, x, y))
    trace = compiled.last_entry.trace
    spans = trace.zero_grad_spans()
    assert len(spans) == 1
    start, end = next(iter(spans.items()))
    assert end - start - 1 == 2 * len(list(model.parameters()))  # a read and a write per parameter

    checked = _checked_calls(monkeypatch)
    replays = compiled.stats["replays"]
    torch.testing.assert_close(compiled(model, opt, x, y), step(reference, ref_opt, x, y))
    assert compiled.stats["replays"] == replays + 1 and compiled.last_backend == "interpret"
    # the range around zero_grad is checked, its p.grad reads and writes are not
    assert checked.count("_record_function_enter_new") == 2 and "Tensor.backward" in checked
    assert not [name for name in checked if name.startswith("Tensor.grad")], checked
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad is None and q.grad is None
        torch.testing.assert_close(p, q)


def test_zero_grad_keeping_the_gradients_is_checked_call_by_call():
    """zero_grad(set_to_none=False) zeroes each gradient in place: not a span run unchecked."""
    model = _model()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def step(model, opt, x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    compiled = compiler.compile(step, backend="interpret")
    for _ in range(4):
        torch.testing.assert_close(compiled(model, opt, x, y), step(reference, ref_opt, x, y))
    assert compiled.last_entry.trace.zero_grad_spans() == {}
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
        assert not p.grad.any()


class _LoggingSGD(torch.optim.SGD):
    """An optimizer whose zero_grad() makes another torch call when asked: its recorded range
    held only p.grad reads and writes."""
    extra = False

    def zero_grad(self, set_to_none=True):
        with torch.autograd.profiler.record_function(self._zero_grad_profile_name):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad = None
            if self.extra:
                self.norm_seen = torch.ones(()) * 2


@pytest.mark.allows_eager("its SGD subclass's step runs eagerly (only the optimizers themselves are fused)")
def test_a_zero_grad_runs_unwatched_as_an_optimizer_step_does():
    """Inside a recorded zero_grad's range the replay's mode is off the stack (as inside an
    optimizer step): a call the recording did not make there runs as it is, on real tensors,
    and the replay goes on after the range."""
    model = _model()
    reference = copy.deepcopy(model)
    opt, ref_opt = _LoggingSGD(model.parameters(), lr=0.1), _LoggingSGD(reference.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def step(model, opt, x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss * 1

    compiled = compiler.compile(step, backend="interpret")
    for _ in range(3):
        torch.testing.assert_close(compiled(model, opt, x, y), step(reference, ref_opt, x, y))
    assert len(compiled.last_entry.trace.zero_grad_spans()) == 1
    divergences, replays = compiled.stats["divergences"], compiled.stats["replays"]
    opt.extra = ref_opt.extra = True
    torch.testing.assert_close(compiled(model, opt, x, y), step(reference, ref_opt, x, y))
    assert compiled.stats["divergences"] == divergences and compiled.stats["replays"] == replays + 1
    assert opt.norm_seen.item() == 2.0
    assert torch._C._len_torch_function_stack() == 0  # the mode left the stack with the call
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
        assert p.grad is None


@pytest.mark.allows_eager("a call that departs from the recording after zero_grad leaves it: what it tests")
def test_the_calls_after_an_unwatched_zero_grad_are_checked_again():
    """zero_grad() first, then the forward: the mode is back on the stack at the range's exit,
    so the forward's calls are the recording's (compiled kernels) and a call that departs from
    them leaves the recording with eager's result."""
    model, reference, opt, ref_opt, x, y = _sgd_twins()
    scale = [1.0]

    def step(model, opt, x, y):
        opt.zero_grad()
        out = model(x)
        if scale[0] != 1.0:
            out = out * scale[0]
        loss = F.mse_loss(out, y)
        loss.backward()
        opt.step()
        return loss

    compiled = compiler.compile(step, backend="interpret")
    for _ in range(3):
        torch.testing.assert_close(compiled(model, opt, x, y), step(reference, ref_opt, x, y))
    assert len(compiled.last_entry.trace.zero_grad_spans()) == 1
    launches = compiled.stats["kernel_launches"]
    torch.testing.assert_close(compiled(model, opt, x, y), step(reference, ref_opt, x, y))
    assert compiled.stats["kernel_launches"] > launches  # the forward replayed as kernels
    divergences = compiled.stats["divergences"]
    scale[0] = 0.5
    torch.testing.assert_close(compiled(model, opt, x, y), step(reference, ref_opt, x, y))
    assert compiled.stats["divergences"] == divergences + 1  # the extra multiply was seen
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)


def test_the_cpu_backend_is_chosen_at_a_compiled_functions_first_call(monkeypatch):
    """SYMGRAD_CPU_BACKEND is read when a compiled function first runs on CPU tensors (not on
    every call: an environment lookup costs microseconds); a new compiled function reads it anew."""
    monkeypatch.setenv(backends.CPU_BACKEND_ENV, "torch")
    f = compiler.compile(lambda x: torch.sin(x) * 2)
    x = torch.randn(8)
    f(x)
    f(x)
    assert f.last_backend == "torch"
    monkeypatch.setenv(backends.CPU_BACKEND_ENV, "interpret")
    torch.testing.assert_close(f(x), torch.sin(x) * 2)
    assert f.last_backend == "torch"
    g = compiler.compile(lambda x: torch.sin(x) * 2)
    g(x)
    g(x)
    assert g.last_backend == "interpret"
    assert backends.chosen() == "interpret"  # what the thread builds now is built for its last call's


def test_cpu_path_kernels_store_without_a_helper_call_where_the_dtype_is_known():
    """A float32 kernel's stores are ``.contiguous()`` calls (no ``_store`` helper, no dtype
    conversion); a bfloat16 one, computed in float32, still rounds at its store."""
    from compiler.codegen import torch_kernel

    sources = []
    original = torch_kernel.TorchKernel._load

    def keep(self):
        sources.append(self.source)
        return original(self)

    def run(dtype):
        sources.clear()
        f = compiler.compile(lambda x: (torch.tanh(x) * 3).sum(-1), backend="torch")
        x = torch.randn(4, 8, dtype=dtype)
        f(x)
        torch.testing.assert_close(f(x), (torch.tanh(x) * 3).sum(-1), rtol=2e-2, atol=2e-2)
        return "\n".join(sources)

    torch_kernel.TorchKernel._load = keep
    try:
        float32, bfloat16 = run(torch.float32), run(torch.bfloat16)
    finally:
        torch_kernel.TorchKernel._load = original
    assert ".contiguous()" in float32 and "_store(" not in float32 and ".to(" not in float32
    assert "_store(" in bfloat16


def test_matmul_operand_views_are_written_in_line_where_one_tensor_method_makes_them():
    """An extern's operand views (ExternCall) and a program's output views: a permute, reshape or
    expand is the tensor method in the generated code (a transpose of the last two dims ``.mT``,
    cheaper than ``permute``); a slice still calls the view op."""
    from compiler.ir.ops.views import VIEWS
    from runtime.program import ExternCall, Program, ValueRef, ViewStep

    permute = ViewStep(VIEWS["permute"], (("dims", (1, 0)),))
    rotate = ViewStep(VIEWS["permute"], (("dims", (1, 2, 0)),))
    narrow = ViewStep(VIEWS["slice"], (("dim", 1), ("start", 1), ("step", 1), ("length", 2)))
    call = ExternCall("mm", torch.mm, [ValueRef(0, (permute,)), ValueRef(1, (narrow,))], 2)
    program = Program(num_inputs=2, num_slots=3, steps=[call], outputs=[ValueRef(2, (permute,)), None],
                      frees=[[]])
    a, b = torch.randn(3, 2), torch.randn(3, 4)
    out, none = program.run([a, b])
    torch.testing.assert_close(out, (a.t() @ b[:, 1:3]).t())
    assert none is None
    names = call.direct_call().__code__.co_names
    assert "mT" in names and "fn" in names and any(n.startswith("v1_") for n in names)
    assert "permute" not in names
    rotated = ExternCall("clone", torch.clone, [ValueRef(0, (rotate,))], 1)
    x = torch.randn(2, 3, 4)
    env = [x, None]
    rotated.run(env, torch.device("cpu"))
    torch.testing.assert_close(env[1], x.permute(1, 2, 0))
    assert "permute" in rotated.direct_call().__code__.co_names  # not a transpose: permute itself


def test_explain_without_arguments_reports_the_last_call_and_runs_nothing():
    """explain(compiled) after a training loop: the recording the last call ran, with no extra
    step taken (parameters unchanged) and no recording made; before any call, it records fn()."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    step = train_step

    compiled = compiler.compile(step, backend="interpret")
    for _ in range(3):
        compiled(model, opt, x, y)
    before = [p.detach().clone() for p in model.parameters()]
    stats = dict(compiled.stats)
    report = compiler.explain(compiled)
    assert report is compiled.last_entry.report and report.kernels and report.fallbacks == []
    assert compiled.stats == stats
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)

    no_arguments = compiler.compile(lambda: torch.ones(3).sin().sum(), backend="interpret")
    assert compiler.explain(no_arguments).kernels  # (nothing ran yet: it records fn())


class _Stop(torch.autograd.Function):
    """Passes its input forward and no gradient back (None)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


def test_a_region_given_no_gradient_for_any_output_gives_none():
    """A region keeps its outputs' shapes for zeros only where several outputs take gradients;
    one whose only output gets None back (a Function upstream returned None) gives None, as eager."""
    one = compiler.compile(lambda x: x.sin() * 2, backend="interpret")
    two = compiler.compile(lambda x: (x.sin() * 2, x.cos() * 3), backend="interpret")
    for _ in range(3):
        x, w = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
        (_Stop.apply(one(x)) + w).sum().backward()
        assert x.grad is None and torch.equal(w.grad, torch.ones(4))
        x = torch.randn(4, requires_grad=True)
        a, b = two(x)
        (_Stop.apply(a) + b).sum().backward()  # (a's gradient None, b's defined)
        torch.testing.assert_close(x.grad, -3 * x.detach().sin())
    assert one.stats["replays"] >= 2 and two.stats["replays"] >= 2


@pytest.mark.allows_eager("a call that departs from the recording after the step leaves it: what it tests")
def test_a_steps_and_a_zero_grads_range_exits_are_made_with_the_mode_off(monkeypatch):
    """An optimizer step's and a zero_grad's profiler ranges: each enter is checked as recorded (the
    mode comes off there), each exit is made with the mode still off (``_UnwatchedRange``,
    ``Replay.range_exits``), and the mode is back after it: a call after the step that departs from
    the recording is seen. Under a profiler both ranges still open and close around their work."""
    model, reference, opt, ref_opt, x, y = _sgd_twins()
    scale = [1.0]

    def step(model, opt, x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if scale[0] != 1.0:
            loss = loss * scale[0]
        opt.zero_grad()
        return loss

    compiled = compiler.compile(step, backend="interpret")
    for _ in range(3):
        torch.testing.assert_close(compiled(model, opt, x, y), step(reference, ref_opt, x, y))
    checked = _checked_calls(monkeypatch)
    torch.testing.assert_close(compiled(model, opt, x, y), step(reference, ref_opt, x, y))
    ranges = [name for name in checked if "record_function" in name]
    assert len(ranges) == 2 and all("enter" in name for name in ranges), checked
    assert compiled.stats["optimizer_launches"] >= 2 and torch._C._len_torch_function_stack() == 0

    with torch.profiler.profile() as prof:
        torch.testing.assert_close(compiled(model, opt, x, y), step(reference, ref_opt, x, y))
    found = {}
    for event in prof.events():
        for kind in ("Optimizer.step#SGD", "Optimizer.zero_grad#SGD", "symgrad kernel"):
            if event.name.startswith(kind) and (kind != "symgrad kernel" or "[SGD.step" in event.name):
                found.setdefault(kind, []).append(event.time_range)
    (kernel,) = found["symgrad kernel"]   # (the fused step's)
    steps, zero_grads = found["Optimizer.step#SGD"], found["Optimizer.zero_grad#SGD"]
    assert len(steps) == len(zero_grads) == 2   # (ours and eager's)
    assert sum(r.start <= kernel.start and kernel.end <= r.end for r in steps) == 1
    assert all(r.end > r.start for r in steps + zero_grads)

    divergences = compiled.stats["divergences"]
    scale[0] = 3.0
    torch.testing.assert_close(compiled(model, opt, x, y), step(reference, ref_opt, x, y))
    assert compiled.stats["divergences"] == divergences + 1   # (the multiply after the step was seen)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)


@pytest.mark.allows_eager("a call inside the range that departs from the recording leaves it: what it tests")
def test_a_user_profiler_range_exit_is_made_with_the_mode_off_where_its_calls_were_the_recordings(monkeypatch):
    """A ``record_function`` range of the user's around the model (as DDP's forward has): its calls are
    checked as recorded, and where all of them were made its exit is made with the mode off
    (``Replay.range_exits``), the mode back after it; where a call inside departs, the exit is made as
    usual. Values stay eager's, and under a profiler the range still closes after its work."""
    model = _model()
    reference = copy.deepcopy(model)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    extra = [False]

    def step(model, x, y):
        with torch.autograd.profiler.record_function("the model"):
            out = model(x)
            if extra[0]:
                out = out * 2
        loss = F.mse_loss(out, y)
        loss.backward()
        return loss

    compiled = compiler.compile(step, backend="interpret")
    for _ in range(3):
        torch.testing.assert_close(compiled(model, x, y), step(reference, x, y))
    checked = _checked_calls(monkeypatch)
    torch.testing.assert_close(compiled(model, x, y), step(reference, x, y))
    assert [name for name in checked if "record_function" in name] == ["_record_function_enter_new"], checked
    assert checked[-1] == "Tensor.backward" and torch._C._len_torch_function_stack() == 0

    with torch.profiler.profile() as prof:
        compiled(model, x, y)
    step(reference, x, y)
    (inside,) = [e.time_range for e in prof.events() if e.name.startswith("symgrad") and "forward" in e.name]
    (ranged,) = [e.time_range for e in prof.events() if e.name == "the model"]
    assert ranged.start <= inside.start and inside.end <= ranged.end

    exits = []   # per range exit: whether the replay made it with the mode off
    original = replay_module.Replay.range_exits
    monkeypatch.setattr(replay_module.Replay, "range_exits",
                        lambda self, *args: exits.append(original(self, *args)) or exits[-1])
    extra[0] = True
    divergences = compiled.stats["divergences"]
    torch.testing.assert_close(compiled(model, x, y), step(reference, x, y))
    assert compiled.stats["divergences"] == divergences + 1 and exits == [False]   # (made as usual)
    assert torch._C._len_torch_function_stack() == 0
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
