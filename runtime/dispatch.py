"""The compiled function: guards, the cache of recorded programs, replay, eager fallback.

On each call the guard key — every tensor argument's shape, dtype, device and
requires_grad, the other arguments' values, the grad mode and autocast — selects recorded entries,
and the train/eval mode of the modules each one ran picks among them.
A miss calls the compiler's builder, which runs the function eagerly once while recording
it (that call's results are eager's) and compiles it; later calls replay the entry with its
compiled regions. A miss at new sizes of dynamic dims (``runtime.dynamic_shapes``) is first
offered to the templates: an entry instantiated from a recording for these sizes replays at
once, without an eager run. Tensors reached inside the function (parameters, closed-over tensors) are
guarded by identity and metadata at replay. Thread-safe: recording is serialized, replays
run concurrently (modes are thread-local).

A function records at most its recording limit of guard keys (RECORDING_LIMIT, as Dynamo's
``recompile_limit``); calls with new keys past it run eagerly, said once with the guards that
kept failing. ``SYMGRAD_DISABLE=1`` makes every call run the function's Python unmodified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import weakref

import torch

from runtime import backends, guard_log, skip_python
from runtime.calls import flatten_call
from runtime.dynamic_shapes import DynamicShapes
from runtime.fallback import CompileError, internal_error, say_once
from runtime.replay import Replay

MAX_RECAPTURES = 8
# NOTE: guard keys a compiled function records (or loads stored recordings for), as
# torch._dynamo.config.recompile_limit (8) caps a code object's cache entries: a call with a new
# key past it runs eagerly, said once with the guards that kept failing; the keys recorded still
# replay. Entries instantiated from a template (dynamic shapes) are not counted: they cost no
# recording. ``compile(recording_limit=...)`` sets it per function, else SYMGRAD_RECORDING_LIMIT.
RECORDING_LIMIT = 8
RECORDING_LIMIT_ENV = "SYMGRAD_RECORDING_LIMIT"
# SYMGRAD_DISABLE=1: every compiled function runs its Python unmodified (no recording, no kernels),
# read at each call, like TORCH_COMPILE_DISABLE (bisecting: is it the compiler?)
DISABLE_ENV = "SYMGRAD_DISABLE"
MAX_VARIANTS = 4  # recordings kept per guard key (modules in train or eval mode)
DYNAMIC_AFTER = 3  # different values of a number argument before calls stop specializing on it
STORED_TRIES = 8  # calls a stored recording waits for its paths to lead somewhere (optimizer state)


# -- watching what runs eagerly -------------------------------------------------------------------
# NOTE: a fallback is logged once per function and reason, and a divergence only counted in the
# function's own stats: a test (tests/conftest.py) or a tool that must see every one, whichever
# function made it, watches. With no watcher, noting costs one empty-list check, on the rare paths
# and once per replay.
_WATCHERS: list = []
COMPILED: "weakref.WeakSet" = weakref.WeakSet()   # every live CompiledFunction (launch counting)


class Watch:
    """What ``watch_eager_runs`` saw: ``events``, each (function name, what, reason), and ``stats``,
    the ``.stats`` of each function compiled while watching (kept: the function may be gone)."""

    def __init__(self):
        self.events: list = []
        self.stats: list = []


@contextlib.contextmanager
def watch_eager_runs():
    """Collect, while inside, every part of a compiled call that ran eagerly instead of compiled: in
    ``.events``, (function name, what, reason), ``what`` being "fallback" (a recording's op or argument
    the compiler does not take), "divergence" (a replay left its recording; the rest of the call ran
    eagerly) or "eager call" (the whole call, e.g. after too many recordings).

    >>> import torch, compiler
    >>> f = compiler.compile(lambda x: torch.nonzero(x).sum())   # (nonzero: a data-dependent shape)
    >>> with watch_eager_runs() as watch:
    ...     _ = f(torch.ones(3))
    >>> [what for _, what, _ in watch.events]
    ['fallback']
    """
    watch = Watch()
    _WATCHERS.append(watch)
    try:
        yield watch
    finally:
        _WATCHERS.remove(watch)


def _note(name: str, what: str, reason: str) -> None:
    for watch in _WATCHERS:
        watch.events.append((name, what, reason))


# -- the switches read from the environment ---------------------------------------------------------
_OFF = ("", "0", "false", "no", "off")
# (os.environ.get costs a microsecond or more: on every call, the common case, the variable not
# set, is one lookup in os.environ's own mapping; set, its value is read as usual)
_ENVIRON_DATA = getattr(os.environ, "_data", None)
try:
    _DISABLE_KEY = os.environ.encodekey(DISABLE_ENV)
except Exception:  # noqa: BLE001 — another Python's os.environ: read it the plain way
    _ENVIRON_DATA = None
_said_disabled = False


def switched_off() -> bool:
    """Whether ``SYMGRAD_DISABLE`` is set (to anything but 0/false/no/off): compiled functions then run
    their Python unmodified. Read at each call, so setting it before or after ``compile`` works."""
    if _ENVIRON_DATA is not None and _DISABLE_KEY not in _ENVIRON_DATA:
        return False
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in _OFF


def _say_switched_off() -> None:
    global _said_disabled
    if not _said_disabled:
        _said_disabled = True
        logging.getLogger("compiler").warning(
            "compiler: %s=%s: compiled functions run their Python unmodified (no recording, no kernels) while "
            "it is set", DISABLE_ENV, os.environ.get(DISABLE_ENV, "").strip())


def recording_limit(asked: int | None) -> int:
    """The guard keys a compiled function records before calls with new ones run eagerly: ``asked``
    (``compile(recording_limit=...)``), else ``$SYMGRAD_RECORDING_LIMIT``, else RECORDING_LIMIT.
    Read when a call would record a new key, not on every call."""
    if asked is not None:
        return asked
    text = os.environ.get(RECORDING_LIMIT_ENV, "").strip()
    if not text:
        return RECORDING_LIMIT
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{RECORDING_LIMIT_ENV}={text!r}: give the number of argument keys (shapes, dtypes, "
                         f"constants...) a compiled function records before new ones run eagerly, >= 1 "
                         f"(default {RECORDING_LIMIT})")
    return value


def check_recording_limit(value) -> None:
    """``compile(recording_limit=...)``: None (the environment's, else RECORDING_LIMIT) or an int >= 1."""
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"recording_limit={value!r}: give None (${RECORDING_LIMIT_ENV}, else {RECORDING_LIMIT}) or "
                         "the number of argument keys a compiled function records before new ones run eagerly (>= 1)")


