"""Running the autograd notes' code examples inside compiled functions: each example is the
notes' code as a function that prints what the notes print. It runs three times from the same
random seed: eagerly, as a compiled function's first call (the recording) and as its second
call (a replay); the three printouts must be equal, and the replay must follow its recording.
Where the notes write to a GPU or to ``G:/``, the examples use the CPU and a temporary directory."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

import compiler


def run_three_ways(fn):
    """``fn``'s printout eagerly, on a compiled first call and on a replay; and the compiled
    function. Each run starts from the same seed."""
    compiled = compiler.compile(fn, backend="interpret")
    printouts = []
    for run in (fn, compiled, compiled):
        torch.manual_seed(0)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            run()
        printouts.append(out.getvalue())
    return printouts, compiled


def check_example(fn):
    """The example prints, as a recording and as a replay, what it prints eagerly."""
    (eager, first_call, replay), compiled = run_three_ways(fn)
    assert eager.strip(), "the example prints nothing"
    assert first_call == eager
    assert replay == eager
    assert (compiled.stats["captures"], compiled.stats["replays"]) == (1, 1), compiled.stats
    assert compiled.stats["divergences"] == 0, compiled.last_backend


def cases(examples, known_limits):
    """pytest parameters: each example, those in ``known_limits`` (name -> why) as strict xfails."""
    for fn in examples:
        reason = known_limits.get(fn.__name__)
        yield pytest.param(fn, marks=pytest.mark.xfail(reason=reason, strict=True)) if reason else fn
