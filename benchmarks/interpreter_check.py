"""Without a GPU, our Triton kernels are checked, not timed: each workload at ``tiny`` size,
compiled with ``backend="interpret"`` (the kernels a GPU would run, in Triton's interpreter),
against a float64 eager run of the same steps.

The timed "ours" row on CPU runs a CPU path (``backend="auto"``), whose kernels are not the
Triton ones; this check keeps the GPU program's values under test on a machine without a GPU.
The interpreter is orders of magnitude slower than compiled code, so its time is never reported.

>>> from benchmarks.workloads import WORKLOADS
>>> checked = check(WORKLOADS["gelu"], torch.device("cpu"))
>>> checked.ran, checked.max_err < 1e-3
('interpret', True)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from unittest import mock

import torch

from benchmarks import backends, measure
from benchmarks.compile_time import warm_up
from compiler.reuse.recordings import ENV as STORED_RECORDINGS

SIZE = "tiny"   # a few steps of every workload in the interpreter: seconds, not minutes


@dataclass
class Checked:
    shape: str        # the checked case's sizes (``SIZE``'s, not the timed ones)
    ran: str          # what the checked call ran: "interpret", unless it ran eagerly
    max_err: float    # vs the float64 reference, relative to each tensor's scale (measure.max_error)


def check(workload, device: torch.device, size: str = SIZE) -> Checked:
    """Run ``workload`` as the harness checks a backend (three steps from fresh seeded arguments)
    in float64 eager and with our kernels in the interpreter; compare what the steps observe."""
    case = workload.build(size, device)
    _, reference = _observed(case, backends.EAGER, case.fn, torch.float64, device)
    run = backends.prepare(backends.INTERPRETER_CHECK, case.fn)
    with _recording_afresh():
        ran, observed = _observed(case, backends.INTERPRETER_CHECK, run, torch.float32, device)
    return Checked(case.shape, ran, measure.max_error(observed, reference))


def _recording_afresh():
    """No recordings stored by earlier runs: the checked calls replay their own. (A stored one can
    have the same key and other control flow, e.g. transformer_step's model for the explicit one,
    whose ``explicit`` flag is no tensor: its replays leave it and the third call records again,
    eagerly, checking no kernel of ours.)"""
    return mock.patch.dict(os.environ, {STORED_RECORDINGS: "0"})


def _observed(case, name, run, dtype, device):
    """What the last of the warm-up steps ran, and the tensors it is checked by."""
    args = case.make_args(dtype)
    _, ran, result = warm_up(case, name, run, args, device)
    return ran[-1], _detached(case.observe(args, result))


def _detached(tensors):
    return [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in tensors]
