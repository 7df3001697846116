"""The two kinds of compiled call every eager-semantics scenario runs on.

- ``"first_call"``: the recording. It runs the user's function eagerly under the capture
  mode; every observable behaviour must be eager PyTorch's own.
- ``"replay"``: a later call, running the compiled regions.

``compiled(fn, call)`` wraps ``fn`` so that, after the scenario's own warm-up call, its calls
are of that kind: for ``"first_call"`` every call records afresh (the cache is emptied before
each one), for ``"replay"`` the compiled function is used as it is.
"""

from __future__ import annotations

import compiler
from compiler.api import _build
from runtime.dispatch import CompiledFunction

CALLS = ["first_call", "replay"]


class EveryCallRecords(CompiledFunction):
    """A compiled function whose every call is a recording (a first call)."""

    def __call__(self, *args, **kwargs):
        with self.lock:  # (recordings are serialized anyway: threads wait here)
            self.cache.clear()
            return super().__call__(*args, **kwargs)


def compiled(fn, call: str, **options):
    """``fn`` compiled (interpreter backend) so that its calls are of kind ``call``."""
    if call == "first_call":
        return EveryCallRecords(fn, _build, backend="interpret", **options)
    return compiler.compile(fn, backend="interpret", **options)


def assert_ran_as(fn, call: str) -> None:
    """The last call of ``fn`` was of kind ``call``: a recording, or compiled kernels."""
    if call == "first_call":
        assert fn.last_backend == "eager (recording)", fn.last_backend
    else:
        assert fn.last_backend == "interpret", fn.last_backend
        assert fn.stats["kernel_launches"] > 0 and fn.stats["divergences"] == 0, fn.stats
