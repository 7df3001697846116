"""Capture: run the user's function once, eagerly, recording its torch calls.

A ``TorchFunctionMode`` sees every torch-level call. Each call runs for real (so this first
call returns eager PyTorch's results) and is recorded. Calls with a binding in the op
catalog are also appended, as catalog ops, to the graph of the current *region*; any other
call — ``backward()``, an optimizer's in-place update, an op the catalog lacks, reading a
value with ``.item()`` (a graph break; the value read is guarded on replay) — is recorded as an
eager call and closes the region.

After the function returns, escape analysis decides which region values must be
materialized: those returned, read by eager calls or later regions, or still alive
(kept by the user in a list, a module attribute...). The rest stay inside fused kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import weakref

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from compiler.capture.calls import (FACTORIES, FUNCTIONS, UNREFERENCED, VALUE_READS, ModulesRun, OptimizerSteps,
                                    expected_eager, gradient_inputs, inside_custom_function, inspects_node,
                                    made_by_distributed, python_references, user_frame, value_read_break,
                                    watched_gradient)
from compiler.capture.numbers import NumbersTaken
from compiler.capture.checkpoints import MIXED_BLOCK, CheckpointedCalls, tag_block
from compiler.capture.regions import (InPlaceTracking, Region, ViewMutation, apply_writes,
                                      forget_input, keep_overwritten_history, mark_eager_saved, map_to_nodes,
                                      saved_inputs,
                                      saves_result)
from compiler.ir.graph import meta_of, update_meta
from compiler.capture.pack_hooks import recording_in_this_thread
from compiler.optimizers import StepRecorder
from compiler.ir.ops import catalog as C
from compiler.ir.sympy_lock import SYMPY_LOCK
from compiler.capture.bindings import Unsupported, Writes, lookup
from runtime import tensor_parallel
from runtime.calls import flatten_call, unflatten_call
from runtime.fallback import InternalCompilerError, internal_error
from runtime.torch_functions import function_name, is_metadata, is_profiler_range, is_state_read
from runtime.trace import (UNKEPT, CallKind, NumberId, NumberInput, Recording, RegionPlan, TensorMeta, TraceCall,
                           ValueId, read_snapshot)

_SUPPORTED_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool,
                     torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                     torch.complex64, torch.complex128}


class RecordingFailed(Exception):
    """A compiler bug broke the recording (logged as such): the function ran eagerly to its
    end and ``result`` is its result; nothing was recorded to replay."""

    def __init__(self, result, message: str):
        super().__init__(message)
        self.result = result


class Capture(InPlaceTracking, TorchFunctionMode):
    def __init__(self, fn_name: str = "?", numbers: NumbersTaken | None = None):
        super().__init__()
        self.fn_name = fn_name
        self.numbers = numbers or NumbersTaken()  # which Python numbers the regions take at run time
        self.number_inputs: dict = {}  # NumberId -> NumberInput
        self.baked_floats: set = set()  # positions of float arguments a compiled call kept as constants
        self.broken = None           # a compiler bug's message (or the strict error): record no more
        self.internal_errors: list = []  # bugs met in single calls, which then ran eagerly
        self.calls: list[TraceCall] = []
        self.regions: list[Region] = []
        self.current: Region | None = None
        self.ids: dict = {}          # id(tensor) -> (weakref, value id)
        self.refs: dict = {}         # value id -> weakref (for escape analysis)
        self.factory_values: set = set()  # value ids made by factories compiled into a region
        self.fresh_storages: set = set()  # storages (data pointers) factories allocated during the call
        self.meta: dict = {}         # value id -> TensorMeta when produced
        self.externals: dict = {}
        self.arg_ids: list = []
        self.produced_by: dict = {}
        self.next_id = 0
        self.breaks: list = []       # why calls run eagerly (fallbacks)
        self.graph_breaks: list = []  # values read into Python: the regions on both sides compile
        self.entry_grad_mode = torch.is_grad_enabled()
        self.isolate: set = set()    # calls whose result's grad_fn the user reads: run eagerly
        self.split_after: set = set()  # calls whose result backward takes as `inputs`: a region ends there
        self.call_meta: dict = {}    # call index -> (input TensorMetas by value id, output metas)
        self.in_library_call = None  # () -> whether an optimizer step or clip_grad_norm_ runs now
        self.gradients: set = set()  # id() of the .grad tensors the function read (bookkeeping reads them)
        self.checkpoints = CheckpointedCalls()  # calls inside torch.utils.checkpoint blocks
        self.gradient_watched: set = set()  # calls whose result gets a hook, retain_grad() or is a gradient input
        self.saved_under_hooks: dict = {}  # value id -> calls that may have saved it under saved-tensor hooks
        self.escaping = 0            # > 0 while a saved tensor's pack hook runs (compiler.capture.pack_hooks)
        self.escaped: set = set()    # value ids made then: autograd holds them, no recorded call reads them
        self.pending: dict = {}      # AsyncCollectiveTensors met -> their waited results (tensor_parallel)
        self.tensor_parallel = False  # a layer's math on DTensors' local shards recorded (its replays look for them)

    # -- value ids -----------------------------------------------------------------------
    def _new_id(self, t: torch.Tensor) -> ValueId:
        vid = ValueId(self.next_id)
        self.next_id += 1
        self.ids[id(t)] = (weakref.ref(t), vid)
        self.refs[vid] = weakref.ref(t)
        self.meta[vid] = TensorMeta.of(t)
        return vid

    def _on_fresh_storage(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives on storage a factory call allocated during the recorded call."""
        return bool(self.fresh_storages) and _storage_address(t) in self.fresh_storages

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
        if is_metadata(func) or self.broken is not None:
            return func(*args, **kwargs)
        if func is F.linear:  # (a tensor-parallel layer's: its math on the local shards, recorded)
            layout = tensor_parallel.linear_layout(args, kwargs)
            if type(layout) is tuple:
                self.tensor_parallel = True
                try:
                    return tensor_parallel.reentered(self, tensor_parallel.rewrite_linear, layout, args, kwargs)
                except Exception as e:  # (a bug, or eager's own error: eager's call says which)
                    self._break(e, func)
                    return func(*args, **kwargs)
        try:
            leaves, spec = flatten_call(args, kwargs)
            if tensor_parallel.has_pending(leaves):  # (a row-parallel layer's all-reduce: its result, waited)
                self.tensor_parallel = True
                leaves = tensor_parallel.reentered(self, tensor_parallel.waited, leaves, self.pending)
                args, kwargs = unflatten_call(leaves, spec)
            recorded = [self.id_of(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        except Exception as e:
            self._break(e, func)
            return func(*args, **kwargs)
        try:
            result = func(*args, **kwargs)
        except Exception:
            # eager raised (and the user may catch it): record the call, so replay raises too
            self.current = None
            self.calls.append(TraceCall(func, CallKind.EAGER, None, spec, recorded, [], None))
            raise
        if type(result) is torch.Tensor and is_state_read(func):
            self.gradients.add(id(result))  # (t.grad: what a hand-written update reads)
        try:
            with SYMPY_LOCK:  # (bindings build SymPy expressions: compiler.ir.sympy_lock)
                self._record(func, args, kwargs, leaves, spec, recorded, result)
        except Exception as e:
            self._break(e, func)
        return result

    def _break(self, exc: Exception, func) -> None:
        """A compiler bug while recording ``func``: the rest of the call runs eagerly, unrecorded
        (under SYMGRAD_STRICT=1 it raises, and stays raised even if the user's code catches it)."""
        if isinstance(exc, InternalCompilerError):
            self.broken = exc
            raise exc
        try:
            self.broken = internal_error(f"{self.fn_name} (recording {function_name(func)})", exc)
        except InternalCompilerError as strict_error:
            self.broken = strict_error
            raise

    def _record(self, func, args, kwargs, leaves, spec, recorded, result) -> None:
        """Record one call that eager just ran (``result``): into the current region when the
        catalog has a binding for it, else as an eager call."""
        out_tensors, out_spec = _results(func, args, result)
        self._note_graph_reads(func, args, kwargs, leaves, recorded)
        self.checkpoints.begin()
        region, nodes, reason = self._bind(func, args, kwargs, leaves, recorded, out_tensors, result)
        outputs, makes_views = self._output_ids(func, out_tensors)
        if self.escaping:
            self.escaped.update(outputs)
        index = len(self.calls)
        self._keep_eager_what_hooks_save_and_writes_change(index, recorded, outputs, out_tensors)
        self.checkpoints.end(index, region is not None, bool(out_tensors))
        if region is not None:
            self.call_meta[index] = ({v: TensorMeta.of(x) if isinstance(v, ValueId) else self.number_meta(v)
                                      for v, x in zip(recorded, leaves) if isinstance(v, (ValueId, NumberId))},
                                     [TensorMeta.of(t) for t in out_tensors], _autocast_dtype(region.device))
            for vid, node, t in zip(outputs, nodes, out_tensors):
                if region.nodes.get(vid) is not node:  # (else returned its input as it is: x.to(x.dtype))
                    self._note_produced(region, func, index, vid, node, t)
            region.calls.append(index)
            if any(t.requires_grad for t in out_tensors):
                self._note_saved_for_grad(region, outputs, out_tensors, leaves, recorded, makes_views)
            self.calls.append(TraceCall(func, CallKind.COMPUTE, region.index, spec, recorded, outputs, out_spec))
            if self._wrote_input_that_requires_grad(region, outputs, out_tensors, recorded):
                # NOTE: eager's later ops read the written tensor, whose grad_fn is the in-place op:
                # gradients with respect to it (a non-leaf now) take their paths. Inside the region
                # they would read the functional value instead, so the region ends here, and what
                # reads the tensor next starts from the real, written-back one.
                self.current = None
        else:
            self._record_eager(func, index, spec, recorded, outputs, out_spec, reason, result)

    def _note_graph_reads(self, func, args, kwargs, leaves, recorded) -> None:
        """Calls that read autograd's graph of a value end the region that makes it there."""
        if recorded and isinstance(recorded[0], ValueId) and recorded[0] in self.produced_by \
                and inspects_node(func, leaves):
            # NOTE: the user inspects this value's Node (hooks on grad_fn, its saved tensors,
            # its name in a printout): the op that made it runs eagerly on every call, so the
            # Node is eager's own.
            producer = self.produced_by[recorded[0]]
            if self.calls[producer].kind is CallKind.COMPUTE:
                self.isolate.add(producer)
        for t in gradient_inputs(func, args, kwargs):
            # NOTE: grad(z, y) / backward(inputs=[y]) needs y's Node in z's graph: the region
            # that computes y ends with it, and what reads y next starts from y itself. It begins
            # there too where what the region made before is read later: sharing y's Node, a
            # value on z's graph would make the engine run the path to y where eager's graph does
            # not reach it (API fuzz seed 2770: a pre-hook called that eager's backward skips)
            entry = self.ids.get(id(t))
            producer = self.produced_by.get(entry[1]) if entry is not None and entry[0]() is t else None
            if producer is not None and self.calls[producer].kind is CallKind.COMPUTE:
                self.split_after.add(producer)
                self.gradient_watched.add(producer)
        watched = watched_gradient(func, args)
        if watched is not None:
            self._isolate_gradient_of(watched)

    def _bind(self, func, args, kwargs, leaves, recorded, out_tensors, result):
        """(region, its nodes for the call's results, None) where the call's binding emitted it into
        the current region; (None, None, reason) where it runs eagerly (reason None: by design)."""
        reason = None
        binding = _binding(func)
        # NOTE: math the function runs under no_grad compiles (a rotary embedding's cos/sin),
        # as a region without autograd, but for a training step's own bookkeeping, which runs
        # eagerly by design, not as a fallback (``_bookkeeping_under_no_grad``).
        by_design = binding is not None and not torch.is_grad_enabled() and self.entry_grad_mode \
            and self._bookkeeping_under_no_grad(leaves, out_tensors)
        if by_design:
            binding = None
        if binding is not None:
            self._split_before_overwriting_a_saved_value(out_tensors)
            try:
                region, nodes = self._emit(func, binding, args, kwargs, leaves, recorded, out_tensors)
                return region, nodes, None
            except Unsupported as e:
                if not (func in FACTORIES and not self._reads_region_value(recorded)):
                    reason = f"{function_name(func)}: {e}"
                # (a factory's form the compiler does not make, a list's data: an eager call, as
                # factories always were, read by the regions as an input; no fallback)
            except InternalCompilerError:
                raise
            except Exception as e:  # a bug in a binding: this call runs eagerly (strict: raises)
                internal = internal_error(f"{self.fn_name} (compiling {function_name(func)})", e)
                self.internal_errors.append(internal)
                self.current = None
        elif getattr(func, "__name__", "") in VALUE_READS:
            # NOTE: a graph break, not a fallback: the region before ends with the value (made
            # by its kernels), only the read runs eagerly, and what follows compiles again.
            if not by_design and not expected_eager(func, self._reads_region_value(recorded)):
                self.graph_breaks.append(value_read_break(func, result))
        elif not by_design and not expected_eager(func, self._reads_region_value(recorded)):
            reason = f"{function_name(func)} is not supported by the compiler yet"
        return None, None, reason

    def _output_ids(self, func, out_tensors) -> tuple:
        """(the value ids of the call's results, whether all are new views: a view op's backward
        saves no value)."""
        outputs = []
        makes_views = bool(out_tensors)
        for t in out_tensors:
            entry = self.ids.get(id(t))
            if entry is not None and entry[0]() is t:
                outputs.append(entry[1])        # returned an existing tensor (in-place, self)
                makes_views = False
            else:
                outputs.append(self._new_id(t))
                makes_views = makes_views and t._base is not None
                if func in FACTORIES:
                    address = _storage_address(t)
                    if address is not None:
                        self.fresh_storages.add(address)
        return outputs, makes_views

    def _note_produced(self, region, func, index: int, vid, node, t) -> None:
        """The region's value ``vid`` is now ``node`` (new, or written in place: then its base,
        views and eager's saved values are tracked, and writes the region cannot express run eagerly)."""
        old = region.nodes.get(vid)
        region.nodes[vid] = node
        region.produced.append(vid)
        if old is None:
            self.produced_by[vid] = index
            if t._base is not None:
                self._note_view(region, vid, node, t)
            if func in FACTORIES:
                self.factory_values.add(vid)
            return
        self._name_written_saved_result(vid, t)  # (before produced_by names this call: it reads the producer)
        self.produced_by[vid] = index
        region.writes[vid] = region.writes.get(vid, 0) + 1
        if t._base is not None:
            region.note_view_mutation()
            try:
                self._update_base(region, vid, old, node, t._base, index)
            except ViewMutation as e:
                region.run_eagerly(f"{function_name(func)}: {e}", keep_first=False)
        refused = self._refuse_write_into_view_of_saved(region, t)
        if refused is not None:
            region.run_eagerly(f"{function_name(func)}: {refused}")
        self._refuse_earlier_saved_views(region, t, function_name(func))
        self._note_stale_views(region, t, vid)
        root = t._base if t._base is not None else t
        if region.eager_reason is None and (torch._debug_has_internal_overlap(t) != 0
                                            or torch._debug_has_internal_overlap(root) != 0):
            # eager writes memory that other elements share (an expanded tensor):
            # the functional value and its write-back cannot express that
            region.run_eagerly(f"{function_name(func)}: an in-place write into a tensor whose elements "
                               "share memory (expanded); the region runs eagerly")

    def _note_saved_for_grad(self, region, outputs, out_tensors, leaves, recorded, makes_views) -> None:
        """What eager's op saved for backward (its inputs, its result): a value written in place
        later is eager's error at backward, which the compiled region must raise too."""
        region.read_for_grad.update(v for v in recorded if isinstance(v, ValueId))
        if not makes_views:
            region.saved_for_grad.update(v for v in recorded if isinstance(v, ValueId))
        # eager's op saved its own result (exp, relu, softmax, polar): an in-place op on it
        # later is eager's error too
        for v, t in zip(outputs, out_tensors):
            if saves_result(t) and self.checkpoints.block is None:  # (in a checkpoint: a holder)
                region.read_for_grad.add(v)
                region.saved_for_grad.add(v)
                region.eager_saved[v] = (t.grad_fn.name(), t.output_nr)
        # eager's op saved one of its inputs (minimum both, log its input): a value written
        # in place later is eager's error at backward (``build_region``'s outputs_written_later)
        if self.checkpoints.block is None and out_tensors[0].requires_grad:
            # (every tensor: mul saves a factor needing no gradient for the other's)
            inputs = [x for x in leaves if isinstance(x, torch.Tensor)]
            for x in saved_inputs(out_tensors[0], inputs):
                entry = self.ids.get(id(x))
                if entry is not None and entry[0]() is x:
                    region.saved_by_consumers.add(entry[1])
                    region.consumer_outputs.setdefault(entry[1], set()).update(outputs)

    def _record_eager(self, func, index: int, spec, recorded, outputs, out_spec, reason, result) -> None:
        """An eager call: it closes the region (a profiler range's enter or exit does not: it changes
        no value, and DDP's forward ends in one, which cut its module's math from the loss's), and a
        fallback's reason is kept."""
        if reason or not is_profiler_range(func):
            self.current = None
        for vid in outputs:
            self.produced_by.setdefault(vid, index)
        if not outputs:
            # NOTE: a function given to a call that makes no tensor (a hook to register) is
            # not needed to replay it, and keeping it would keep what its closure holds
            # (the gradients a hook saw) alive, mistaken for tensors reached from outside.
            recorded = [UNKEPT if isinstance(x, FUNCTIONS) else x for x in recorded]
        # a value read into Python: the calls Python makes next may depend on it, replay compares it
        guarded = getattr(func, "__name__", "") in VALUE_READS and not isinstance(result, torch.Tensor)
        self.calls.append(TraceCall(func, CallKind.EAGER, None, spec, recorded, outputs, out_spec, reason,
                                    guard=read_snapshot(result) if guarded else None, guarded=guarded))
        if reason:
            self.breaks.append(reason)

    def _keep_eager_what_hooks_save_and_writes_change(self, index, recorded, outputs, out_tensors) -> None:
        """Run eagerly each op that saved a value under saved-tensor hooks which a later call
        writes in place.

        NOTE: with hooks PyTorch checks no version: eager's backward reads the value as written
        (a softmax's result doubled in place: its gradient is no longer zero), where the compiled
        backward would read the value the op made (fuzz seeds 687, 7551: a gradient other than
        eager's). Run eagerly, the op saves through the hooks as eager's does. Which values an op
        saves is taken wide: its tensor inputs, and its result where its Node keeps it."""
        read = {v for v in recorded if isinstance(v, ValueId)}
        for v in outputs:
            if v in read and v in self.saved_under_hooks:  # (written in place)
                self.isolate.update(c for c in self.saved_under_hooks.pop(v) if self.calls[c].kind is CallKind.COMPUTE)
        if out_tensors and out_tensors[0].requires_grad and _saved_tensors_hooks(False) is not None:
            saved = read | {v for v, t in zip(outputs, out_tensors) if saves_result(t)}
            for v in saved:
                self.saved_under_hooks.setdefault(v, set()).add(index)

    def _isolate_gradient_of(self, t: torch.Tensor) -> None:
        """``t`` gets a hook or retain_grad(): the call that made it runs as a region of its own.

        NOTE: eager's hook sees ``t``'s whole gradient, from every op that read it, also those
        recorded before the hook was registered; inside one region they would pass their part to
        ``t``'s producer in the region's backward, and the hook on ``t``'s output would see only
        the rest (None where there is none). A region that ends at ``t`` hands all of it to
        ``t``'s output. Begun there too, no other output shares ``t``'s Node: where the loss does
        not reach ``t``, its hook is not called, as eager's is not (fuzz seeds 155, 156;
        ``_split_before_watched``)."""
        entry = self.ids.get(id(t))
        producer = self.produced_by.get(entry[1]) if entry is not None and entry[0]() is t else None
        if producer is not None and self.calls[producer].kind is CallKind.COMPUTE:
            self.split_after.add(producer)
            self.gradient_watched.add(producer)

    def _split_before_watched(self, returned: set) -> None:
        """End a region before the producer of a value whose gradient is watched where what the
        region made before it is read later (or returned): those values would share the watched
        value's Node, whose hook then runs where the loss reaches only them (with None). Where
        they only feed the watched value (the usual case), the region stays whole."""
        for producer in self.gradient_watched:
            region = self.calls[producer].region
            before = []
            for c in reversed(range(producer)):
                if self.calls[c].region != region or c in self.split_after or c in self.isolate:
                    break
                before.extend(self.calls[c].outputs)
            made = set(before)
            if made & returned or any(v in made for call in self.calls[producer + 1:] for v in call.leaves
                                      if isinstance(v, ValueId)):
                self.split_after.add(producer - 1)

    def _name_written_saved_result(self, vid, written: torch.Tensor) -> None:
        """A value an eager op saved as its result (hypot's) and a later op saved as its input
        (square's), now written in place (sin_): at backward eager's error comes from the later
        node, which names the tensor's grad_fn then (the in-place op's, "output 0 of Sin"), not the
        op that saved its result. The name the bridge's version check gives (``eager_saved``)."""
        if written.grad_fn is not None:
            for r in [*self.regions, self.current]:
                if r is not None and vid in r.saved_by_consumers:
                    # NOTE: eager's error for a value an op saved as its input names the tensor's
                    # grad_fn at backward: the last in-place op's (fuzz seeds 488, 5317, 5704, 7151)
                    r.written_names[vid] = f"output {written.output_nr} of {written.grad_fn.name()}"
        producer = self.produced_by.get(vid)
        if producer is None or self.calls[producer].region is None:
            return
        index = self.calls[producer].region
        saved_by = self.regions[index] if index < len(self.regions) else self.current   # (not appended yet)
        if vid in saved_by.eager_saved and written.grad_fn is not None and any(
                vid in r.saved_by_consumers for r in [*self.regions, self.current] if r is not None):
            saved_by.result_names.setdefault(vid, saved_by.eager_saved[vid])
            saved_by.eager_saved[vid] = (written.grad_fn.name(), written.output_nr)

    def _forget_names_of_unused_consumers(self, live: set) -> None:
        """Undo ``_name_written_saved_result`` where no output of the ops that saved the value as
        their input is used: eager never runs their backward, so its error comes from the op that
        saved the value as its result, and names it (fuzz seed 9359: softmax's result, saved by a
        matmul whose product is dropped, then written in place)."""
        for r in self.regions:
            for vid in [v for v in r.written_names if not r.consumer_outputs.get(v, set()) & live]:
                del r.written_names[vid]
        for r in self.regions:
            for vid in list(r.result_names):
                if not any(vid in other.written_names for other in self.regions):  # (no used consumer)
                    r.eager_saved[vid] = r.result_names.pop(vid)

    def _bookkeeping_under_no_grad(self, leaves, out_tensors) -> bool:
        """Whether a call under a no_grad the function turned on is a training step's bookkeeping,
        run eagerly by design: inside an optimizer.step() or clip_grad_norm_ (their own kernels,
        or eager), made by torch.distributed (FSDP2 views and copies its all-gather buffers under
        no_grad in its hooks: compiled, those views became region values that its collectives and
        copy-out ops, which the compiler does not know, then read: fallbacks and divergences),
        inside a custom autograd.Function's forward (its own math, for its own backward),
        reading a gradient (a hand-written update, whose step size changes every step), or
        writing in place into a tensor that requires grad (a parameter) or is a subclass."""
        if self.in_library_call is not None and self.in_library_call():
            return True
        if made_by_distributed() or inside_custom_function():
            return True
        inputs = [x for x in leaves if isinstance(x, torch.Tensor)]
        if any(id(x) in self.gradients for x in inputs):
            return True
        for t in out_tensors:
            if any(t is x for x in inputs) and (t.requires_grad or type(t) is not torch.Tensor):
                return True
        return False

    def _emit(self, func, binding, args, kwargs, leaves, recorded, out_tensors):
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if (not tensors and func not in FACTORIES) or not out_tensors:
            raise Unsupported("no tensor inputs or outputs")
        for t in tensors + out_tensors:
            if type(t) not in (torch.Tensor, torch.nn.Parameter):
                layout = tensor_parallel.linear_layout(args, kwargs) if func is F.linear else None
                raise Unsupported(f"tensor subclass {type(t).__name__}" + (f" ({layout})" if layout else ""))
            if t.layout != torch.strided:
                raise Unsupported(f"{t.layout} tensors")
            if t.dtype not in _SUPPORTED_DTYPES:
                raise Unsupported(f"{t.dtype} tensors are not supported yet")
        devices = {t.device for t in tensors + out_tensors}
        if len(devices) != 1:
            raise Unsupported("tensors on several devices in one call")
        device = devices.pop()
        grad_enabled = torch.is_grad_enabled()
        hooks = self._saved_tensor_hooks_in_effect()
        region = self.current
        # (a call given a number taken at run time begins its region: a region runs whole at its
        # first call, and the replay knows the number only when Python makes this call)
        lifting = self.numbers.positions(self, func, binding, leaves)
        # (a float argument is known before any region runs: only other numbers begin a region)
        begins = any(self.numbers.argument_of(leaves[i]) is None for i in lifting)
        if region is None or region.device != device or region.grad_enabled != grad_enabled \
                or region.saved_tensor_hooks is not hooks or (begins and region.calls):
            region = self._new_region(len(self.regions), grad_enabled, device, hooks)
        stale = region.stale.intersection(v for v in recorded if isinstance(v, ValueId))
        if stale:
            region.run_eagerly(f"{function_name(func)} reads a view that an earlier in-place op changed through "
                               "other memory it shares (the functional capture cannot follow); the region "
                               "runs eagerly")
        b = region.builder
        metas = {vid: TensorMeta.of(x) for x, vid in zip(leaves, recorded) if isinstance(x, torch.Tensor)}
        lifted = self._take_numbers(lifting, leaves, recorded, metas, device)
        mapped = map_to_nodes(region, recorded, metas)
        a, k = unflatten_call(mapped, flatten_call(args, kwargs)[1])
        start = len(b.created)
        if lifted:
            result = self._bind_numbers(region, binding, (args, kwargs), leaves, recorded, metas, lifted, out_tensors)
        else:
            result = _apply_binding(b, binding, a, k, out_tensors, _autocast_dtype(device))
        for x, r in zip(leaves, recorded):   # (float arguments kept as constants: the key specializes on them)
            if type(r) is float and self.numbers.argument_of(x) is not None:
                self.baked_floats.add(self.numbers.argument_of(x))
        result, writes = (result.result, result.writes) if isinstance(result, Writes) else (result, ())
        source, op_name = user_frame(), function_name(func)
        for made in b.created[start:]:
            update_meta(made, source=source, torch_op=op_name, device=device)
        nodes = list(result) if isinstance(result, (tuple, list)) else [result]
        if len(nodes) != len(out_tensors):
            raise AssertionError(f"the binding of {function_name(func)} returned {len(nodes)} results where eager "
                                 f"returned {len(out_tensors)}")
        inputs = {id(n): x for n, x in zip(mapped, leaves) if isinstance(n, fx.Node)}
        for i, (node, t) in enumerate(zip(nodes, out_tensors)):
            source = inputs.get(id(node))
            if source is not None and t is not source and t._base is None:
                # the binding passed an input through where eager made a new tensor (contiguous()
                # of a strided one): a copy, so the result does not alias the input
                nodes[i] = C.emit_pointwise(b, "identity", [node], dtype=meta_of(node).dtype,
                                            requires_grad=meta_of(node).requires_grad)
        keep_overwritten_history(b, nodes, out_tensors, mapped, leaves, start)
        for node, t in zip(nodes, out_tensors):
            if meta_of(node).shape != tuple(t.shape) or meta_of(node).dtype != t.dtype:
                raise AssertionError(
                    f"the binding of {function_name(func)} computed {meta_of(node).dtype}{list(meta_of(node).shape)} "
                    f"where eager gave {t.dtype}{list(t.shape)}")
            if meta_of(node).requires_grad != t.requires_grad:
                update_meta(node, requires_grad=t.requires_grad)
        apply_writes(region, writes)
        tag_block(b.created[start:], self.checkpoints.block)
        if region is not self.current:
            self.regions.append(region)
            self.current = region
        return region, nodes

    def _bind_numbers(self, region, binding, call, leaves, recorded, metas, lifted, out_tensors):
        """Emit a binding given numbers taken at run time (``lifted``: their nodes); where it needs them
        as constants (Unsupported), emit it with the constants, as before."""
        b, autocast_dtype, spec = region.builder, _autocast_dtype(region.device), flatten_call(*call)[1]
        start = len(b.created)
        try:
            result = _apply_binding(b, binding, *unflatten_call(map_to_nodes(region, recorded, metas), spec),
                                    out_tensors, autocast_dtype)
        except Unsupported:
            for i, nid in lifted:
                forget_input(region, nid, start)
                recorded[i] = leaves[i]
                self.number_inputs.pop(nid)
            return _apply_binding(b, binding, *unflatten_call(map_to_nodes(region, recorded, metas), spec),
                                  out_tensors, autocast_dtype)
        for i, nid in lifted:   # (dropout's p: an interval its kernels hold for, checked per replay)
            low, high = b.number_bounds.get(region.nodes.get(nid), (None, None))
            if low is not None or high is not None:
                self.number_inputs[nid] = dataclasses.replace(self.number_inputs[nid], low=low, high=high)
        return result

    def number_meta(self, nid: NumberId) -> TensorMeta:
        taken = self.number_inputs[nid]
        return TensorMeta((), taken.dtype, taken.device, False)

    def _take_numbers(self, positions, leaves, recorded, metas, device) -> list:
        """Leaves at ``positions`` become NumberIds in ``recorded`` (with their 0-dim metadata in
        ``metas``): the region reads them as inputs. Returns [(leaf position, NumberId)]."""
        lifted = []
        wide = any(isinstance(x, torch.Tensor) and x.dtype == torch.float64 for x in leaves)
        for i in positions:
            value = leaves[i]
            # (eager computes with a float in its op's opmath type: float32 but for float64 tensors)
            dtype = torch.int64 if type(value) is int else torch.float64 if wide else torch.float32
            nid = NumberId(self.next_id)
            self.next_id += 1
            recorded[i] = nid
            metas[nid] = TensorMeta((), dtype, device, False)
            self.number_inputs[nid] = NumberInput(type(value), dtype, device, argument=self.numbers.argument_of(value))
            lifted.append((i, nid))
        return lifted

    def _saved_tensor_hooks_in_effect(self):
        """The pack hook of the innermost ``saved_tensors_hooks`` block the call runs in (None: none,
        or a checkpoint's, which ``runtime.checkpoints`` handles). NOTE: a region's forward runs at
        its first call, and its saved values go through the hooks in effect then; eager's ops pack
        theirs through their own block's, so a region ends where the hooks change (API fuzz seed
        51334: a sigmoid after the block saved through the block's hooks, and the version error
        eager's sigmoid raises was taken for one under hooks)."""
        hooks = _saved_tensors_hooks(False)
        return None if hooks is None or self.checkpoints.block is not None else hooks[0]

    def _new_region(self, index, grad_enabled, device, hooks) -> Region:
        return Region(index, grad_enabled, device, saved_tensor_hooks=hooks, seed_input=self._seed_input)

    def _seed_input(self, region: Region):
        """A region input that replay fills with a fresh random seed before each run (random
        ops in kernels: dropout). It has a value id but no tensor in the recording."""
        vid = ValueId(self.next_id)
        self.next_id += 1
        self.meta[vid] = TensorMeta((), torch.int64, region.device, False)
        node = region.builder.placeholder(f"seed{vid}", (), torch.int64, device=region.device)
        region.nodes[vid] = node
        region.inputs.append(vid)
        region.seeds.append(vid)
        return node

    def _reads_region_value(self, recorded) -> bool:
        return any(isinstance(v, ValueId) and v in r.nodes and v not in r.inputs
                   for v in recorded for r in self.regions)

    def _wrote_input_that_requires_grad(self, region, outputs, out_tensors, recorded) -> bool:
        """Whether this call wrote in place into one of the region's inputs (or a view of one)
        that requires grad afterwards."""
        for vid, t in zip(outputs, out_tensors):
            if vid not in recorded or not t.requires_grad:
                continue  # (a new tensor, not an in-place op)
            if vid in region.inputs or any(v in region.inputs for v in self._base_of(t)):
                return True
        return False

    # -- after the run -------------------------------------------------------------------
    def _split_isolated(self):
        """Take each isolated call out of its region: it runs eagerly on every call, so the
        Node the user inspects is eager's own (its type, ``_saved_*`` tensors and their
        hooks, ``next_functions``). Regions also end after each call in ``split_after``. The
        calls around are rebuilt as regions of their own."""
        if not self.isolate and not self.split_after:
            return
        regions = []
        for r in self.regions:
            segments, current = [], []
            for c in r.calls:
                if c in self.isolate:
                    segments += [current, [c]] if current else [[c]]
                    current = []
                    continue
                current.append(c)
                if c in self.split_after:
                    segments.append(current)
                    current = []
            if current:
                segments.append(current)
            if r.view_mutation or (len(segments) == 1 and segments[0][0] not in self.isolate):
                r.renumber(len(regions))
                regions.append(r)
                continue
            for seg in segments:
                if seg[0] in self.isolate:
                    self.calls[seg[0]] = dataclasses.replace(self.calls[seg[0]], kind=CallKind.EAGER, region=None)
                    continue
                regions.append(self._rebuild(len(regions), seg, r))
        for r in regions:
            for c in r.calls:
                if self.calls[c].region != r.index:
                    self.calls[c] = dataclasses.replace(self.calls[c], region=r.index)
        self.regions = regions

    def _rebuild(self, index, call_indices, old: Region) -> Region:
        """A segment of region ``old``: its graph re-emitted from recorded calls (bindings need
        metadata only), with what the recording learned about those calls (``carry_recorded_facts``)."""
        region = self._new_region(index, old.grad_enabled, old.device, old.saved_tensor_hooks)
        b = region.builder
        for c in call_indices:
            call = self.calls[c]
            in_meta, out_meta, autocast_dtype = self.call_meta[c]
            a, k = unflatten_call(map_to_nodes(region, call.leaves, in_meta), call.spec)
            start = len(b.created)
            result = _apply_binding(b, _binding(call.func), a, k, out_meta, autocast_dtype)
            if isinstance(result, Writes):
                apply_writes(region, result.writes)
                result = result.result
            nodes = list(result) if isinstance(result, (tuple, list)) else [result]
            tag_block(b.created[start:], self.checkpoints.block_of(c))
            for vid, node, m in zip(call.outputs, nodes, out_meta):
                if region.nodes.get(vid) is node:
                    continue
                update_meta(node, requires_grad=m.requires_grad)
                if vid in region.nodes:
                    region.writes[vid] = region.writes.get(vid, 0) + 1
                region.nodes[vid] = node
                region.produced.append(vid)
            region.calls.append(c)
        region.take_recorded_facts(old)
        return region

    def _kept_by_user(self) -> set:
        """Value ids of region values the user still holds after the call (or holds a view of:
        the view's base, as the recording had it)."""
        kept = set()
        for r in self.regions:
            for vid in r.produced:
                t = self.refs[vid]()
                if t is None or vid in kept:
                    continue
                # Held by Python code other than ours (a list, a module attribute, a closure):
                # the user may read it after the call. References from C++ do not count:
                # autograd's saved tensors (replay saves what its backward needs) and view bases.
                if python_references(t) > UNREFERENCED:
                    kept.add(vid)
                    kept.update(self._base_of(t))
                del t  # (no variable of ours may hold a tensor counted next)
        return kept

    def _base_of(self, t: torch.Tensor) -> list:
        """The value id of ``t``'s base, if ``t`` is a view of a recorded value."""
        base = t._base
        entry = self.ids.get(id(base)) if base is not None else None
        return [entry[1]] if entry is not None and entry[0]() is base else []

    def finish(self, result, modules, steps, optimizer_steps, reseeded: bool) -> Recording:
        """Escape analysis, then the recording with one RegionPlan per region, with what the hooks
        watching the call saw: the ``modules`` run (``ModulesRun``), the optimizer ``steps``
        (``OptimizerSteps``) and which optimizer each was (``StepRecorder``)."""
        # What is still alive decides what escapes; garbage in reference cycles (module hooks
        # make some) is not: collect the young generations, where the call's own cycles are
        # (a full collection costs a large program ~0.3 s per recording).
        gc.collect(1)
        eager_blocks = self.checkpoints.to_run_eagerly()
        if eager_blocks:
            self.isolate |= eager_blocks
            self.breaks.append(MIXED_BLOCK)
        returned = {self.ids[id(t)][1] for t in tree_flatten(result)[0]
                    if isinstance(t, torch.Tensor) and id(t) in self.ids and self.ids[id(t)][0]() is t}
        self._split_before_watched(returned)
        self._split_isolated()
        # Values read outside the region that computes them: by eager calls, and by other
        # regions (a region's inputs). A region's own inputs that it mutates are among them:
        # their final value is written back into the real tensor.
        used_outside = set(returned)
        for call in self.calls:
            if call.kind is CallKind.EAGER:
                used_outside.update(v for v in call.leaves if isinstance(v, ValueId))
        for r in self.regions:
            used_outside.update(r.inputs)
        used_outside.update(self.escaped)  # (what pack hooks made: compiler.capture.pack_hooks)
        # NOTE: a factory's value no recorded call reads went where the mode does not see: a module
        # built inside the function wraps torch.empty's tensor as nn.Parameter(...) and initializes it
        # in place; it must be a real tensor on replay, not a stand-in
        read = {v for call in self.calls for v in call.leaves if isinstance(v, ValueId)}
        used_outside.update(self.factory_values - read)
        kept = self._kept_by_user()
        self._forget_names_of_unused_consumers(read | returned | kept)
        plans = []
        for r in self.regions:
            outputs, internal = [], {}
            seen = set()
            for vid in r.produced:
                if vid in seen:
                    continue
                seen.add(vid)
                if vid in used_outside or vid in kept:
                    outputs.append(vid)
                else:
                    internal[vid] = self.meta[vid]
            b = r.builder
            output_nodes = [r.nodes[v] for v in outputs]
            b.output(output_nodes)
            mark_eager_saved(b.graph, r, outputs, list(r.inputs))
            b.graph.eliminate_dead_code()
            mutated = [v for v in r.inputs if v in seen]
            # (eager bumps a version counter per in-place op, none for a write inside an operator;
            # views share their base's)
            writes = {} if r.view_mutation else {v: r.writes[v] for v in mutated if r.writes.get(v, 1) != 1}
            if r.stale.intersection(outputs):
                r.run_eagerly("a view that an in-place op changed through other memory it shares is used "
                              "after the region (the functional capture cannot follow); the region runs eagerly")
            views = {v: r.view_of[v] for v in outputs if v in r.view_of and r.view_of[v][0] in outputs}
            plans.append(RegionPlan(r.calls, list(r.inputs), outputs, internal, r.grad_enabled, mutated=mutated,
                                    reason=r.eager_reason, seeds=[(v, r.device) for v in r.seeds], writes=writes,
                                    views=views, writes_in_place=bool(r.writes) or r.view_mutation, graph=b.graph))
        # Externals already gone appeared during the call, from code the mode does not see (a
        # Parameter made inside the function, a tensor unpacked from a grad_fn): replay binds
        # them to what the function passes then. The others are guarded by identity.
        # NOTE: so are those on storage a factory allocated during the call (``Parameter(torch.empty(...))``
        # of a module built inside the function), alive or not: a module's hooks make reference cycles,
        # which keep it alive until the garbage collector runs, so "gone" alone depended on its timing
        # (the notes' multi-grad-hook example replayed or diverged by the run)
        transient = {vid: meta for vid, (ref, meta) in self.externals.items()
                     if ref() is None or self._on_fresh_storage(ref())}
        externals = {vid: e for vid, e in self.externals.items() if vid not in transient}
        found = optimizer_steps.found
        return Recording(self.calls, plans, self.arg_ids, externals, dict(self.produced_by),
                         list(dict.fromkeys(self.breaks)), list(dict.fromkeys(self.graph_breaks)),
                         internal_errors=list(self.internal_errors), transient=transient, module_modes=modules.modes,
                         optimizer_steps=steps.spans(self.calls), recorded_optimizer_steps=found,
                         step_calls={f[0]: (f[1], f[2]) for f in found if type(f) is tuple},
                         result=_result_structure(self, result), reseeded=reseeded,
                         numbers=dict(self.number_inputs), baked_floats=frozenset(self.baked_floats),
                         tensor_parallel=self.tensor_parallel)

    def watch_library_calls(self, running) -> None:
        """``running()``: whether an optimizer step or clip_grad_norm_ runs now (its math stays eager)."""
        self.in_library_call = running

    def analysis_failed(self, error: Exception) -> None:
        """A compiler bug while analysing the finished recording (``finish``): the key runs eagerly."""
        self.broken = internal_error(f"{self.fn_name} (analysing its recording)", error)

    @contextlib.contextmanager
    def pack_hook_running(self):
        """While a saved tensor's pack hook runs: what it makes escapes (autograd holds it)."""
        self.escaping += 1
        try:
            yield
        finally:
            self.escaping -= 1


_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def _autocast_dtype(device: torch.device):
    """The lower-precision dtype of an active ``torch.autocast`` for this device, else None (also for
    a device autocast has no mode for: meta tensors, a capture from shapes alone, where asking raises)."""
    if not torch.amp.is_autocast_available(device.type):
        return None
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def _apply_binding(b, binding, a, k, outputs, autocast_dtype):
    """Emit the binding. Under ``torch.autocast`` eager casts an op's floating inputs first (to
    the lower precision for matmuls, to float32 for losses and softmax, to the widest for
    cat): where eager's result has another dtype than the binding's, emit the binding again
    on its floating inputs cast to that dtype, as autocast did. (``outputs``: eager's result
    tensors or their metadata; the dead first attempt is dropped with unused nodes.)"""
    if autocast_dtype is None:
        return _call_binding(binding, b, a, k)
    wanted = [o.dtype for o in outputs]
    target = next((d for d in wanted if d.is_floating_point), None)
    try:
        result = _call_binding(binding, b, a, k)
    except Unsupported:
        if target is None:
            raise
        result = None  # (mixed dtypes that autocast's casts resolve: try again cast)
    if result is not None:
        plain = result.result if isinstance(result, Writes) else result
        nodes = list(plain) if isinstance(plain, (tuple, list)) else [plain]
        if target is None or all(not isinstance(n, fx.Node) or meta_of(n).dtype == d for n, d in zip(nodes, wanted)):
            return result

    def cast(x):
        if isinstance(x, fx.Node) and meta_of(x).dtype.is_floating_point and meta_of(x).dtype != target:
            return C.emit_pointwise(b, "identity", [x], dtype=target)
        return x
    a, k = tree_map(cast, (list(a), dict(k)))
    return _call_binding(binding, b, a, k)


def _call_binding(binding, b, a, k):
    """``binding(b, *a, **k)``; an argument the binding does not take (``memory_format=`` of
    ``x.double(...)``) is a deliberate fallback, with the argument named, not a bug."""
    try:
        return binding(b, *a, **k)
    except TypeError:
        try:
            inspect.signature(binding).bind(b, *a, **k)
        except TypeError as e:
            raise Unsupported(f"arguments not supported: {e}") from None
        except ValueError:  # (no signature to check against)
            pass
        raise


def _binding(func):
    if getattr(func, "__name__", None) == "__get__":
        return lookup(getattr(func, "__self__", None))
    return lookup(func)


def _result_structure(mode, result):
    """(spec, leaves) of the function's result, each tensor as its value id; None where a tensor
    in it was not made by a call the recording saw (skip_python then cannot rebuild it)."""
    leaves, spec = tree_flatten(result)
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            entry = mode.ids.get(id(leaf))
            if entry is None or entry[0]() is not leaf:
                return None
            out.append(entry[1])
        else:
            out.append(leaf)
    return spec, out


def capture(fn, args, kwargs, numbers_seen_changing=frozenset()):
    """Run ``fn`` eagerly, recording it. Returns (the function's result, Recording). Raises
    ``RecordingFailed`` (carrying the result) where a compiler bug broke the recording. Float
    arguments, and the numbers ``numbers_seen_changing`` names, are taken at run time
    (``compiler.capture.numbers``)."""
    leaves, _ = tree_flatten((args, kwargs))
    mode = Capture(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__,
                   NumbersTaken(flatten_call(args, kwargs)[0], numbers_seen_changing))
    mode.add_args(leaves)
    # NOTE: nothing here changes how autograd sees the user's tensors (no saved-tensor hooks
    # of ours): the recording call is eager PyTorch, version checks and saved tensors included.
    modules = ModulesRun()
    steps = OptimizerSteps(mode)
    optimizer_steps = StepRecorder(mode)  # which optimizer each step was, to compile it (compiler.optimizers)
    # (a clip_grad_norm_ call runs from its ClipRecord until its end is set; one that raised
    # counts as running on, which only keeps later no_grad math eager)
    mode.watch_library_calls(lambda: bool(steps.open) or any(
        getattr(found, "end", 0) is None for found in optimizer_steps.found))
    handles = [torch.nn.modules.module.register_module_forward_pre_hook(modules),
               register_optimizer_step_pre_hook(steps.begin),
               register_optimizer_step_post_hook(steps.end),
               register_optimizer_step_pre_hook(optimizer_steps.begin),
               optimizer_steps.watch_clipping()]  # clip_grad_norm_ calls, compiled as the steps are
    seed = torch.initial_seed()
    try:
        with recording_in_this_thread(mode), mode:
            result = fn(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    reseeded = torch.initial_seed() != seed  # (torch.manual_seed is no torch call the mode sees)
    del leaves
    if isinstance(mode.broken, InternalCompilerError):
        raise mode.broken  # (strict) the user's code caught it: a bug fails the call all the same
    if mode.broken is None:
        try:
            with SYMPY_LOCK:  # (splitting regions emits their bindings again)
                recording = mode.finish(result, modules, steps, optimizer_steps, reseeded)
        except Exception as e:
            mode.analysis_failed(e)
    if mode.broken is not None:
        raise RecordingFailed(result, mode.broken)
    return result, recording


def _storage_address(t: torch.Tensor):
    """Where ``t``'s storage starts; None where it has no memory of its own (empty, meta, a
    wrapper subclass)."""
    try:
        address = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return address or None


def _results(func, args, result) -> tuple:
    """(the tensors a call returned, how to rebuild its result from them: None for one tensor,
    "setitem" for ``x[i] = v``, which changes ``x`` and returns None, else a pytree spec)."""
    if isinstance(result, torch.Tensor):
        return [result], None
    if func is torch.Tensor.__setitem__:
        return [args[0]], "setitem"
    out_leaves, out_spec = tree_flatten(result)
    return [t for t in out_leaves if isinstance(t, torch.Tensor)], out_spec
