"""compile(fn, skip_python=True): replays make the recorded torch calls without running fn's
Python (runtime.skip_python), with eager's values; where the promise cannot hold, the checked
replay runs instead and says why."""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook

import compiler
from tests.parity import assert_ran_compiled


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)


def _make_step(counter):
    def train_step(model, opt, x, y):
        counter.append(1)  # Python the replays skip (the promise: nothing the results depend on)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return train_step


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.Adam(p, lr=1e-2),
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
], ids=["adam", "sgd_nesterov"])
def test_replays_skip_the_python_and_match_eager_over_steps(make_opt):
    x, y = _data()
    model, eager_model = _model(), _model()
    opt, eager_opt = make_opt(model.parameters()), make_opt(eager_model.parameters())
    runs = []
    step = compiler.compile(_make_step(runs), skip_python=True)
    eager_step = _make_step([])
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.9 ** i)
    eager_scheduler = torch.optim.lr_scheduler.LambdaLR(eager_opt, lambda i: 0.9 ** i)
    for _ in range(12):
        loss, expected = step(model, opt, x, y), eager_step(eager_model, eager_opt, x, y)
        torch.testing.assert_close(loss, expected)
        assert loss.grad_fn is not None and model[0].weight.grad is None  # zero_grad(set_to_none) made
        scheduler.step()  # (a new lr every step: optimizer.step() runs as its own Python, reading it)
        eager_scheduler.step()
    assert len(runs) <= 2, "the function's Python ran on replays"  # the recording (+ the first step's state)
    assert step.stats["replays"] >= 10 and step.stats["divergences"] == 0
    assert step.stats.get("optimizer_launches", 0) >= 10  # the fused optimizer kernels, through the pre-hook
    assert step.last_entry is not None and step.last_entry.report.kernels  # (explain's view of the last call)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q)
        for key, value in eager_opt.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value)


@pytest.mark.allows_eager("Python takes another path: the replay leaves its recording, what it tests")
def test_a_value_read_into_python_keeps_the_checked_replay_and_says_why(caplog):
    runs = []

    def f(x):
        runs.append(1)
        y = x.sin()
        if y.sum().item() > 0:  # Python decides with a value: the calls after it depend on it
            return y * 2
        return y - 1

    compiled = compiler.compile(f, skip_python=True)
    x = torch.randn(64)
    with caplog.at_level(logging.INFO, logger="compiler"):
        for sign in (1, 1, -1, -1):
            torch.testing.assert_close(compiled(x.abs() * sign), f(x.abs() * sign))
    assert len(runs) == 8  # (4 compiled calls ran their Python, 4 eager)
    assert any("skip_python" in r.getMessage() and "reads a value" in r.getMessage() for r in caplog.records)
    report = compiler.explain(f, x)  # (explain says it too)
    assert "reads a value" in report.skip_python_refusal and "skip_python: its replays run the Python" in str(report)
    assert compiler.explain(lambda x: x.sin().sum(), x).skip_python_refusal is None


def test_a_module_hook_added_after_the_recording_runs_the_python():
    model = _model()
    x = torch.randn(8, 4)
    step = compiler.compile(lambda m, x: m(x).square().mean(), skip_python=True)
    step(model, x)
    step(model, x)
    assert step.stats["replays"] == 1
    seen = []
    handle = model[0].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    try:
        torch.testing.assert_close(step(model, x), model(x).square().mean())
    finally:
        handle.remove()
    assert len(seen) == 2  # the compiled call ran the module's Python (its hook), then eager's call


def test_a_hook_registered_inside_keeps_the_checked_replay():
    grads = []

    def f(x):
        y = x.exp()
        y.register_hook(lambda g: grads.append(g.clone()))
        return y.sum()

    compiled = compiler.compile(f, skip_python=True)
    for _ in range(3):
        x = torch.randn(5, requires_grad=True)
        compiled(x).backward()
        torch.testing.assert_close(grads[-1], torch.ones(5))
    assert len(grads) == 3  # each call's hook ran: the function's Python was not skipped


BRANCH = [True]


def two_paths(x):
    y = x.cos()
    return (y * 3 if BRANCH[0] else y - 3).sum()


