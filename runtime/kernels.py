"""Loading generated kernel sources as real ``@triton.jit`` functions, once each.

A real ``@triton.jit`` refuses source ``exec``'d from a string, so each kernel is written to
a file in the cache directory (named by a hash of its body) and loaded from there, as Inductor
does. Kernels are cached by name: identical kernels from different graphs load once.

The cache directory is shared: by the threads of a process and by processes running at once
(one ``SYMGRAD_CACHE_DIR`` for a whole CI job). Files are written to a private temporary name
and renamed into place, so a reader sees a whole file or none. A file that is there is never
trusted: its bytes are compared with the source the compiler just generated, and a file that
differs (truncated by a full disk, garbled, edited by hand) is rewritten before it is loaded.
The module is compiled from the verified source itself, never from a ``__pycache__`` file, so
stale or damaged bytecode cannot run either.
"""

from __future__ import annotations

import linecache
import logging
import os
import sys
import tempfile
import threading
import types

log = logging.getLogger("compiler")

_lock = threading.Lock()
_loaded: dict = {}


def cache_dir() -> str:
    """The kernel cache directory: ``$SYMGRAD_CACHE_DIR`` or a per-user one under the temp dir."""
    chosen = os.environ.get("SYMGRAD_CACHE_DIR")
    if chosen:
        os.makedirs(chosen, exist_ok=True)
        return chosen
    return _default_cache_dir()


_private: list = []  # a folder of this process's own, where the shared default is not safe


def _default_cache_dir() -> str:
    owner = os.path.join(tempfile.gettempdir(), f"symgrad-{os.getuid()}")
    path = os.path.join(owner, "kernels")
    os.makedirs(owner, mode=0o700, exist_ok=True)
    os.makedirs(path, mode=0o700, exist_ok=True)
    # NOTE: the cache holds code that is loaded (kernel sources) and pickles that are read: a
    # folder under the shared temp dir that another user made (or anyone may write) would let
    # them run code here. Such a folder is not used. (Group-writable is left alone: with a umask
    # of 002 a user's own folders are, and the group is usually the user's own.)
    info = os.stat(owner)
    if info.st_uid == os.getuid() and not info.st_mode & 0o002:
        return path
    with _lock:
        if not _private:
            _private.append(tempfile.mkdtemp(prefix="symgrad-cache-"))
            log.warning("compiler: %s belongs to another user or anyone may write it; caching in %s for this "
                        "process only (set SYMGRAD_CACHE_DIR to a folder of your own to keep the cache)", owner,
                        _private[0])
    return _private[0]


def load_kernel(name: str, source: str):
    """The jit function ``name`` defined by ``source`` (written to disk, checked and loaded once)."""
    fn = _loaded.get(name)
    if fn is not None:
        return fn
    with _lock:
        fn = _loaded.get(name)
        if fn is not None:
            return fn
        path = os.path.join(cache_dir(), f"{name}.py")
        _ensure_file(path, source)
        fn = getattr(_load_module(name, path, source), name)
        _loaded[name] = fn
        return fn


def _ensure_file(path: str, source: str) -> None:
    """Make ``path`` hold exactly ``source``: write it when it is missing or differs."""
    expected = source.encode()
    try:
        with open(path, "rb") as f:
            found = f.read()
    except FileNotFoundError:
        found = None
    if found == expected:
        return
    if found is not None:
        # NOTE: another process writes whole files only (rename into place), so a difference
        # is damage from outside: say so, then replace it with the right source.
        log.warning("kernel cache file %s did not match its kernel's source (%d bytes found, %d expected); "
                    "rewriting it", path, len(found), len(expected))
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "wb") as f:
        f.write(expected)
    os.replace(tmp, path)


def _load_module(name: str, path: str, source: str) -> types.ModuleType:
    # Compiled from the checked source (not imported: an import could use a stale .pyc).
    # triton.jit reads a kernel's source back through inspect/linecache; seeding linecache
    # with the checked text (no mtime: never invalidated) keeps a later change to the file
    # on disk from reaching the jit function.
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    module = types.ModuleType(f"symgrad_kernels.{name}")
    module.__file__ = path
    sys.modules[module.__name__] = module
    exec(compile(source, path, "exec"), module.__dict__)
    return module
