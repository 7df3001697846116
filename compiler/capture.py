"""Capture: run the user's function once, eagerly, recording its torch calls.

A ``TorchFunctionMode`` sees every torch-level call. Each call runs for real (so this first
call returns eager PyTorch's results) and is recorded. Calls with a binding in the op
catalog are also appended, as catalog ops, to the graph of the current *region*; any other
call — ``backward()``, an optimizer's in-place update, an op the catalog lacks, reading a
value with ``.item()`` — is recorded as an eager call and closes the region.

After the function returns, escape analysis decides which region values must be
materialized: those returned, read by eager calls or later regions, or still alive
(kept by the user in a list, a module attribute...). The rest stay inside fused kernels.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from compiler.ir import GraphBuilder
from compiler.ops import catalog as C
from compiler.ops.bindings import Unsupported, Writes, lookup
from runtime.calls import flatten_call, unflatten_call
from runtime.replay import _name, is_metadata, is_state_read
from runtime.trace import RegionPlan, TensorMeta, Trace, TraceCall, ValueId

# Eager calls that are part of a training step, not gaps in the compiled graph.
_AUTOGRAD_CALLS = {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad,
                   torch._C._set_grad_enabled, torch.Tensor.requires_grad_, torch.Tensor.retain_grad,
                   torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook,
                   torch.Tensor.detach, torch.Tensor.zero_}
_FACTORIES = {torch.ones, torch.zeros, torch.full, torch.empty, torch.arange, torch.eye, torch.tensor,
              torch.as_tensor, torch.linspace, torch.ones_like, torch.zeros_like, torch.full_like,
              torch.empty_like, torch.randn, torch.rand, torch.randint, torch.randn_like, torch.rand_like}
_VALUE_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "__format__",
                "__repr__", "__str__", "__array__"}
_SUPPORTED_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool,
                     torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                     torch.complex64, torch.complex128}


@dataclass
class _Region:
    index: int
    grad_enabled: bool
    device: torch.device
    builder: GraphBuilder = field(default_factory=GraphBuilder)
    nodes: dict = field(default_factory=dict)       # value id -> graph node
    inputs: list = field(default_factory=list)      # value ids that became placeholders
    produced: list = field(default_factory=list)    # value ids made here, in order
    calls: list = field(default_factory=list)
    seeds: list = field(default_factory=list)       # input value ids that take a fresh RNG seed per call
    view_mutation: bool = False                     # an in-place op changed a view
    eager_reason: str | None = None                 # set when the region must run eagerly
    stale: set = field(default_factory=set)         # views whose memory an in-place op changed since


class _ViewMutation(Exception):
    """A view changed in place in a way the functional capture cannot follow."""


class Capture(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: list[TraceCall] = []
        self.regions: list[_Region] = []
        self.current: _Region | None = None
        self.ids: dict = {}          # id(tensor) -> (weakref, value id)
        self.refs: dict = {}         # value id -> weakref (for escape analysis)
        self.meta: dict = {}         # value id -> TensorMeta when produced
        self.externals: dict = {}
        self.arg_ids: list = []
        self.produced_by: dict = {}
        self.next_id = 0
        self.breaks: list = []       # reasons the graph was broken
        self.entry_grad_mode = torch.is_grad_enabled()
        self.isolate: set = set()    # calls whose result's grad_fn the user reads
        self.call_meta: dict = {}    # call index -> (input TensorMetas by value id, output metas)

    # -- value ids -----------------------------------------------------------------------
    def _new_id(self, t: torch.Tensor) -> ValueId:
        vid = ValueId(self.next_id)
        self.next_id += 1
        self.ids[id(t)] = (weakref.ref(t), vid)
        self.refs[vid] = weakref.ref(t)
        self.meta[vid] = TensorMeta.of(t)
        return vid

    def id_of(self, t: torch.Tensor) -> ValueId:
        entry = self.ids.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        vid = self._new_id(t)
        self.externals[vid] = (weakref.ref(t), TensorMeta.of(t))
        return vid

    def add_args(self, leaves):
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                entry = self.ids.get(id(leaf))
                if entry is not None and entry[0]() is leaf:
                    self.arg_ids.append(entry[1])  # the same tensor passed twice
                else:
                    self.arg_ids.append(self._new_id(leaf))

    # -- the mode ------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_metadata(func):
            return func(*args, **kwargs)
        leaves, spec = flatten_call(args, kwargs)
        recorded = [self.id_of(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        try:
            result = func(*args, **kwargs)
        except Exception:
            # eager raised (and the user may catch it): record the call, so replay raises too
            self.current = None
            self.calls.append(TraceCall(func, "eager", None, spec, recorded, [], None))
            raise
        if isinstance(result, torch.Tensor):
            out_tensors, out_spec = [result], None
        elif func is torch.Tensor.__setitem__:
            out_tensors, out_spec = [args[0]], "setitem"  # mutates args[0], returns None
        else:
            out_leaves, out_spec = tree_flatten(result)
            out_tensors = [t for t in out_leaves if isinstance(t, torch.Tensor)]

        if _is_grad_fn_access(func) and recorded and recorded[0] in self.produced_by:
            # NOTE: the user inspects this value's Node (hooks on grad_fn): compile the op that
            # made it as a region of its own, so its Node has that op's inputs, as in eager.
            producer = self.produced_by[recorded[0]]
            if self.calls[producer].kind == "compute":
                self.isolate.add(producer)
        reason = None
        region = None
        nodes = None
        binding = _binding(func)
        # NOTE: math the function itself runs under no_grad (an optimizer's update, with a
        # step size that changes every step; a custom autograd.Function's forward) runs
        # eagerly by design, not as a fallback; a whole call made under no_grad compiles.
        by_design = binding is not None and not torch.is_grad_enabled() and self.entry_grad_mode
        if by_design:
            binding = None
        if binding is not None:
            try:
                region, nodes = self._emit(func, binding, args, kwargs, leaves, recorded, out_tensors)
            except Unsupported as e:
                reason = f"{_name(func)}: {e}"
        elif not by_design and not _expected_eager(func, self._reads_region_value(recorded)):
            if getattr(func, "__name__", "") in _VALUE_READS:
                reason = (f"{_name(func)} reads a tensor's value into Python (a graph break: the compiled "
                          "region ends there, and the call is recorded again if the value steers control flow)")
            else:
                reason = f"{_name(func)} is not supported by the compiler yet"

        outputs = []
        for t in out_tensors:
            entry = self.ids.get(id(t))
            if entry is not None and entry[0]() is t:
                outputs.append(entry[1])        # returned an existing tensor (in-place, self)
            else:
                outputs.append(self._new_id(t))
        index = len(self.calls)
        if region is not None:
            self.call_meta[index] = ({v: TensorMeta.of(x) for v, x in zip(recorded, leaves) if isinstance(v, ValueId)},
                                     [TensorMeta.of(t) for t in out_tensors], _autocast_dtype(region.device))
            for vid, node, t in zip(outputs, nodes, out_tensors):
                if region.nodes.get(vid) is node:
                    continue  # returned its input as it is (x.to(x.dtype), x.reshape(x.shape))
                old = region.nodes.get(vid)
                region.nodes[vid] = node
                region.produced.append(vid)
                self.produced_by[vid] = index
                if old is not None and t._base is not None:
                    region.view_mutation = True
                    try:
                        self._update_base(region, vid, old, node, t._base, index)
                    except _ViewMutation as e:
                        region.eager_reason = f"{_name(func)}: {e}"
                if old is not None:
                    self._note_stale_views(region, t, vid)
                    root = t._base if t._base is not None else t
                    if region.eager_reason is None and (torch._debug_has_internal_overlap(t) != 0
                                                        or torch._debug_has_internal_overlap(root) != 0):
                        # eager writes memory that other elements share (an expanded tensor):
                        # the functional value and its write-back cannot express that
                        region.eager_reason = (f"{_name(func)}: an in-place write into a tensor whose elements "
                                               "share memory (expanded); the region runs eagerly")
            region.calls.append(index)
            self.calls.append(TraceCall(func, "compute", region.index, spec, recorded, outputs, out_spec))
        else:
            self.current = None  # an eager call closes the region
            for vid in outputs:
                self.produced_by.setdefault(vid, index)
            self.calls.append(TraceCall(func, "eager", None, spec, recorded, outputs, out_spec, reason))
            if reason:
                self.breaks.append(reason)
        return result

    def _emit(self, func, binding, args, kwargs, leaves, recorded, out_tensors):
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if not tensors or not out_tensors:
            raise Unsupported("no tensor inputs or outputs")
        for t in tensors + out_tensors:
            if type(t) not in (torch.Tensor, torch.nn.Parameter):
                raise Unsupported(f"tensor subclass {type(t).__name__}")
            if t.layout != torch.strided:
                raise Unsupported(f"{t.layout} tensors")
            if t.dtype not in _SUPPORTED_DTYPES:
                raise Unsupported(f"{t.dtype} tensors are not supported yet")
        devices = {t.device for t in tensors + out_tensors}
        if len(devices) != 1:
            raise Unsupported("tensors on several devices in one call")
        device = devices.pop()
        grad_enabled = torch.is_grad_enabled()
        region = self.current
        if region is None or region.device != device or region.grad_enabled != grad_enabled:
            region = self._new_region(len(self.regions), grad_enabled, device)
        stale = region.stale.intersection(v for v in recorded if isinstance(v, ValueId))
        if stale and region.eager_reason is None:
            region.eager_reason = (f"{_name(func)} reads a view that an earlier in-place op changed through "
                                   "other memory it shares (the functional capture cannot follow); the region "
                                   "runs eagerly")
        b = region.builder
        metas = {vid: TensorMeta.of(x) for x, vid in zip(leaves, recorded) if isinstance(x, torch.Tensor)}
        mapped = _map_to_nodes(region, recorded, metas)
        a, k = unflatten_call(mapped, flatten_call(args, kwargs)[1])
        start = len(b.created)
        result = _apply_binding(b, binding, a, k, out_tensors, _autocast_dtype(device))
        result, writes = (result.result, result.writes) if isinstance(result, Writes) else (result, ())
        source, op_name = _user_frame(), _name(func)
        for made in b.created[start:]:
            made.meta.update(source=source, torch_op=op_name, device=device)
        nodes = list(result) if isinstance(result, (tuple, list)) else [result]
        if len(nodes) != len(out_tensors):
            raise Unsupported("internal: the binding returned a different number of results than eager")
        inputs = {id(n): x for n, x in zip(mapped, leaves) if isinstance(n, fx.Node)}
        for i, (node, t) in enumerate(zip(nodes, out_tensors)):
            source = inputs.get(id(node))
            if source is not None and t is not source and t._base is None:
                # the binding passed an input through where eager made a new tensor (contiguous()
                # of a strided one): a copy, so the result does not alias the input
                nodes[i] = C.emit_pointwise(b, "identity", [node], dtype=node.meta["dtype"],
                                            requires_grad=node.meta["requires_grad"])
        for node, t in zip(nodes, out_tensors):
            if node.meta["shape"] != tuple(t.shape) or node.meta["dtype"] != t.dtype:
                raise Unsupported(
                    f"internal: the binding computed {node.meta['dtype']}{list(node.meta['shape'])} "
                    f"where eager gave {t.dtype}{list(t.shape)}")
            if node.meta["requires_grad"] != t.requires_grad:
                node.meta["requires_grad"] = t.requires_grad
        _apply_writes(region, writes)
        if region is not self.current:
            self.regions.append(region)
            self.current = region
        return region, nodes

    def _new_region(self, index, grad_enabled, device) -> _Region:
        region = _Region(index, grad_enabled, device)
        region.builder.new_seed = lambda: self._seed_input(region)
        return region

    def _seed_input(self, region: _Region):
        """A region input that replay fills with a fresh random seed before each run (random
        ops in kernels: dropout). It has a value id but no tensor in the recording."""
        vid = ValueId(self.next_id)
        self.next_id += 1
        self.meta[vid] = TensorMeta((), torch.int64, region.device, False)
        node = region.builder.placeholder(f"seed{vid}", (), torch.int64)
        node.meta["device"] = region.device
        region.nodes[vid] = node
        region.inputs.append(vid)
        region.seeds.append(vid)
        return node

    def _note_stale_views(self, region, t, vid) -> None:
        """An in-place op wrote ``t``: other live views of its memory now show the write in
        eager, but their nodes hold the old value (only ``t`` and its base are updated). They
        are marked stale: a region that reads one later, or outputs one, runs eagerly."""
        root = t._base if t._base is not None else t
        region.stale.discard(vid)
        for ref, other in list(self.ids.values()):
            u = ref()
            if u is None or u is t:
                continue
            if u is root:
                region.stale.discard(other)  # updated with t (``_update_base``)
            elif (u._base if u._base is not None else u) is root and other in region.nodes:
                region.stale.add(other)

    def _update_base(self, region, vid, old_node, new_node, base, index):
        """An in-place op changed a view: its base changes too (eager views share memory).

        The base's new value is the view's new value mapped back through the view ops that
        made the view (reshape and permute are invertible); the runtime writes it back.
        """
        entry = self.ids.get(id(base))
        base_vid = entry[1] if entry is not None and entry[0]() is base else None
        base_node = region.nodes.get(base_vid) if base_vid is not None else None
        chain, node = [], old_node
        while node is not base_node and getattr(node.target, "kind", None) == "view":
            chain.append(node)
            node = node.args[0]
        if base_node is None or node is not base_node or any(
                n.target.name not in ("reshape", "permute", "slice") for n in chain):
            raise _ViewMutation(
                "an in-place op on a view whose base is outside this region, or made by a view op "
                "other than reshape, permute or slicing; "
                "the region runs eagerly")
        b = region.builder
        value = new_node
        for view in chain:  # undo the views, last first
            source_shape = view.args[0].meta["shape"]
            if view.target.name == "slice":  # write the slice back into the (old) source
                value = C.emit_slice_scatter(b, view.args[0], value, **view.kwargs)
            elif view.target.name == "permute":
                inverse = [0] * len(view.kwargs["dims"])
                for i, d in enumerate(view.kwargs["dims"]):
                    inverse[d] = i
                value = C.emit_view(b, "permute", value, dims=tuple(inverse))
            else:
                value = C.emit_view(b, "reshape", value, shape=source_shape)
        region.nodes[base_vid] = value
        region.produced.append(base_vid)
        self.produced_by[base_vid] = index

    def _reads_region_value(self, recorded) -> bool:
        return any(isinstance(v, ValueId) and v in r.nodes and v not in r.inputs
                   for v in recorded for r in self.regions)

    # -- after the run -------------------------------------------------------------------
    def _split_isolated(self):
        """Rebuild regions so each isolated call is a region of its own."""
        if not self.isolate:
            return
        regions = []
        for r in self.regions:
            segments, current = [], []
            for c in r.calls:
                if c in self.isolate:
                    segments += [current, [c]] if current else [[c]]
                    current = []
                else:
                    current.append(c)
            if current:
                segments.append(current)
            if len(segments) == 1 or r.view_mutation:
                r.index = len(regions)
                regions.append(r)
                continue
            for seg in segments:
                regions.append(self._rebuild(len(regions), seg, r.grad_enabled, r.device))
        for r in regions:
            for c in r.calls:
                self.calls[c].region = r.index
        self.regions = regions

    def _rebuild(self, index, call_indices, grad_enabled, device) -> _Region:
        """A region's graph re-emitted from recorded calls (bindings need metadata only)."""
        region = self._new_region(index, grad_enabled, device)
        b = region.builder
        for c in call_indices:
            call = self.calls[c]
            in_meta, out_meta, autocast_dtype = self.call_meta[c]
            a, k = unflatten_call(_map_to_nodes(region, call.leaves, in_meta), call.spec)
            result = _apply_binding(b, _binding(call.func), a, k, out_meta, autocast_dtype)
            if isinstance(result, Writes):
                _apply_writes(region, result.writes)
                result = result.result
            nodes = list(result) if isinstance(result, (tuple, list)) else [result]
            for vid, node, m in zip(call.outputs, nodes, out_meta):
                if region.nodes.get(vid) is node:
                    continue
                node.meta["requires_grad"] = m.requires_grad
                region.nodes[vid] = node
                region.produced.append(vid)
            region.calls.append(c)
        return region

    def finish(self, result) -> Trace:
        """Escape analysis, then the trace with one RegionPlan per region."""
        self._split_isolated()
        returned = {self.ids[id(t)][1] for t in tree_flatten(result)[0]
                    if isinstance(t, torch.Tensor) and id(t) in self.ids and self.ids[id(t)][0]() is t}
        # Values read outside the region that computes them: by eager calls, and by other
        # regions (a region's inputs). A region's own inputs that it mutates are among them:
        # their final value is written back into the real tensor.
        used_outside = set(returned)
        for call in self.calls:
            if call.kind == "eager":
                used_outside.update(v for v in call.leaves if isinstance(v, ValueId))
        for r in self.regions:
            used_outside.update(r.inputs)
        plans = []
        for r in self.regions:
            outputs, internal = [], {}
            seen = set()
            for vid in r.produced:
                if vid in seen:
                    continue
                seen.add(vid)
                alive = self.refs[vid]() is not None
                if vid in used_outside or alive:
                    outputs.append(vid)
                else:
                    internal[vid] = self.meta[vid]
            b = r.builder
            output_nodes = [r.nodes[v] for v in outputs]
            b.output(output_nodes)
            b.graph.eliminate_dead_code()
            mutated = [v for v in r.inputs if v in seen]
            if r.stale.intersection(outputs) and r.eager_reason is None:
                r.eager_reason = ("a view that an in-place op changed through other memory it shares is used "
                                  "after the region (the functional capture cannot follow); the region runs eagerly")
            plans.append(RegionPlan(r.calls, list(r.inputs), outputs, internal, r.grad_enabled, mutated=mutated,
                                    reason=r.eager_reason, seeds=[(v, r.device) for v in r.seeds]))
            plans[-1].graph = b.graph
        return Trace(self.calls, plans, self.arg_ids, dict(self.externals), dict(self.produced_by),
                     list(dict.fromkeys(self.breaks)))


