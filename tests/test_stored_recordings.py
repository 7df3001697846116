"""Recordings stored on disk (compiler.reuse.recordings): a fresh process's first call of a function seen
before replays the compiled kernels at once (no eager recording run, no SymPy, no codegen), with
eager's values; what the recording held by identity is found again by path, and whatever does
not fit makes the call record, as without the store.

A new ``compiler.compile`` of the same function in this process starts as a fresh process does
(nothing in memory), so most tests use that; one runs two real processes."""

import copy
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import compiler
from compiler.reuse import recordings
from runtime.calls import flatten_call
from tests.training import train_step


@pytest.fixture(autouse=True)
def store(monkeypatch, tmp_path):
    """Stored recordings on (the suite turns them off), in a cache folder of this test's own."""
    monkeypatch.setenv("SYMGRAD_STORED_RECORDINGS", "1")
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "recordings"


def _stored_files(folder):
    return sorted(p for p in folder.rglob("*.pkl")) if folder.exists() else []


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)


def test_a_new_compiled_function_of_the_same_code_replays_from_its_first_call(store):
    def f(x, y):
        return (torch.sin(x) * y + torch.exp(-x)).sum()

    x, y = torch.randn(8, requires_grad=True), torch.randn(8)
    first = compiler.compile(f)
    first(x, y)
    assert first.stats["captures"] == 1 and len(_stored_files(store)) == 1

    again = compiler.compile(f)
    x2 = x.detach().clone().requires_grad_()
    out = again(x2, y)
    assert again.stats["captures"] == 0 and again.stats["loaded"] == 1 and again.stats["replays"] == 1
    assert again.last_backend == "interpret"
    out.backward()
    x3 = x.detach().clone().requires_grad_()
    expected = f(x3, y)
    expected.backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x2.grad, x3.grad)


def test_parameters_modules_and_optimizer_state_are_found_by_path_in_new_objects():
    x, y = _data()
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    compiled = compiler.compile(train_step)
    for _ in range(3):
        compiled(model, opt, x, y)
    assert compiled.stats["captures"] >= 1

    # a "new process": new model and optimizer objects, a new compiled function, and eager's twin
    model, eager_model = _mlp(), _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    eager_opt = torch.optim.Adam(eager_model.parameters(), lr=1e-2)
    again = compiler.compile(train_step)
    for step in range(4):
        loss = again(model, opt, x, y)
        expected = train_step(eager_model, eager_opt, x, y)
        torch.testing.assert_close(loss, expected)
        if step == 0:
            assert again.stats["captures"] == 0 and again.stats["loaded"] >= 1, again.stats
    assert again.stats["captures"] == 0, "every call replayed a stored recording"
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[p][key], eager_opt.state[q][key])


def test_a_loaded_recordings_optimizer_step_is_fused_once_its_state_exists():
    """A stored recording is compiled in the new process before its optimizer has state (the
    recorded step made it): that is no reason to run every step eagerly. The first step runs
    eagerly and makes the state; the next ones run as the fused kernels, with eager's values."""
    x, y = _data()
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    compiled = compiler.compile(train_step, backend="interpret")
    compiled(model, opt, x, y)
    assert _stored_files(_store_dir())

    model, eager_model = _mlp(), _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    eager_opt = torch.optim.Adam(eager_model.parameters(), lr=1e-2)
    again = compiler.compile(train_step, backend="interpret")
    launches = []
    for _ in range(3):
        torch.testing.assert_close(again(model, opt, x, y), train_step(eager_model, eager_opt, x, y))
        launches.append(again.stats.get("optimizer_launches", 0))
    assert again.stats["captures"] == 0 and again.stats["loaded"] >= 1, again.stats
    assert compiler.explain(again).fallbacks == []
    assert launches[0] == 0 and launches[2] > launches[1] > 0, launches   # eager first, then fused
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], eager_opt.state[q]["exp_avg_sq"])


def _closure_step(model):
    def step(x):
        return model(x).square().mean()
    return step


GLOBAL_MODEL = None


def global_step(x):
    return GLOBAL_MODEL(x).tanh().sum()


def test_modules_reached_through_a_closure_or_a_global_are_found_again():
    global GLOBAL_MODEL
    x = torch.randn(32, 4)
    compiler.compile(_closure_step(_mlp()))(x)
    GLOBAL_MODEL = _mlp()
    compiler.compile(global_step)(x)

    model, eager_model = _mlp(), _mlp()
    with torch.no_grad():  # other weights than the recording's: its parameters must not be used
        for p in (*model.parameters(), *eager_model.parameters()):
            p.mul_(0.5)
    again = compiler.compile(_closure_step(model))
    out = again(x)
    assert again.stats["captures"] == 0 and again.stats["loaded"] == 1
    out.backward()
    expected = _closure_step(eager_model)(x)
    expected.backward()
    torch.testing.assert_close(out, expected)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad)

    GLOBAL_MODEL = copy.deepcopy(eager_model)
    again = compiler.compile(global_step)
    torch.testing.assert_close(again(x), eager_model(x).tanh().sum())
    assert again.stats["captures"] == 0 and again.stats["loaded"] == 1


