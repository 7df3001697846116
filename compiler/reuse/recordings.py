"""Recordings on disk: a fresh process's first call of a function seen before replays at once.

A recording (``runtime.trace.Recording``, capture's hand-off) is what the first call of a function learned: its torch
calls, its regions' captured graphs, the tensors it reached outside its arguments. Stored after
it compiled, it lets another process skip the eager recording run: the regions it names load from
the compiled-region cache (``compiler.reuse.persist``: no SymPy, no fusion, no codegen), and the call
replays, checked call by call as every replay is (a call that departs from the recording runs
eagerly and records again, as in the process that stored it).

What the recording holds by identity is stored as a *path* from the function's roots and found
again by walking it in the new process:

* roots: the call's arguments (``("arg", i)``, leaves as ``runtime.calls.flatten_call`` makes
  them), the function itself when it is a module or the ``self`` of a bound method, its closure
  cells, its default argument values and the globals its code names;
* steps: a module's submodules, parameters and buffers by name; an optimizer's parameters by
  group and position and their state (``exp_avg``...) by key; items of lists, tuples and dicts;
  the attributes of a bound method's object (a trainer's ``self.model``, ``self.opt``).

So a parameter the recording read as ``model.0.weight`` is the new process's ``model.0.weight``
(guarded at replay by identity, as always). A recording that holds something no path reaches (a
tensor made before the call and reached another way, a hook function, a module made inside the
call) is not stored; the reason is logged at INFO on the ``symgrad.cache`` logger. A stored
recording whose paths do not all lead to objects in this process (an optimizer whose state does
not exist yet) waits: it is tried again on the next calls with the same key.

The key of a call (which recordings it may use) holds what the in-process guard key holds, made
portable: the function's identity (module, qualified name, file, and its code: constants, names
and bytecode, recursively; its closure cells' and default arguments' values, described as arguments
are, functions by name and code, other objects by type: ``lambda x, fn=fn: fn(x)`` made with two
``fn`` has two keys), each argument's description (a tensor's shape, dtype, device and
requires_grad; a module's class and its parameters' and buffers' names and metadata; an
optimizer's class and group sizes; a plain constant's value), grad mode, autocast, and the
versions of Python, torch, triton, sympy and this package's source (as the region cache's key).

Where: ``$SYMGRAD_CACHE_DIR/recordings/<key>/``, one checked file per recording (SHA-256,
written to a private name and renamed into place), the newest ``MAX_STORED`` kept. A damaged file
is deleted, logged and ignored. ``SYMGRAD_STORED_RECORDINGS=0`` turns this off (the tests do, but
for the tests of this module: a test's first call must record); ``compiler.clear_cache()``
deletes the folder too.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import io
import logging
import os
import pickle
import sys
import types
import weakref
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from compiler.reuse import persist
from runtime.kernels import cache_dir

log = logging.getLogger("symgrad.cache")
ENV = "SYMGRAD_STORED_RECORDINGS"
MAX_STORED = 4  # recordings kept per key (the dispatcher keeps as many per guard key)
_MAGIC = b"SYMGRAD-RECORDING-1\n"


class NotStorable(Exception):
    """The recording holds something another process cannot find again (said at INFO)."""


class Unresolved(Exception):
    """A stored recording's path does not lead to an object in this call's roots (yet)."""


def enabled() -> bool:
    """Whether recordings are stored and loaded (``SYMGRAD_STORED_RECORDINGS=0``: not)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def recordings_dir() -> str:
    return os.path.join(cache_dir(), "recordings")


# -- the key --------------------------------------------------------------------------------------
def portable_key(fn, spec, leaves) -> str:
    """The key of a call across processes (a hex digest). Raises NotStorable where the function or
    an argument has no description that means the same in another process."""
    parts = [persist.build_versions(), _function_identity(fn), repr(spec), repr(torch.is_grad_enabled()),
             repr(tuple((torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None)
                        for d in ("cpu", "cuda")))]
    parts.extend(_describe_argument(x) for x in leaves)
    text = "\n".join(parts)
    if " at 0x" in text:
        raise NotStorable("an argument is described by its address")
    return hashlib.sha256(text.encode()).hexdigest()


