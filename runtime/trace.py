"""What a recorded call of a user's function is: the torch calls it made, in order.

Capture (in ``compiler``) records every torch call the function makes. Runs of calls the
compiler understands form *regions*, each compiled to one ``CompiledRegion``; every other
call (``loss.backward()``, the optimizer's in-place updates, an unsupported op) is an
*eager* call, run as it is on replay. Values are numbered (value ids); a call's tensor
arguments are recorded as value ids and its other arguments as constants.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass, field

import torch

from runtime.torch_functions import GRAD_GET, function_name, is_grad_set, is_profiler_range, is_state_read
from runtime.unchanged import tensors_unchanged

# what a recorded call holds in place of a Python function it was given (a hook): the recording
# does not keep the function alive, and a replay re-runs the Python that makes a new one
UNKEPT = "<a function, not kept by the recording>"


class ValueId(int):
    """A recorded tensor value, distinct from an integer constant in a call's arguments."""


class NumberId(int):
    """A Python number a compiled region takes at run time (issue 39: a temperature, a loss scale,
    dropout's p): the call's leaf is this id in place of the constant, the region reads it as a
    0-dim tensor input (``NumberInput``), and each replay passes the value the call was given."""


@dataclass(frozen=True)
class NumberInput:
    """How a replay hands a region the number ``NumberId`` stands for: a 0-dim tensor of ``dtype``
    on ``device``, made from a Python number of type ``kind`` (another type diverges: ``x * 2`` and
    ``x * 2.0`` promote differently); ``low``/``high``: the open interval the binding's kernels
    hold for (dropout's p in (0, 1): p = 0 returns the input itself), None: any value."""

    kind: type
    dtype: torch.dtype
    device: torch.device
    low: float | None = None
    high: float | None = None
    # where it is a float argument of the function: its position among the call's leaves, from which
    # a replay takes it before any region runs (so its call need not begin a region)
    argument: int | None = None

    def admits(self, value) -> bool:
        return type(value) is self.kind and (self.low is None or self.low < value) \
            and (self.high is None or value < self.high)

    def tensor(self, value) -> torch.Tensor:
        # (torch.full, not torch.tensor: on a GPU a fill kernel, with no copy from the host to wait for)
        return torch.full((), value, dtype=self.dtype, device=self.device)


class CallKind(enum.Enum):
    """How a recorded call runs on replay."""
    COMPUTE = "compute"        # inside a region: the region's kernels compute it
    EAGER = "eager"            # as it is (``loss.backward()``, an optimizer's update, an op not compiled)


@dataclass(frozen=True)
class TraceCall:
    func: object
    kind: CallKind
    region: int | None
    spec: object               # pytree spec of (args, kwargs)
    leaves: list               # ValueId for tensors, the value itself for constants
    outputs: list              # ValueId per tensor leaf of the result, in order
    out_spec: object = None
    reason: str | None = None  # for an eager call that breaks a region: why
    # A value the call read out of a tensor into Python (``if mask.all():``, ``loss.item()``): the
    # calls Python makes next may depend on it, so replay compares it (``guarded``; runtime.replay).
    guard: object = None
    guarded: bool = False

    @functools.cached_property
    def value_slots(self) -> tuple:
        """(leaf position, value id) of each tensor argument: replay's per-call check."""
        return tuple((i, x) for i, x in enumerate(self.leaves) if isinstance(x, ValueId))

    @functools.cached_property
    def constant_slots(self) -> tuple:
        """(leaf position, constant) of every other argument but numbers taken at run time."""
        return tuple((i, x) for i, x in enumerate(self.leaves) if not isinstance(x, (ValueId, NumberId)))

    @functools.cached_property
    def number_slots(self) -> tuple:
        """(leaf position, NumberId) of the Python numbers its region takes at run time."""
        return tuple((i, x) for i, x in enumerate(self.leaves) if isinstance(x, NumberId))

    @functools.cached_property
    def flat_arity(self) -> int | None:
        """The number of positional arguments when the call had only those, each a leaf (no
        keywords, no container of tensors): replay then checks ``args`` as they come, without
        flattening them. None otherwise, and for comparisons (Python may call their reflection)."""
        from runtime.torch_functions import REFLECTED_COMPARISONS

        spec = self.spec
        if type(spec) is not tuple or spec[0] == "tree" or spec[1] or self.func in REFLECTED_COMPARISONS:
            return None
        return spec[0]

    @functools.cached_property
    def flat_keywords(self) -> tuple | None:
        """(number of positional arguments, keyword names) of a compiled call made with keywords,
        each argument a leaf (``F.gelu(x, approximate="none")``, ``F.mse_loss(a, b, reduction=...)``):
        replay checks ``args`` and the keywords' values as they come. None otherwise."""
        from runtime.torch_functions import REFLECTED_COMPARISONS

        spec = self.spec
        if self.kind is not CallKind.COMPUTE or type(spec) is not tuple or spec[0] == "tree" or not spec[1] \
                or self.func in REFLECTED_COMPARISONS:
            return None
        return spec


