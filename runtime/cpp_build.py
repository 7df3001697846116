"""Building the C++ CPU kernels (``backend="cpp"``) with the system's compiler, once each, and loading them.

Each kernel (``compiler.codegen.cpp_kernel``) is one translation unit, built into a shared library
by ``$CXX`` or the first of g++ and clang++ that works here, as Inductor's CPU backend requires a
system compiler: ``-O3 -march=native -fopenmp -shared -fPIC``, no ``-ffast-math`` (IEEE division,
NaN and infinity kept) and ``-ffp-contract=off`` (no fused multiply-adds: eager's CPU kernels round
each operation, and the parity tests hold the kernels to that). It is loaded with ctypes.

The cache is the kernel cache's folder (``runtime.kernels.cache_dir``), under ``cpp/``, keyed by the
kernel's name (a hash of its source). As there, nothing on disk is trusted: the source file is
compared byte for byte with the generated source (rewritten where it differs), and a library is
used only beside a stamp holding the SHA-256 of the source it was built from and of its own bytes;
anything else is built again. Files are written under private names and renamed into place, so
processes sharing the cache see whole files.

``available()`` says whether a working compiler was found (checked once per process, by building a
small OpenMP program), and why not.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

log = logging.getLogger("compiler")

# ATen's vector headers, included first by a kernel with a vector body, from the cache folder, where
# a precompiled form of it is built once (g++ reads that instead: ~0.5 s a kernel build, not ~1.5)
VECTOR_HEADER = "symgrad_vec.h"
_VECTOR_HEADER_TEXT = "#pragma once\n#include <ATen/cpu/vec/functional.h>\n#include <ATen/cpu/vec/vec.h>\n"
_LINKING = ("-shared", "-L", "-l", "-Wl,")   # (flags that only the link reads: not the header's build)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-std=c++17")
_lock = threading.Lock()
_name_locks: dict = {}   # kernel name -> the lock its builds take (``build``)
_found: dict = {}      # "compiler": (path or None, why not); "vector": flags for at::vec kernels
_loaded: dict = {}     # kernel name -> its loaded library (ctypes.CDLL)


def compiler_path() -> tuple:
    """(the C++ compiler to build with, or None; why not), found and checked once."""
    with _lock:
        return compiler_path_unlocked()


def available() -> tuple:
    """(whether C++ kernels can be built here, why not)."""
    path, why = compiler_path()
    return path is not None, why


def _find_compiler() -> tuple:
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "clang++"]
    reasons = []
    for name in candidates:
        path = shutil.which(name)
        if path is None:
            reasons.append(f"{name}: not found")
            continue
        problem = _try(path)
        if problem is None:
            return path, ""
        reasons.append(f"{name}: {problem}")
    return None, "no working C++ compiler with OpenMP (" + "; ".join(reasons) + "); set CXX to one"


def _try(path: str) -> str | None:
    """None if ``path`` builds and loads a small OpenMP library, else what went wrong."""
    source = '#include <cmath>\nextern "C" double probe(double x) {\n  double s = 0;\n' \
             '  #pragma omp parallel for reduction(+:s)\n  for (int i = 0; i < 4; ++i) s += std::exp(x);\n' \
             '  return s;\n}\n'
    with tempfile.TemporaryDirectory(prefix="symgrad-cxx-") as tmp:
        src, lib = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(src, "w") as f:
            f.write(source)
        try:
            done = subprocess.run([path, *FLAGS, src, "-o", lib], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            return str(e)
        if done.returncode != 0:
            return done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        try:
            probe = ctypes.CFUNCTYPE(ctypes.c_double, ctypes.c_double)(("probe", ctypes.CDLL(lib)))
        except (OSError, AttributeError) as e:
            return str(e)
        return None if abs(probe(0.0) - 4.0) < 1e-12 else "the probe computed a wrong value"


def vector_flags() -> tuple:
    """What a kernel's vector body (``at::vec::Vectorized``, ATen's SIMD types and math, as eager's
    CPU kernels and Inductor's C++ kernels use them) is built with: torch's headers, the SIMD
    capability torch runs with here, linked to torch's CPU library (whose Sleef functions the vector
    math calls). Where that does not build, ``-DSYMGRAD_SCALAR_ONLY``: the scalar loops alone."""
    with _lock:
        if "vector" not in _found:
            _found["vector"] = _vector_flags()
        return _found["vector"]


def _vector_flags() -> tuple:
    import torch
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return ("-DSYMGRAD_SCALAR_ONLY",)
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    flags = (*[f"-I{p}" for p in cpp_extension.include_paths()], f"-DCPU_CAPABILITY_{capability}",
             f"-DCPU_CAPABILITY={capability}", f"-L{lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}")
    path, _ = compiler_path_unlocked()
    probe = '#include <ATen/cpu/vec/vec.h>\nextern "C" void probe(float* x) {\n' \
            '  auto v = at::vec::Vectorized<float>::loadu(x); v.exp().store(x);\n}\n'
    with tempfile.TemporaryDirectory(prefix="symgrad-cxx-vec-") as tmp:
        src = os.path.join(tmp, "probe.cpp")
        with open(src, "w") as f:
            f.write(probe)
        done = subprocess.run([path, *FLAGS, *flags, src, "-o", os.path.join(tmp, "probe.so")], capture_output=True,
                              text=True, timeout=300)
    if done.returncode != 0:
        log.info("compiler: C++ kernels are built without vector bodies (ATen's headers did not build: %s)",
                 done.stderr.strip()[-300:])
        return ("-DSYMGRAD_SCALAR_ONLY",)
    return flags


def compiler_path_unlocked() -> tuple:
    if "compiler" not in _found:
        _found["compiler"] = _find_compiler()
    return _found["compiler"]


def _folder() -> str:
    from runtime.kernels import cache_dir

    path = os.path.join(cache_dir(), "cpp")
    os.makedirs(path, exist_ok=True)
    return path


def library(name: str, source: str, vectorized: bool = False):
    """The shared library ``name`` built from ``source`` (or found, checked), loaded once (ctypes);
    ``vectorized``: the source includes ``VECTOR_HEADER``."""
    lib = _loaded.get(name)
    if lib is not None:
        return lib
    path = build(name, source, vectorized)
    with _lock:
        lib = _loaded.get(name)
        if lib is None:
            lib = _loaded[name] = ctypes.CDLL(path)
    return lib


def load(name: str, source: str, argtypes: list, function: str | None = None, vectorized: bool = False):
    """The C function ``function`` (default: ``name``) of library ``name``, taking ``argtypes``
    (ctypes types) and returning an int (a kernel's: 1 where a gather met an index out of range)."""
    return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)((function or name, library(name, source, vectorized)))