class Entry:
    """One recorded program for one guard key (``trace`` None: a compiler bug broke the
    recording; calls with this key run eagerly). ``instantiated``: made from a template
    (``compiler.reuse.dynamic``) for this key's sizes, not recorded."""

    def __init__(self, trace, report, instantiated=False, sizes=None):
        self.trace = trace
        self.report = report
        self.instantiated = instantiated
        self.sizes = sizes  # an instantiated entry's sizes
        self.diverged_last = False  # whether its last replay left it

    def runs_with(self, backend: str, why: str) -> None:
        """The backend the compiled function chose for this entry's calls, and why (its report says so)."""
        self.report = dataclasses.replace(self.report, backend=backend, backend_reason=why)

    def replayed(self, diverged: bool) -> None:
        """A replay of this entry ended; ``diverged``: it left the recording."""
        self.diverged_last = diverged


_UNCHECKED = object()   # _record's `seen` when the caller asks for a recording whatever the cache holds


class CompiledFunction:
    def __init__(self, fn, builder, backend="auto", fullgraph=False, dynamic=None, templates=None, stored=None,
                 skip_python=False, recording_limit=None):
        functools.update_wrapper(self, fn, updated=())  # not __dict__: fn may be a Module
        if not hasattr(self, "__name__"):   # (a module or another callable object: its class names it in logs)
            self.__name__ = type(fn).__name__
        if backend not in backends.BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(backends.BACKENDS)}")
        check_recording_limit(recording_limit)
        self.fn = fn
        self.builder = builder
        self.backend = backend
        self.fullgraph = fullgraph
        self.skip_python = skip_python  # runtime.skip_python: replays make the recorded calls directly
        self.cache: dict = {}
        self.lock = threading.RLock()
        self.recaptures = 0
        self.dynamic: set = set()        # (spec, leaf position) of number arguments not in the key
        self.scalars_seen: dict = {}     # (spec, leaf position) -> values seen
        self.needs_variant: set = set()  # guard keys whose last call took an unrecorded path
        # numbers replays saw change (compiler.capture.numbers.changed_at): recordings take them at run time
        self.numbers_changing: set = set()
        self.baked_floats: set = set()  # (spec, leaf position) of float arguments a recording kept as constants
        self.numbers_due: set = set()  # guard keys whose next call records with those numbers taken at run time
        self.disabled: str | None = None
        self.recording_limit = recording_limit  # None: SYMGRAD_RECORDING_LIMIT's, else RECORDING_LIMIT
        self.recorded_keys: dict = {}  # guard keys recorded or loaded (not instantiated), in order
        self.limit_reached: str | None = None  # why calls with new keys run eagerly (the limit), once hit
        # (captures: recordings, each an eager run; instantiations: entries re-made from a template)
        # (loaded: recordings stored on disk, by an earlier process or another compiled function of the
        # same key in this one, replayed without a recording run here)
        self.stats = {"calls": 0, "captures": 0, "instantiations": 0, "loaded": 0, "replays": 0, "eager_calls": 0,
                      "divergences": 0, "kernel_launches": 0}
        self.stored = stored              # compiler.reuse.recordings, through compiler.api (None: none)
        self.stored_pending: dict = {}    # guard key -> [stored recordings not (yet) usable, tries left]
        self.shapes = DynamicShapes(dynamic, templates)
        self.last_backend: str | None = None
        self.last_entry: Entry | None = None
        # device type -> (backend, why), decided at the first call on it: the environment
        # (SYMGRAD_CPU_BACKEND) is read then, not on every call (microseconds a call)
        self.choices: dict = {}
        COMPILED.add(self)
        for watch in _WATCHERS:
            watch.stats.append(self.stats)

    def __get__(self, obj, objtype=None):  # decorating a method
        if obj is None:
            return self
        return functools.partial(self, obj)

    def __repr__(self):
        return f"<compiled {getattr(self.fn, '__qualname__', self.fn)} backend={self.backend}>"

    # -- the call --------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        self.stats["calls"] += 1
        if self.backend == "eager" or switched_off():
            return self._unmodified(args, kwargs)
        leaves, spec = flatten_call(args, kwargs)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        device = tensors[0].device.type if tensors else None
        choice = self.choices.get(device)
        if choice is None:
            try:
                choice = backends.choose(self.backend, device)
            except backends.BackendUnavailable as e:
                if self.backend != "auto" or self.fullgraph:
                    raise
                return self._eager(str(e), args, kwargs)
            if choice[0] != backends.UNDECIDED:  # (no tensor arguments: the first recording decides)
                self.choices[device] = choice
        else:
            backends.use(choice[0])  # (what this call builds is built for its backend, as choose sets)
        backend, why = choice
        if self.disabled:
            return self._eager(self.disabled, args, kwargs)
        key = _guard_key(spec, leaves, self.dynamic, self.baked_floats)
        variants = self.cache.get(key)
        # (the common case, a key seen before with nothing pending on it, hashes the key once)
        if variants is None or (self.stored_pending and key in self.stored_pending) \
                or (self.needs_variant and key in self.needs_variant) or (self.numbers_due and key in self.numbers_due):
            if variants is None and self._note_changing_scalars(spec, leaves):
                key = _guard_key(spec, leaves, self.dynamic, self.baked_floats)
            if self.stored is not None and (key not in self.cache or key in self.stored_pending) \
                    and backend != backends.UNDECIDED:
                self._load_stored(key, spec, leaves, backend, why)  # an earlier process's recording: replayed
            if key not in self.cache and tensors and self.shapes.enabled:
                self._instantiate(key, spec, leaves)  # sizes a template covers: an entry without recording
            variants = self.cache.get(key, [])
            if key in self.numbers_due or key in self.needs_variant:
                return self._record_again(key, backend, why, args, kwargs)
        entry = None
        for candidate in list(variants):
            if candidate.trace is None:  # its recording failed on a bug (logged then): eager
                if _WATCHERS:
                    _note(self.__name__, "eager call", "its recording failed on an internal error")
                self.stats["eager_calls"] += 1
                self.last_backend = "eager (after an internal error)"
                return self.fn(*args, **kwargs)
            if not candidate.trace.modes_match():
                continue
            externals = candidate.trace.external_values()
            if externals is None:  # a tensor it closed over is gone or changed: record again
                if guard_log.on():
                    guard_log.log_miss(self.__name__, guard_log.describe_externals(candidate.trace))
                variants.remove(candidate)
                return self._record(key, backend, why, args, kwargs, recapture=True)
            entry = candidate
            break
        if entry is None:  # first, or another train/eval mode
            if guard_log.on():
                guard_log.log_miss(self.__name__, guard_log.describe_modes([e.trace for e in variants]) if variants
                                   else guard_log.describe_miss(self.__name__, key, self.cache,
                                                                guard_log.leaf_names(self.fn, spec, len(leaves))))
            return self._record(key, backend, why, args, kwargs, seen=self.cache.get(key))
        self.last_backend = backend
        self.stats["replays"] += 1
        if _WATCHERS and entry.report.fallbacks:  # (its recording's fallbacks run eagerly on each replay too)
            for reason in entry.report.fallbacks:
                _note(self.__name__, "fallback", reason)
        mode = Replay(entry.trace, tensors, externals, alternatives=[e.trace for e in variants if e is not entry])
        if self.skip_python and self._python_skippable(entry, variants):
            self.last_entry = entry
            return mode.run_calls()
        if entry.trace.numbers:
            mode.take_argument_numbers(leaves)
        result = mode.run(self.fn, args, kwargs)
        mode.finish()
        result = mode.real_result(result)
        self._after_replay(mode, entry, variants, key, backend)
        return result

    def _record_again(self, key, backend, why, args, kwargs):
        """Record a key that has recordings: numbers of its math changed (``numbers_due``: the new
        recording takes them at run time), or the last call took a path none has (``needs_variant``)."""
        if key in self.numbers_due:
            self.numbers_due.discard(key)
            self.needs_variant.discard(key)
            if guard_log.on():
                guard_log.log_miss(self.__name__, "numbers of its math changed: recording them as run-time "
                                   "arguments of the kernels")
            return self._record(key, backend, why, args, kwargs, recapture=True)
        self.needs_variant.discard(key)
        if guard_log.on():
            guard_log.log_miss(self.__name__, "the last two calls left their recording: recording the path taken")
        return self._record(key, backend, why, args, kwargs, recapture=True, other_path=True)

    def _after_replay(self, mode, entry, variants: list, key, backend: str) -> None:
        """Bookkeeping after a replay: the recording it followed first among its key's variants,
        and what a divergence means (one: nothing; two in a row: record the path taken)."""
        if mode.trace is not entry.trace:  # switched to the recording of the path it took
            entry = next(e for e in variants if e.trace is mode.trace)
        if not variants or variants[0] is not entry:
            with self.lock:
                if entry in variants:  # most recently used first
                    variants.remove(entry)
                    variants.insert(0, entry)
        self.last_entry = entry
        # NOTE: one divergence records nothing (an optimizer step every few calls leaves the
        # recording only for its eager tail); two in a row mean the path changed: record it.
        if mode.diverged and (entry.diverged_last or mode.path_changed):
            self.needs_variant.add(key)  # (a guarded bool that no recording read: a new branch, record it)
        new_numbers = mode.changed_numbers - self.numbers_changing
        if new_numbers:
            # (numbers of the math changed: the next recording takes them at run time, once)
            self.numbers_changing |= new_numbers
            self.numbers_due.add(key)
            where = ", ".join(f"argument {leaf} of call {k + 1} to {name}" for name, k, leaf in sorted(new_numbers))
            say_once(self.__name__, f"Python numbers of its math changed value ({where}): the next call records "
                     "them as run-time arguments of the kernels", logging.INFO)
            if guard_log.on():
                guard_log.recompiles.info("%s: numbers changed (%s): the next call records them as run-time "
                                          "arguments", self.__name__, where)
        if mode.diverged and guard_log.on():
            guard_log.guards.info("%s: a per-call guard failed: %s; the rest of the call ran eagerly%s", self.__name__,
                                  mode.diverged, " (twice in a row: the next call records this path)"
                                  if key in self.needs_variant else "")
        entry.replayed(bool(mode.diverged))
        if mode.diverged:
            self.last_backend = f"{backend}, then eager (the call left its recording)"
            self.stats["divergences"] += 1
            if _WATCHERS:
                _note(self.__name__, "divergence", str(mode.diverged))
            # INFO, not WARNING: expected once in a training step (an optimizer's first step
            # creates its state), and the results are right either way.
            say_once(self.__name__, f"this call did not follow its recording ({mode.diverged}); "
                     "the rest of the call ran eagerly; a path taken twice in a row is recorded too",
                     logging.INFO)

    def _python_skippable(self, entry, variants) -> bool:
        """Whether this replay may make the recorded calls without the function's Python
        (``runtime.skip_python``); where not, why is said once and the replay checks each call."""
        reason = skip_python.refusal(entry.trace)
        if reason is None and entry.instantiated:
            reason = "its recording was instantiated for new sizes (compiler.reuse.dynamic)"
        if reason is None and any(e.trace is not None and e.trace.other_path and e.trace.modes_match()
                                  for e in variants):
            reason = "Python took another path with these arguments (a recording of it was made)"
        if reason is None:
            reason = skip_python.hooks_in_the_way(entry.trace) or skip_python.ddp_in_the_way(entry.trace)
        if reason is None:
            return True
        skip_python.say_python_runs(self.__name__, reason)
        return False

    def _load_stored(self, key, spec, leaves, backend, why) -> None:
        """Add the recordings stored on disk for this call (``compiler.reuse.recordings``) to the cache.
        One whose paths do not lead to this call's objects yet (an optimizer's state, made by its
        first step) is tried again on the next STORED_TRIES calls with this key."""
        with self.lock:
            pending = self.stored_pending.pop(key, None)
            if pending is None:
                if key in self.cache or self._over_limit(key) is not None:  # (past the limit: no new key loads)
                    return
                pending = [self.stored.find(self.fn, spec, leaves), STORED_TRIES]
            waiting, loaded, here = [], [], 0
            for stored in pending[0]:
                try:
                    entry = self.stored.load(stored, self.fn, leaves, self.fullgraph, self.stats)
                    entry.runs_with(backend, why)
                    loaded.append(entry)
                    here += bool(getattr(stored, "stored_here", False))
                except self.stored.Unresolved as e:
                    waiting.append(stored)
                    if guard_log.on():
                        guard_log.guards.info("%s: a stored recording does not fit this call (yet): %s",
                                              self.__name__, e)
                except CompileError:  # fullgraph refuses it as it refused the recording: this call says so
                    continue
                except Exception as e:  # noqa: BLE001 — a bug (strict: raises); the call records instead
                    internal_error(f"{self.__name__} (loading a stored recording)", e)
            if waiting and pending[1] > 1:
                self.stored_pending[key] = [waiting, pending[1] - 1]
            if not loaded:
                return
            self.stats["loaded"] += len(loaded)
            if _WATCHERS:
                for entry in loaded:
                    for reason in entry.report.fallbacks:
                        _note(self.__name__, "fallback", reason)
            self.cache[key] = (self.cache.get(key, []) + loaded)[:MAX_VARIANTS]
            self.recorded_keys[key] = None
            if guard_log.on():
                # (stored by this process: another compiled function of the same key, its code, defaults,
                # closure and argument descriptions, recorded it; compiler.reuse.recordings)
                earlier = len(loaded) - here
                where = ("an earlier process stored" if not here else
                         "this process stored earlier (another compiled function with the same key)" if not earlier
                         else f"stored earlier: {earlier} by an earlier process, {here} by this process")
                guard_log.recompiles.info("%s: loaded %d recording(s) %s (no recording run)",
                                          self.__name__, len(loaded), where)

    def _instantiate(self, key, spec, leaves) -> None:
        """Put an entry for ``key`` in the cache, made from the template of its dynamic key when
        the call's sizes satisfy the template's relations; else leave the miss to record."""
        self.shapes.note_shapes(spec, leaves, self.__name__)
        with self.lock:
            if key in self.cache:
                return
            entry, reason = self.shapes.instantiate(key, spec, leaves, self.cache, self.fn, self.fullgraph, self.stats)
            if entry is None:
                if reason and guard_log.on():  # (the recompiles log then says that it records, and why)
                    guard_log.guards.info("%s: no template covers these sizes: %s", self.__name__, reason)
                return
            self.stats["instantiations"] += 1
            self.cache[key] = [entry]
            if guard_log.on():
                guard_log.recompiles.info("%s: instantiated its template for sizes %s (no recording)",
                                          self.__name__, ", ".join(map(str, entry.sizes)))

    def _note_changing_scalars(self, spec, leaves) -> bool:
        """A Python number argument seen with DYNAMIC_AFTER different values (a step counter,
        a learning rate) stops being part of the guard key: the replay still checks every
        constant a compiled kernel uses, so a change that matters is caught there. Returns
        whether a position became dynamic."""
        changed = False
        for i, x in enumerate(leaves):
            if type(x) not in (int, float) or (spec, i) in self.dynamic:
                continue
            seen = self.scalars_seen.setdefault((spec, i), set())
            seen.add(x)
            if len(seen) >= DYNAMIC_AFTER:
                self.dynamic.add((spec, i))
                changed = True
                say_once(self.__name__, f"argument leaf {i} changed value {len(seen)} times; calls no longer "
                         "specialize on it", logging.INFO)
        return changed

    def _record(self, key, backend, why, args, kwargs, recapture=False, seen=_UNCHECKED, other_path=False,
                limited=True):
        """Record a call. ``seen``: the key's recordings when the caller found none to replay;
        if another thread recorded the key since, this call replays that instead. ``limited``: a
        new key past the recording limit runs eagerly instead (``explain`` records whatever it is)."""
        with self.lock:
            # NOTE: another thread recorded this key while this one waited for the lock
            # (recordings are made one at a time): replay it, or record another mode's
            recorded_meanwhile = seen is not _UNCHECKED and self.cache.get(key) is not seen
            if not recorded_meanwhile:
                return self._record_now(key, backend, why, args, kwargs, recapture, other_path, limited)
        self.stats["calls"] -= 1  # counted again by the call below
        return self(*args, **kwargs)

    def _record_now(self, key, backend, why, args, kwargs, recapture, other_path=False, limited=True):
        with self.lock:
            if recapture:
                self.recaptures += 1
                if self.recaptures > MAX_RECAPTURES:
                    self.disabled = (f"recorded {self.recaptures} times: its torch calls change from call "
                                     "to call (Python control flow or changing constants); running eagerly")
                    guard_log.recompiles.info("%s: %s", self.__name__, self.disabled)
                    return self._eager(self.disabled, args, kwargs)
            over = self._over_limit(key) if limited else None
            if over is not None:
                return self._eager(over, args, kwargs)
            self.stats["captures"] += 1
            # (a recording under a dynamic key: its kernels shape-generic, as its instantiations' are)
            dynamic = self.shapes.enabled and self.shapes.is_dynamic(key, args, kwargs)
            options = {"shape_generic": True} if dynamic else {}
            if other_path:  # (Python left the key's recording twice in a row: skip_python must not guess)
                options["other_path"] = True
            if self.numbers_changing:
                options["numbers_seen_changing"] = frozenset(self.numbers_changing)
            if backend == backends.UNDECIDED:  # no tensor arguments: the devices it records on decide
                options["decide_backend"] = self.backend
            result, entry = self.builder(self.fn, args, kwargs, fullgraph=self.fullgraph, stats=self.stats, **options)
            if backend == backends.UNDECIDED:
                backend, why = ((entry.report.backend, entry.report.backend_reason) if entry.report.backend
                                else backends.decide(self.backend, None))  # (a recording that failed: none said)
                self.choices.setdefault(None, (backend, why))
            entry.runs_with(backend, why)
            if entry.trace is not None and entry.trace.baked_floats:
                key = self._specialize_on(key, entry.trace.baked_floats, args, kwargs)
            # NOTE: several recordings per guard key: one per train/eval mode of the modules
            # the function ran, and one per path Python took (the replay switches between
            # recordings that agree on the calls made so far: an optimizer step every few calls).
            variants = self.cache.get(key, [])
            self.cache[key] = [entry] + variants[:MAX_VARIANTS - 1]
            self.recorded_keys[key] = None
            if guard_log.on():
                leaves, spec = flatten_call(args, kwargs)
                names = guard_log.leaf_names(self.fn, spec, len(leaves))
                guard_log.log_recorded(self.__name__, key, names, entry.trace)
            self.last_entry = entry
            # (a recording broken by a compiler bug, logged: this key runs eagerly from now on)
            self.last_backend = "eager (recording)" if entry.trace is not None else "eager (after an internal error)"
            for reason in entry.report.fallbacks:
                say_once(self.__name__, reason, runs_eagerly="that part")
                if _WATCHERS:
                    _note(self.__name__, "fallback", reason)
            return result

    def _specialize_on(self, key, baked, args, kwargs):
        """Float arguments a compiled call kept as constants (``baked``: leaf positions): the guard key
        holds their values from now on; the key the recording is filed under, with this call's values."""
        leaves, spec = flatten_call(args, kwargs)
        self.baked_floats.update((spec, i) for i in baked)
        parts = list(key)
        for i in baked:
            parts[3 + i] = (float, leaves[i])   # (``_guard_key``'s layout: spec, grad mode, autocast, then leaves)
        return tuple(parts)

    def _unmodified(self, args, kwargs):
        """``backend="eager"``, or ``SYMGRAD_DISABLE``: the function's Python, unmodified (not refused
        under ``fullgraph``: the user asked for it)."""
        if self.backend == "eager":
            self.last_backend = "eager"
            return self.fn(*args, **kwargs)
        _say_switched_off()
        if _WATCHERS:
            _note(self.__name__, "eager call", f"{DISABLE_ENV} is set")
        self.stats["eager_calls"] += 1
        self.last_backend = f"eager ({DISABLE_ENV})"
        return self.fn(*args, **kwargs)

    def _over_limit(self, key) -> str | None:
        """Why a call with ``key`` runs eagerly instead of recording, where it is a new key and
        the function has recorded as many keys as its limit allows; else None."""
        if key in self.recorded_keys:
            return None
        limit = recording_limit(self.recording_limit)
        if len(self.recorded_keys) < limit:
            return None
        if self.limit_reached is None:
            leaves_spec = key[0]
            names = guard_log.leaf_names(self.fn, leaves_spec, len(key) - 3)
            self.limit_reached = (
                f"reached its recording limit, {limit} argument keys (compile(recording_limit=...) or "
                f"${RECORDING_LIMIT_ENV}; default {RECORDING_LIMIT}): calls with new keys run eagerly, the "
                f"{len(self.recorded_keys)} recorded still replay; the guards that kept failing: "
                f"{_failing_guards(list(self.recorded_keys) + [key], names, self.shapes.mode)}")
            guard_log.recompiles.info("%s: %s", self.__name__, self.limit_reached)
        return self.limit_reached

    def _eager(self, reason, args, kwargs):
        if self.fullgraph:
            raise CompileError(f"{self.__name__}: {reason}")
        say_once(self.__name__, reason, runs_eagerly="the whole call")
        if _WATCHERS:
            _note(self.__name__, "eager call", reason)
        self.stats["eager_calls"] += 1
        self.last_backend = "eager"
        return self.fn(*args, **kwargs)

    def build(self, args, kwargs):
        """Record and compile for these arguments now (runs the function once, eagerly)."""
        leaves, spec = flatten_call(args, kwargs)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        backend, why = backends.choose("auto" if self.backend == "eager" else self.backend,
                                       tensors[0].device.type if tensors else None)
        key = _guard_key(spec, leaves, self.dynamic, self.baked_floats)
        self._record(key, backend, why, args, kwargs, limited=False)
        return self.last_entry