def read_snapshot(value):
    """What replay compares a value read into Python against: the value itself, or a copy of an
    array (``Tensor.numpy()`` shares the tensor's memory, which later calls may change)."""
    copy = getattr(value, "copy", None)
    return copy() if callable(copy) and not isinstance(value, (list, dict, set)) else value


def same_read(a, b) -> bool:
    """Whether two values read into Python are the same (NaN equals NaN; arrays element-wise)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (a != a and b != b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_read(x, y) for x, y in zip(a, b))
    try:
        equal = a == b
        return bool(equal if isinstance(equal, bool) else equal.all()) and getattr(a, "shape", None) == getattr(
            b, "shape", None)
    except Exception:
        return a is b


@dataclass
class TensorMeta:
    shape: tuple
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> "TensorMeta":
        return TensorMeta(tuple(t.shape), t.dtype, t.device, t.requires_grad)

    def matches(self, t: torch.Tensor) -> bool:
        # (torch.Size compares equal to the tuple: no tuple made per check; ``Recording.external_values``
        # writes this test out in its loop)
        return (t.shape == self.shape and t.dtype == self.dtype and t.device == self.device
                and t.requires_grad == self.requires_grad)


@dataclass(frozen=True)
class RegionPlan:
    """One region as capture recorded it, and, in a ``CompiledRecording``, as compiling left it
    (``compiled`` or the eager ``reason``): each stage makes a new plan, none changes one."""
    calls: list                # indices into Recording.calls
    input_ids: list            # value ids read (not produced inside)
    output_ids: list           # value ids produced inside and visible outside (materialized)
    internal: dict             # value id -> TensorMeta of values never seen outside
    grad_enabled: bool
    mutated: list = field(default_factory=list)  # input value ids changed in place inside
    compiled: object = None    # CompiledRegion, or None: run this region's calls eagerly
    reason: str | None = None  # why it runs eagerly
    seeds: list = field(default_factory=list)  # (value id, device) of inputs given a fresh RNG seed per run
    writes: dict = field(default_factory=dict)  # mutated input's value id -> in-place ops on it (version bumps)
    # outputs that eager has as views of another output (or of a mutated input), written in place
    # here: value id -> (base value id, ViewSteps); remade from the real base after the region
    views: dict = field(default_factory=dict)
    # whether a call inside writes in place (into an input or a value made inside): such a region
    # must not run whole where Python may not make all its calls (runtime.replay, after a read)
    writes_in_place: bool = False
    graph: object = None       # the region's captured FX graph (None: a stored recording's, not kept)


@dataclass(frozen=True)
class Recording:
    """What capture hands the compiler: the calls one run of the function made, its regions
    (``RegionPlan``, none compiled yet) and what replay must check. Frozen: compiling makes a
    ``CompiledRecording`` beside it."""
    calls: list
    regions: list
    arg_ids: list              # value id per tensor leaf of the function's (args, kwargs)
    externals: dict            # value id -> (weakref to a tensor reached inside, TensorMeta)
    produced_by: dict          # value id -> index of the call that made it
    fallbacks: list = field(default_factory=list)
    graph_breaks: list = field(default_factory=list)  # values read into Python (compiled on both sides)
    internal_errors: list = field(default_factory=list)  # compiler bugs met while recording (ran eagerly)
    transient: dict = field(default_factory=dict)  # value id -> TensorMeta: externals made during the call
    module_modes: list = field(default_factory=list)  # (weakref to an nn.Module it ran, its .training)
    optimizer_steps: dict = field(default_factory=dict)  # call index where an optimizer.step began -> where it ended
    # optimizer steps (and clip_grad_norm_ calls) as recorded, for the compiler to fuse
    # (``compiler.optimizers.StepRecorder.found``); a compiled recording keeps none
    recorded_optimizer_steps: list = field(default_factory=list)
    # what the function returned: (pytree spec, leaves: ValueId per tensor, the value itself
    # otherwise), or None where a tensor it returned was not made by a recorded call
    result: tuple | None = None
    # optimizer.step() calls by the index where each began: (weak reference to the optimizer,
    # whether step() was given arguments): what skip_python calls in their place
    step_calls: dict = field(default_factory=dict)
    reseeded: bool = False  # the call seeded the random generator (torch.manual_seed): no torch call records it
    # recorded because Python left the key's other recordings (a path they do not have): with
    # such a recording beside it, skip_python cannot know which path Python would take
    other_path: bool = False
    numbers: dict = field(default_factory=dict)  # NumberId -> NumberInput: numbers the regions take at run time
    # positions among the call's leaves of float arguments a compiled call used as a constant (its binding
    # needs one: a factory's fill value): the guard key specializes on those
    baked_floats: frozenset = frozenset()
    # it computed a tensor-parallel layer on DTensors' local shards (an F.linear rewritten, an
    # AsyncCollectiveTensor waited): only then does a replay look for them in each call
    tensor_parallel: bool = False

    def recorded_fields(self) -> dict:
        """This recording's own fields (a ``CompiledRecording``'s without what compiling added)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Recording)}

    def zero_grad_spans(self) -> dict:
        """Where an optimizer's ``zero_grad()`` began -> where it ended (its profiler range's
        enter and exit), for those whose recorded calls between are only ``p.grad`` reads and
        ``p.grad = None`` and whose reads no later call uses: a replay runs them unchecked
        (``runtime.replay``). Worked out once per recording."""
        spans = self.__dict__.get("_zero_grad_spans")
        if spans is None:
            spans = self.__dict__["_zero_grad_spans"] = _zero_grad_spans(self)
        return spans

    def unwatched_ranges(self) -> dict:
        """Where a recorded profiler range is entered -> (where it is exited, its kind): "zero_grad"
        (``zero_grad_spans``) and "step" (an optimizer step's, holding its recorded calls and nothing
        else, ``optimizer_steps``), whose calls a replay makes with its mode off the stack, and
        "watched" for any other (its calls checked, its exit made with the mode off). Worked out once
        per recording."""
        ranges = self.__dict__.get("_unwatched_ranges")
        if ranges is None:
            calls, ranges, entered = self.calls, {}, []
            for i, rec in enumerate(calls):   # (ranges nest: an exit closes the last range entered)
                if _range_call(rec, "enter"):
                    entered.append(i)
                elif _range_call(rec, "exit") and entered:
                    ranges[entered.pop()] = (i, "watched")
            ranges.update({begin: (end, "zero_grad") for begin, end in self.zero_grad_spans().items()})
            for start, end in self.optimizer_steps.items():
                if 0 < start and end < len(calls) and _range_call(calls[start - 1], "enter", OPTIMIZER_STEP_RANGE) \
                        and _range_call(calls[end], "exit"):
                    ranges[start - 1] = (end, "step")
            self.__dict__["_unwatched_ranges"] = ranges
        return ranges

    def unused_reads(self) -> list:
        """Per recorded call: whether it reads a tensor's state (``p.grad``) whose value nothing
        after it reads (a later call, a region, the result): zero_grad's ``if p.grad is not
        None`` reads a gradient the optimizer step read before it. Worked out once per recording."""
        unused = self.__dict__.get("_unused_reads")
        if unused is None:
            unused = self.__dict__["_unused_reads"] = _unused_reads(self)
        return unused

    def modes_match(self) -> bool:
        """Whether every module the recording ran is still in the same train/eval mode."""
        for ref, training in self.module_modes:
            module = ref()
            if module is not None and module.training != training:
                return False
        return True

    def external_values(self):
        """Value id -> the tensor reached inside (closed over, a parameter), each alive and as recorded
        (``TensorMeta.matches``, written out: this runs per call, per parameter); None where one is not.
        NOTE (speed): once they matched, later calls check them first in one C++ call (``tensors_unchanged``)."""
        known = self.__dict__.get("_externals_unchanged")
        if known is not None:
            vids, refs, unchanged = known
            tensors = [ref() for ref in refs]
            if unchanged(*tensors):
                return dict(zip(vids, tensors))
        values = {}
        for vid, (ref, meta) in self.externals.items():
            t = ref()
            if t is None or not (t.shape == meta.shape and t.dtype == meta.dtype and t.device == meta.device
                                 and t.requires_grad == meta.requires_grad):
                return None
            values[vid] = t
        self.__dict__["_externals_unchanged"] = (tuple(values), tuple(ref for ref, _ in self.externals.values()),
                                                 tensors_unchanged(list(values.values())))
        return values


