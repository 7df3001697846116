"""The switches a user reaches for when something is off: ``SYMGRAD_DISABLE`` (every compiled function
runs its Python unmodified, for bisecting), the recording limit (``compile(recording_limit=...)``,
``SYMGRAD_RECORDING_LIMIT``: calls with new argument keys past it run eagerly, said once with the
guards that kept failing), and default arguments as part of a stored recording's key."""

import logging

import pytest
import torch

import compiler
from compiler.reuse import recordings
from runtime import backends, dispatch
from runtime.calls import flatten_call


def _compiler_records(caplog) -> list:
    return [r for r in caplog.records if r.name == "compiler"]


# -- SYMGRAD_DISABLE -------------------------------------------------------------------------------
@pytest.mark.allows_eager("SYMGRAD_DISABLE runs every call eagerly: what it tests")
def test_disable_runs_the_python_unmodified_read_at_each_call(monkeypatch, caplog):
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    monkeypatch.setattr(dispatch, "_said_disabled", False)
    ran = []

    def scaled(x):
        ran.append(1)
        return (x.sin() * 3).sum()

    f = compiler.compile(scaled)
    x = torch.randn(6)
    f(x), f(x)  # recorded, then replayed: kernels run
    assert f.stats["captures"] == 1 and f.stats["kernel_launches"] > 0
    launches = f.stats["kernel_launches"]

    monkeypatch.setenv(dispatch.DISABLE_ENV, "1")  # set after decorating: read at the call
    late = compiler.compile(lambda x: (x.exp() - 1).sum(), fullgraph=True)  # (not refused under fullgraph)
    ran.clear()
    with caplog.at_level(logging.INFO, logger="compiler"):
        for n in (6, 7, 8):  # new shapes too: nothing records
            y = torch.randn(n)
            torch.testing.assert_close(f(y), (y.sin() * 3).sum())
            torch.testing.assert_close(late(y), (y.exp() - 1).sum())
    assert len(ran) == 3  # its Python ran each time
    assert f.stats["captures"] == 1 and f.stats["kernel_launches"] == launches  # no recording, no kernel
    assert f.stats["replays"] == 1 and f.stats["eager_calls"] == 3
    assert late.stats["captures"] == 0 and late.stats["kernel_launches"] == 0 and late.last_entry is None
    assert f.last_backend == f"eager ({dispatch.DISABLE_ENV})"
    said = _compiler_records(caplog)
    assert len(said) == 1 and dispatch.DISABLE_ENV in said[0].getMessage(), [r.getMessage() for r in said]

    monkeypatch.setenv(dispatch.DISABLE_ENV, "0")  # 0: off, as unset
    torch.testing.assert_close(f(x), (x.sin() * 3).sum())
    assert f.stats["kernel_launches"] > launches and f.stats["replays"] == 2
    monkeypatch.delenv(dispatch.DISABLE_ENV)
    torch.testing.assert_close(late(x), (x.exp() - 1).sum())
    assert late.stats["captures"] == 1


# -- the recording limit ---------------------------------------------------------------------------
@pytest.mark.allows_eager("calls past the recording limit run eagerly: what it tests")
def test_thirty_shapes_stop_at_the_limit_with_one_log_line(monkeypatch, caplog):
    monkeypatch.delenv(dispatch.RECORDING_LIMIT_ENV, raising=False)

    def thirty_shapes(x):
        return (x.cos() * 2 + 1).sum(0)

    f = compiler.compile(thirty_shapes, dynamic=False)
    assert dispatch.RECORDING_LIMIT == torch._dynamo.config.recompile_limit == 8
    with caplog.at_level(logging.INFO, logger="compiler"):
        for n in range(2, 32):
            x = torch.randn(n, 3)
            torch.testing.assert_close(f(x), (x.cos() * 2 + 1).sum(0))
    assert f.stats["captures"] == 8 and f.stats["eager_calls"] == 22, f.stats
    said = _compiler_records(caplog)
    assert len(said) == 1, [r.getMessage() for r in said]
    message = said[0].getMessage()
    assert "recording limit" in message and "x: shape [2, 3], [3, 3]" in message and "dynamic" in message, message
    assert said[0].levelno == logging.WARNING

    # the shapes recorded still replay their kernels; new ones keep running eagerly, with eager's values
    launches, replays = f.stats["kernel_launches"], f.stats["replays"]
    x = torch.randn(5, 3)
    torch.testing.assert_close(f(x), (x.cos() * 2 + 1).sum(0))
    assert f.stats["replays"] == replays + 1 and f.stats["kernel_launches"] > launches
    x = torch.randn(40, 3)
    torch.testing.assert_close(f(x), (x.cos() * 2 + 1).sum(0))
    assert f.stats["captures"] == 8 and f.stats["eager_calls"] == 23 and f.last_backend == "eager"
    assert any("recording limit" in reason for reason in compiler.explain(f).fallbacks)


