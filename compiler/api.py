"""The public face: ``compile`` and ``explain``. It wires the compiler (capture → autodiff →
fusion → codegen) to the runtime's dispatcher, which calls ``_build`` on a cache miss."""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch.fx as fx

from compiler.build import build_region
from compiler.capture.recorder import RecordingFailed, capture
from compiler.capture.calls import VALUE_READS
from compiler.reuse.dynamic import NotInstantiable, Template
from compiler.optimizers import compile_optimizer_steps, fused_call_indices, optimizer_kernel_infos
from compiler.codegen.triton_printer import NotPrintable
from compiler.capture.bindings import Unsupported
from compiler.report import dumps
from compiler.report import logs
from compiler.reuse import persist
from compiler.reuse import recordings
from compiler.report.explain import KernelInfo, Report, fused_user_ops
from compiler.ir.graph import copy_graph, has_meta, meta_of
from compiler.ir.sympy_lock import SYMPY_LOCK
from compiler.autodiff.saved_set import check_policy
from runtime import ahead_of_time
from runtime import skip_python
from runtime import backends
from runtime.dispatch import CompiledFunction, Entry, check_recording_limit
from runtime.trace import CallKind, CompiledRecording, Recording
from runtime.fallback import CompileError, internal_error
from runtime.segments import ddp_bucket_bytes
from runtime.torch_functions import function_name


# The compiler's deliberate refusals: what it does not compile (yet), each with its reason.
# Any other exception while compiling is a bug (see runtime.fallback.internal_error).
DELIBERATE = (Unsupported, NotPrintable)

log = logging.getLogger("compiler")


def compile(fn=None, *, backend: str = "auto", fullgraph: bool = False, memory: str = "balanced",
            dynamic: bool | None = None, skip_python: bool = False, recording_limit: int | None = None):
    """Compile ``fn``: its torch ops become fused kernels, forward and backward.

    Usable as ``@compiler.compile`` or ``@compiler.compile(backend=..., fullgraph=...)``.
    Backends (``runtime.backends``):

    - ``"auto"`` (the default): ``"triton"`` for CUDA tensors; for CPU tensors ``"cpp"`` where a
      working C++ compiler is found, else ``"torch"`` (a warning says why, once), or what
      ``SYMGRAD_CPU_BACKEND=cpp|torch|interpret`` names (the test suite sets ``interpret``).
      Chosen at the first call on each device type; a call with no tensor arguments is decided by
      the device its recording's tensors are on;
    - ``"triton"``: compiled Triton kernels (CUDA tensors);
    - ``"cpp"``: each fused kernel the C++ printer writes, compiled by the system's C++ compiler,
      the others as ``"torch"`` (CPU tensors);
    - ``"torch"``: each fused kernel as a generated function of PyTorch ops (CPU tensors);
    - ``"interpret"``: the Triton kernels in Triton's interpreter (CPU tensors; slow, for tests);
    - ``"eager"``: the function unmodified.

    The first call
    with new shapes runs eagerly while it records; later calls run the compiled kernels. With
    ``fullgraph=True``, anything that would run eagerly raises ``CompileError`` instead.

    ``memory`` chooses what the forward saves for backward (the rest is recomputed inside the
    backward's kernels; ``compiler.autodiff.saved_set``): ``"balanced"`` (the default) recomputes
    pointwise values and views where that saves bytes and always saves reductions' statistics
    and matmul/convolution results; ``"min"`` saves the fewest bytes, recomputing reductions
    too.

    ``dynamic`` chooses which tensor sizes calls specialize on (README "Shapes that change"):
    ``None`` (the default) stops specializing on a dimension once it is seen with a second size,
    ``True`` on every dimension from the first call, ``False`` always specializes (each new
    shape records again). A call at sizes a recording covers is instantiated from it: no eager
    run, no recording. ``compiler.mark_dynamic(t, dim)`` marks one dimension up front. Sizes 0
    and 1 always specialize.

    ``recording_limit``: how many argument keys (shapes, dtypes, requires_grad, constants, grad
    mode...) the function records, as ``torch._dynamo.config.recompile_limit`` caps recompiles;
    ``None`` (the default) takes ``$SYMGRAD_RECORDING_LIMIT``, else 8. Past it, a call with a new
    key runs eagerly (with ``fullgraph=True``: raises ``CompileError``), said once with the guards
    that kept failing, and in ``explain(fn)``'s fallbacks; the keys recorded still replay. Entries
    instantiated for new sizes (``dynamic``) are not counted. (A key recorded again and again, its
    Python taking new paths, is run eagerly after eight re-recordings, whatever the limit.)

    ``skip_python=True`` (a promise, off by default): every call with the same arguments'
    description makes the same torch calls with the same constants, and ``fn``'s Python has no
    other effect. Replays then make the recorded calls directly instead of running ``fn`` and
    checking each of its torch calls (``runtime.skip_python``: what stays guarded, and where
    the promise cannot hold and the checked replay runs instead, with the reason logged once).

    ``SYMGRAD_DISABLE=1`` turns every compiled function off while it is set (read at each call,
    so before or after ``compile``, as ``TORCH_COMPILE_DISABLE``): each call runs ``fn``'s Python
    unmodified — no recording, no kernels, nothing stored — and a warning says so once. For
    bisecting a wrong value or a crash: is it the compiler?

    >>> import torch, compiler
    >>> @compiler.compile
    ... def f(x, y):
    ...     return (torch.sin(x) * y + torch.exp(-x)).sum()
    >>> x = torch.randn(8, requires_grad=True)
    >>> _ = f(x, torch.randn(8)); loss = f(x, torch.randn(8)); loss.backward()
    """
    check_policy(memory)
    check_recording_limit(recording_limit)
    if fn is None:
        return lambda f: compile(f, backend=backend, fullgraph=fullgraph, memory=memory, dynamic=dynamic,
                                 skip_python=skip_python, recording_limit=recording_limit)
    if isinstance(fn, CompiledFunction):
        fn = fn.fn
    build = _build if memory == "balanced" else functools.partial(_build, memory=memory)
    return CompiledFunction(fn, build, backend=backend, fullgraph=fullgraph, dynamic=dynamic,
                            templates=_Templates(memory), stored=_StoredRecordings(memory), skip_python=skip_python,
                            recording_limit=recording_limit)


