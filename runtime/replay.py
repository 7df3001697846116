"""Running a recorded function again with its regions compiled.

The user's function runs again, as Python, under a ``TorchFunctionMode``. Each torch call is
checked against the recording (same function, same tensors, same constants); at the first
call of a region the whole region runs as fused kernels, and each of the region's calls
then just hands back its result. Values that never leave the region are not materialized:
Python receives a stand-in of the right shape, dtype and device (capture proved nothing
outside reads it). Eager calls (backward, optimizer updates) run for real.

If the function does something else this time (Python control flow took another path), the
replay *diverges*: stand-ins the function still holds are recomputed eagerly from the
recording, the rest of the call runs eagerly — so results stay right — and the dispatcher
records the function again next time.
"""

from __future__ import annotations

import sys
import threading

import torch
from torch.autograd.profiler import record_function
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from runtime import tensor_parallel
from runtime.calls import flatten_call, holds_tensor, unflatten_call
from runtime.program import apply_views
from runtime.torch_functions import GRAD_GET, GRAD_SET, REFLECTED_COMPARISONS, function_name, is_metadata, is_state_read
from runtime.trace import CallKind, CompiledRecording, NumberId, ValueId, changed_at, same_read

_LINEAR = torch.nn.functional.linear


def _holds(cls, values) -> bool:
    """Whether ``values`` (or a list or tuple among them) hold a ``cls``. (A loop: it runs per call.)"""
    for v in values:
        kind = type(v)
        if kind is cls or (kind is list or kind is tuple) and any(type(u) is cls for u in v):
            return True
    return False


def _tensors_in_containers(kwargs: dict) -> bool:
    """Whether a list, tuple or dict among ``kwargs``' values holds a tensor. (A loop: it runs per call.)"""
    for v in kwargs.values():
        if (type(v) is list or type(v) is tuple or type(v) is dict) and holds_tensor(v):
            return True
    return False


class Diverged(Exception):
    pass


_REFLECTED = REFLECTED_COMPARISONS
_SLOW = object()  # the fast path's answer when the call needs the full check
_IMMUTABLE = frozenset({str, int, float, bool, type(None)})


class StandIn(torch.Tensor):
    """What Python holds, on a replay, for a value the recording proved nobody reads outside
    the fused kernels: metadata, no value. Every use the replay mode sees is a recorded call
    (answered from the kernels' results); a use it does not see — another thread, a hook that
    ``backward()`` runs — would compute on a value that is not there, so it raises instead."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if is_metadata(func) or is_state_read(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise RuntimeError(
            f"symgrad: {function_name(func)} read a value that the compiled function keeps inside its fused kernels, "
            "from code the compiler does not see (another thread, or a hook run by backward()), so the value "
            "is not there. Keep a reference to the tensor that outlives the call (return it, or store it in "
            "a list or an attribute) so that it is materialized, or run the function with backend='eager'. "
            "Please report this: the recording should have seen the use.")


def stand_in(meta) -> torch.Tensor:
    """A ``StandIn`` with a value's metadata but no data of its own (one element, expanded).
    The element is NaN (or the lowest integer): were a stand-in's storage ever read, it shows."""
    if meta.dtype.is_floating_point or meta.dtype.is_complex:
        fill = float("nan")
    elif meta.dtype == torch.bool:
        fill = True
    else:
        fill = torch.iinfo(meta.dtype).min
    with torch._C.DisableTorchFunctionSubclass():
        t = torch.full((), fill, dtype=meta.dtype, device=meta.device).expand(meta.shape).as_subclass(StandIn)
        if meta.requires_grad:
            t.requires_grad_(True)
    return t


_active = threading.local()  # the replay running in this thread, for the optimizer hooks


def _optimizer_step_begins(optimizer, args, kwargs):
    replay = getattr(_active, "replay", None)
    if replay is not None:
        return replay.step_begins(optimizer, args, kwargs)  # a compiled step: the call's new arguments


def _optimizer_step_ends(optimizer, args, kwargs):
    replay = getattr(_active, "replay", None)
    if replay is not None and not replay.range_open:   # (else the step's range exit puts the mode back)
        replay.step_ends()


_OUR_STEP_HOOKS = (register_optimizer_step_pre_hook(_optimizer_step_begins).id,
                   register_optimizer_step_post_hook(_optimizer_step_ends).id)


def active_replay():
    """The replay running in this thread, or None (for library calls the compiler fuses,
    which PyTorch gives no hooks: runtime.clip_grad)."""
    return getattr(_active, "replay", None)


_RECORD_ENTER = record_function.__enter__.__code__