def test_a_recording_that_needs_optimizer_state_waits_until_it_exists():
    x, y = _data()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_step(model, opt, x, y)  # (eager: the momentum buffers exist before the recording)
    compiled = compiler.compile(train_step)
    compiled(model, opt, x, y)
    needs_state = _stored_files(_store_dir())
    assert needs_state

    model, eager_model = _mlp(), _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1, momentum=0.9)
    again = compiler.compile(train_step)
    for _ in range(3):
        torch.testing.assert_close(again(model, opt, x, y), train_step(eager_model, eager_opt, x, y))
    # the first call (no momentum buffers yet) recorded; the stored recording fit once they existed
    assert again.stats["captures"] == 1 and again.stats["loaded"] == 1, again.stats
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], eager_opt.state[q]["momentum_buffer"])


def _store_dir():
    import pathlib

    return pathlib.Path(recordings.recordings_dir())


def test_two_paths_that_now_lead_to_one_tensor_make_the_call_record():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)
    compiler.compile(_closure_step(model))(x)

    tied = copy.deepcopy(model)
    tied[1].weight = tied[0].weight  # one parameter where the recording had two
    again = compiler.compile(_closure_step(tied))
    out = again(x)
    assert again.stats["captures"] == 1 and again.stats["loaded"] == 0
    out.backward()
    eager = copy.deepcopy(tied)
    expected = _closure_step(eager)(x)
    expected.backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(tied[0].weight.grad, eager[0].weight.grad)


FLAG = True


def branchy(x):
    y = x.sin()
    if FLAG:  # a global Python value the key does not hold: the replay's per-call checks see the change
        y = y * 2
    return y.exp().sum()


@pytest.mark.allows_eager("a replay that leaves its recording: what it tests")
def test_a_stored_recording_that_python_leaves_runs_the_rest_eagerly_with_eagers_values():
    global FLAG
    x = torch.randn(16, requires_grad=True)
    compiler.compile(branchy)(x)
    FLAG = False
    try:
        again = compiler.compile(branchy)
        x2 = x.detach().clone().requires_grad_()
        out = again(x2)
        assert again.stats["loaded"] == 1 and again.stats["divergences"] == 1
        out.backward()
        x3 = x.detach().clone().requires_grad_()
        expected = branchy(x3)
        expected.backward()
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(x2.grad, x3.grad)
    finally:
        FLAG = True


def test_a_damaged_stored_recording_is_deleted_and_the_call_records(store, caplog):
    def f(x):
        return (x * 3).cos().sum()

    x = torch.randn(8)
    compiler.compile(f)(x)
    (path,) = _stored_files(store)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    again = compiler.compile(f)
    with caplog.at_level(logging.WARNING, logger="symgrad.cache"):
        torch.testing.assert_close(again(x), f(x))
    assert again.stats["captures"] == 1 and again.stats["loaded"] == 0
    assert any("damaged" in r.getMessage() for r in caplog.records)
    assert _stored_files(store) and _stored_files(store)[0].read_bytes() != bytes(data)  # stored anew


def test_a_recording_holding_what_no_path_reaches_is_not_stored_and_says_why(store, caplog):
    hidden = [torch.randn(8)]

    def reach():
        return hidden[0]

    def f(x):
        return (x * reach()).sum()  # a tensor reached through a function call: no path names it

    with caplog.at_level(logging.INFO, logger="symgrad.cache"):
        compiled = compiler.compile(f)
        compiled(torch.randn(8))
    assert _stored_files(store) == []
    assert any("not stored" in r.getMessage() and "no path" in r.getMessage() for r in caplog.records)


def test_the_key_holds_the_code_and_the_arguments():
    def f(x):
        return x.sin()

    def g(x):
        return x.cos()

    x = torch.randn(4)
    leaves, spec = flatten_call((x,), {})
    key = recordings.portable_key(f, spec, leaves)
    assert key == recordings.portable_key(f, spec, leaves)
    assert key != recordings.portable_key(g, spec, leaves)
    leaves2, spec2 = flatten_call((torch.randn(5),), {})
    assert key != recordings.portable_key(f, spec2, leaves2)
    with pytest.raises(recordings.NotStorable, match="argument of type"):
        recordings.portable_key(f, *reversed(flatten_call((object(),), {})))

    def key_of(opt):
        leaves, spec = flatten_call((opt,), {})
        return recordings.portable_key(f, spec, leaves)

    params = [torch.nn.Parameter(torch.randn(3))]
    plain = key_of(torch.optim.SGD(params, lr=0.1))
    assert plain == key_of(torch.optim.SGD(params, lr=0.5))  # a rate: schedulers change it between steps
    assert plain != key_of(torch.optim.SGD(params, lr=0.1, momentum=0.9))  # momentum buffers: other calls
    assert plain != key_of(torch.optim.SGD(params, lr=0.1, nesterov=False, maximize=True))

    def with_options(**options):  # a closure's dict of options is part of the key, as its code is
        return lambda x: torch.addmm(x, x, x, **options)

    square = (torch.randn(3, 3),)
    leaves, spec = flatten_call(square, {})
    assert recordings.portable_key(with_options(beta=0.5), spec, leaves) != recordings.portable_key(
        with_options(beta=2.0), spec, leaves)


