"""Running the autograd notes' code examples inside compiled functions: each example is the
notes' code as a function that prints what the notes print. It runs from the same random seed
eagerly, as a compiled function's first call (the recording), as its second call (a replay), and
as a fresh process's first and second calls (a new ``compile`` of the same function, which loads
the recording the first one stored: no eager run); every printout must equal eager's, and each
replay must follow its recording. Where the notes write to a GPU or to ``G:/``, the examples use
the CPU and a temporary directory."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile

import pytest
import torch

import compiler


@contextlib.contextmanager
def stored_recordings():
    """Recordings stored and loaded (the suite turns them off), in a cache folder of their own."""
    saved = {k: os.environ.get(k) for k in ("SYMGRAD_STORED_RECORDINGS", "SYMGRAD_CACHE_DIR")}
    with tempfile.TemporaryDirectory(prefix="symgrad-notes-") as folder:
        os.environ.update(SYMGRAD_STORED_RECORDINGS="1", SYMGRAD_CACHE_DIR=folder)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _printout(run) -> str:
    torch.manual_seed(0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run()
    return out.getvalue()


def run_five_ways(fn):
    """``fn``'s printout eagerly, on a compiled first call and on a replay, then on a fresh
    process's first call and replay (a second ``compile``, from the stored recording); and the
    two compiled functions. Each run starts from the same seed."""
    with stored_recordings():
        compiled = compiler.compile(fn, backend="interpret")
        printouts = [_printout(run) for run in (fn, compiled, compiled)]
        fresh = compiler.compile(fn, backend="interpret")
        printouts += [_printout(fresh), _printout(fresh)]
    return printouts, compiled, fresh


def check_example(fn):
    """The example prints, as a recording, as a replay and in a fresh process, what it prints eagerly."""
    (eager, *compiled_runs), compiled, fresh = run_five_ways(fn)
    assert eager.strip(), "the example prints nothing"
    for name, printout in zip(("recording", "replay", "fresh first call", "fresh replay"), compiled_runs):
        assert printout == eager, name
    assert (compiled.stats["captures"], compiled.stats["replays"]) == (1, 1), compiled.stats
    assert compiled.stats["divergences"] == 0, compiled.last_backend
    # (a recording that holds what another process cannot find again is not stored: then the
    # fresh function records as the first did, and is checked as it is)
    assert fresh.stats["captures"] + fresh.stats["loaded"] == 1, fresh.stats
    assert fresh.stats["divergences"] == 0, fresh.last_backend


def cases(examples, known_limits, unstable=None):
    """pytest parameters: each example, those in ``known_limits`` (name -> why) as strict xfails,
    those in ``unstable`` (name -> the open bug that makes them pass or fail by the run) as xfails
    that may pass."""
    for fn in examples:
        reason = known_limits.get(fn.__name__)
        flaky = (unstable or {}).get(fn.__name__)
        if reason:
            yield pytest.param(fn, marks=pytest.mark.xfail(reason=reason, strict=True))
        elif flaky:
            yield pytest.param(fn, marks=pytest.mark.xfail(reason=flaky, strict=False))
        else:
            yield fn