class _UnwatchedRange(record_function):
    """A ``record_function`` the replay took over at its enter (``Replay._range_begins``): an
    optimizer's zero_grad or step range, whose calls run with the replay's mode off the stack (storing
    its handle, the last thing its ``__enter__`` does, takes the mode off; a step's pre-hook does), or
    any other recorded range, whose calls are checked. Reading ``run_callbacks_on_exit``, the first
    thing its ``__exit__`` does, makes the range's exit call with the mode off where it may be
    (``Replay.range_exits``), puts the mode back after it and answers False, so that ``__exit__``
    makes no second one; the object is a ``record_function`` again. (``with``
    looked ``__exit__`` up when it began: these attributes are the hooks both ends have.) Only the
    class changes, for the range's lifetime. NOTE (speed): each call the mode sees costs a Python
    dispatch, about 30 us for a range's enter or exit where the step begins out of the caches."""

    @property
    def record(self):
        return self.__dict__["record"]

    @record.setter
    def record(self, handle):
        self.__dict__["record"] = handle
        replay = self.__dict__.get("_symgrad_replay")
        if replay is not None:
            replay._zero_grad_entered()

    @property
    def run_callbacks_on_exit(self):
        replay = self.__dict__.pop("_symgrad_replay", None)
        self.__class__ = record_function
        if replay is not None and replay.range_exits(self.__dict__["record"], self.__dict__.pop("_symgrad_exit", None)):
            self.__dict__["run_callbacks_on_exit"] = False   # (its exit was made)
        return self.__dict__["run_callbacks_on_exit"]

    @run_callbacks_on_exit.setter
    def run_callbacks_on_exit(self, value):
        self.__dict__["run_callbacks_on_exit"] = value