def test_clear_cache_and_the_switch(store, monkeypatch):
    def f(x):
        return x.tan().sum()

    compiler.compile(f)(torch.randn(4))
    assert _stored_files(store)
    compiler.clear_cache()
    assert _stored_files(store) == []
    monkeypatch.setenv("SYMGRAD_STORED_RECORDINGS", "0")
    compiler.compile(f)(torch.randn(4))
    assert _stored_files(store) == []


_SCRIPT = textwrap.dedent('''
    import json, sys, torch, torch.nn.functional as F
    import compiler, compiler.build
    builds = []
    partition = compiler.build.partition
    compiler.build.partition = lambda *a, **k: builds.append(1) or partition(*a, **k)

    python_runs = []

    def train_step(model, opt, x, y):
        python_runs.append(1)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
    model, opt = make()
    eager_model, eager_opt = make()
    step = compiler.compile(train_step, backend=sys.argv[1], skip_python=sys.argv[2] == "skip")
    losses, eager, ran = [], [], []
    for i in range(3):
        losses.append(step(model, opt, x, y).item())
        eager.append(train_step(eager_model, eager_opt, x, y).item())
        ran.append(step.last_backend)
        if i == 0:
            first = dict(step.stats)
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), eager_model.parameters()))
    print(json.dumps({"losses": losses, "eager": eager, "ran": ran, "first": first, "builds": len(builds),
                      "python_runs": len(python_runs) - 3,  # (the eager twin's 3 calls)
                      "close": all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(losses, eager)),
                      "params_close": same or all(torch.allclose(p, q, atol=1e-6)
                                                  for p, q in zip(model.parameters(), eager_model.parameters()))}))
''')


@pytest.mark.parametrize("backend, mode", [("interpret", "checked"), ("torch", "checked"), ("torch", "skip")])
def test_a_fresh_process_replays_its_first_call(tmp_path, backend, mode):
    script = tmp_path / "step.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "SYMGRAD_CACHE_DIR": str(tmp_path / "cache"), "SYMGRAD_STORED_RECORDINGS": "1",
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}

    def run():
        done = subprocess.run([sys.executable, str(script), backend, mode], env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    assert cold["first"]["captures"] == 1 and cold["ran"][0] == "eager (recording)" and cold["builds"] >= 1
    # the second process: its first call replays the compiled kernels (no recording, nothing built)
    assert warm["first"]["captures"] == 0 and warm["first"]["loaded"] == 1 and warm["first"]["replays"] == 1
    assert warm["ran"] == [backend] * 3 and warm["builds"] == 0
    for result in (cold, warm):
        assert result["close"] and result["params_close"], result
    assert warm["losses"] == pytest.approx(cold["losses"], rel=1e-6)
    # the step's Python: each checked replay runs it; with skip_python the warm process never does
    assert warm["python_runs"] == (0 if mode == "skip" else 3)


class _Trainer:
    def __init__(self):
        self.model = _mlp()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def step(self, x, y):
        return train_step(self.model, self.opt, x, y)  # (its model and optimizer reached through self)


def test_a_bound_methods_object_is_a_root_its_attributes_found_again():
    x, y = _data()
    trainer = _Trainer()
    compiler.compile(trainer.step)(x, y)

    trainer, eager = _Trainer(), _Trainer()
    again = compiler.compile(trainer.step)
    for _ in range(3):
        torch.testing.assert_close(again(x, y), eager.step(x, y))
    assert again.stats["captures"] == 0 and again.stats["loaded"] == 1, again.stats
    for p, q in zip(trainer.model.parameters(), eager.model.parameters()):
        torch.testing.assert_close(p, q)


def test_the_key_is_the_calls_before_it_runs():
    def f(x):
        x.requires_grad_()  # (the call changes what the key describes: stored under the key before)
        return (x * 2).sum()

    compiler.compile(f)(torch.randn(4))
    again = compiler.compile(f)
    x = torch.randn(4)
    again(x).backward()
    assert again.stats["captures"] == 0 and again.stats["loaded"] == 1
    torch.testing.assert_close(x.grad, torch.full((4,), 2.0))