class _Templates:
    """The dispatcher's way to the templates of ``compiler.reuse.dynamic``: make one from recordings,
    and instantiate it for a call's sizes (``runtime.dynamic_shapes``)."""

    def __init__(self, memory: str):
        self.memory = memory

    @staticmethod
    def make_template(entry: Entry, sizes, others) -> Template:
        def graphs(e):
            return [info.get("captured") for info in e.report.regions]
        with SYMPY_LOCK:
            return Template(entry.trace, graphs(entry), sizes,
                            [(e.trace, graphs(e), s) for e, s in others if e.report.regions is not None])

    def instantiate(self, template: Template, sizes, fn, fullgraph, stats, arg_shapes=None):
        """(Entry, None), or (None, why the sizes break the template's relations)."""
        name = _name(fn)
        try:
            with SYMPY_LOCK:
                trace, _ = template.instantiate(sizes, arg_shapes)
        except NotInstantiable as e:
            return None, str(e)
        except Exception as e:  # noqa: BLE001 — a bug (logged; strict: raises): this call records instead
            return None, internal_error(f"{name} (instantiating its template)", e)
        # (its optimizer steps are the template's: the same calls, the same parameters at every size)
        entry = _compile_trace(name, trace, fullgraph=fullgraph, stats=stats, memory=self.memory, shape_generic=True,
                               instantiated_at=tuple(sizes), fused_from=template.trace)
        return entry, None