@dataclass(frozen=True)
class CompiledRecording(Recording):
    """What compiling a ``Recording`` hands the runtime, which replays it: the same calls, each
    region with its ``CompiledRegion`` or the reason it runs eagerly, and the fused optimizer
    steps. Replay-time caches (the regions' stand-ins) live in ``stand_ins``, made empty here."""
    # compiled optimizer steps by the call index where each began (runtime.optimizer_step.FusedOptimizerStep)
    fused_steps: dict = field(default_factory=dict)
    # library calls compiled as a whole (clip_grad_norm_), by the index of their first recorded
    # call: runtime.clip_grad.FusedClipGradNorm (its ``end``: the index after its calls)
    fused_calls: dict = field(default_factory=dict)
    # region index -> {value id: stand-in tensor}: made at the region's first replay (runtime.replay);
    # a stand-in refuses to be read, so neither repr nor == looks at them
    stand_ins: dict = field(default_factory=dict, repr=False, compare=False)


ZERO_GRAD_RANGE = "Optimizer.zero_grad#"  # the profiler range torch.optim's zero_grad opens
OPTIMIZER_STEP_RANGE = "Optimizer.step#"   # the one its step opens (``Optimizer.profile_hook_step``)


def sets_grad_to_none(call) -> bool:
    """A recorded ``p.grad = None`` (zero_grad's write): the parameter, then None."""
    return (is_grad_set(call.func) and len(call.leaves) == 2 and isinstance(call.leaves[0], ValueId)
            and call.leaves[1] is None and not call.outputs)


