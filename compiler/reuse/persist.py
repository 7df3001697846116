"""Compiled regions on disk: a region graph seen before, in this process or another, is loaded
instead of being differentiated (SymPy), fused and rendered again.

The key of a region is everything its compiled form depends on: the captured graph (each
node's op, arguments and metadata — shapes, dtypes, devices, requires_grad, SymPy expressions),
which inputs it writes in place and which the function writes after it, the saved-set policy,
and the versions of Python, torch, triton, sympy and this package's own source (a hash of every
``compiler/`` and ``runtime/`` file, so an edit or an upgrade never loads a stale build). The
entry holds the ``CompiledRegion`` (its programs: kernel sources, launches, matmul calls,
views) and what ``explain`` shows (the backward graph, the kernels and the user ops each
fused). Kernel sources load through ``runtime.kernels`` (checked against the file on disk).

Three parts of a region are closures over autodiff's graphs and are not stored: the double
backward (``create_graph=True``), the backward of a subset of the outputs, and anomaly mode's
NaN explanation. A loaded region builds them the long way the first time one is needed, and
uses them only if that build saves the same values in the same order as the loaded one.

Where: ``$SYMGRAD_CACHE_DIR/regions`` (by default under the temp dir, next to the kernels).
Entries are written to a private name and renamed into place (processes share the folder);
each carries a SHA-256 of its bytes, and an entry that fails the check or does not load is
deleted, logged and rebuilt. ``SYMGRAD_REGION_CACHE=0`` turns the cache off;
``compiler.clear_cache()`` (or deleting the folder) empties it.

This is the compile half of the persistent cache; ``compiler.reuse.recordings`` stores the recordings
that name these regions, so that a fresh process replays from its first call.
"""

from __future__ import annotations

import copyreg
import dataclasses
import functools
import hashlib
import io
import logging
import os
import pickle
import shutil
import sys
import threading

import torch.fx as fx

from runtime.autograd_bridge import OnDemand
from runtime.kernels import cache_dir
from runtime.program import KernelLaunch

log = logging.getLogger("symgrad.cache")
ENV = "SYMGRAD_REGION_CACHE"
_MAGIC = b"SYMGRAD-REGION-1\n"
_LAZY = ("partial_backward", "double_backward", "explain_nan")  # OnDemand's parts: rebuilt when first asked