class Replay(TorchFunctionMode):
    def __init__(self, trace: CompiledRecording, arg_leaves: list, externals: dict, alternatives=()):
        super().__init__()
        self.trace = trace
        self.alternatives = list(alternatives)  # other recordings of the same guard key
        self.pos = 0
        env = self.env = dict(externals)    # value id -> real tensor
        env.update(zip(trace.arg_ids, arg_leaves))
        self.shown = env.copy()             # value id -> the object Python holds
        self.stand_ins: dict = {}           # id(stand-in) -> value id
        self.done_regions: set = set()
        self.diverged: str | None = None
        self.path_changed = False  # a guarded bool differed from every recording's (_guard_failed)
        # a number read into Python differed from the recording's (_guard_failed): why, or None
        self.unverified: str | None = None
        # numbers of compiled calls' math that differed from the recording's constants: where
        # (``compiler.capture.numbers.changed_at``), for the dispatcher to take them at run time
        self.changed_numbers: set = set()
        self.scanning: int | None = None  # after such a divergence: the recorded call the next eager call is
        self.numbers_given: dict = {}  # NumberId -> the Python number this call gave (``_take_numbers``)
        self.eager_regions: set = set()  # regions run call by call since (they write in place)
        self.suspended_until: int | None = None  # inside an optimizer step run unwatched
        self.unwatched = False  # skip_python: the recorded calls made without the function's Python
        # NOTE: an optimizer's zero_grad() sets each p.grad to None: ~2 calls a parameter, each
        # checked at a few microseconds, about what eager's whole zero_grad costs. Where the
        # recording's zero_grad made only those (``Recording.zero_grad_spans``), it runs unwatched,
        # as an optimizer step does: this mode off the stack from its profiler range's enter
        # to its exit, the exit included (``_range_begins``); a later call given a gradient read
        # there finds an unknown tensor and leaves the recording, as after a step. Where the mode
        # cannot come off (another mode above it), the p.grad reads and writes pass unchecked up to
        # the range's exit, which is checked (``zero_grad_until``). An optimizer step's range exit
        # is made unwatched likewise, and any other recorded range's where every call inside it was
        # the recording's (``Recording.unwatched_ranges``).
        self.ranges = trace.unwatched_ranges()
        self.zero_grad_until: int | None = None  # inside such a zero_grad, watched: where it ends
        self.range_open = False  # an optimizer step's range is open whose exit puts this mode back
        self.pending: dict = {}  # AsyncCollectiveTensors met -> their waited results (tensor_parallel)
        # NOTE: only a recording of tensor-parallel layers looks for them in each call (a few us a call
        # under torch.distributed otherwise). One without met none: a DTensor or an AsyncCollectiveTensor
        # where it had plain tensors is another tensor than recorded, and the replay leaves it (eager).
        # (pending_type: None also until torch.distributed's functional collectives are imported;
        # the alternatives count: the replay may go on with one of them, ``_switch``)
        self.tensor_parallel = trace.tensor_parallel or any(alt.tensor_parallel for alt in alternatives)
        self.pending_type = tensor_parallel.pending_class() if self.tensor_parallel else None

    # -- optimizer steps run unwatched ------------------------------------------------------
    def run(self, fn, args, kwargs):
        """``fn(*args, **kwargs)`` under this replay (the mode, and the optimizer-step hooks)."""
        _active.replay = self
        try:
            with self:
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.step_ends()  # a step that raised: the mode goes back on the stack
        finally:
            _active.replay = None

    def run_calls(self):
        """``skip_python``: the recorded calls made again in order without the function's Python
        (``runtime.skip_python``); returns its result. Each region runs whole at its first call;
        an eager call runs on this call's tensors; an optimizer step is its optimizer's own
        ``step()`` (fused kernels where the recording's step was compiled, through the pre-hook)."""
        from runtime.skip_python import plan, result_of, run_ddp_forward

        trace, env = self.trace, self.env
        self.unwatched = True
        _active.replay = self
        try:
            for kind, item in plan(trace):
                if kind == "call":
                    rec, slots, positional = item
                    real = list(rec.leaves)
                    for i, vid in slots:
                        real[i] = env[vid] if vid in env else self._materialize(vid)
                    if positional:  # (the common case: positional arguments, each a leaf)
                        result = rec.func(*real)
                    else:
                        a, k = unflatten_call(real, rec.spec)
                        result = rec.func(*a, **k)
                    if rec.outputs:
                        env.update(zip(rec.outputs, _output_tensors(rec, result, real)))
                elif kind == "region":
                    self._run_region(item)
                elif kind == "grads_none":
                    for vid in item:
                        env[vid].grad = None
                elif kind == "ddp":   # DDP's own Python around its module's forward: the reducer prepared
                    run_ddp_forward(*item)
                else:  # an optimizer step: its own Python (the pre-hook finds a fused step at self.pos)
                    self.pos = item
                    optimizer = trace.step_calls[item][0]()
                    fused = trace.fused_steps.get(item)
                    if fused is None or not fused.run_directly(optimizer, _OUR_STEP_HOOKS):
                        optimizer.step()
            self.pos = len(trace.calls)
        finally:
            _active.replay = None
        return result_of(trace, env)

    def step_begins(self, optimizer=None, args=(), kwargs=None):
        """An optimizer.step() begins where the recording has one: its calls are all eager,
        so they run with this mode off the stack (no per-call checks), and the replay goes on
        after them. Values it makes are not tracked: a recorded call reading one later sees
        an unknown tensor and diverges. Where the step was compiled (``trace.fused_steps``)
        its fused kernels make the update, and the step call gets arguments that skip its
        own (``runtime.optimizer_step``); returned for the pre-hook to hand back."""
        end = self.trace.optimizer_steps.get(self.pos)
        if end is None or self.diverged or self.suspended_until is not None:
            return
        if self.unwatched:  # (skip_python: no mode to take off the stack)
            fused = self.trace.fused_steps.get(self.pos)
            return fused.run_after_pre_hooks(optimizer, args, kwargs or {}, _OUR_STEP_HOOKS[0]) \
                if fused is not None else None
        if not self._leave_stack():
            return
        self.suspended_until = end
        fused = self.trace.fused_steps.get(self.pos)
        if fused is not None:
            return fused.run_after_pre_hooks(optimizer, args, kwargs or {}, _OUR_STEP_HOOKS[0])
        return None

    def step_ends(self):
        if self.suspended_until is None:
            return
        torch._C._push_on_torch_function_stack(self)
        self.pos = self.suspended_until
        self.suspended_until = None

    def _range_begins(self, end: int, kind: str) -> None:
        """A recorded profiler range is being entered (``end``: its exit's position; ``kind``:
        ``Recording.unwatched_ranges``'). A zero_grad's p.grad calls pass unchecked up to the exit
        (``zero_grad_until``). Where the range is a ``record_function`` entered as usual, more
        (``_UnwatchedRange``): a zero_grad's or a step's calls are made with the mode off the stack,
        from the enter (which stores its handle out of this mode, which cannot take itself off the
        stack while it answers a call) or the step's pre-hook (``step_begins``); the exit of every
        kind is made with the mode off, which comes back after it (``range_exits``)."""
        if kind == "zero_grad":
            self.zero_grad_until = end
        frame = sys._getframe(2)
        for _ in range(3):  # (record_function.__enter__ -> the op packet's __call__ -> this mode)
            if frame is None:
                return
            if frame.f_code is _RECORD_ENTER:
                entering = frame.f_locals.get("self")
                if type(entering) is record_function and entering.run_callbacks_on_exit:
                    entering.__class__ = _UnwatchedRange
                    entering._symgrad_replay = self
                    if kind == "watched":   # (its exit's position in this recording)
                        entering._symgrad_exit = (end, self.trace)
                    else:
                        self.range_open = kind == "step"
                return
            frame = frame.f_back

    def range_exits(self, handle, watched=None) -> bool:
        """An ``_UnwatchedRange``'s ``__exit__`` begins: where the mode is off the stack for it (since
        its enter, or its step's pre-hook), or a watched range (``watched``: its exit's position and
        recording) has made every recorded call inside it and the mode is on top, make the range's
        exit call (``handle``: its enter's) with the mode off, put the mode back and go on after the
        recorded exit: True. False: the exit is made as usual (checked as recorded where the mode is on)."""
        if watched is not None:
            end, trace = watched
            if self.pos != end or trace is not self.trace or self.diverged or self.suspended_until is not None \
                    or not self._leave_stack():
                return False
        else:
            self.range_open = False
            end = self.suspended_until
            if end is None:
                return False
        with torch._C.DisableTorchFunctionSubclass():   # (as record_function.__exit__ makes it)
            torch.ops.profiler._record_function_exit._RecordFunction(handle)
        torch._C._push_on_torch_function_stack(self)
        self.pos, self.suspended_until = end + 1, None
        return True

    def _zero_grad_entered(self) -> None:
        """Called by ``_UnwatchedRange`` once the range's enter returned: the mode comes off the
        stack (if it is on top) until the range's exit."""
        if self.zero_grad_until is None or self.suspended_until is not None or not self._leave_stack():
            return
        self.suspended_until, self.zero_grad_until = self.zero_grad_until, None

    def _leave_stack(self) -> bool:
        """Take this mode off the torch-function stack if it is on top (``step_ends`` puts it back);
        False where it is not (another mode above ours: keep watching)."""
        if torch._C._len_torch_function_stack() == 0:
            return False
        top = torch._C._pop_torch_function_stack()
        if top is not self:
            torch._C._push_on_torch_function_stack(top)
            return False
        return True

    # -- library calls run as fused kernels (runtime.clip_grad) --------------------------
    def run_fused_call(self, *args):
        """A library call the compiler fused (``trace.fused_calls``: clip_grad_norm_) made where
        the recording made it: its kernels run in place of its recorded calls, with this mode
        off the stack, and the replay goes on after them. Returns its result, or None where it
        must run as recorded (then nothing has changed)."""
        fused = self.trace.fused_calls.get(self.pos)
        if fused is None or self.diverged or self.suspended_until is not None \
                or torch._C._len_torch_function_stack() == 0:
            return None
        top = torch._C._pop_torch_function_stack()
        try:
            result = fused.run(*args) if top is self else None
        finally:
            torch._C._push_on_torch_function_stack(top)
        if result is not None:
            self.pos = fused.end
            self.env[fused.output_id] = self.shown[fused.output_id] = result
        return result

    # -- the mode ----------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _LINEAR and self.tensor_parallel:  # (as the recording rewrote it)
            rewritten = self._tensor_parallel(args, kwargs)
            if rewritten is not None:
                return rewritten[0]
        if self.pending_type is not None:
            args, kwargs = self._waited(args, kwargs)
        if self.zero_grad_until is not None:
            if func == GRAD_GET or func == GRAD_SET:
                return func(*args, **(kwargs or {}))  # inside a zero_grad(): p.grad reads and writes, run as they are
            # (its end: the range's exit, checked as recorded; anything else fails that check)
            self.pos, self.zero_grad_until = self.zero_grad_until, None
        if not self.diverged:
            # the common case first: the next recorded call, with its tensors and constants
            calls, pos = self.trace.calls, self.pos
            if pos < len(calls):
                rec = calls[pos]
                # (``==``: a property's getter and setter come as a new method-wrapper each call)
                if rec.func is func or rec.func == func:
                    if not kwargs:
                        result = self._replay_flat(rec, func, args) if rec.flat_arity == len(args) else _SLOW
                    elif rec.flat_keywords == (len(args), tuple(kwargs)) and not _tensors_in_containers(kwargs):
                        # (a compiled call with keywords: never called here, its leaves checked)
                        result = self._replay_flat(rec, func, (*args, *kwargs.values()))
                    else:
                        result = _SLOW
                    if result is not _SLOW:
                        if pos in self.ranges:
                            self._range_begins(*self.ranges[pos])
                        return result
        kwargs = kwargs or {}
        if is_metadata(func):
            return func(*args, **kwargs)
        if self.diverged:
            return self._eager(func, args, kwargs)
        try:
            return self._replay(func, args, kwargs)
        except Diverged as e:
            reason = str(e)
        if self._switch(ending=False, func=func):
            try:
                return self._replay(func, args, kwargs)
            except Diverged as e:
                reason = str(e)
        self.diverged = reason
        return self._eager(func, args, kwargs)

    def _tensor_parallel(self, args, kwargs):
        """(result,) where this F.linear is a tensor-parallel layer's, on DTensors: the recording's
        rewrite of it on the local shards (``runtime.tensor_parallel``), replayed call by call."""
        if self.diverged:
            return None
        layout = tensor_parallel.linear_layout(args, kwargs or {})
        if type(layout) is not tuple:
            return None
        return (tensor_parallel.reentered(self, tensor_parallel.rewrite_linear, layout, args, kwargs or {}),)

    def _waited(self, args, kwargs):
        """``args`` and ``kwargs`` with AsyncCollectiveTensors waited for, as the recording had them."""
        pending = self.pending_type
        if pending is None or self.diverged \
                or not (_holds(pending, args) or kwargs and _holds(pending, kwargs.values())):
            return args, kwargs
        leaves, spec = flatten_call(args, kwargs or {})
        leaves = tensor_parallel.reentered(self, tensor_parallel.waited, leaves, self.pending)
        return unflatten_call(leaves, spec)

    def finish(self):
        if not self.diverged and self.pos != len(self.trace.calls) and not self._switch(ending=True):
            self.diverged = f"the function made {self.pos} of the {len(self.trace.calls)} recorded torch calls"

    def real_result(self, result):
        """The function's result with any stand-in replaced by its real value. (A path the
        recording did not take can return a value the recording kept inside the kernels; the
        replay has then diverged, and the value is computed from the recording.)"""
        if isinstance(result, torch.Tensor):  # (the usual result: one tensor, no pytree walk)
            return self._real(result) if id(result) in self.stand_ins else result
        leaves, spec = tree_flatten(result)
        if not any(isinstance(t, torch.Tensor) and id(t) in self.stand_ins for t in leaves):
            return result
        return tree_unflatten([self._real(t) for t in leaves], spec)

    def _switch(self, ending: bool, func=None) -> bool:
        """Continue with another recording of this function that made the same calls so far,
        through the same compiled regions (Python took another path after them: an optimizer
        step every few calls, a log line every hundred). ``ending``: the function returned;
        ``func``: the call being made now, which the other recording must make next."""
        k = self.pos
        for alt in self.alternatives:
            if alt is self.trace or (len(alt.calls) != k if ending else len(alt.calls) <= k):
                continue
            if func is not None and alt.calls[k].func is not func and alt.calls[k].func != func:
                continue
            if not _same_prefix(self.trace, alt, k) or not alt.modes_match():
                continue
            if self._switch_to(alt):
                return True
        return False

    def _switch_to(self, alt) -> bool:
        """Go on with recording ``alt`` from here, if the values it takes from outside (closed-over
        tensors, parameters) are all still alive; they join this replay's environment."""
        externals = alt.external_values()
        if externals is None:
            return False
        for vid, t in externals.items():
            self.env.setdefault(vid, t)
            self.shown.setdefault(vid, t)
        self.trace = alt
        self.ranges = alt.unwatched_ranges()
        return True

    def _guard_failed(self, value):
        """The value just read differs from the recording's. Go on with a recording that read this
        value at the same point after the same calls. With none: a bool (``if mask.all():``)
        steers Python's branch, so the replay diverges here, before any region of the other
        branch runs (a region runs whole at its first call: were its first call shared by both
        branches, its in-place writes would be the other branch's), and sets ``path_changed``:
        the dispatcher records this path next time. A number (``loss.item()``) may steer
        nothing (a log line): the replay goes on unverified, each later region that writes in
        place runs call by call (``_run_region``), so a call Python does not make diverges
        before any of its effects."""
        k = self.pos - 1
        rec = self.trace.calls[k]
        for alt in self.alternatives:
            if alt is self.trace or len(alt.calls) <= k or not alt.calls[k].guarded \
                    or not same_read(alt.calls[k].guard, value):
                continue
            read = alt.calls[k]  # the same read (of the same value id), with this result
            if read.func is not rec.func or read.spec != rec.spec or read.leaves != rec.leaves:
                continue
            if not _same_prefix(self.trace, alt, k) or not alt.modes_match():
                continue
            if self._switch_to(alt):
                return
        if type(value) is not bool:
            self.unverified = f"{function_name(rec.func)} read {value!r} where the recording read {rec.guard!r}"
            return
        self.path_changed = True
        self.diverged = (f"{function_name(rec.func)} read {value!r} where the recording read {rec.guard!r}: "
                         "Python takes another branch")

    # -- replaying a recorded call --------------------------------------------------------
    def _replay_flat(self, rec, func, args):
        """The recorded call ``rec`` made again with positional arguments only, each a leaf: the
        checks of ``_replay`` on ``args`` as they are (no flattening, no allocation), for the
        calls that need nothing more (a region's first call runs the region, as ``_replay`` would).
        Anything else (a tensor bound for the first time, a region that draws random seeds or runs
        eagerly, a value to materialize) answers _SLOW: ``_replay`` does it all."""
        shown = self.shown
        for i, expected in rec.value_slots:
            if args[i] is not shown.get(expected):
                return _SLOW
        if rec.kind is CallKind.COMPUTE:
            for i, expected in rec.constant_slots:
                leaf = args[i]
                if leaf is expected and type(leaf) in _IMMUTABLE:
                    continue   # (the recording's own object: GELU's approximate="none", a loss's reduction)
                if isinstance(leaf, torch.Tensor) or not _same_constant(leaf, expected):
                    return _SLOW
            if rec.number_slots and not self._take_numbers(rec, args):
                return _SLOW
            region = self.trace.regions[rec.region]
            if rec.region not in self.done_regions:  # a region's first call (the checks above are _replay's)
                if region.seeds:
                    return _SLOW  # (its seeds are drawn once: where the region cannot run, _replay says why)
                try:
                    self._run_region(rec.region)
                except Diverged:
                    return _SLOW  # (_replay meets the same and handles it: nothing was changed)
            if region.compiled is None or rec.region in self.eager_regions:
                return _SLOW  # (its calls run eagerly, one by one: _replay makes them)
            self.pos += 1
            if rec.out_spec is None:  # the common case: one tensor
                return shown[rec.outputs[0]]
            if rec.out_spec == "setitem":
                return None
            return tree_unflatten([shown[v] for v in rec.outputs], rec.out_spec)
        for i, _ in rec.constant_slots:
            leaf = args[i]
            if isinstance(leaf, torch.Tensor) or (type(leaf) in (list, tuple, dict) and holds_tensor(leaf)):
                return _SLOW  # (a container of tensors: another structure than the recording's)
        env = self.env
        for i, vid in rec.value_slots:
            if env.get(vid) is not args[i]:  # a stand-in where the call needs the value: materialize
                return _SLOW
        self.pos += 1
        result = func(*args)
        outputs = rec.outputs
        if not outputs:  # most eager calls: optimizer updates, attribute writes, grad mode
            if rec.guarded and not same_read(result, rec.guard):
                self._guard_failed(result)
            return result
        if rec.out_spec == "setitem":
            env[outputs[0]] = shown[outputs[0]] = args[0]
            return result
        if type(result) is torch.Tensor or isinstance(result, torch.Tensor):
            if len(outputs) == 1:
                env[outputs[0]] = shown[outputs[0]] = result
                return result
            tensors = [result]
        else:
            tensors = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        for vid, t in zip(outputs, tensors):
            env[vid] = t
            shown[vid] = t
        return result

    def _replay(self, func, args, kwargs):
        calls = self.trace.calls
        if self.pos < len(calls) and func in _REFLECTED and calls[self.pos].func == _REFLECTED[func] \
                and len(args) == 2 and not kwargs and type(args[0]) is StandIn and type(args[1]) is not StandIn \
                and (func is not _REFLECTED[func] or self.shown.get(calls[self.pos].leaves[0]) is not args[0]):
            # NOTE: `x <= s` with s a StandIn (a Tensor subclass) makes Python try s.__ge__(x)
            # first (a subclass's reflected comparison wins): it is the recorded x.__le__(s)
            # (`x == s` is s.__eq__(x): swapped unless the recording has s first too)
            func, args = calls[self.pos].func, (args[1], args[0])
        if self.pos >= len(calls) or (calls[self.pos].func is not func and calls[self.pos].func != func):
            if is_state_read(func) and self._switch(ending=False, func=func):
                calls = self.trace.calls  # another recording made this read here: go on with it
            elif is_state_read(func):
                # NOTE: reading .grad (a profiler, a debugger, a logging hook) changes nothing:
                # an extra read runs as it is. Were its result used by a recorded call, that
                # call's tensor check would see an unknown tensor and diverge.
                return func(*args, **kwargs)
            else:
                while self.pos < len(calls) and is_state_read(calls[self.pos].func):
                    self.pos += 1  # a recorded read not made this time: nothing to do
        if self.pos >= len(calls):
            raise Diverged(f"an extra call to {function_name(func)} that was not recorded")
        rec = calls[self.pos]
        if func is not rec.func and func != rec.func:
            raise Diverged(f"called {function_name(func)} where the recording has {function_name(rec.func)}")
        leaves, spec = flatten_call(args, kwargs)
        if spec != rec.spec:
            raise Diverged(f"{function_name(func)} called with differently structured arguments")
        shown = self.shown
        for i, expected in rec.value_slots:
            if leaves[i] is not shown.get(expected) and not self._bind_external(expected, leaves[i]):
                raise Diverged(f"{function_name(func)} called on a different tensor")
        compute = rec.kind is CallKind.COMPUTE
        for i, expected in rec.constant_slots:
            leaf = leaves[i]
            if isinstance(leaf, torch.Tensor) or (compute and not _same_constant(leaf, expected)):
                # NOTE: only compiled calls have their constants baked into kernels; an eager
                # call runs with this call's values (an optimizer's step size changes per step).
                if type(leaf) is type(expected) and type(leaf) in (int, float):  # (next time: taken at run time)
                    self.scanning = self.pos   # (and the calls after it, run eagerly, may show more: _scan)
                raise Diverged(f"{function_name(func)} called with a different constant ({leaf!r} != {expected!r})")
        if rec.kind is CallKind.COMPUTE:
            if rec.number_slots and not self._take_numbers(rec, leaves):
                raise Diverged(f"{function_name(func)} called with a number its kernels do not hold for "
                               f"({', '.join(repr(leaves[i]) for i, _ in rec.number_slots)})")
            region = self.trace.regions[rec.region]
            if rec.region not in self.done_regions:
                self._run_region(rec.region)
            if region.compiled is not None and rec.region not in self.eager_regions:
                self.pos += 1
                if rec.out_spec is None:  # the common case: one tensor
                    return self.shown[rec.outputs[0]]
                if rec.out_spec == "setitem":  # x[i] = v changed x (written back by the region)
                    return None
                return tree_unflatten([self.shown[v] for v in rec.outputs], rec.out_spec)
        self.pos += 1
        env = self.env
        real = leaves
        if all(env.get(vid) is leaves[i] for i, vid in rec.value_slots):
            result = func(*args, **kwargs)  # the common case: Python holds the real tensors
        else:
            real = list(leaves)
            for i, vid in rec.value_slots:
                # (a value another recording's region kept internal: computed from the recording)
                real[i] = env[vid] if vid in env else self._materialize(vid)
            a, k = unflatten_call(real, spec)
            result = func(*a, **k)
        if not rec.outputs:  # most eager calls: optimizer updates, attribute reads, grad mode
            if rec.guarded and not same_read(result, rec.guard):
                self._guard_failed(result)
            return result
        tensors = _output_tensors(rec, result, real)
        shown = self.shown
        for vid, t in zip(rec.outputs, tensors):
            env[vid] = t
            shown[vid] = t
        return result

    def _take_numbers(self, rec, leaves) -> bool:
        """The numbers call ``rec`` gives its region (``rec.number_slots``), made 0-dim tensors for the
        region's kernels; False (nothing taken) where one is of another type than the recording's,
        or outside the interval its kernels hold for (dropout's p of 0 returns its input)."""
        numbers, given = self.trace.numbers, self.numbers_given
        for i, nid in rec.number_slots:
            if not numbers[nid].admits(leaves[i]):
                return False
            if nid in given and not _same_constant(leaves[i], given[nid]):
                return False   # (taken from the function's argument before its region ran: this is another)
        if rec.region in self.done_regions and any(nid not in given for _, nid in rec.number_slots):
            return False   # (never: such a call begins its region; capture makes it so)
        for i, nid in rec.number_slots:
            if nid not in given:
                self.env[nid] = numbers[nid].tensor(leaves[i])
                given[nid] = leaves[i]
        return True

    def take_argument_numbers(self, leaves) -> None:
        """The float arguments the regions take at run time (``NumberInput.argument``), from the call's
        leaves, before any region runs (their calls need not begin a region). One that is not what the
        kernels hold for is left out: its call then finds it missing and leaves the recording."""
        for nid, taken in self.trace.numbers.items():
            if taken.argument is not None and taken.argument < len(leaves) and taken.admits(leaves[taken.argument]):
                self.env[nid] = taken.tensor(leaves[taken.argument])
                self.numbers_given[nid] = leaves[taken.argument]

    def _bind_external(self, vid, t) -> bool:
        """The first use of a value that appeared during the recorded call without a torch
        call the mode saw (a Parameter made inside the function, a saved tensor unpacked from
        a grad_fn; ``Recording.transient``): bind it to the tensor the function passes now, if
        its metadata matches the recording's."""
        meta = self.trace.transient.get(vid)
        if meta is None or vid in self.env or not isinstance(t, torch.Tensor) or id(t) in self.stand_ins \
                or not meta.matches(t):
            return False
        self.env[vid] = t
        self.shown[vid] = t
        return True

    def _run_region(self, index: int):
        region = self.trace.regions[index]
        if region.compiled is not None and self.unverified and (region.writes_in_place or region.seeds):
            # NOTE: a region runs whole at its first call. After a number read that differs from
            # the recording's, Python may not make all its calls (``if v > 0:`` took the other
            # branch, whose first call is the same): a region that only computes is harmless
            # (what Python did not ask for is never shown), but one that writes in place or
            # draws random numbers would leave the other branch's effects. It runs call by
            # call, each checked, as eager would.
            self.eager_regions.add(index)
        if region.compiled is None or index in self.eager_regions:
            self.done_regions.add(index)
            return  # runs call by call, eagerly
        for vid, device in region.seeds:
            # from the device's generator, as eager's random ops draw: manual_seed reproduces it
            self.env[vid] = torch.randint(0, 2**31 - 1, (), dtype=torch.int64, device=device)
        try:
            inputs = [self.env[v] if v in self.env else self._materialize(v) for v in region.input_ids]
        except KeyError:
            raise Diverged("a value the compiled region reads was not made this time") from None
        if region.compiled.donated_inputs and _shares_memory(inputs, region.compiled.donated_inputs):
            raise Diverged("a tensor the compiled region changes in place shares memory with another of its inputs")
        self.done_regions.add(index)
        if torch.is_grad_enabled() == region.grad_enabled:  # (the usual case: no context to enter)
            self._region_results(region, inputs)
        else:
            with torch.set_grad_enabled(region.grad_enabled):
                self._region_results(region, inputs)
        if self.unwatched:
            return  # (skip_python: no Python to hand stand-ins to)
        # Stand-ins are made once per region and reused: capture proved no one keeps them.
        stand_ins = self.trace.stand_ins.get(index)
        if stand_ins is None:
            stand_ins = self.trace.stand_ins[index] = {vid: stand_in(meta) for vid, meta in region.internal.items()}
        for vid, s in stand_ins.items():
            self.shown[vid] = s
            self.stand_ins[id(s)] = vid

    def _region_results(self, region, inputs):
        """Run a compiled region on ``inputs``; its results (in-place writes written back into
        the real tensors, views remade from their real bases) join the replay's values."""
        outs = region.compiled(inputs)
        written = dict(zip(region.output_ids, outs))
        for vid in region.mutated:
            # NOTE: in-place ops were compiled functionally; write the final value back
            # into the real tensor, as eager's in-place op would have left it: same object,
            # version counter bumped, autograd history through the compiled region. A kernel
            # may have stored the value into the tensor's memory already (``compiler.lower.program._input_donors``:
            # an input that needs no gradient): then there is nothing to copy.
            target, new = self.env[vid], written[vid]
            bumps = region.writes.get(vid, 1)  # as many bumps as eager's in-place ops
            if not _stored_in_place(new, target):
                if bumps:
                    target.copy_(new)
                    bumps -= 1
                else:  # (written inside eager's operator: its version stays, as there)
                    with torch.autograd._unsafe_preserve_version_counter(target):
                        target.copy_(new)
            for _ in range(bumps):
                torch.autograd.graph.increment_version(target)
            written[vid] = target
        for vid, (base, steps) in region.views.items():
            # NOTE: the kernels computed the view's value into fresh memory; eager's view
            # still shares its base's, so later in-place writes through it change the base
            written[vid] = apply_views(written[base], steps)
        self.env.update(written)
        if not self.unwatched:
            self.shown.update(written)

    # -- after a divergence: everything eagerly, stand-ins recomputed -------------------------
    def _eager(self, func, args, kwargs):
        leaves, spec = flatten_call(args, kwargs)
        if self.scanning is not None:
            self._scan(func, spec, leaves)
        real = [self._real(leaf) for leaf in leaves]
        a, k = unflatten_call(real, spec)
        return func(*a, **k)

    def _scan(self, func, spec, leaves) -> None:
        """After a number of the math changed, the calls Python makes next still follow the recording
        (run eagerly): note every number of compiled calls that changed too (a loss scale after a
        temperature), so that one more recording takes them all at run time. Stops where they part."""
        calls, pos = self.trace.calls, self.scanning
        rec = calls[pos] if pos < len(calls) else None
        if rec is None or (rec.func is not func and rec.func != func) or rec.spec != spec:
            self.scanning = None
            return
        if rec.kind is CallKind.COMPUTE:
            for i, expected in rec.constant_slots:
                leaf = leaves[i]
                if type(leaf) is type(expected) and type(leaf) in (int, float) and not _same_constant(leaf, expected):
                    self.changed_numbers.add(changed_at(calls, pos, i))
        self.scanning = pos + 1

    def _real(self, leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        vid = self.stand_ins.get(id(leaf))
        if vid is None or self.shown.get(vid) is not leaf:
            return leaf
        return self._materialize(vid)

    def _materialize(self, vid, before=None):
        """The real value ``vid`` (as made by the last call before call ``before`` that makes it),
        recomputed eagerly from the recording where the replay has none."""
        if vid in self.env:
            return self.env[vid]
        index = self._maker(vid, before)
        rec = self.trace.calls[index]
        real = [self._materialize(x, index) if isinstance(x, ValueId) else self._number(x) for x in rec.leaves]
        a, k = unflatten_call(real, rec.spec)
        result = rec.func(*a, **k)
        tensors = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        for out_vid, t in zip(rec.outputs, tensors):
            self.env.setdefault(out_vid, t)
        return self.env[vid]


    def _number(self, leaf):
        """A recorded call's constant, or the number this call gave where the recording takes it at
        run time (a NumberId is an int: passed on as one it would compute with the wrong value)."""
        if type(leaf) is not NumberId:
            return leaf
        if leaf not in self.numbers_given:
            raise RuntimeError("symgrad: a value the compiled function kept inside its kernels is needed, and it "
                               "was computed from a number this call did not give. Please report this; "
                               "backend='eager' runs the function as it is.")
        return self.numbers_given[leaf]

    def _maker(self, vid, before) -> int:
        """The call that made ``vid`` last before call ``before`` (None: of all). NOTE: an in-place
        call reads and makes the same value id (``x.clone().fill_(v)``): what it read was made by an
        earlier call, not by itself (a divergence there recursed for ever)."""
        if before is None:
            return self.trace.produced_by[vid]
        for index in range(before - 1, -1, -1):
            if vid in self.trace.calls[index].outputs:
                return index
        return self.trace.produced_by[vid]


def _output_tensors(rec, result, leaves) -> list:
    """The tensors a recorded call made, in its outputs' order (``x[i] = v`` makes its target)."""
    if rec.out_spec == "setitem":
        return [leaves[0]]
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]


