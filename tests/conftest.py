"""Test set-up: Triton's interpreter (set before triton is imported), a kernel cache of
this session's own, so the Hopper compile test can find every kernel the suite generated,
and strict mode: a compiler bug raises instead of falling back to eager (SYMGRAD_STRICT)."""

import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SYMGRAD_CACHE_DIR", tempfile.mkdtemp(prefix="symgrad-test-kernels-"))
os.environ.setdefault("SYMGRAD_STRICT", "1")

import compiler  # noqa: E402,F401  (import order: before anything imports triton)


def pytest_collection_modifyitems(config, items):
    # The Hopper compile test compiles every kernel the other tests generated: run it last.
    items.sort(key=lambda item: "test_hopper" in item.nodeid)