def _failing_guards(keys, names, dynamic) -> str:
    """What told guard keys ``keys`` apart (the recorded ones, then a new one): each guard whose value
    differed between them, with the values seen (``x: shape [2, 4], [3, 4], ...``)."""
    def listed(values):
        shown = list(dict.fromkeys(values))
        text = ", ".join(map(str, shown[:4])) + (", ..." if len(shown) > 4 else "")
        return f"{text} ({len(shown)} different)"
    new = keys[-1]
    found = []
    if len({k[0] for k in keys}) > 1:
        found.append(f"the arguments' structure ({len({k[0] for k in keys})} different: other numbers of arguments, "
                     "keywords or containers)")
    if len({k[1] for k in keys}) > 1:
        found.append("grad mode (on and off)")
    if len({k[2] for k in keys}) > 1:
        found.append(f"autocast {listed(k[2] for k in keys)}")
    alike = [k for k in keys if k[0] == new[0]]
    shapes = False
    for i, name in enumerate(names):
        parts = [k[3 + i] for k in alike]
        if len(set(parts)) < 2:
            continue
        if all(isinstance(p, tuple) and len(p) == 4 and isinstance(p[1], torch.dtype) for p in parts):
            for j, what in enumerate(("shape", "dtype", "device", "requires_grad")):
                values = [list(p[j]) if j == 0 else p[j] for p in parts]
                if len({str(v) for v in values}) > 1:
                    found.append(f"{name}: {what} {listed(str(v) for v in values)}")
                    shapes = shapes or j == 0
        else:
            found.append(f"{name}: {listed(guard_log._describe_leaf(p) for p in parts)}")
    if not found:
        return "the guard keys differ"
    hint = ""
    if shapes and dynamic is False:
        hint = " (compile(dynamic=None), the default, or dynamic=True shares recordings across sizes)"
    elif shapes:
        hint = " (sizes 0 and 1, and sizes no template covers, record again)"
    return "; ".join(found) + hint


_NO_AUTOCAST = (None, None)


def _autocast_state():
    if not torch._C._is_any_autocast_enabled():  # (the usual case: one call)
        return _NO_AUTOCAST
    return tuple((torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None) for d in ("cpu", "cuda"))


def _guard_key(spec, leaves, dynamic=frozenset(), baked=frozenset()):
    parts = [spec, torch.is_grad_enabled(), _autocast_state()]
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            parts.append((tuple(x.shape), x.dtype, x.device, x.requires_grad))
        elif (type(x) is float and (spec, i) not in baked) or (dynamic and (spec, i) in dynamic and type(x) is int):
            # (a float argument is taken at run time by the kernels, compiler.capture.numbers: any value
            # replays; where one decides a size or a path, the replay's checks leave the recording; one
            # a compiled call kept as a constant, ``baked``, is part of the key by value)
            parts.append(type(x))
        else:
            try:
                hash(x)
                parts.append((type(x), x))
            except TypeError:
                parts.append((type(x), id(x)))
    return tuple(parts)
