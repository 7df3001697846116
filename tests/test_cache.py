"""The compiled-region cache (compiler.reuse.persist): a region graph compiled before — in this process
or another — is loaded instead of differentiated and rendered again, with eager's results; a
damaged entry is detected and rebuilt; anything that changes the build changes the key."""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import compiler
import compiler.build
from compiler.reuse import persist
from compiler.fusion import tiling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def builds(monkeypatch, tmp_path):
    """A cache of this test's own; counts the regions differentiated (autodiff's partition)."""
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    partition = compiler.build.partition

    def counting(*args, **kwargs):
        calls.append(1)
        return partition(*args, **kwargs)
    monkeypatch.setattr(compiler.build, "partition", counting)
    return calls


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def _loss(model):
    return lambda x: model(x).softmax(-1).square().sum()


def _grads(model, x, fn):
    model.zero_grad()
    loss = fn(x)
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


def test_a_region_compiled_before_is_loaded_and_matches_eager(builds):
    x = torch.randn(4, 8)
    model = _model()
    first = compiler.compile(_loss(model), backend="interpret")
    first(x)
    assert len(builds) == 1 and os.listdir(persist.regions_dir())
    second = compiler.compile(_loss(model), backend="interpret")  # another function, the same graph
    second(x)
    assert len(builds) == 1  # loaded: no autodiff, no codegen
    expected = _grads(model, x, _loss(model))
    for got, want in zip(_grads(model, x, second), expected):  # a replay of the loaded region
        torch.testing.assert_close(got, want)
    assert second.stats["replays"] == 1
    assert [k.name for k in second.last_entry.report.kernels] == [k.name for k in first.last_entry.report.kernels]


def test_a_loaded_region_checks_its_indices_as_the_built_one_does(builds):
    """An index out of range raises eager's IndexError in a region loaded from the cache too (its
    launches keep their index checks: without them the kernel would read out of bounds)."""
    def gather(x, i):
        return (x[i] * 2).sum()
    x, good, bad = torch.randn(5, 3), torch.tensor([0, 4, 2]), torch.tensor([0, 5, 2])
    compiler.compile(gather, backend="interpret", fullgraph=True)(x, good)
    loaded = compiler.compile(gather, backend="interpret", fullgraph=True)
    loaded(x, good)
    assert len(builds) == 1  # the second function's region came from the cache
    torch.testing.assert_close(loaded(x, good), gather(x, good))
    assert loaded.stats["replays"] == 1 and loaded.stats["kernel_launches"] > 0
    with pytest.raises(IndexError, match="out of bounds"):
        loaded(x, bad)