def _stored_in_place(new, target) -> bool:
    """Whether a region's output ``new`` is ``target``'s new value already in ``target``'s own
    memory (a kernel stored it there: ``compiler.lower.program._input_donors``), with no autograd history for the
    write-back copy to give (neither needs a gradient). An empty tensor's address says nothing."""
    return not new.requires_grad and not target.requires_grad and new.numel() > 0 \
        and new.data_ptr() == target.data_ptr() and new.shape == target.shape and new.stride() == target.stride()


def _shares_memory(inputs, donated) -> bool:
    """Whether an input whose new value a kernel stores into its own memory (``donated``: positions)
    shares that memory with another input: the kernels would read the new value where the
    recording read the old (a buffer passed as an argument too, a view of it)."""
    storages = {_memory_of(inputs[i]) for i in donated}
    if len(storages) < len(donated):
        return True
    return any(isinstance(t, torch.Tensor) and i not in donated and _memory_of(t) in storages
               for i, t in enumerate(inputs))


def _memory_of(t: torch.Tensor):
    """Where a tensor's storage is: its address, or, for a storage with none (meta tensors: every
    one's address is 0, ``benchmarks.models`` replays steps on them), the storage itself."""
    storage = t.untyped_storage()
    return storage.data_ptr() or ("storage", storage._cdata)


