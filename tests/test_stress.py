"""Stress and soak: many threads on one compiled function, a long training loop, processes
sharing one kernel cache, and a damaged cache file.

CI runs short versions; the long settings are environment variables:

    SYMGRAD_STRESS_SECONDS=60 SYMGRAD_SOAK_STEPS=1000 python -m pytest -q tests/test_stress.py

NOTE: the soak's 1,000 steps (issue 11) are opt-in: in the Triton interpreter a replayed step costs
0.07-0.15 s (each kernel launch is emulated in NumPy; a single Linear(4, 1) step launches 2), so
1,000 steps take 1.5-3 minutes on 2 cores, over the suite's budget; the default 200 steps take 20-40 s.
"""

from __future__ import annotations

import gc
import glob
import os
import subprocess
import sys
import textwrap
import threading
import time
import traceback

import torch

import compiler
from runtime import kernels
from tests.training import sgd_step

STRESS_SECONDS = float(os.environ.get("SYMGRAD_STRESS_SECONDS", "3"))
SOAK_STEPS = int(os.environ.get("SYMGRAD_SOAK_STEPS", "200"))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- threads -------------------------------------------------------------------------------------
def test_threads_share_one_compiled_function_and_its_backward():
    def f(x, w):
        return (torch.tanh(x @ w) * torch.sigmoid(x).sum(-1, keepdim=True)).sum()

    compiled = compiler.compile(f, backend="interpret")
    shapes = [(2, 3), (4, 3), (1, 3), (5, 3)]
    errors, counts = [], [0] * 8
    stop = time.monotonic() + STRESS_SECONDS

    def worker(k):
        g = torch.Generator().manual_seed(k)
        try:
            while time.monotonic() < stop:
                shape = shapes[(k + counts[k]) % len(shapes)]
                x = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
                w = torch.randn(3, 2, generator=g, dtype=torch.float64, requires_grad=True)
                xe, we = (t.detach().clone().requires_grad_() for t in (x, w))
                out = compiled(x, w)
                out.backward()
                want = f(xe, we)
                want.backward()
                torch.testing.assert_close(out, want)
                torch.testing.assert_close(x.grad, xe.grad)
                torch.testing.assert_close(w.grad, we.grad)
                counts[k] += 1
        except BaseException as e:  # noqa: BLE001 — reported by the main thread
            errors.append((k, e))

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=STRESS_SECONDS + 120)
    assert not any(t.is_alive() for t in threads), "a thread is stuck: deadlock?"
    assert not errors, _told_whole(*errors[0])
    assert all(c > 0 for c in counts), counts
    assert compiled.stats["replays"] > 0
    assert compiled.stats["captures"] <= len(shapes) * 2  # each shape recorded once (maybe twice in a race)



def test_threads_touch_sympy_only_under_its_lock(monkeypatch):
    """SymPy is not thread-safe: a query of an assumption writes the expression's ``_assumptions``
    dict, which another thread may be iterating ("dictionary changed size during iteration", the
    error CI once met in the test above; sympy/sympy#16734). Every such write in a thread other than
    the main one must happen under ``SYMPY_LOCK``: threads record, build backwards on demand and
    instantiate templates of several functions at once here, and none writes outside the lock."""
    from sympy.core.facts import FactKB
    from compiler.ir.sympy_lock import SYMPY_LOCK

    outside, tell = [], FactKB._tell

    def watched_tell(self, k, v):
        if threading.current_thread() is not threading.main_thread() and not SYMPY_LOCK._is_owned():
            outside.append("".join(traceback.format_stack(limit=12)))
        return tell(self, k, v)
    monkeypatch.setattr(FactKB, "_tell", watched_tell)

    def make(k):
        def f(x, w):
            return (torch.sinh(x @ w) * (k + 1.5) + torch.sigmoid(x).sum(-1, keepdim=True)).pow(2).mean()
        return compiler.compile(f, backend="interpret", dynamic=k % 2 == 0)

    functions, errors = [make(k) for k in range(4)], []

    def worker(k):
        try:
            for n in (2, 2, 3, 3, 5, 5):   # (new shapes: recordings, replays, instantiations where dynamic)
                x = torch.randn(n, 3, dtype=torch.float64, requires_grad=True)
                w = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
                functions[k](x, w).backward()
        except BaseException as e:  # noqa: BLE001 — reported by the main thread
            errors.append((k, e))

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, _told_whole(*errors[0])
    assert all(f.stats["kernel_launches"] > 0 for f in functions)
    assert not outside, f"{len(outside)} SymPy writes outside SYMPY_LOCK; the first from:\n{outside[0]}"