@pytest.mark.allows_eager("calls past the recording limit run eagerly: what it tests")
def test_the_limit_is_set_by_keyword_or_environment(monkeypatch):
    def shapes(f, sizes, op):
        for n in sizes:
            x = torch.randn(n)
            torch.testing.assert_close(f(x), op(x))
        return f.stats["captures"]

    monkeypatch.setenv(dispatch.RECORDING_LIMIT_ENV, "3")
    assert shapes(compiler.compile(lambda x: x.tanh() * 2, dynamic=False), range(2, 8), lambda x: x.tanh() * 2) == 3
    # the keyword wins over the environment
    assert shapes(compiler.compile(lambda x: x.tanh() * 3, dynamic=False, recording_limit=2), range(2, 8),
                  lambda x: x.tanh() * 3) == 2
    # a number argument's values are keys too: the log names it
    keyed = compiler.compile(lambda x, k: x * k, recording_limit=1)
    x = torch.randn(3)
    for k in (2, 2, 5):
        torch.testing.assert_close(keyed(x, k), x * k)
    assert keyed.stats["captures"] == 1 and keyed.stats["replays"] == 1 and keyed.stats["eager_calls"] == 1
    assert "k: 2, 5" in keyed.limit_reached, keyed.limit_reached
    with pytest.raises(ValueError, match="recording_limit"):
        compiler.compile(lambda x: x, recording_limit=0)
    monkeypatch.setenv(dispatch.RECORDING_LIMIT_ENV, "many")
    with pytest.raises(ValueError, match=dispatch.RECORDING_LIMIT_ENV):
        compiler.compile(lambda x: x.exp())(torch.randn(2))


def test_past_the_limit_fullgraph_raises():
    f = compiler.compile(lambda x: x.sin() + 1, dynamic=False, fullgraph=True, recording_limit=1)
    f(torch.randn(3))
    with pytest.raises(compiler.CompileError, match="recording limit"):
        f(torch.randn(4))


# -- default arguments in a stored recording's key --------------------------------------------------
def test_default_arguments_are_part_of_the_key():
    x = torch.randn(3, 4)
    leaves, spec = flatten_call((x,), {})

    def key(fn):
        return recordings.portable_key(fn, spec, leaves)

    soft, log_soft = [lambda x, fn=fn: fn(x, -1) for fn in (torch.softmax, torch.log_softmax)]
    assert key(soft) != key(log_soft)
    two, three = [lambda x, *, k=k: x * k for k in (2.0, 3.0)]
    assert key(two) != key(three)
    # tensors by metadata (the recording holds them by identity, found again by path)
    a, b = [lambda x, w=w: x * w for w in (torch.randn(4), torch.randn(4))]
    c = (lambda w: (lambda x, w=w: x * w))(torch.randn(5))
    assert key(a) == key(b) != key(c)


@pytest.fixture
def stored(monkeypatch, tmp_path):
    """Stored recordings on (the suite turns them off), in a cache folder of this test's own."""
    monkeypatch.setenv("SYMGRAD_STORED_RECORDINGS", "1")
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path / "cache"))


def test_lambdas_with_other_defaults_keep_their_own_recordings(stored, caplog):
    x = torch.randn(4, 5)
    made = [lambda x, fn=fn: fn(x, -1).sum(-1) for fn in (torch.softmax, torch.log_softmax)]
    with caplog.at_level(logging.INFO, logger="symgrad.recompiles"):
        for fn in made:
            f = compiler.compile(fn)
            for _ in range(3):
                torch.testing.assert_close(f(x), fn(x))
            # its own recording, replayed without leaving it: not the other lambda's
            assert f.stats["captures"] == 1 and f.stats["loaded"] == 0 and f.stats["divergences"] == 0, f.stats
            assert f.stats["replays"] == 2 and f.stats["kernel_launches"] > 0
        # the same lambda compiled again loads what this process stored, and the log says so
        again = compiler.compile(made[1])
        torch.testing.assert_close(again(x), made[1](x))
        assert again.stats["captures"] == 0 and again.stats["loaded"] == 1 and again.stats["divergences"] == 0
    loads = [r.getMessage() for r in caplog.records if "loaded" in r.getMessage()]
    assert loads and all("this process stored earlier" in m and "an earlier process" not in m for m in loads), loads


def test_a_tensor_default_is_found_again_by_path(stored):
    x = torch.randn(4)
    first, second = [lambda x, w=w: (x * w).exp().sum() for w in (torch.randn(4), torch.randn(4))]
    compiler.compile(first)(x)
    f = compiler.compile(second)  # same key: loads the first's recording, with its own default tensor
    torch.testing.assert_close(f(x), second(x))
    assert f.stats["loaded"] == 1 and f.stats["captures"] == 0 and f.stats["divergences"] == 0


# -- the docstring ----------------------------------------------------------------------------------
def test_the_docstring_names_every_backend_and_what_auto_picks():
    doc = compiler.compile.__doc__
    for name in backends.BACKENDS:
        assert f'``"{name}"``' in doc, name
    assert "SYMGRAD_CPU_BACKEND" in doc and "C++ compiler" in doc and "CUDA tensors" in doc
    assert dispatch.RECORDING_LIMIT_ENV in doc and dispatch.DISABLE_ENV in doc