def _function_identity(fn) -> str:
    if isinstance(fn, torch.nn.Module):
        forward = type(fn).forward
        return (f"module {type(fn).__module__}.{type(fn).__qualname__} {_code_text(forward.__code__)} "
                f"{_describe_defaults(forward)}")
    func = getattr(fn, "__func__", fn)  # a bound method: its function (its self is a root)
    code = getattr(func, "__code__", None)
    if code is None:
        raise NotStorable(f"{type(fn).__name__} objects have no code to key a stored recording by")
    # (a closure's cells are part of what the code means: ``lambda x: fn(x, -1)`` made with
    # torch.softmax and with torch.log_softmax is one code object; so are its default arguments'
    # values: ``lambda x, fn=fn: fn(x, -1)``)
    cells = [_describe_cell(cell) for cell in getattr(func, "__closure__", None) or ()]
    return (f"{getattr(func, '__module__', '')}.{getattr(func, '__qualname__', '')} "
            f"{code.co_filename}:{code.co_firstlineno} {_code_text(code)} {cells} {_describe_defaults(func)}")


def _describe_defaults(func) -> str:
    """A function's default argument values (``__defaults__``, ``__kwdefaults__``), described as
    closure cells are: tensors by metadata (the recording holds them by identity, found again by
    path: ``_roots``), constants by value, functions by name and code, other objects by type."""
    defaults = getattr(func, "__defaults__", None) or ()
    kwdefaults = getattr(func, "__kwdefaults__", None) or {}
    if not defaults and not kwdefaults:
        return "no defaults"
    return (f"defaults {[_describe_value(v) for v in defaults]} "
            f"{[(k, _describe_value(v)) for k, v in sorted(kwdefaults.items())]}")


def _describe_cell(cell) -> str:
    """A closure cell's value, as far as it can be said across processes: tensors, modules and
    constants as arguments are; functions by name (and code); anything else by its type (its
    effect on the torch calls is still checked call by call on replay)."""
    try:
        value = cell.cell_contents
    except ValueError:
        return "empty"
    return _describe_value(value)


def _describe_value(value, depth=0) -> str:
    try:
        return _describe_argument(value)
    except NotStorable:
        pass
    if type(value) in (list, tuple) and depth < 2 and len(value) <= 64:
        return f"{type(value).__name__} {[_describe_value(v, depth + 1) for v in value]}"
    if type(value) is dict and depth < 2 and len(value) <= 64:
        return f"dict {[(repr(k), _describe_value(v, depth + 1)) for k, v in value.items()]}"
    code = getattr(value, "__code__", None)
    if code is not None:
        return f"function {getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')} {_code_text(code)}"
    if callable(value) and getattr(value, "__qualname__", None):
        return f"callable {getattr(value, '__module__', '')}.{value.__qualname__}"
    return f"object {type(value).__module__}.{type(value).__qualname__}"


def _code_text(code) -> str:
    """A stable digest of a code object: bytecode, names and constants, nested functions' too.
    (Not ``marshal``: its output depends on reference counts, which differ between processes.)"""
    digest = hashlib.sha256()

    def add(c):
        digest.update(c.co_code)
        digest.update(repr((c.co_names, c.co_varnames, c.co_freevars, c.co_cellvars)).encode())
        for const in c.co_consts:
            if hasattr(const, "co_code"):
                add(const)
            else:
                digest.update(repr(const).encode())
    add(code)
    return digest.hexdigest()[:32]


def _describe_argument(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor {tuple(x.shape)} {x.dtype} {x.device} {x.requires_grad}"
    if isinstance(x, torch.nn.Module):
        params = [(n, tuple(p.shape), p.dtype, p.device, p.requires_grad) for n, p in x.named_parameters()]
        buffers = [(n, tuple(b.shape), b.dtype, b.device) for n, b in x.named_buffers()]
        return f"module {type(x).__module__}.{type(x).__qualname__} {params} {buffers}"
    if isinstance(x, torch.optim.Optimizer):
        # (its options that choose which calls a step makes: flags, and which rates are zero —
        # not the rates themselves, which schedulers change between steps)
        groups = [(len(g["params"]), sorted((k, v if v is None or type(v) in (bool, str) else v != 0)
                                            for k, v in g.items() if k != "params" and (
                                                v is None or type(v) in (bool, str, int, float))))
                  for g in x.param_groups]
        return f"optimizer {type(x).__module__}.{type(x).__qualname__} {groups}"
    if x is None or type(x) in (bool, int, float, complex, str, torch.dtype, torch.device, torch.Size) or (
            type(x) is tuple and all(type(v) in (bool, int, float, str) for v in x)):
        return f"{type(x).__name__} {x!r}"
    raise NotStorable(f"an argument of type {type(x).__qualname__} (only tensors, modules, optimizers and plain "
                      "constants are keyed across processes)")


# -- paths to what the recording holds by identity -------------------------------------------------
_HELD = (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)


def _roots(fn, leaves) -> list:
    """(root step, object) of every place a path may start."""
    roots = [(("arg", i), x) for i, x in enumerate(leaves) if isinstance(x, _HELD)]
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, type(torch)):
        roots.append((("self",), owner))
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)
    if code is not None:
        for name, cell in zip(code.co_freevars, getattr(func, "__closure__", None) or ()):
            try:
                roots.append((("closure", name), cell.cell_contents))
            except ValueError:  # an empty cell
                pass
        names = getattr(func, "__globals__", {})
        roots.extend((("global", n), names[n]) for n in code.co_names if n in names)
    # (default argument values: a tensor or module a ``lambda x, w=w:`` default holds)
    roots.extend((("default", i), v) for i, v in enumerate(getattr(func, "__defaults__", None) or ()))
    roots.extend((("kwdefault", k), v) for k, v in (getattr(func, "__kwdefaults__", None) or {}).items())
    return roots