class _StoredRecordings:
    """The dispatcher's way to recordings stored by earlier processes (``compiler.reuse.recordings``):
    find those of a call's key, and make an Entry of one whose paths lead to this call's objects."""

    Unresolved = recordings.Unresolved

    def __init__(self, memory: str):
        self.memory = memory

    @staticmethod
    def find(fn, spec, leaves) -> list:
        return recordings.find(fn, spec, leaves)

    def load(self, stored, fn, leaves, fullgraph, stats) -> Entry:
        """The Entry of a stored recording (its regions from the compiled-region cache). Raises
        ``Unresolved`` where it does not fit this call (yet), CompileError where ``fullgraph``
        refuses it as it would have refused the recording."""
        trace = recordings.load(stored, fn, leaves)
        return _compile_trace(_name(fn), trace, fullgraph=fullgraph, stats=stats, memory=self.memory)


def explain(fn, *args, **kwargs) -> Report:
    """Record and compile ``fn`` for these arguments and report every stage.

    Runs ``fn`` once, eagerly (as its first compiled call would). The report has ``.graph``,
    ``.backward_graph``, ``.kernels`` (each with ``.name`` and ``.source``) and
    ``.fallbacks``; ``print(report)`` shows them all.

    ``explain(compiled_fn)`` with no arguments reports the recording its last call ran, without
    running anything (a training step explained after the loop takes no extra step); before
    any call it records ``fn()``. Where whole calls of it run eagerly (its recording limit
    reached: calls with new argument keys; recorded too many times), its ``fallbacks`` say so too.

    >>> import torch, compiler
    >>> report = compiler.explain(lambda x: (x.sin() * 2).sum(), torch.randn(4, requires_grad=True))
    >>> len(report.kernels), report.fallbacks
    (2, [])
    """
    compiled = fn if isinstance(fn, CompiledFunction) else compile(fn)
    if not args and not kwargs and compiled is fn and fn.last_entry is not None:
        report = fn.last_entry.report
        whole_calls = [reason for reason in (fn.disabled, fn.limit_reached) if reason]
        if whole_calls:  # (whole calls run eagerly: the function's, not this recording's)
            report = dataclasses.replace(report, fallbacks=list(report.fallbacks) + [
                f"whole calls run eagerly: {reason}" for reason in whole_calls])
        return report
    entry = compiled.build(args, kwargs)
    return entry.report


def _build(fn, args, kwargs, *, fullgraph=False, stats=None, memory="balanced", shape_generic=False,
           other_path=False, decide_backend=None, numbers_seen_changing=frozenset()):
    """Record ``fn`` on these arguments and compile the recording: (its result, the Entry).
    ``decide_backend``: the backend asked for a call with no tensor arguments, where the device the
    recorded tensors are on decides it (the entry's report says which). ``numbers_seen_changing``:
    numbers replays saw change, which the regions take at run time (``compiler.capture.numbers``)."""
    name = _name(fn)
    stored_key = None if shape_generic else recordings.call_key(fn, args, kwargs)  # (before the call changes it)
    backend = backends.chosen()  # (the dispatcher chose it for this call; a compiled call inside fn chooses its own)
    try:
        result, recording = capture(fn, args, kwargs, numbers_seen_changing)
    except RecordingFailed as failed:  # a bug (logged): this key runs eagerly from now on
        if fullgraph:
            raise CompileError(f"{name}: {failed}") from failed
        report = Report(graph=None, backward_graph=None, kernels=[], fallbacks=[], eager_calls=[],
                        internal_errors=[str(failed)])
        return failed.result, Entry(None, report)
    if other_path:
        recording = dataclasses.replace(recording, other_path=True)
    decided = None
    if decide_backend is not None:
        decided = backends.decide(decide_backend, _recorded_device_type(recording))
        backend = decided[0]
    # (written once it compiled, for other processes)
    stored = recordings.prepare(fn, args, kwargs, recording, stored_key)
    with backends.building_for(backend):
        entry = _compile_trace(name, recording, fullgraph=fullgraph, stats=stats, memory=memory,
                               shape_generic=shape_generic)
    if stored is not None:
        recordings.write(stored)
    if decided is not None:
        entry.runs_with(*decided)
    return result, entry


