"""Test set-up: Triton's interpreter (set before triton is imported), a kernel cache of
this session's own, so the Hopper compile test can find every kernel the suite generated,
strict mode: a compiler bug raises instead of falling back to eager (SYMGRAD_STRICT), and
backend="auto" on CPU tensors running the real Triton kernels in Triton's interpreter
(SYMGRAD_CPU_BACKEND=interpret; tests/test_cpu_backend.py runs the CPU path explicitly), and
no recordings stored across calls of compile() (SYMGRAD_STORED_RECORDINGS=0): a test's first call
of a function must record, not replay what an earlier test of the same code stored
(tests/test_stored_recordings.py turns them on)."""

import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SYMGRAD_CACHE_DIR", tempfile.mkdtemp(prefix="symgrad-test-kernels-"))
os.environ.setdefault("SYMGRAD_STRICT", "1")
os.environ.setdefault("SYMGRAD_CPU_BACKEND", "interpret")
os.environ.setdefault("SYMGRAD_STORED_RECORDINGS", "0")

import compiler  # noqa: E402,F401  (import order: before anything imports triton)


def pytest_collection_modifyitems(config, items):
    # The Hopper compile test compiles every kernel the other tests generated: run it last.
    items.sort(key=lambda item: "test_hopper" in item.nodeid)