# -- a long training loop --------------------------------------------------------------------------
def _live_tensors():
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_training_loop_holds_steady():
    """SOAK_STEPS compiled SGD steps: no new recordings, kernels or live tensors after warm-up,
    and the parameters match an eager run of the same steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    reference.load_state_dict(model.state_dict())
    step = compiler.compile(sgd_step(model, lr=0.01), backend="interpret")
    eager_step = sgd_step(reference, lr=0.01)
    batches = [(torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64)) for _ in range(5)]
    warm_up = 10
    for i in range(warm_up):
        step(*batches[i % 5]), eager_step(*batches[i % 5])
    recordings, loaded, live = step.stats["captures"], len(kernels._loaded), _live_tensors()
    for i in range(warm_up, SOAK_STEPS):
        loss = step(*batches[i % 5])
        want = eager_step(*batches[i % 5])
    torch.testing.assert_close(loss, want)
    del loss, want  # (the warm-up kept no results: count like for like)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
    assert step.stats["captures"] == recordings, step.stats
    assert sum(len(v) for v in step.cache.values()) == recordings
    assert len(kernels._loaded) == loaded
    assert _live_tensors() <= live
    assert step.stats["replays"] >= SOAK_STEPS - warm_up


# -- the kernel cache on disk ----------------------------------------------------------------------
WORKER = textwrap.dedent("""
    import sys, torch, compiler
    def f(x, y):
        return (torch.exp(torch.sin(x) * y) + torch.cos(y).sum(0)).softmax(-1)
    c = compiler.compile(f, backend="interpret")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    for _ in range(3):
        out = c(x, y)
        gx, gy = torch.autograd.grad(out.pow(2).sum(), (x, y))
        xe, ye = x.detach().requires_grad_(), y.detach().requires_grad_()
        want = f(xe, ye)
        wx, wy = torch.autograd.grad(want.pow(2).sum(), (xe, ye))
        torch.testing.assert_close(out, want); torch.testing.assert_close(gx, wx); torch.testing.assert_close(gy, wy)
    assert c.stats["kernel_launches"] > 0 and not c.last_entry.report.fallbacks, c.stats
    print("ok", c.stats["kernel_launches"])
""")


def _workers(cache, count):
    env = dict(os.environ, SYMGRAD_CACHE_DIR=str(cache), TRITON_INTERPRET="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(count)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        results.append((p.returncode, out, err))
    return results


def test_processes_share_one_cache_directory(tmp_path):
    results = _workers(tmp_path, 3)  # at once, into an empty directory
    for code, out, err in results:
        assert code == 0 and out.startswith("ok"), err[-3000:]
    files = glob.glob(str(tmp_path / "*.py"))
    assert files and not glob.glob(str(tmp_path / "*.tmp"))


def test_a_damaged_cache_file_is_detected_and_rewritten(tmp_path):
    (code, out, err), = _workers(tmp_path, 1)
    assert code == 0, err[-3000:]
    files = sorted(glob.glob(str(tmp_path / "*.py")))
    assert len(files) >= 3
    good = {path: open(path, "rb").read() for path in files}
    with open(files[0], "r+b") as f:     # truncated (a full disk, a killed writer)
        f.truncate(len(good[files[0]]) // 2)
    with open(files[1], "wb") as f:      # not even text
        f.write(b"\xff\xfe\x00garbage" * 10)
    with open(files[2], "wb") as f:      # valid Python that computes something else
        f.write(good[files[2]].replace(b"tl.store(", b"0 and tl.store("))
    (code, out, err), = _workers(tmp_path, 1)
    assert code == 0 and out.startswith("ok"), err[-3000:]
    assert "did not match its kernel's source" in err
    for path in files:
        assert open(path, "rb").read() == good[path]


def test_cache_check_in_process(tmp_path, monkeypatch):
    """load_kernel compares the file with the source, rewrites a wrong one, and never runs
    bytecode from __pycache__."""
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path))
    source = "VALUE = 1\n\ndef k_test_0():\n    return VALUE\n"
    path = tmp_path / "k_test_0.py"
    path.write_text("VALUE = 2\n\ndef k_test_0():\n    return VALUE\n")
    monkeypatch.setattr(kernels, "_loaded", {})
    assert kernels.load_kernel("k_test_0", source)() == 1
    assert path.read_text() == source
    assert not (tmp_path / "__pycache__").exists()


def _told_whole(thread: int, error: BaseException) -> str:
    """A worker's error with its traceback and its cause's (an internal error's message is cut short,
    and where in the compiler a race struck is in the cause: seen once in CI, "... changed size during
    iteration", not reproduced since)."""
    return f"thread {thread}:\n" + "".join(traceback.format_exception(error))