def _unused_reads(trace: Recording) -> list:
    calls = trace.calls
    unused = [False] * len(calls)
    later = {v for v in trace.result[1] if isinstance(v, ValueId)} if trace.result is not None else set()
    for k in range(len(calls) - 1, -1, -1):  # (backwards: what the calls after each one read is known)
        unused[k] = is_state_read(calls[k].func) and not later.intersection(calls[k].outputs)
        later.update(v for v in calls[k].leaves if isinstance(v, ValueId))
        if calls[k].kind is CallKind.COMPUTE:  # (a region reads its inputs at its first call: counted at each)
            later.update(trace.regions[calls[k].region].input_ids)
    return unused


def _zero_grad_spans(trace: Recording) -> dict:
    calls, unused, spans = trace.calls, trace.unused_reads(), {}
    for i, rec in enumerate(calls):
        if _range_call(rec, "enter", ZERO_GRAD_RANGE):
            j = i + 1
            while j < len(calls) and ((calls[j].func == GRAD_GET and unused[j]) or sets_grad_to_none(calls[j])):
                j += 1
            if i + 1 < j < len(calls) and _range_call(calls[j], "exit"):
                spans[i] = j
    return spans


def _range_call(rec, end: str, name: str = "") -> bool:
    """Whether a recorded call is a profiler range's ``end`` ("enter", "exit"), of a range whose name
    begins with ``name`` (an enter's first argument)."""
    if not is_profiler_range(rec.func) or end not in getattr(rec.func, "__name__", ""):
        return False
    return not name or bool(rec.leaves) and type(rec.leaves[0]) is str and rec.leaves[0].startswith(name)


def occurrence_of(calls, func, position: int) -> int:
    """How many of ``calls[:position]`` call ``func``: with its name, where a number was seen to change."""
    return sum(1 for c in calls[:position] if c.func is func or c.func == func)


def changed_at(calls, position: int, leaf: int) -> tuple:
    """The key ``compiler.capture.numbers.NumbersTaken`` knows a changing number by: (function name,
    occurrence, leaf position)."""
    func = calls[position].func
    return function_name(func), occurrence_of(calls, func, position), leaf