@pytest.mark.allows_eager("Python takes another path: the replay leaves its recording, what it tests")
def test_a_key_whose_python_took_another_path_keeps_the_checked_replay(caplog):
    compiled = compiler.compile(two_paths)  # checked replays: they see Python change paths
    x = torch.randn(8)
    for branch in (True, True, False, False, False):
        BRANCH[0] = branch
        torch.testing.assert_close(compiled(x), two_paths(x))
    assert any(e.trace.other_path for variants in compiled.cache.values() for e in variants)
    compiled.skip_python = True  # (as compile(..., skip_python=True) would have it from now on)
    try:
        with caplog.at_level(logging.INFO, logger="compiler"):
            for branch in (True, False, True):
                BRANCH[0] = branch
                torch.testing.assert_close(compiled(x), two_paths(x))  # each path right: Python ran
    finally:
        BRANCH[0] = True
    assert any("another path" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_real_model_code_trains_like_eager_without_its_python(name):
    pytest.importorskip("transformers")
    from tests.test_models_hf import build

    model, batch = build(name)
    model.train()
    eager_model = copy.deepcopy(model)
    runs = []

    def make_step(m, record_runs):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6)

        def step(**batch):
            record_runs.append(1)
            loss = m(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step

    compiled, eager = compiler.compile(make_step(model, runs), skip_python=True), make_step(eager_model, [])
    for _ in range(3):
        torch.testing.assert_close(compiled(**batch), eager(**batch), atol=1e-4, rtol=1e-4)
    assert len(runs) == 1, "the model's Python ran on replays"
    for (key, a), (_, b) in zip(model.state_dict().items(), eager_model.state_dict().items()):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, key=key: f"{name}: {key}: {m}")


def _same_as_eager(fn, make_inputs, calls=3):
    """Call ``fn`` compiled with skip_python and eagerly on equal inputs; compare results, inputs
    (in-place writes) and gradients. Returns the compiled function."""
    compiled = compiler.compile(fn, skip_python=True)
    for _ in range(calls):
        ours, theirs = make_inputs(), make_inputs()
        got, want = compiled(*ours), fn(*theirs)
        torch.testing.assert_close(got, want)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b)
        loss_ours = sum(t.float().sum() for t in torch.utils._pytree.tree_leaves(got) if t.requires_grad)
        loss_theirs = sum(t.float().sum() for t in torch.utils._pytree.tree_leaves(want) if t.requires_grad)
        if isinstance(loss_ours, torch.Tensor):
            loss_ours.backward()
            loss_theirs.backward()
            for a, b in zip(ours, theirs):
                if a.requires_grad:
                    torch.testing.assert_close(a.grad, b.grad)
    assert compiled.stats["replays"] == calls - 1
    assert_ran_compiled(compiled)
    return compiled


def _inputs(*shapes, grad=()):
    def make():
        g = torch.Generator().manual_seed(7)
        return [torch.randn(*s, generator=g).requires_grad_(i in grad) for i, s in enumerate(shapes)]
    return make


def test_in_place_writes_into_arguments_no_grad_blocks_and_structured_results():
    def f(x, w, buf):
        y = (x @ w).relu()
        with torch.no_grad():
            buf.mul_(0.9).add_(y.mean(0), alpha=0.1)  # a running statistic, as batch norm keeps
        z = y.sigmoid()
        return {"out": z * 2, "view": z.t(), "pair": (y.sum(), buf)}

    _same_as_eager(f, _inputs((8, 4), (4, 6), (6,), grad=(0, 1)))


def test_random_ops_and_factories_inside():
    def f(x):
        mask = torch.rand(x.shape) > 0.5
        noise = torch.randn_like(x)
        return torch.where(mask, x * 2, x + noise) + torch.arange(x.shape[-1])

    compiled = compiler.compile(f, skip_python=True)
    for _ in range(3):
        x = torch.randn(5, 7)
        state = torch.random.get_rng_state()
        got = compiled(x)
        torch.random.set_rng_state(state)  # (eager draws the same numbers from the same state)
        torch.testing.assert_close(got, f(x))
    assert compiled.stats["replays"] == 2


def test_manual_seed_inside_keeps_the_checked_replay(caplog):
    def f(x):
        torch.manual_seed(3)  # no torch call: a recording without Python would not reseed
        return x + torch.randn_like(x)

    x = torch.randn(6)
    torch.manual_seed(12345)  # (another seed than f's: the recording sees the seed change)
    compiled = compiler.compile(f, skip_python=True)
    with caplog.at_level(logging.INFO, logger="compiler"):
        for _ in range(3):
            torch.testing.assert_close(compiled(x), f(x))
    assert any("manual_seed" in r.getMessage() for r in caplog.records)


def test_autocast_inside():
    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = x @ w
        return y.float().tanh()

    _same_as_eager(f, _inputs((8, 8), (8, 8), grad=(0, 1)))


def test_zero_grads_reads_of_gradients_the_step_already_read_are_left_out():
    """zero_grad's ``if p.grad is not None`` reads a gradient the optimizer step read before it:
    the plan makes no such read (each cost a call), only the ``p.grad = None`` run; a gradient
    the function reads itself (into its result) is still read."""
    from runtime.skip_python import plan
    from runtime.torch_functions import function_name

    x, y = _data()

    def keeps_a_grad(model, opt, x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        g = model[0].bias.grad * 1
        opt.step()
        opt.zero_grad()
        return loss, g

    for fn, grad_reads in ((_make_step([]), 0), (keeps_a_grad, 1)):
        model, eager_model = _model(), _model()
        opt, eager_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, eager_model))
        step = compiler.compile(fn, skip_python=True)
        for _ in range(4):
            torch.testing.assert_close(step(model, opt, x, y), fn(eager_model, eager_opt, x, y))
        items = plan(step.last_entry.trace)
        reads = [item for kind, item in items if kind == "call" and function_name(item[0].func) == "Tensor.grad"]
        assert len(reads) == grad_reads, items
        assert [len(item) for kind, item in items if kind == "grads_none"] == [4]
        for p, q in zip(model.parameters(), eager_model.parameters()):
            torch.testing.assert_close(p, q)
            assert p.grad is None


