"""Benchmarks: our compiler vs eager PyTorch vs torch.compile. See ``benchmarks/README.md``.

    python -m benchmarks                  # CPU-only machine: --cpu sizes, ours timed as backend="auto"
    PYTHONPATH=. python -m benchmarks     # GPU machine: the full suite

From Python: ``benchmarks.run(size="tiny", only=["overhead_step"])`` (see ``harness.run``).
"""

import compiler  # noqa: F401  (first: it must come before anything imports triton)

from benchmarks.harness import run  # noqa: E402

__all__ = ["run"]