def _apply_writes(region: _Region, writes) -> None:
    """Inputs a binding changes in place without returning them (batch norm's running
    statistics): their new values become the region's, written back into the real tensors."""
    for target, value in writes:
        vid = next(v for v, n in region.nodes.items() if n is target)
        region.nodes[vid] = value
        region.produced.append(vid)


def _autocast_dtype(device: torch.device):
    """The lower-precision dtype of an active ``torch.autocast`` for this device, else None."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def _apply_binding(b, binding, a, k, outputs, autocast_dtype):
    """Emit the binding. Under ``torch.autocast`` eager casts an op's floating inputs first (to
    the lower precision for matmuls, to float32 for losses and softmax, to the widest for
    cat): where eager's result has another dtype than the binding's, emit the binding again
    on its floating inputs cast to that dtype, as autocast did. (``outputs``: eager's result
    tensors or their metadata; the dead first attempt is dropped with unused nodes.)"""
    if autocast_dtype is None:
        return binding(b, *a, **k)
    wanted = [o.dtype for o in outputs]
    target = next((d for d in wanted if d.is_floating_point), None)
    try:
        result = binding(b, *a, **k)
    except Unsupported:
        if target is None:
            raise
        result = None  # (mixed dtypes that autocast's casts resolve: try again cast)
    if result is not None:
        plain = result.result if isinstance(result, Writes) else result
        nodes = list(plain) if isinstance(plain, (tuple, list)) else [plain]
        if target is None or all(not isinstance(n, fx.Node) or n.meta["dtype"] == d for n, d in zip(nodes, wanted)):
            return result

    def cast(x):
        if isinstance(x, fx.Node) and x.meta["dtype"].is_floating_point and x.meta["dtype"] != target:
            return C.emit_pointwise(b, "identity", [x], dtype=target)
        return x
    a, k = tree_map(cast, (list(a), dict(k)))
    return binding(b, *a, **k)


def _map_to_nodes(region: _Region, recorded, metas) -> list:
    """A call's recorded leaves with each value id replaced by the region's node for it;
    a value the region has not seen yet becomes a placeholder (a region input)."""
    mapped = []
    for leaf in recorded:
        if not isinstance(leaf, ValueId):
            mapped.append(leaf)
            continue
        node = region.nodes.get(leaf)
        if node is None:
            m = metas[leaf]
            node = region.builder.placeholder(f"v{leaf}", m.shape, m.dtype, m.requires_grad and region.grad_enabled)
            node.meta["device"] = m.device
            region.nodes[leaf] = node
            region.inputs.append(leaf)
        mapped.append(node)
    return mapped


def _user_frame() -> str:
    """file:line of the user's code that made the current torch call."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not any(part in path for part in _LIBRARY_PATHS):
            return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