def _root(step, fn, leaves):
    kind = step[0]
    try:
        if kind == "arg":
            return leaves[step[1]]
        if kind == "self":
            return fn if isinstance(fn, torch.nn.Module) else fn.__self__
        func = getattr(fn, "__func__", fn)
        if kind == "closure":
            return func.__closure__[func.__code__.co_freevars.index(step[1])].cell_contents
        if kind == "global":
            return func.__globals__[step[1]]
        if kind == "default":
            return func.__defaults__[step[1]]
        if kind == "kwdefault":
            return func.__kwdefaults__[step[1]]
    except (AttributeError, IndexError, KeyError, ValueError, TypeError):
        pass
    raise Unresolved(f"{_describe_path((step,))} is not there")


class _Index:
    """id -> path of every tensor, module and optimizer reachable from the function's roots now
    (the first path found, arguments first)."""

    def __init__(self, fn, leaves):
        self.paths: dict = {}
        self.keep: list = []  # (the objects indexed stay alive while their ids are keys)
        for step, obj in _roots(fn, leaves):
            self._walk(obj, (step,), depth=0)

    def _add(self, obj, path):
        if id(obj) not in self.paths:
            self.paths[id(obj)] = path
            self.keep.append(obj)

    def _walk(self, obj, path, depth):
        if isinstance(obj, torch.Tensor):
            self._add(obj, path)
        elif isinstance(obj, torch.nn.Module):
            self._add(obj, path)
            for name, m in obj.named_modules(remove_duplicate=False):
                if name:
                    self._add(m, path + (("module", name),))
            for name, p in obj.named_parameters(remove_duplicate=False):
                self._add(p, path + (("param", name),))
            for name, b in obj.named_buffers(remove_duplicate=False):
                self._add(b, path + (("buffer", name),))
        elif isinstance(obj, torch.optim.Optimizer):
            self._add(obj, path)
            for gi, group in enumerate(obj.param_groups):
                for pi, p in enumerate(group["params"]):
                    self._add(p, path + (("group", gi, pi),))
                    for key, value in obj.state.get(p, {}).items():
                        if isinstance(value, torch.Tensor) and isinstance(key, str):
                            self._add(value, path + (("state", gi, pi, key),))
        elif depth == 0 and path == (("self",),) and hasattr(obj, "__dict__"):
            # the object of a bound method (a trainer's ``self.step``): its attributes, one level
            for name, value in vars(obj).items():
                if isinstance(name, str) and (isinstance(value, _HELD) or type(value) in (list, tuple, dict)):
                    self._walk(value, path + (("attr", name),), depth + 1)
        elif depth <= 1 and type(obj) in (list, tuple):
            for k, v in enumerate(obj):
                self._walk(v, path + (("item", k),), depth + 1)
        elif depth <= 1 and type(obj) is dict:
            for k, v in obj.items():
                if type(k) in (str, int):
                    self._walk(v, path + (("item", k),), depth + 1)

    def path_of(self, obj, what: str):
        path = self.paths.get(id(obj))
        if path is None:
            raise NotStorable(f"it holds {what} ({type(obj).__name__}) that no path from the function's arguments, "
                              "closure or globals reaches")
        return path


def resolve(path, fn, leaves):
    """The object ``path`` leads to in this call (raises Unresolved)."""
    obj = _root(path[0], fn, leaves)
    for step in path[1:]:
        kind = step[0]
        try:
            if kind == "module":
                obj = obj.get_submodule(step[1])
            elif kind == "param":
                obj = obj.get_parameter(step[1])
            elif kind == "buffer":
                obj = obj.get_buffer(step[1])
            elif kind == "group":
                obj = obj.param_groups[step[1]]["params"][step[2]]
            elif kind == "state":
                obj = obj.state[obj.param_groups[step[1]]["params"][step[2]]][step[3]]
            elif kind == "item":
                obj = obj[step[1]]
            elif kind == "attr":
                obj = vars(obj)[step[1]]
            else:
                raise KeyError(kind)
        except (AttributeError, IndexError, KeyError, TypeError):
            raise Unresolved(f"{_describe_path(path)} is not there") from None
    return obj