def test_a_fused_step_made_without_its_wrapper_keeps_what_the_wrapper_does():
    """skip_python makes a fused optimizer step without ``optimizer.step()``'s Python where that
    Python would do nothing else (runtime.optimizer_step.FusedOptimizerStep.run_directly): an LR
    scheduler's wrapper still sees the step (``_opt_called``), hooks registered later still run,
    and under the profiler the step's range is there; the values stay eager's throughout."""
    x, y = _data()
    model, eager_model = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    eager_scheduler = torch.optim.lr_scheduler.StepLR(eager_opt, step_size=2)
    step, eager_step = compiler.compile(_make_step([]), skip_python=True), _make_step([])

    def both():
        torch.testing.assert_close(step(model, opt, x, y), eager_step(eager_model, eager_opt, x, y))
        scheduler.step()
        eager_scheduler.step()

    for _ in range(3):
        both()
    launches = step.stats.get("optimizer_launches", 0)
    opt._opt_called = False
    both()
    assert opt._opt_called, "the LR scheduler's step wrapper did not see the step"
    assert step.stats.get("optimizer_launches", 0) > launches  # (the fused kernels made it)

    seen = []
    handles = [opt.register_step_pre_hook(lambda o, a, k: seen.append("pre")),
               opt.register_step_post_hook(lambda o, a, k: seen.append("post")),
               register_optimizer_step_pre_hook(lambda o, a, k: seen.append("global") if o is opt else None)]
    both()
    assert seen == ["global", "pre", "post"]
    for h in handles:
        h.remove()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        both()
    wrapped_step, calls = opt.step, []  # a step the user replaced (here the scheduler's, wrapped again)

    def counted(*args, **kwargs):
        calls.append(1)
        return wrapped_step(*args, **kwargs)

    opt.step = counted
    both()
    assert calls == [1], "the user's replacement of optimizer.step did not run"
    del opt.step
    assert sum(e.name == "Optimizer.step#SGD.step" for e in prof.events()) == 2  # (ours and eager's)
    both()
    assert step.stats["divergences"] == 0
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], eager_opt.state[q]["momentum_buffer"])


_DDP_SCRIPT = r"""
import json, sys, tempfile
import torch, torch.distributed as dist
import torch.nn.functional as F
import compiler
from runtime import skip_python

dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1)))
buckets = []
def hook(state, bucket):   # (the all-reduce a step hands its gradients to)
    buckets.append(1)
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future
model.register_comm_hook(None, hook)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
runs = []
def step(x, y):
    runs.append(1)
    loss = F.mse_loss(model(x * 2), y)   # (a region begun before DDP's forward: no buffers to sync first)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss
fn = compiler.compile(step, skip_python=True, backend=sys.argv[1])
x, y = torch.randn(16, 4), torch.randn(16, 1)
per_step = []
for _ in range(4):
    before = len(buckets)
    fn(x, y)
    per_step.append(len(buckets) - before)
trace = fn.last_entry.trace
from torch.distributed.algorithms.join import Join
before, python_runs = len(buckets), len(runs)
with Join([model]):   # (DDP's forward then tells the join context that this rank has not joined)
    in_the_way = skip_python.ddp_in_the_way(trace)
    fn(x, y)   # (the Python runs, each call checked: DDP's forward as it is)
print(json.dumps({"per_step": per_step, "replays": fn.stats["replays"], "python_runs": python_runs,
                  "refusal": skip_python.refusal(trace), "in_the_way": in_the_way, "then": len(buckets) - before,
                  "python_runs_then": len(runs)}))
dist.destroy_process_group()
"""


def test_a_ddp_step_replays_without_its_python_and_prepares_the_reducer():
    # DDP's forward prepares its reducer for the backward's all-reduce in Python no torch call records:
    # skipped whole, the replays' gradients reached no all-reduce (2 ranks stepped apart, silently). The
    # replays make DDP's own pre- and post-forward calls instead (tests/test_distributed.py: 2 ranks)
    import json
    import subprocess
    import sys

    from tests.devices import KERNELS

    done = subprocess.run([sys.executable, "-c", _DDP_SCRIPT, KERNELS], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["replays"] == 4
    assert found["per_step"][1:] == found["per_step"][:1] * 3 and found["per_step"][0] > 0
    assert found["refusal"] is None and found["python_runs"] == 1   # (the recording's)
    # a setting that makes DDP's forward do more: its Python runs, and the bucket is still all-reduced
    assert "Join" in found["in_the_way"]
    assert found["python_runs_then"] == 2 and found["then"] == found["per_step"][0]
