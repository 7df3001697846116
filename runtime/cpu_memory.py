"""Large CPU buffers kept for reuse: a caching allocator for the C++ kernels' outputs.

On a CPU, PyTorch's allocator hands every large tensor fresh pages from the operating system
(glibc serves allocations of 32 MB and more, and often far less, with ``mmap``, and returns them at
``free``), and each page faults when first written: on this 2-core machine a 32 MB output costs
~10 ms of page faults against ~2 ms to write it. A training step allocates the same buffers every
step, so the C++ kernels take their large outputs from this pool, as CUDA's caching allocator
serves the Triton kernels' outputs on a GPU: freed buffers are kept and handed out again.

A buffer is free when nothing but the pool holds its storage: no tensor, view or saved tensor
(``torch._C._storage_Use_Count``, the storage's strong references: weak ones do not count), and no
Python reference to its storage object besides the pool's (``t.untyped_storage()`` returns the
pool's own object: PyTorch keeps one Python object per storage). What is handed out is an
ordinary resizable CPU tensor on that storage.

The pool keeps at most ``SYMGRAD_CPU_POOL_BYTES`` (default: an eighth of physical memory, at most
4 GiB; 0 turns it off) of buffers; beyond that a buffer is allocated as usual and not kept.
Buffers under ``MIN_BYTES`` come from PyTorch's allocator (malloc's heap serves them without
faults). ``release()`` lets go of every free buffer (their memory goes back to the system).
"""

from __future__ import annotations

import os
import sys
import threading

import torch

POOL_ENV = "SYMGRAD_CPU_POOL_BYTES"
MIN_BYTES = 1 << 20

_use_count = torch._C._storage_Use_Count


def _default_limit() -> int:
    value = os.environ.get(POOL_ENV, "").strip()
    if value:
        try:
            return max(int(float(value)), 0)
        except ValueError:
            raise ValueError(f"{POOL_ENV}={value!r}: give a number of bytes (0 turns the pool off)") from None
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 8 << 30
    return min(physical // 8, 4 << 30)


class BufferPool:
    def __init__(self, limit: int | None = None):
        self.limit = _default_limit() if limit is None else limit
        self.held = 0                  # bytes of the buffers kept
        self.buckets: dict = {}        # nbytes -> [UntypedStorage]
        self.reused = 0                # buffers handed out again (for tests and benchmarks)
        self._lock = threading.Lock()  # (PyTorch's ops release the GIL: two threads must not take one buffer)

    def empty(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A new contiguous tensor of ``shape`` and ``dtype`` (its values undefined, as ``torch.empty``'s)."""
        nbytes = dtype.itemsize
        for size in shape:
            nbytes *= size
        if nbytes < MIN_BYTES or self.limit == 0:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            bucket = self.buckets.get(nbytes)
            if bucket is not None:
                for storage in bucket:
                    # (only the pool holds it; a user's resize_ may have swapped its memory: sized again)
                    if _use_count(storage._cdata) == 1 and sys.getrefcount(storage) <= _POOL_REFERENCES \
                            and storage.nbytes() == nbytes:
                        self.reused += 1
                        return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
            storage = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
            if self.held + nbytes <= self.limit:
                self.buckets.setdefault(nbytes, []).append(storage)
                self.held += nbytes
            return torch.empty(0, dtype=dtype).set_(storage, 0, shape)

    def release(self) -> None:
        """Let go of every buffer nothing else holds (the others stay in use, no longer kept)."""
        with self._lock:
            self.buckets.clear()
            self.held = 0


def _pool_references() -> int:
    """How many references a storage that only the pool holds has where ``empty`` counts them (its
    bucket's, the loop's variable, ``getrefcount``'s argument): measured, not assumed."""
    bucket = [torch.empty(1, dtype=torch.uint8).untyped_storage()]
    for storage in bucket:
        return sys.getrefcount(storage)


_POOL_REFERENCES = _pool_references()
POOL = BufferPool()