def _describe_path(path) -> str:
    root = path[0]
    text = {"arg": lambda: f"argument {root[1]}", "self": lambda: "self",
            "default": lambda: f"default argument {root[1]}"}.get(root[0], lambda: str(root[-1]))()
    for step in path[1:]:
        text += f".{step[1]}" if step[0] in ("module", "param", "buffer", "attr") else f"{list(step[1:])}"
    return text


# -- pickling: live objects become paths -----------------------------------------------------------
def _reduce_treespec(spec):
    # (pytree's own pickling of a spec warns on load in torch 2.13; its JSON form does not.
    # A spec of a type pytree cannot serialize makes the recording not stored.)
    return _treespec_loads, (pytree.treespec_dumps(spec),)


def _treespec_loads(text):
    return pytree.treespec_loads(text)


class _Writer(persist.RegionPickler):
    def __init__(self, buffer, index: _Index):
        super().__init__(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        self.index = index
        self.required: dict = {}  # path -> None (ordered)

    def persistent_id(self, obj):
        if isinstance(obj, weakref.ReferenceType):
            target = obj()
            if target is None:
                raise NotStorable("it holds a reference to an object that is gone")
            return ("ref", self._path(target, "a reference"))
        if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
            return ("obj", self._path(obj, "an object"))
        if isinstance(obj, torch.Tensor):
            path = self.index.paths.get(id(obj))
            if path is not None:
                self.required[path] = None
                return ("obj", path)
            if isinstance(obj, torch.nn.Parameter):
                raise NotStorable("it holds a parameter that no path from the function's arguments, closure or "
                                  "globals reaches")
            return None  # a constant: stored by value
        if isinstance(obj, torch.ScriptObject):
            # a profiler range's handle, an argument of an eager call (never compared on replay)
            return ("unstored",)
        if isinstance(obj, torch._ops.OpOverload):
            return ("op", obj._schema.name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return ("op", obj._qualified_op_name, None)
        if isinstance(obj, types.FunctionType) and "<locals>" in obj.__qualname__:
            # a torch function made by a factory (F.max_pool2d is ``boolean_dispatch.<locals>.fn``):
            # by the name its module gives it
            name = _module_attribute(obj)
            if name is None:
                raise NotStorable(f"it calls {obj.__qualname__}, a local function no module names")
            return ("attribute", obj.__module__, name)
        if type(obj).__name__ == "method-wrapper" and type(getattr(obj, "__self__", None)).__name__ in (
                "getset_descriptor", "member_descriptor"):
            # a property's getter or setter as a torch function sees it (``p.grad = None``)
            descriptor = obj.__self__
            return ("descriptor", descriptor.__objclass__, descriptor.__name__, obj.__name__)
        return None

    def reducer_override(self, obj):
        if isinstance(obj, pytree.TreeSpec):  # (LeafSpec too: a subclass)
            return _reduce_treespec(obj)
        return NotImplemented

    def _path(self, obj, what):
        path = self.index.path_of(obj, what)
        self.required[path] = None
        return path


@functools.lru_cache(maxsize=None)
def _module_attribute(function) -> str | None:
    """The name ``function``'s module binds it to, or None."""
    module = sys.modules.get(function.__module__)
    return next((name for name, value in vars(module).items() if value is function), None) if module else None


class _Reader(pickle.Unpickler):
    def __init__(self, data, fn, leaves):
        super().__init__(io.BytesIO(data))
        self.fn, self.leaves = fn, leaves

    def persistent_load(self, pid):
        kind = pid[0]
        if kind == "ref":
            return weakref.ref(resolve(pid[1], self.fn, self.leaves))
        if kind == "obj":
            return resolve(pid[1], self.fn, self.leaves)
        if kind == "unstored":
            return None
        if kind == "op":
            namespace, name = pid[1].split("::")
            packet = getattr(getattr(torch.ops, namespace), name)
            return packet if pid[2] is None else getattr(packet, pid[2] or "default")
        if kind == "descriptor":
            return getattr(vars(pid[1])[pid[2]], pid[3])
        if kind == "attribute":
            return getattr(importlib.import_module(pid[1]), pid[2])
        raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")


# -- storing and finding --------------------------------------------------------------------------
@dataclass
class Prepared:
    """A recording ready to be written."""
    path: str
    payload: bytes


@dataclass
class Stored:
    """A recording read from disk: the paths it needs, and its trace's bytes. ``stored_here``: this
    process wrote it (another compiled function with the same key recorded it), not an earlier one."""
    path: str
    required: list
    data: bytes
    stored_here: bool = False


_WRITTEN_HERE: set = set()  # the paths of the recordings this process wrote (what the logs say of a load)


def call_key(fn, args, kwargs) -> str | NotStorable | None:
    """The key of ``fn(*args, **kwargs)``, taken before the call runs (as ``find`` takes it: the
    call may change what the key describes, ``x.requires_grad_()``); the reason where it has none;
    None where stored recordings are off."""
    if not enabled():
        return None
    from runtime.calls import flatten_call

    leaves, spec = flatten_call(args, kwargs)
    try:
        return portable_key(fn, spec, leaves)
    except NotStorable as e:
        return e


def prepare(fn, args, kwargs, trace, key) -> Prepared | None:
    """The recording ``trace`` of ``fn(*args, **kwargs)`` as bytes, to be stored under ``key``
    (``call_key``'s, before the call), or None where it cannot be stored (said at INFO, with why)."""
    if key is None:
        return None
    from runtime.calls import flatten_call

    leaves, _ = flatten_call(args, kwargs)
    try:
        if isinstance(key, NotStorable):
            raise key
        buffer = io.BytesIO()
        writer = _Writer(buffer, _Index(fn, leaves))
        writer.dump(trace)
    except NotStorable as e:
        log.info("the recording of %s is not stored on disk: %s", getattr(fn, "__qualname__", fn), e)
        return None
    except Exception as e:  # noqa: BLE001 — something in it does not pickle: it records in each process
        log.info("the recording of %s is not stored on disk (%s: %s)", getattr(fn, "__qualname__", fn),
                 type(e).__name__, e)
        return None
    data = buffer.getvalue()
    payload = pickle.dumps({"required": list(writer.required), "trace": data}, protocol=pickle.HIGHEST_PROTOCOL)
    name = hashlib.sha256(data).hexdigest()[:24]
    return Prepared(os.path.join(recordings_dir(), key[:2], key, f"{name}.pkl"), payload)


def write(prepared: Prepared) -> None:
    """Write a prepared recording; keep the newest MAX_STORED of its key."""
    try:
        persist.write_checked(prepared.path, prepared.payload, _MAGIC)
    except OSError as e:  # a full or read-only disk: the next process records, as without a cache
        log.warning("could not store a recording in %s (%s); later processes record it again", prepared.path, e)
        return
    _WRITTEN_HERE.add(prepared.path)
    try:
        for old in _newest_first(os.path.dirname(prepared.path))[MAX_STORED:]:
            os.remove(old)
    except OSError:  # another process pruned the folder at the same time
        pass


def _newest_first(folder: str) -> list:
    """The recordings stored in ``folder`` (one key's), newest first. Raises OSError."""
    return sorted((os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".pkl")),
                  key=os.path.getmtime, reverse=True)


def find(fn, spec, leaves) -> list:
    """The recordings stored under this call's key, newest first ([] for none)."""
    if not enabled():
        return []
    try:
        key = portable_key(fn, spec, leaves)
    except NotStorable:
        return []
    folder = os.path.join(recordings_dir(), key[:2], key)
    try:
        files = _newest_first(folder)
    except OSError:  # (none stored under this key)
        return []
    found = []
    for path in files[:MAX_STORED]:
        try:
            payload = persist.read_checked(path, _MAGIC)
            if payload is None:
                continue
            entry = pickle.loads(payload)
            found.append(Stored(path, entry["required"], entry["trace"], path in _WRITTEN_HERE))
        except Exception as e:  # noqa: BLE001 — truncated, garbled, or from an incompatible build
            persist.discard_damaged(path, "stored recording", "recording the call instead", e)
    return found


def load(stored: Stored, fn, leaves):
    """The Recording of a stored recording with its paths resolved in this call. Raises Unresolved
    where a path leads nowhere or two lead to one object (the recording had two)."""
    seen = {}
    for path in stored.required:
        obj = resolve(path, fn, leaves)
        other = seen.setdefault(id(obj), path)
        if other is not path:
            raise Unresolved(f"{_describe_path(path)} and {_describe_path(other)} are one object here, two in "
                             "the recording")
    try:
        return _Reader(stored.data, fn, leaves).load()
    except Unresolved:
        raise
    except Exception as e:  # noqa: BLE001 — written by this build (same key) yet unreadable: treat as damaged
        persist.discard_damaged(stored.path, "stored recording", "recording the call instead", e)
        raise Unresolved("it does not load") from e
