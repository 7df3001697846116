"""Loading generated kernel sources as real ``@triton.jit`` functions, once each.

A real ``@triton.jit`` refuses source ``exec``'d from a string, so each kernel is written to
a file in the cache directory (named by its hash) and imported, as Inductor does. Kernels are
cached by name (a hash of the source): identical kernels from different graphs load once.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import threading

_lock = threading.Lock()
_loaded: dict = {}


def cache_dir() -> str:
    path = os.environ.get("SYMGRAD_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"symgrad-{os.getuid()}", "kernels")
    os.makedirs(path, exist_ok=True)
    return path


def load_kernel(name: str, source: str):
    """The jit function ``name`` defined by ``source`` (written to disk and imported once)."""
    fn = _loaded.get(name)
    if fn is not None:
        return fn
    with _lock:
        fn = _loaded.get(name)
        if fn is not None:
            return fn
        path = os.path.join(cache_dir(), f"{name}.py")
        if not os.path.exists(path) or open(path).read() != source:
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                f.write(source)
            os.replace(tmp, path)
        spec = importlib.util.spec_from_file_location(f"symgrad_kernels.{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        fn = getattr(module, name)
        _loaded[name] = fn
        return fn