def enabled() -> bool:
    """Whether compiled regions are stored and loaded (``SYMGRAD_REGION_CACHE=0``: not)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def regions_dir() -> str:
    return os.path.join(cache_dir(), "regions")


def clear_cache() -> None:
    """Delete every stored compiled region, recording and kernel source in ``SYMGRAD_CACHE_DIR`` (what
    this package wrote there: ``regions/``, ``recordings/`` and the kernels' ``.py`` files; nothing else is touched);
    the next calls compile again. Kernels already loaded in this process stay loaded."""
    root = cache_dir()
    shutil.rmtree(os.path.join(root, "regions"), ignore_errors=True)
    shutil.rmtree(os.path.join(root, "recordings"), ignore_errors=True)  # (compiler.reuse.recordings)
    for name in os.listdir(root):
        if name.endswith((".py", ".tmp")) and os.path.isfile(os.path.join(root, name)):
            try:
                os.remove(os.path.join(root, name))
            except FileNotFoundError:
                pass


@functools.lru_cache(maxsize=1)
def build_versions() -> str:
    """The versions every cache key holds: Python, torch, triton, sympy, and a hash of this
    package's own source (an edit or an upgrade never loads a stale entry)."""
    import sympy
    import torch
    import triton

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (the repository)
    code = hashlib.sha256()
    for package in ("compiler", "runtime"):
        for folder, dirs, files in sorted(os.walk(os.path.join(here, package))):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    with open(os.path.join(folder, name), "rb") as f:
                        code.update(name.encode() + b"\0" + f.read())
    return f"py{sys.version_info[:3]} torch{torch.__version__} triton{triton.__version__} sympy{sympy.__version__} " \
           f"code{code.hexdigest()[:16]}"


def _settings() -> str:
    """The compiler's tunable constants as they are now (``tiling.PERSISTENT_MAX``, ...): upper-case
    module attributes of plain values, which a test or a user may change at run time."""
    out = []
    # NOTE: copies first (one C call each): another thread importing a module meanwhile changes
    # sys.modules, and iterating it then raised (CI's thread stress test, 2a66be7)
    for name, module in sorted(sys.modules.copy().items()):
        if module is None or not name.startswith(("compiler.", "runtime.")):
            continue
        for attr, value in sorted(vars(module).copy().items()):
            if attr.isupper() and type(value) in (int, float, bool, str, tuple) and " at 0x" not in repr(value):
                out.append(f"{name}.{attr}={value!r}")
    return ";".join(out)


def region_key(graph: fx.Graph, mutated, options: dict, backend: str) -> str | None:
    """The key of a region graph built for ``backend`` (a hex digest; its programs keep the backend
    they were built for: ``runtime.backends``), or None when some part of it has no stable text
    (an object printed by address): such a region is compiled every time."""
    index = {}
    options = sorted((k, sorted(v) if isinstance(v, (set, frozenset)) else v) for k, v in options.items())
    parts = [build_versions(), _settings(), backend, repr(sorted(mutated)), repr(options)]
    for i, node in enumerate(graph.nodes):
        index[node] = i
        target = node.target
        if node.op == "call_function":
            fn = getattr(target, "torch_fn", None)
            target_text = (f"{type(target).__module__}.{type(target).__qualname__}:{getattr(target, 'name', '')}:"
                           f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}")
        else:
            target_text = str(target)
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{index[n]}")
        meta = sorted((k, repr(v)) for k, v in node.meta.items() if k != "val")
        parts.append(f"{node.op} {target_text} {args!r} {meta!r}")
    text = "\n".join(parts)
    if " at 0x" in text:
        return None
    return hashlib.sha256(text.encode()).hexdigest()


# -- storing ------------------------------------------------------------------------------------
def _reduce_launch(launch: KernelLaunch):
    """A kernel launch without what it loaded at run time (the jit function, bound launchers).
    Kept: a shape-generic kernel's size arguments, the CPU path's function (``torch_kernel``, as
    source text), the buffer reuse (without it a loaded step allocates every output anew: a
    higher peak than the step built here) and the index checks (without them a loaded kernel's
    out-of-range index would not raise eager's IndexError)."""
    kept = ("name", "source", "loads", "stores", "grid", "xblock", "rblock", "bytes_moved", "num_warps", "wide_name",
            "wide_source", "sizes", "reuse", "torch_kernel", "index_checks")
    return _launch, ({name: getattr(launch, name) for name in kept},)


def _launch(fields: dict) -> KernelLaunch:
    return KernelLaunch(**fields)


class _NodeRef:
    """A node of a pickled graph, by its position (``_reduce_graph``)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __reduce__(self):
        return _NodeRef, (self.index,)


def _reduce_graph(graph: fx.Graph):
    """A graph as a flat list of its nodes. (Pickled as it is, an fx graph recurses once per node
    through its linked list: a model's backward graph exceeds Python's recursion limit.)"""
    index = {}
    nodes = []
    for i, node in enumerate(graph.nodes):
        index[node] = i
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: _NodeRef(index[n]))
        nodes.append((node.op, node.name, node.target, args, kwargs, node.type, dict(node.meta)))
    return _rebuild_graph, (nodes,)


def _rebuild_graph(nodes) -> fx.Graph:
    graph, made = fx.Graph(), []
    for op, name, target, args, kwargs, type_expr, meta in nodes:
        args, kwargs = fx.node.map_aggregate(
            (args, kwargs), lambda a: made[a.index] if isinstance(a, _NodeRef) else a)
        node = graph.create_node(op, target, args, kwargs, name=name, type_expr=type_expr)
        node.meta = meta
        made.append(node)
    return graph


class RegionPickler(pickle.Pickler):
    """Pickles compiled regions: kernel launches without what they loaded at run time, graphs as
    flat lists of nodes."""
    dispatch_table = copyreg.dispatch_table.copy()
    dispatch_table[KernelLaunch] = _reduce_launch
    dispatch_table[fx.Graph] = _reduce_graph


def store(key: str, region, backward_graph, kernels) -> None:
    """Write one compiled region (without its OnDemand closures and run-time caches) under ``key``."""
    lazy = [name for name in _LAZY if getattr(region.on_demand, name) is not None]
    try:
        buffer = io.BytesIO()
        RegionPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(
            {"region": dataclasses.replace(region, on_demand=OnDemand(), stats={}), "lazy": lazy,
             "backward_graph": backward_graph, "kernels": kernels})
    except Exception as e:  # noqa: BLE001 — something in it does not pickle: compiled each time, said once
        log.info("compiled region not stored (%s: %s)", type(e).__name__, e)
        return
    write_checked(_path(key), buffer.getvalue())


def write_checked(path: str, payload: bytes, magic: bytes = _MAGIC) -> None:
    """Write ``payload`` to ``path`` with its magic line and SHA-256, under a private name renamed
    into place: a process reading the folder sees the whole file or none."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "wb") as f:
        f.write(magic + hashlib.sha256(payload).digest() + payload)
    os.replace(tmp, path)


def read_checked(path: str, magic: bytes = _MAGIC) -> bytes | None:
    """The payload ``write_checked`` wrote to ``path``; None if there is no such file. Raises
    ValueError where the file is damaged (truncated, garbled, another format)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    head = len(magic) + 32
    if data[:len(magic)] != magic or hashlib.sha256(data[head:]).digest() != data[len(magic):head]:
        raise ValueError("its checksum does not match its contents")
    return data[head:]


def load(key: str, rebuild):
    """(region, backward graph, kernels) stored under ``key``, or None. ``rebuild()`` builds
    the region the long way; a loaded region calls it for its closures, the first time one is
    needed. A damaged entry is deleted (and logged): the caller builds and stores it again."""
    path = _path(key)
    try:
        payload = read_checked(path)
        if payload is None:
            return None
        entry = pickle.loads(payload)
        region = entry["region"]
    except Exception as e:  # noqa: BLE001 — truncated, garbled, or from an incompatible build
        discard_damaged(path, "compiled-region cache entry", "compiling again", e)
        return None
    lazy = _LazyParts(region, rebuild)  # (it compares the saved set and kernels: the copy below shares them)
    region = dataclasses.replace(region, on_demand=OnDemand(**{name: functools.partial(lazy.call, name)
                                                               for name in entry["lazy"]}))
    return region, entry["backward_graph"], entry["kernels"]


def discard_damaged(path: str, what: str, instead: str, error: BaseException) -> None:
    """Delete a cache file that does not load, saying so (the caller then does ``instead``)."""
    log.warning("%s %s is damaged (%s: %s); deleting it and %s", what, path, type(error).__name__, error, instead)
    try:
        os.remove(path)
    except FileNotFoundError:  # (another process deleted it first)
        pass


def _path(key: str) -> str:
    return os.path.join(regions_dir(), key[:2], f"{key}.pkl")


class _LazyParts:
    """The closures of a loaded region, from a build of the same graph made when first needed.
    That build must save the same values in the same order (its backward programs read the
    loaded forward's saved tensors); if it does not, the loaded region says so and the part
    is unavailable: the partial backward then gives zeros for the absent outputs' gradients
    (as with no partial backward), the others raise."""

    def __init__(self, region, rebuild):
        self.region = region
        self.rebuild = rebuild
        self.built = None
        self.lock = threading.Lock()

    def _built(self):
        with self.lock:
            if self.built is None:
                built = self.rebuild()
                same = (built.saved == self.region.saved and built.grad_output_for == self.region.grad_output_for
                        and [k.name for k in built.forward.kernels] == [k.name for k in self.region.forward.kernels])
                self.built = built if same else False
                if not same:
                    log.warning("a loaded compiled region differs from a fresh build of its graph; its double "
                                "backward and partial backward are unavailable (please report this)")
            return self.built

    def call(self, name, *args):
        built = self._built()
        if built is False:
            if name == "partial_backward":
                return None
            raise RuntimeError("symgrad: a compiled region loaded from the cache cannot run this backward "
                               "(a fresh build of its graph differs); set SYMGRAD_REGION_CACHE=0 and run again")
        return getattr(built.on_demand, name)(*args)
