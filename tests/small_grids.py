"""Test knob: run a kernel path the full-size GPU rules pick, at a size the interpreter runs fast.

Which kernels fusion makes depends on ``MIN_PROGRAMS`` (the programs a grid needs to fill an
H100's SMs: 264): a reduction with fewer is split (in chunks of at least ``SPLIT_MIN_CHUNK``
elements), a norm's column sums are computed beside its rows only with that many chunks of rows.
Value tests that need those paths would run hundreds of programs through Triton's interpreter
(minutes a test on 2 cores); ``fewer_programs`` lowers the bars to ``SMALL_GRID`` programs and
``SMALL_CHUNK`` elements for one test, so the same paths are taken with a few hundred rows.
The structure tests (``compiler.explain``: which kernels, what they read) keep the real constant.

    SYMGRAD_FULL_SIZE_KERNEL_TESTS=1 python -m pytest tests/test_column_sums.py tests/test_long_rows.py

runs the value tests at the real constant and sizes (the long run).
"""

import os

from compiler.fusion import fuse as fusion

FULL_SIZE = os.environ.get("SYMGRAD_FULL_SIZE_KERNEL_TESTS", "") not in ("", "0")
SMALL_GRID = 8
SMALL_CHUNK = 32


def fewer_programs(monkeypatch) -> int:
    """Lower fusion's MIN_PROGRAMS to SMALL_GRID and SPLIT_MIN_CHUNK to SMALL_CHUNK for this test (unless
    FULL_SIZE); returns the MIN_PROGRAMS in effect, from which the test sizes its tensors."""
    if not FULL_SIZE:
        monkeypatch.setattr(fusion, "MIN_PROGRAMS", SMALL_GRID)
        monkeypatch.setattr(fusion, "SPLIT_MIN_CHUNK", SMALL_CHUNK)
        monkeypatch.setattr(fusion, "NO_SPLIT_NUMEL", 0)   # small rows take the split paths too
    return fusion.MIN_PROGRAMS