def _recorded_device_type(recording: Recording) -> str | None:
    """The device type of the first tensor a region of ``recording`` holds, else of a tensor it
    reached from outside (a module's parameters); None where it touched no tensor."""
    for plan in recording.regions:
        for node in plan.graph.nodes if plan.graph is not None else ():
            if has_meta(node) and meta_of(node).device is not None:
                return meta_of(node).device.type
    return next((meta.device.type for _, meta in recording.externals.values()), None)


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _compile_trace(name, recording: Recording, **options) -> Entry:
    """Compile a recording's regions (and optimizer steps): ``_compile_trace_locked`` under ``SYMPY_LOCK``."""
    with SYMPY_LOCK:
        return _compile_trace_locked(name, recording, **options)


def _compile_trace_locked(name, recording: Recording, *, fullgraph, stats, memory, shape_generic=False,
                          instantiated_at=None, fused_from=None) -> Entry:
    """Compile a recording's regions (and optimizer steps): the Entry to replay it with, holding
    the ``CompiledRecording``. ``shape_generic``: the recording was instantiated from a template
    (``compiler.reuse.dynamic``) at the sizes ``instantiated_at``; ``fused_from``: the template's
    compiled recording, whose fused optimizer steps and clip_grad_norm_ calls it shares."""
    fallbacks = list(recording.fallbacks)
    internal_errors = list(recording.internal_errors)
    if fullgraph and (fallbacks or internal_errors or recording.graph_breaks):
        raise CompileError(f"{name} cannot be compiled whole: "
                           + "; ".join(fallbacks + internal_errors + recording.graph_breaks))
    regions, kernels, plans = [], [], []
    for reason in fallbacks:
        logs.fallback(name, reason)
    for index, plan in enumerate(recording.regions):
        info, compiled = _compile_plan(name, recording, index, plan, fullgraph, stats, memory, shape_generic)
        if compiled is not None:
            kernels.extend(info["kernels"])
        elif info.get("internal_error"):
            internal_errors.append(info["reason"])
        else:
            fallbacks.append(info["reason"])
        regions.append(info)
        plans.append(plan if compiled is None and plan.reason == info["reason"] else
                     dataclasses.replace(plan, compiled=compiled, reason=info.get("reason")))
    # optimizer.step() calls: fused kernels where the optimizer is one the compiler knows
    if fused_from is not None:
        fused_steps, fused_calls = fused_from.fused_steps, fused_from.fused_calls
        optimizer_kernels, optimizer_reasons = optimizer_kernel_infos(fused_steps, fused_calls), []
    else:
        fused_steps, fused_calls, optimizer_kernels, optimizer_reasons = compile_optimizer_steps(
            recording, recording.recorded_optimizer_steps, stats)
    kernels.extend(optimizer_kernels)
    fallbacks.extend(optimizer_reasons)
    logs.kernels(name, optimizer_kernels)
    for reason in optimizer_reasons:
        logs.fallback(name, reason)
    # (the recorded optimizer steps are consumed: the compiled recording holds no optimizer)
    trace = CompiledRecording(**(recording.recorded_fields() | dict(regions=plans, recorded_optimizer_steps=[])),
                              fused_steps=fused_steps, fused_calls=fused_calls)
    report = Report(
        graph=_merged_graph(regions),
        backward_graph=next((r["backward_graph"] for r in regions if r.get("backward_graph") is not None), None),
        kernels=kernels, fallbacks=fallbacks, eager_calls=_eager_calls(trace), regions=regions,
        internal_errors=internal_errors, graph_breaks=list(trace.graph_breaks),
        skip_python_refusal=skip_python.refusal(trace))
    dumps.dump(name, report)  # (when SYMGRAD_DUMP_DIR is set)
    return Entry(trace, report, instantiated=instantiated_at is not None, sizes=instantiated_at)