def _same_prefix(a: CompiledRecording, b: CompiledRecording, k: int) -> bool:
    """Whether recordings ``a`` and ``b`` agree on their first ``k`` calls — same functions,
    arguments and value ids, and the same compiled regions, each ending before call ``k`` —
    so a replay of ``a`` may go on as a replay of ``b``. Remembered per pair."""
    memo = a.__dict__.setdefault("_prefix_memo", {})
    key = (id(b), k)
    if key not in memo:
        memo[key] = _compare_prefix(a, b, k)
    return memo[key]


def _compare_prefix(a: CompiledRecording, b: CompiledRecording, k: int) -> bool:
    if a.arg_ids != b.arg_ids:
        return False
    regions = set()
    for ca, cb in zip(a.calls[:k], b.calls[:k]):
        if (ca.func is not cb.func and ca.func != cb.func) or ca.spec != cb.spec or ca.kind != cb.kind \
                or ca.region != cb.region or ca.outputs != cb.outputs or ca.out_spec != cb.out_spec \
                or len(ca.leaves) != len(cb.leaves) or ca.guarded != cb.guarded \
                or (type(ca.guard) is bool and ca.guard != cb.guard):  # (a number read: any value)
            return False
        for x, y in zip(ca.leaves, cb.leaves):
            if isinstance(x, ValueId) or isinstance(y, ValueId):
                if not (isinstance(x, ValueId) and isinstance(y, ValueId) and x == y):
                    return False
            elif ca.kind is CallKind.COMPUTE and not _same_constant(x, y):
                return False
        if ca.kind is CallKind.COMPUTE:
            regions.add(ca.region)
    for r in regions:
        ra, rb = a.regions[r], b.regions[r]
        if ra.calls != rb.calls or max(ra.calls) >= k or (ra.compiled is None) != (rb.compiled is None):
            return False
        # what ``b`` lets Python see of the region, ``a``'s run must have made real (a stand-in
        # must never reach Python where ``b``'s recording says the value is used)
        if not set(rb.output_ids) <= set(ra.output_ids) or ra.mutated != rb.mutated:
            return False
    return True


def _same_constant(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and a != a:
        return b != b
    try:
        return bool(a == b)
    except Exception:
        return a is b