def build(name: str, source: str, vectorized: bool = False) -> str:
    """The path of ``name``'s shared library, built from ``source`` unless a checked one is there
    (``vectorized``: it includes ``VECTOR_HEADER``, made first where it is missing)."""
    compiler, why = compiler_path()
    if compiler is None:
        raise RuntimeError(f"C++ kernels cannot be built here: {why}")
    # (one build of a name at a time in this process: a kernel shared by a region's forward and
    # backward is one job each; the second finds the first's library, stamped, instead of a half-written one)
    with _lock:
        lock = _name_locks.setdefault(name, threading.Lock())
    with lock:
        return _build_locked(name, source, vectorized, compiler)


def _build_locked(name: str, source: str, vectorized: bool, compiler: str) -> str:
    folder = _folder()
    src, lib, stamp = (os.path.join(folder, f"{name}{ext}") for ext in (".cpp", ".so", ".stamp"))
    source_hash = hashlib.sha256(source.encode()).hexdigest()
    _write_whole(src, source.encode())
    if _stamped(lib, stamp, source_hash):
        return lib
    tmp = f"{lib}.{os.getpid()}.{threading.get_ident()}.tmp"
    flags = vector_flags()
    if vectorized and "-DSYMGRAD_SCALAR_ONLY" not in flags:
        _vector_header(folder, compiler, flags)
    done = subprocess.run([compiler, *FLAGS, src, "-o", tmp, f"-I{folder}", *flags], capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{compiler} failed on {src}: {done.stderr[-2000:]}")
    with open(tmp, "rb") as f:
        library_hash = hashlib.sha256(f.read()).hexdigest()
    os.replace(tmp, lib)
    _write_whole(stamp, f"{source_hash} {library_hash}\n".encode())
    return lib


_header_lock = threading.Lock()


def _vector_header(folder: str, compiler: str, flags: tuple) -> None:
    """``VECTOR_HEADER`` in ``folder``, and its precompiled form, built once (under a lock of its own:
    the first kernel build of a pool waits for it, the others then use it). Where the precompiled
    header cannot be built the header is still there, read by each build. A stale or damaged one
    is not used: g++ checks it against the build's options and falls back to the header."""
    header = os.path.join(folder, VECTOR_HEADER)
    with _header_lock:
        _write_whole(header, _VECTOR_HEADER_TEXT.encode())
        compiled = header + ".gch"
        if os.path.exists(compiled):
            return
        options = [f for f in (*FLAGS, *flags) if not f.startswith(_LINKING)]
        tmp = f"{compiled}.{os.getpid()}.tmp"
        done = subprocess.run([compiler, *options, "-x", "c++-header", header, "-o", tmp], capture_output=True,
                              text=True, timeout=600)
        if done.returncode == 0:
            os.replace(tmp, compiled)
        else:
            log.info("compiler: no precompiled %s (%s); each C++ kernel reads ATen's headers", VECTOR_HEADER,
                     done.stderr.strip()[-200:])


def _stamped(lib: str, stamp: str, source_hash: str) -> bool:
    """Whether ``lib`` is the build of the source hashed ``source_hash``, undamaged."""
    try:
        with open(stamp) as f:
            built_from, library_hash = f.read().split()
        with open(lib, "rb") as f:
            found = hashlib.sha256(f.read()).hexdigest()
    except (OSError, ValueError):
        return False
    if built_from == source_hash and found == library_hash:
        return True
    log.warning("C++ kernel cache: %s did not match its stamp; building it again", lib)
    return False


def _write_whole(path: str, data: bytes) -> None:
    """``path`` holds exactly ``data``: written (privately, then renamed) where it differs."""
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return
    except FileNotFoundError:
        pass
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