def test_damaged_entries_are_detected_and_rebuilt(builds, caplog):
    x = torch.randn(4, 8)
    model = _model()
    compiler.compile(_loss(model), backend="interpret")(x)
    paths = [os.path.join(d, f) for d, _, files in os.walk(persist.regions_dir()) for f in files]
    assert len(paths) == 1
    data = open(paths[0], "rb").read()
    for damaged in (data[: len(data) // 2], data[:-10] + b"0123456789", b"not a cache entry"):
        with open(paths[0], "wb") as f:
            f.write(damaged)
        before = len(builds)
        with caplog.at_level(logging.WARNING, logger="symgrad.cache"):
            again = compiler.compile(_loss(model), backend="interpret")
            again(x)
        assert len(builds) == before + 1 and "damaged" in caplog.text
        assert open(paths[0], "rb").read() == data  # rebuilt and stored whole again
        for got, want in zip(_grads(model, x, again), _grads(model, x, _loss(model))):
            torch.testing.assert_close(got, want)


def test_what_changes_the_build_changes_the_key(builds, monkeypatch):
    model = _model()
    compiler.compile(_loss(model), backend="interpret")(torch.randn(4, 8))
    compiler.compile(_loss(model), backend="interpret")(torch.randn(5, 8))  # another shape
    assert len(builds) == 2
    monkeypatch.setattr(tiling, "RBLOCK_MAX", tiling.RBLOCK_MAX // 2)  # a tunable of the kernels
    compiler.compile(_loss(model), backend="interpret")(torch.randn(4, 8))
    assert len(builds) == 3
    monkeypatch.setenv("SYMGRAD_REGION_CACHE", "0")
    compiler.compile(_loss(model), backend="interpret")(torch.randn(4, 8))
    assert len(builds) == 4
    compiler.clear_cache()
    assert os.listdir(os.environ["SYMGRAD_CACHE_DIR"]) == []


def test_loaded_region_builds_its_double_and_partial_backward_when_needed(builds):
    def f(x, w):
        y = (x * w).sin()
        return y.sum(), (y * 3).exp().mean()
    x, w = torch.randn(6, requires_grad=True), torch.randn(6, requires_grad=True)
    compiler.compile(f, backend="interpret")(x, w)
    loaded = compiler.compile(f, backend="interpret")
    loaded(x, w)
    assert len(builds) == 1
    a, _ = loaded(x, w)  # only the first output in the loss: the partial backward
    (gx,) = torch.autograd.grad(a, [x], create_graph=True)  # and the double backward
    (ggw,) = torch.autograd.grad(gx.sum(), [w])
    ea, _ = f(x, w)
    (egx,) = torch.autograd.grad(ea, [x], create_graph=True)
    (eggw,) = torch.autograd.grad(egx.sum(), [w])
    torch.testing.assert_close(gx, egx)
    torch.testing.assert_close(ggw, eggw)
    # (the loaded region's builder, held by the one that builds it for the region's backend)
    lazy = loaded.last_entry.trace.regions[0].compiled.on_demand.partial_backward.build.func.__self__
    assert lazy.built  # the loaded region's closures came from a build made when first needed


_FRESH = """
import json, sys, torch, compiler, compiler.build
builds = []
partition = compiler.build.partition
compiler.build.partition = lambda *a, **k: builds.append(1) or partition(*a, **k)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
step = compiler.compile(lambda x: model(x).softmax(-1).square().sum(), backend="interpret")
x = torch.randn(4, 8)
loss = step(x); loss.backward()
grad = model[0].weight.grad.clone(); model.zero_grad()
ref = model(x).softmax(-1).square().sum(); ref.backward()
print(json.dumps({"builds": len(builds), "error": float((grad - model[0].weight.grad).abs().max()),
                  "loss_error": float((loss - ref).abs())}))
"""


def test_a_fresh_process_loads_what_another_compiled(tmp_path):
    env = dict(os.environ, SYMGRAD_CACHE_DIR=str(tmp_path), PYTHONPATH=ROOT)
    results = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert [r["builds"] for r in results] == [1, 0]
    assert all(r["error"] < 1e-5 and r["loss_error"] < 1e-5 for r in results)


def test_a_graph_longer_than_the_recursion_limit_is_stored_and_read_back():
    """A model's backward graph has thousands of nodes; pickled as fx links them, each node is a
    level of recursion (a 2-layer GPT-2's regions were not stored: RecursionError)."""
    import io
    import pickle

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = x
    for _ in range(sys.getrecursionlimit() * 2):
        node = graph.call_function(torch.add, (node, 1), {"alpha": 2})
    graph.output((node, [x, {"last": node}]))
    buffer = io.BytesIO()
    persist.RegionPickler(buffer).dump(graph)
    again = pickle.loads(buffer.getvalue())
    assert [(n.op, n.name, n.target, str(n.args), str(n.kwargs)) for n in again.nodes] == \
        [(n.op, n.name, n.target, str(n.args), str(n.kwargs)) for n in graph.nodes]
    out = next(n for n in again.nodes if n.op == "output")
    assert out.args[0][1][1]["last"] is out.args[0][0]  # (the same node, not a copy)


def test_a_default_cache_folder_others_may_write_is_not_used(tmp_path, monkeypatch, caplog):
    from runtime import kernels

    monkeypatch.delenv("SYMGRAD_CACHE_DIR", raising=False)
    monkeypatch.setattr(kernels.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(kernels, "_private", [])
    shared = tmp_path / f"symgrad-{os.getuid()}"
    assert kernels.cache_dir() == str(shared / "kernels")  # made here, ours: used
    shared.chmod(0o777)  # (as if another user had made it first, open to all)
    with caplog.at_level(logging.WARNING, logger="compiler"):
        private = kernels.cache_dir()
    assert not private.startswith(str(shared)) and os.path.isdir(private)
    assert kernels.cache_dir() == private
    assert any("another user or anyone may write it" in r.getMessage() for r in caplog.records)
