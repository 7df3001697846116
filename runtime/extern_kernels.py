"""Our Triton kernels that extern calls launch themselves (flash attention's, the chunked loss's):
run, or handed to whoever records them.

``launches_recorded(on_launch)``: within the block, this thread's such launches go to
``on_launch(kernel, grid, args, options, cost)`` instead of running (the sm_90 compiles and the
roofline of ``benchmarks``, the meta-device run of ``runtime.ahead_of_time``: the launch as a GPU
would get it, never run). ``cost`` says what the launch does: flash attention's phase, FLOPs,
bytes, head dim, length, causality and dtype (``runtime.attention``), or ``{"kind": "memory",
"bytes": B}`` for a memory-bound kernel priced by its bytes.
"""

from __future__ import annotations

import contextlib
import threading

_recording = threading.local()


@contextlib.contextmanager
def launches_recorded(on_launch):
    saved = getattr(_recording, "on_launch", None)
    _recording.on_launch = on_launch
    try:
        yield
    finally:
        _recording.on_launch = saved


def recording() -> bool:
    """Whether this thread's launches are being recorded (not run)."""
    return getattr(_recording, "on_launch", None) is not None


def launch(kernel, grid, args, options, cost) -> None:
    """``kernel[grid](*args, **options)``, or its hand-over to the recorder in effect."""
    on_launch = getattr(_recording, "on_launch", None)
    if on_launch is not None:
        on_launch(kernel, grid, args, options, cost)
        return
    kernel[grid](*args, **options)