_LIBRARY_PATHS = (os.sep + "torch" + os.sep, os.sep + "compiler" + os.sep, os.sep + "runtime" + os.sep)


def _is_grad_fn_access(func) -> bool:
    return getattr(func, "__name__", None) == "__get__" and \
        getattr(getattr(func, "__self__", None), "__name__", None) == "grad_fn"


def _binding(func):
    if getattr(func, "__name__", None) == "__get__":
        return lookup(getattr(func, "__self__", None))
    return lookup(func)


def _expected_eager(func, reads_region_value: bool) -> bool:
    """Eager calls that belong to a training step rather than to the model's math: autograd
    calls, parameter state, and bookkeeping under no_grad (an optimizer's update) that reads
    nothing computed by a compiled region."""
    if func in _AUTOGRAD_CALLS:
        return True
    if func in _FACTORIES and not reads_region_value:
        return True  # a new constant tensor (a mask, positions): made eagerly, read by regions
    if not torch.is_grad_enabled() and not reads_region_value:
        return True
    name = getattr(func, "__name__", "") or ""
    if name in ("__set__", "__delete__"):
        return True  # setting a tensor's attribute (.grad, hooks) is state, not math
    if name == "__get__":
        return is_state_read(func)
    module = getattr(func, "__module__", "") or ""
    if "profiler" in module or "record_function" in name:
        return True
    return False