def _compile_plan(name, recording, index, plan, fullgraph, stats, memory, shape_generic) -> tuple:
    """(what ``explain`` shows of region ``index``, its CompiledRegion or None: it runs eagerly,
    ``info["reason"]`` says why; ``info["internal_error"]``: because of a compiler bug)."""
    captured = copy_graph(plan.graph)
    logs.graph(name, index, captured)
    info = {"captured": captured}
    if plan.reason:  # capture found this region cannot be compiled faithfully
        if fullgraph:
            raise CompileError(f"region {index}: {plan.reason}")
        info["reason"] = plan.reason
        logs.fallback(name, plan.reason)
        return info, None
    try:
        mutated, options = _region_options(recording, plan, memory, shape_generic)
        compiled, info["backward_graph"], info["kernels"] = _compile_region(plan.graph, mutated, options, index)
        # (built for this call's backend; what it builds during a backward is built for it too)
        compiled = backends.builds_keep_backend(compiled, backends.chosen())
        # (compiled Triton: every forward and backward kernel now, in parallel, not in the first replay)
        ahead_of_time.compile_region(compiled, f"{name} region {index}", backends.chosen())
        compiled.count_launches_in(stats if stats is not None else {})
        compiled.hand_out_in_segments(ddp_bucket_bytes(recording.module_modes))  # (under DDP: overlap)
        if backends.cpu_path(backends.chosen()):  # (the CPU path: its code made now, not in the first replay)
            compiled.prepare_cpu()
        logs.backward(name, index, info["backward_graph"])
        logs.kernels(name, info["kernels"])
        name_for_profiler(compiled, name, index, captured, info["kernels"])
        return info, compiled
    except DELIBERATE as e:  # something this compiler does not do (yet): its ops run eagerly
        if fullgraph:
            raise CompileError(f"region {index} cannot be compiled: {e}") from e
        info["reason"] = f"region {index} cannot be compiled ({e}); its ops run eagerly"
        logs.fallback(name, info["reason"])
    except Exception as e:  # noqa: BLE001 — a bug: loud (strict: raises), and the user's program goes on
        info["reason"] = internal_error(f"{name} (compiling region {index})", e)
        if fullgraph:
            raise CompileError(f"region {index} failed to compile: {type(e).__name__}: {e}") from e
        info["internal_error"] = True
    return info, None


def _region_options(trace, plan, memory, shape_generic):
    """(positions of the inputs the region changes in place, ``build_region``'s other options)."""
    mutated = {plan.input_ids.index(v) for v in plan.mutated}
    later = _written_after(trace, plan)
    written_later = {i for i, v in enumerate(plan.input_ids) if v in later}
    outputs_written_later = _outputs_written(plan, later)
    # the output that is each changed input's new value (a kernel may store it in the input)
    # (tensors the function reads from outside: the same objects on every replay, by its guards)
    mutated_outputs = tuple(sorted((plan.input_ids.index(v), plan.output_ids.index(v)) for v in plan.mutated
                                   if v in plan.output_ids and v in trace.externals))
    options = {k: v for k, v in (("written_later", written_later), ("memory", _policy(memory, plan.graph)),
                                 ("outputs_written_later", outputs_written_later),
                                 ("shape_generic", shape_generic), ("mutated_outputs", mutated_outputs),
                                 ("gradients_handed_out", bool(ddp_bucket_bytes(trace.module_modes))))
               if v and v != "balanced"}  # (defaults left out: the cache key of a plain region stays short)
    return mutated, options


def _eager_calls(trace) -> list:
    """Names of the torch functions the replay runs eagerly (not optimizer steps and
    clip_grad_norm_, which run as kernels; a value read into Python is a graph break, listed apart)."""
    fused = fused_call_indices(trace)
    return list(dict.fromkeys(function_name(c.func) for i, c in enumerate(trace.calls)
                              if c.kind is CallKind.EAGER and i not in fused
                              and getattr(c.func, "__name__", "") not in VALUE_READS))


def _policy(memory: str, graph: fx.Graph) -> str:
    """The saved-set policy of one region: ``"balanced"`` is ``"cpu"`` where the torch path will run
    the region (CPU tensors, backend torch: recomputing costs a PyTorch op's full time there). C++
    kernels recompute inside the fused loop, as GPU kernels do: ``"balanced"`` stays."""
    if memory != "balanced" or backends.chosen() != "torch":
        return memory
    devices = {meta_of(n).device for n in graph.nodes if n.op == "placeholder" and has_meta(n)}
    return "cpu" if devices and all(d is not None and d.type == "cpu" for d in devices) else memory