def capture(fn, args, kwargs):
    """Run ``fn`` eagerly, recording it. Returns (the function's result, Trace)."""
    mode = Capture()
    leaves, _ = tree_flatten((args, kwargs))
    mode.add_args(leaves)
    # NOTE: autograd keeps every tensor a backward needs alive, which would make every
    # intermediate look "kept by the user". Packing saved tensors as detached aliases (same
    # storage and version counter) lets escape analysis see the user's references only.
    # Skipped when the user has saved-tensor hooks of their own: theirs must run.
    hooks_active = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    modules = _ModulesRun()
    steps = _OptimizerSteps(mode)
    handles = [torch.nn.modules.module.register_module_forward_pre_hook(modules),
               register_optimizer_step_pre_hook(steps.begin),
               register_optimizer_step_post_hook(steps.end)]
    try:
        if hooks_active:
            with mode:
                result = fn(*args, **kwargs)
        else:
            with torch.autograd.graph.saved_tensors_hooks(_detach, _identity), mode:
                result = fn(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    del leaves
    trace = mode.finish(result)
    trace.module_modes = modules.modes
    trace.optimizer_steps = steps.spans(trace)
    return result, trace


class _OptimizerSteps:
    """Where each ``optimizer.step()`` began and ended among the recorded calls. Its calls are
    all eager (an update under no_grad): the replay runs the step without watching it call by
    call, which is most of a small training step's host overhead."""

    def __init__(self, mode):
        self.mode = mode
        self.thread = threading.get_ident()
        self.open: list = []
        self.found: list = []

    def begin(self, optimizer, args, kwargs):
        if threading.get_ident() == self.thread:
            self.open.append(len(self.mode.calls))

    def end(self, optimizer, args, kwargs):
        if threading.get_ident() == self.thread and self.open:
            self.found.append((self.open.pop(), len(self.mode.calls)))

    def spans(self, trace) -> dict:
        return {start: end for start, end in self.found
                if end > start and all(c.kind == "eager" and c.reason is None for c in trace.calls[start:end])}


class _ModulesRun:
    """A global forward pre-hook for the recording: which modules ran, in which train/eval
    mode (dropout and batch norm read it in Python, so it is part of what was recorded)."""

    def __init__(self):
        self.thread = threading.get_ident()
        self.seen: set = set()
        self.modes: list = []

    def __call__(self, module, args):
        if threading.get_ident() == self.thread and id(module) not in self.seen:
            self.seen.add(id(module))
            self.modes.append((weakref.ref(module), module.training))


def _detach(t):
    return t.detach()


def _identity(t):
    return t