def _compile_region(graph: fx.Graph, mutated: set, options: dict, index: int):
    """(CompiledRegion, backward graph, KernelInfos) of a region graph: built (SymPy autodiff,
    fusion, codegen), or loaded from the compiled-region cache (``compiler.reuse.persist``) when this
    graph was compiled before, here or in another process."""
    key = persist.region_key(graph, mutated, options, backends.chosen()) if persist.enabled() else None
    if key is not None:
        loaded = persist.load(key, lambda: build_region(copy_graph(graph), mutated, **options)[0])
        if loaded is not None:
            region, backward_graph, kernels = loaded
            return region, backward_graph, [dataclasses.replace(k, region=index) for k in kernels]
    region, details = build_region(graph, mutated, **options)
    kernels = ([KernelInfo(k.name, k.source, "forward", index, k.bytes_moved, fused_user_ops(k))
                for k in details["forward_kernels"]]
               + [KernelInfo(k.name, k.source, "backward", index, k.bytes_moved, fused_user_ops(k))
                  for k in details["backward_kernels"]])
    if key is not None:
        persist.store(key, region, details["backward_graph"], kernels)
    return region, details["backward_graph"], kernels


def name_for_profiler(region, fn_name: str, index: int, captured: fx.Graph, kernels) -> None:
    """Names under which a compiled region's programs and kernels appear in a profile
    (``runtime.program.Program.run`` records them only while a profiler is on)."""
    ops = [getattr(n.meta.get("symgrad"), "torch_op", None) for n in captured.nodes if n.op == "call_function"]
    ops = list(dict.fromkeys(op for op in ops if op))
    shown = ", ".join(ops[:8]) + (", ..." if len(ops) > 8 else "")
    for phase, program in (("forward", region.forward), ("backward", region.backward)):
        if program is None:
            continue
        ops_of = {k.name: ", ".join(k.op_names) for k in kernels if k.phase == phase}
        program.name_in_profiles(f"symgrad {fn_name} region {index} {phase} [{shown}]",
                                 {launch.name: f"symgrad kernel {launch.name} [{ops_of.get(launch.name, '')}]"
                                  for launch in program.kernels})


def _written_after(trace, plan) -> set:
    """Value ids that calls after ``plan``'s region change in place (an in-place op's result
    keeps its argument's value id), region calls and eager calls alike, up to the first
    backward call (an optimizer's updates after ``loss.backward()`` come after the backward
    that read them)."""
    written = set()
    start = max(plan.calls, default=-1) + 1
    stop = len(trace.calls)
    for index, call in enumerate(trace.calls[start:], start):
        if function_name(call.func) in _BACKWARD_CALLS:
            stop = index
            break
        written.update(call.outputs)
    # a base written through a view in a later region (``v[1:].fill_(c)``) is made again there
    written.update(v for v, index in trace.produced_by.items() if start <= index < stop)
    return written


def _outputs_written(plan, written: set) -> set:
    """Positions of ``plan``'s outputs that later calls change in place (``written``), with their
    views or bases (they share memory); not the new values of inputs it changes in place (the
    runtime copies those into the caller's tensor: the output itself is not written)."""
    base = {v: plan.views[v][0] for v in plan.output_ids if v in plan.views}
    touched = written | {base[v] for v in written if v in base}
    return {j for j, v in enumerate(plan.output_ids)
            if v not in plan.mutated and (v in touched or base.get(v) in touched)}


_BACKWARD_CALLS = ("Tensor.backward", "torch.autograd.backward", "torch.autograd.grad")




def _merged_graph(regions) -> fx.Graph:
    if len(regions) == 1:
        return regions[0]["captured"]
    merged = fx.Graph()
    outputs = []
    for r in regions:
        env = {}
        for node in r["captured"].nodes:
            if node.op == "output":
                outputs.extend(env[o] for o in node.args[0])
                continue
            env[node] = merged.node_copy(node, lambda n: env[n])
    merged.output(tuple(outputs))
    return merged
