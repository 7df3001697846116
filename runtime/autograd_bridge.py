"""One compiled region as one ``torch.autograd.Function``.

The forward program's results are the region's outputs plus what backward needs; the latter
go through ``ctx.save_for_backward``, so saved-tensor hooks, in-place version checks and
"backward through the graph a second time" errors are PyTorch's own. Outputs carry a
grad_fn; ``.grad`` accumulation and its hooks stay with PyTorch's engine.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field

import torch
from torch._C._autograd import _make_saved_tensor

from runtime import function_apply
from runtime.checkpoints import in_checkpoint, outside_checkpoints
from runtime.program import Program, apply_views
from runtime.segments import SegmentChain, SharedLaterNodes, later_segments, plan_segments


@dataclass(frozen=True)
class OnDemand:
    """What the runtime asks of the compiler while autograd runs a region's backward: the one
    interface through which ``loss.backward()`` reaches the compiler, which partitions, fuses and
    renders then (each answer built once and kept). ``compiler.build`` gives each region its own;
    a region loaded from the compile cache gets one that builds its graph again when first asked
    (``compiler.reuse.persist``). None where the region has no such backward."""
    # output positions given a gradient -> (Program, positions in the saved list it reads,
    # the double-backward builder of that partial backward) | None: the backward without the
    # outputs outside the loss's graph
    partial_backward: object = None
    double_backward: object = None  # requires_grad pattern -> CompiledRegion of the backward (create_graph)
    explain_nan: object = None      # backward inputs -> message naming the forward op that made NaN (anomaly mode)


@dataclass
class CompiledRegion:
    forward: Program
    backward: Program | None
    num_outputs: int            # user-visible outputs (the forward may return more: saved values)
    saved: list                 # ("input", i) | ("output", j) per saved value, backward's first inputs
    grad_output_for: list       # which outputs receive a gradient in backward
    differentiable: list        # per output: whether it can carry a gradient
    stats: dict = field(default_factory=dict)
    input_views: list = field(default_factory=list)  # (position, input, views): outputs that view inputs
    # (position, base, views): outputs that view a base the forward returns last, made by torch
    # (``compiler.build._split_written_output_views``); ``hidden_bases``: how many such bases
    output_views: list = field(default_factory=list)
    hidden_bases: int = 0
    mutated_inputs: tuple = ()  # positions of inputs the region writes into (after its forward)
    written_later: tuple = ()  # positions of inputs the function writes in place after this region
    double_backward_reads: tuple = ()  # per input: whether the double backward reads its value
    grad_sources: tuple = ()    # per input gradient: positions in grad_output_for it is computed from
    # (output position, eager grad_fn name, output_nr, grad positions reaching it, the shape eager's
    # message names where the saved tensor is a view of that output made after the program, else None)
    eager_saved: tuple = ()
    eager_names: dict = field(default_factory=dict)  # saved position -> the producer eager's version error names
    # positions of inputs changed in place whose new value a kernel stores into their own memory
    # (``compiler.lower.program._input_donors``): the replay checks that no other input shares it
    donated_inputs: tuple = ()
    unread_inputs: tuple = ()   # positions of inputs no output depends on: no autograd edge to them
    # ((output positions, input positions they depend on), ...): a Node per group (``_apply_by_group``)
    output_groups: tuple = ()
    on_demand: OnDemand = OnDemand()  # the compiler's work during backward
    # where set, its backward is handed out in segments of about this many bytes of parameter
    # gradients, one autograd Node each (``runtime.segments``: under DDP, its bucket size)
    segment_bytes: int = 0

    def __post_init__(self):
        # (saved position, output position) of each saved output: what eager's version message names
        self.saved_output_positions = [(k, i) for k, (kind, i) in enumerate(self.saved) if kind == "output"]
        # facts about the region's calls worked out at its first call and fixed after it
        # (``_internal_views``, the inputs kept for double backward): name -> value
        self.first_call_facts: dict = {}

    def count_launches_in(self, stats: dict) -> None:
        """Count this region's kernel launches (and those of the regions it builds for a
        create_graph backward) into ``stats``: the compiled function's."""
        self.stats = stats

    def hand_out_in_segments(self, segment_bytes: int) -> None:
        """Hand its backward out in segments of about ``segment_bytes`` of parameter gradients (0: one
        Node), one autograd Node each (``runtime.segments``: DDP's buckets fire as they fill)."""
        self.segment_bytes = segment_bytes if self.backward is not None else 0

    def prepare_cpu(self) -> None:
        """The CPU path's generated code, made at build time (``Program.prepare_cpu``)."""
        for program in (self.forward, self.backward):
            if program is not None:
                program.prepare_cpu()

    def __call__(self, inputs):
        if self.backward is None or not torch.is_grad_enabled():
            outs = self.forward.run(inputs, self.stats)[: self.num_outputs]
        elif in_checkpoint():
            # NOTE (memory): inside torch.utils.checkpoint the region does the checkpoint's work:
            # its saved set leaves out the block's values (recomputed by its backward kernels),
            # and what it saves goes through the hooks around the checkpoint, not into holders
            # whose unpack would rerun the block eagerly (``runtime.checkpoints``).
            with outside_checkpoints():
                outs = list(_apply(self, self._originals(inputs), self._without_unread_edges(inputs)))
        elif self.segment_bytes and (plan := self.segment_plan(inputs)) is not None:
            outs = self._apply_in_segments(plan, self._without_unread_edges(inputs))
        elif self.output_groups and self.__dict__.get("_groupable", True):
            outs = self._apply_by_group(inputs)
        elif self.unread_inputs:
            outs = list(_apply(self, self._originals(inputs), self._without_unread_edges(inputs)))
        else:
            outs = list(_apply(self, self._originals(inputs), inputs))
        if self.hidden_bases:
            outs = self._view_bases(outs)
        for position, index, views in self.input_views:  # views of inputs: made outside, by torch
            outs.insert(position, apply_views(inputs[index], views))
        return outs

    def segment_plan(self, inputs):
        """How this region's backward is handed out in segments of ``segment_bytes`` (``runtime.segments``),
        worked out at its first call with them (which parameters it reads is fixed per region); None: one
        Node. (Kept per size: a region handed out in other segments since, by a test or a second DDP
        module, plans again.)"""
        facts, key = self.first_call_facts, ("segments", self.segment_bytes)
        plan = facts.get(key, False)
        if plan is False:
            # (inputs it writes that need no gradient, a BatchNorm's running statistics, change nothing
            # of its backward's graph; one that needs a gradient is dirtied on the region's Node)
            dirties = any(isinstance(inputs[i], torch.Tensor) and inputs[i].requires_grad for i in self.mutated_inputs)
            segmentable = not self.output_groups and not dirties
            plan = facts[key] = plan_segments(self.backward, inputs, self.segment_bytes) if segmentable else None
        return plan

    def _apply_in_segments(self, plan, inputs) -> list:
        """The region as its own Node and a Node per later segment of its backward (``runtime.segments``):
        those made once and shared by its calls where they can be (``SharedLaterNodes``), else per call."""
        shared = self._shared_later_nodes(plan, inputs)
        chain = SegmentChain(plan, shared)
        carrier = shared.carrier if shared is not None else later_segments(chain, inputs)
        return list(function_apply.apply(_FirstSegment, self, self._originals(inputs), chain, carrier, *inputs))

    def _shared_later_nodes(self, plan, inputs):
        """The later segments' Nodes this call's graph shares (``SharedLaterNodes``), made at the first call
        or where the plan or parameters changed (a few times: then Nodes per call), or None."""
        kept = self.__dict__.get("_later_nodes")
        if kept is not None and kept.plan is plan and kept.fits(inputs):
            return kept
        made = self.__dict__.get("_later_nodes_made", 0)
        # (under a functorch transform the carrier would be a tensor of that call's level)
        if made >= 4 or torch._C._are_functorch_transforms_active() or not SharedLaterNodes.shareable(plan, inputs):
            self._later_nodes = None
            return None
        self._later_nodes_made = made + 1
        self._later_nodes = SharedLaterNodes(plan, inputs)
        return self._later_nodes

    def _view_bases(self, outs) -> list:
        """The outputs with the views of the bases the forward returns last in their places, made
        by torch on the bases (a view Node each), and the bases themselves left out."""
        cut = len(outs) - self.hidden_bases
        bases, outs = outs[cut:], list(outs[:cut])
        for position, k, views in self.output_views:
            outs.insert(position, apply_views(bases[k], views))
        return outs

    def _apply_by_group(self, inputs) -> list:
        """The region as one autograd Node per group of outputs (``output_groups``), each connected
        only to the inputs its outputs depend on, as eager's graph is. The forward program runs once
        (``_GroupedCall``); each Node saves what the backward reads and computes the gradients of
        its own outputs (the partial backward of those outputs). Where an output is a view of
        another output or of an input, its view would not survive (later Nodes hand out aliases):
        the region is one Node then, as before (worked out at its first call, whose forward then
        runs again: a region that writes its inputs is never grouped)."""
        call = _GroupedCall(self._originals(inputs))
        outs = None
        for positions, connected in self.output_groups:
            # (only edges to cut: a detached alias of an inference tensor no longer says it is one)
            own = [t.detach() if i not in connected and isinstance(t, torch.Tensor) and t.requires_grad else t
                   for i, t in enumerate(inputs)]
            call.next_node_saves(self._group_reads_saved(positions))
            results = _apply(self, call, own)
            if outs is None:
                outs = list(results)
                if "_groupable" not in self.__dict__:
                    self._groupable = _groupable(call.outs[: self.num_outputs], inputs)
                    if not self._groupable:  # (the forward writes nothing: run again as one Node)
                        return list(_apply(self, self._originals(inputs), self._without_unread_edges(inputs)))
            else:
                for p in positions:
                    outs[p] = results[p]
        return outs

    def _group_reads_saved(self, positions) -> bool:
        """Whether the backward of an output group (any of its outputs given a gradient) reads a
        saved value. NOTE: one that reads none saves none, and a second backward through it runs
        as eager's does where eager's ops saved nothing (fuzz seed 7312: sums on the loss's path,
        a layer's output beside them). Worked out once per group (its partial backwards are built
        then, as its first backward would); groups of more than two outputs save."""
        known = self.__dict__.setdefault("_reads_saved", {})
        if positions not in known:
            subsets = [(p,) for p in positions] + ([positions] if len(positions) == 2 else [])
            partial = self.on_demand.partial_backward
            known[positions] = (len(positions) > 2 or partial is None
                                or any(p is None or p[1] for p in (partial(frozenset(s)) for s in subsets)))
        return known[positions]

    def _without_unread_edges(self, inputs) -> list:
        """``inputs`` with those no output depends on detached: eager's graph does not reach them
        from these outputs, so neither does the region's Node (``compiler.build``: unread_inputs)."""
        inputs = list(inputs)
        for i in self.unread_inputs:
            if isinstance(inputs[i], torch.Tensor) and inputs[i].requires_grad:
                inputs[i] = inputs[i].detach()
        return inputs

    def _originals(self, inputs) -> dict:
        """Inputs requiring grad that this region writes into and its double backward reads:
        position -> a copy made before the write, still on the input's autograd history (the
        double backward recomputes from the values the forward read; eager's in-place ops
        keep their original ``self`` likewise). Empty for almost every region."""
        if not self.mutated_inputs or self.on_demand.double_backward is None:
            return {}
        reads = self.double_backward_reads or (True,) * len(inputs)
        return {i: inputs[i].clone() for i in self.mutated_inputs
                if isinstance(inputs[i], torch.Tensor) and inputs[i].requires_grad and reads[i]}


class _GroupedCall(dict):
    """``_RegionFunction``'s ``originals`` for a region applied as a Node per output group: the
    forward program's results, made by the first Node's forward and handed to the others as
    aliases (``detach()``: same memory and version counter, their own autograd identity); and
    whether the Node being made saves the region's saved values (``_group_reads_saved``)."""
    outs = None
    saves = True

    def made(self, outs: list) -> None:
        """The first Node's forward ran the program: its results, for the other Nodes."""
        self.outs = outs

    def next_node_saves(self, saves: bool) -> None:
        """Whether the Node made next saves the region's saved values."""
        self.saves = saves


class _RegionFunction(torch.autograd.Function):
    keeps_double_backward_inputs = True   # (what a create_graph backward through it reads)

    @staticmethod
    def forward(ctx, region: CompiledRegion, originals: dict, *inputs):
        if type(originals) is _GroupedCall and originals.outs is not None:
            outs = [t.detach() if isinstance(t, torch.Tensor) else t for t in originals.outs]
        else:
            outs = region.forward.run(list(inputs), region.stats)
            if type(originals) is _GroupedCall:
                originals.made(outs)
        saved = [inputs[i] if kind == "input" else outs[i] for kind, i in region.saved] \
            if type(originals) is not _GroupedCall or originals.saves else []
        try:
            versions = [t._version if isinstance(t, torch.Tensor) else None for t in saved]
        except RuntimeError:  # an inference tensor (``_savable``)
            saved = [_savable(t) for t in saved]
            versions = [t._version if isinstance(t, torch.Tensor) else None for t in saved]
        ctx.save_for_backward(*saved)
        ctx.saved_versions = versions
        # the user's tensors of the saved outputs, weakly: eager's message names their grad_fn then
        ctx.saved_outputs = {k: weakref.ref(outs[i]) for k, i in region.saved_output_positions}
        # outputs eager's op saved (exp, polar: its result), version-checked where eager would run
        # that op's backward, with eager's message. NOTE: detach() shares the version counter;
        # the output itself would make a reference cycle through its grad_fn (this ctx).
        ctx.eager_saved = [(outs[position].detach(), outs[position]._version, name, output_nr, sources, shape)
                           for position, name, output_nr, sources, shape in region.eager_saved]
        if region.eager_saved:
            # (under saved-tensor hooks eager's op would check no version: the values this region
            # saves itself are read as eager reads them; those it recomputes raise, ``_hooked_and_written``)
            ctx.hooked = _saved_tensors_hooks(False) is not None
            if ctx.hooked:
                ctx.eager_saved = [kept for kept, (position, *_) in zip(ctx.eager_saved, region.eager_saved)
                                   if ("output", position) not in region.saved]
        ctx.region = region
        # NOTE: an output outside the loss's graph gets None, not zeros: an input reached only
        # through such outputs then gets None too, as eager leaves it (``backward``).
        ctx.set_materialize_grads(False)
        if region.on_demand.double_backward is not None and type(ctx)._forward_cls.keeps_double_backward_inputs:
            ctx.double_backward_inputs = _keep_for_double_backward(region, inputs, originals, saved_inputs=bool(saved))
        user = outs[: region.num_outputs]
        internal_views = region.first_call_facts.get("internal_views")
        if internal_views is None:  # (fixed per region: worked out at its first call)
            internal_views = region.first_call_facts["internal_views"] = _views_of_internal_buffers(user, inputs, outs)
        for i in internal_views:
            user[i] = user[i].detach()
        if len(region.grad_output_for) > 1:
            # (zeros stand for a missing gradient in backward: only where several outputs take one,
            # as autograd calls backward at all only when some output's gradient is defined)
            ctx.shapes = [(o.shape, o.dtype, o.device) for o in user]
        if not all(region.differentiable):
            ctx.mark_non_differentiable(*[o for o, d in zip(user, region.differentiable) if not d])
        return tuple(user)

    @staticmethod
    def backward(ctx, *grad_outputs):
        region: CompiledRegion = ctx.region
        grads = [grad_outputs[i] for i in region.grad_output_for]
        given = {k for k, g in enumerate(grads) if g is not None}
        if given and len(given) < len(grads):  # (then several outputs take gradients: ctx.shapes is kept)
            for k, i in enumerate(region.grad_output_for):
                if grads[k] is None:
                    shape, dtype, device = ctx.shapes[i]
                    grads[k] = torch.zeros(shape, dtype=dtype, device=device)
        # (before unpacking our saved tensors: eager's message names its op, not _RegionFunction)
        for t, version, name, output_nr, sources, shape in ctx.eager_saved:
            if sources & given and t._version != version:
                if ctx.hooked:
                    raise RuntimeError(_hooked_and_written(t, name))
                raise RuntimeError(_version_error(t, version, f"output {output_nr} of {name}", shape))
        if ctx.saved_versions:
            try:
                saved = list(ctx.saved_tensors)  # version-checked by PyTorch
            except RuntimeError as e:
                saved = _saved_for_partial_backward(ctx, region, given, _named_as_eager(ctx, e))
            # NOTE (memory): without retain_graph, autograd drops its references to the saved tensors
            # now rather than after this returns (as AOTAutograd's backward does): the backward
            # program, handed ours (``consume``), frees each after its last use.
            ctx.maybe_clear_saved_tensors()
        else:
            # NOTE: a backward that reads no value (sums, views, additions) frees nothing, and a
            # second backward through it without retain_graph runs, as eager's does: reading
            # ``ctx.saved_tensors`` after a backward would raise (fuzz seed 426)
            saved = []
        if not given:  # no output of this region is in the loss's graph
            return (None,) * len(ctx.needs_input_grad)
        partial = _partial_backward(region, given) if len(given) < len(grads) else None
        if torch.is_grad_enabled() and region.on_demand.double_backward is not None:
            if partial is not None and partial[2] is not None:
                results = _differentiable_backward(ctx, region, [grads[k] for k in sorted(given)], partial[2], saved)
            else:
                results = _differentiable_backward(ctx, region, grads, region.on_demand.double_backward, saved)
        elif partial is not None:
            program, take, _ = partial
            args = [saved[i] for i in take] + [grads[k] for k in sorted(given)]
            del saved
            results = program.run(args, region.stats, consume=True)
        elif torch.is_anomaly_enabled() and region.on_demand.explain_nan is not None:
            results = region.backward.run(saved + grads, region.stats)
            if _has_nan(results) and not _has_nan(grads):
                raise RuntimeError(region.on_demand.explain_nan(saved + grads))
        else:
            args = saved + grads
            del saved
            chain = getattr(ctx, "chain", None)
            if chain is not None:  # (segmented: this Node's gradients now, the later Nodes' as they run)
                return (None, None, *chain.first(region.backward, args, region.stats))
            results = region.backward.run(args, region.stats, consume=True)
        if region.grad_sources:  # an input reached only through outputs outside the loss's graph: None
            results = [r if sources & given else None for r, sources in zip(results, region.grad_sources)]
        return (None, None, *results)


class _FirstSegment(_RegionFunction):
    """The region's Node where its backward is handed out in segments (``runtime.segments``): the
    region's forward and backward, returning its own segment's gradients; the carrier it takes
    from the later segments' Nodes gets a gradient, so that they run next. It takes every input as
    it is: for a later segment's parameter it returns None and that segment's Node the gradient (the
    parameter's AccumulateGrad runs once both Nodes have: when the later one has). NOTE (speed): no
    ``detach()`` per later parameter per call (8 a step in the DDP benchmark)."""
    keeps_double_backward_inputs = False   # (its backward refuses create_graph: nothing would read them)

    @staticmethod
    def forward(ctx, region, originals, chain, carrier, *inputs):
        # (the carrier's gradient: a zero, its own, detached (no reference to its Node); nothing writes it)
        ctx.chain, ctx.carrier_grad = chain, None if carrier is None else carrier.detach()
        return _RegionFunction.forward(ctx, region, originals, *inputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        chain = ctx.chain
        chain.restart()   # (a backward again, under retain_graph: from the start)
        if chain.shared is not None:   # (its later Nodes, shared by the region's calls, continue this run)
            chain.shared.register(chain)
        if torch.is_grad_enabled():
            # (the later segments' gradients come from this run's program, not from a graph a second
            # order could go through; DDP itself supports no double backward)
            raise RuntimeError(
                "symgrad: create_graph=True through a compiled region whose backward is handed out in segments "
                "for DDP's buckets is not supported (DistributedDataParallel does not support double backward "
                "either). Set SYMGRAD_DDP_SEGMENTS=0 to compile such regions as one autograd Node.")
        results = _RegionFunction.backward(ctx, *grad_outputs)
        if len(results) == len(ctx.needs_input_grad):  # (no output of the region in the loss's graph)
            return results
        grads = results[2:]
        if chain.run is None:   # (not the plain backward: every gradient computed here; the later Nodes hand theirs)
            chain.stash(grads)
            grads = chain.own(grads)
        return (None, None, None, ctx.carrier_grad, *grads)


def _groupable(user: list, inputs) -> bool:
    """Whether a region's outputs can come from a Node per group (``_apply_by_group``): none is a
    view of an input or of another output, which later Nodes' aliases would not keep. (A view of a
    buffer the region does not return is handed over as a tensor of its own anyway.)"""
    seen = {id(t) for t in (*inputs, *user) if isinstance(t, torch.Tensor)}
    return not any(isinstance(o, torch.Tensor) and o._base is not None and id(o._base) in seen for o in user)


def _views_of_internal_buffers(user: list, inputs, outs) -> tuple:
    """Positions of user outputs that are views of a buffer the region does not return (a linear
    layer's 3-d output: a view of its 2-d matmul's). NOTE: autograd refuses in-place ops on a
    custom Function's view outputs ("Output 0 of _RegionFunction is a view and is being modified
    inplace", fuzz seed 4104), where eager's view of its own op's result allows them (through
    CopySlices). Nothing else sees the buffer, so the output is handed over as a tensor of its own
    on the same memory (``detach()`` makes no view), whose in-place ops autograd records as usual."""
    others = {id(t) for t in (*inputs, *outs) if isinstance(t, torch.Tensor)}
    return tuple(i for i, o in enumerate(user)
                 if isinstance(o, torch.Tensor) and o._base is not None and id(o._base) not in others)


def _apply(region: CompiledRegion, originals: dict, inputs):
    """``_RegionFunction.apply(region, originals, *inputs)``, without ``Function.apply``'s Python."""
    return function_apply.apply(_RegionFunction, region, originals, *inputs)


def _partial_backward(region: CompiledRegion, given: set):
    """The backward without the outputs outside the loss's graph (``given``: positions in
    grad_output_for of those inside): (Program, saved positions it reads, double-backward
    builder), or None (then zeros stand for their gradients)."""
    partial = region.on_demand.partial_backward
    if partial is None:
        return None
    return partial(frozenset(region.grad_output_for[k] for k in given))


def _named_as_eager(ctx, error: RuntimeError) -> RuntimeError:
    """``error`` with eager's wording where a saved *output* of the region was changed in place:
    PyTorch names a custom Function's saved output after the Function (_RegionFunction), eager
    after the tensor's grad_fn now (a custom Function's ``mark_dirty``: "output 0 of Inplace").
    A value eager's op saved as its input and the function wrote later names the writer's node
    as the recording saw it (``eager_names``): our write-back is a copy (CopyBackwards).
    A saved view of an input (a 3-d activation as a linear layer's matmul reads it) was made under
    the forward's no_grad: once its base is written in place PyTorch refuses to unpack it ("A view
    was created in no_grad mode"), where eager's view fails its version check (API fuzz seed 9410)."""
    if "A view was created in no_grad mode" in str(error):
        return _saved_view_written(ctx, error)
    if "modified by an inplace operation" not in str(error):
        return error
    for k, name in ctx.region.eager_names.items():
        t = ctx._raw_saved_tensors[k].data
        if t is not None and t._version != ctx.saved_versions[k]:
            return RuntimeError(_version_error(t, ctx.saved_versions[k], name))
    if "of _RegionFunction" not in str(error):
        return error
    for k, ref in ctx.saved_outputs.items():
        t = ref()
        if t is not None and t.grad_fn is not None and t._version != ctx.saved_versions[k]:
            return RuntimeError(_version_error(t, ctx.saved_versions[k]))
    return error


def _saved_view_written(ctx, error: RuntimeError) -> RuntimeError:
    """Eager's version error for the saved view whose base was written in place (``_named_as_eager``):
    eager's view, unpacked after that write, has a regenerated AsStridedBackward0 node."""
    for k, packed in enumerate(ctx._raw_saved_tensors):
        t = packed.data
        if t is not None and t._base is not None and t._version != ctx.saved_versions[k]:
            producer = "output 0 of AsStrided" if t._base.requires_grad else ""
            return RuntimeError(_version_error(t, ctx.saved_versions[k], producer))
    return error


def _saved_for_partial_backward(ctx, region: CompiledRegion, given: set, error: RuntimeError) -> list:
    """The saved values when unpacking them all failed (``error``): eager runs the backward of
    the ops on the loss's graph only, so a saved value changed in place later that only the
    other outputs' backward reads is no error there (fuzz seed 7665). Those the partial backward
    reads are version-checked here; None stands for the rest. Raises ``error`` when a value it
    reads was changed, or there is no partial backward."""
    partial = _partial_backward(region, given) if given and len(given) < len(region.grad_output_for) else None
    if partial is None or "modified by an inplace operation" not in str(error):
        raise error
    take = set(partial[1])
    values = []
    for i, (packed, version) in enumerate(zip(ctx._raw_saved_tensors, ctx.saved_versions)):
        t = packed.data if i in take else None  # (the data, unchecked: checked below)
        if t is not None and t._version != version:
            raise error
        values.append(t)
    return values


def _has_nan(tensors) -> bool:
    return any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
               and bool(torch.isnan(t).any()) for t in tensors)


def _keep_for_double_backward(region: CompiledRegion, inputs, originals, saved_inputs=True) -> dict:
    """For create_graph=True the backward is recomputed from the region's inputs: position ->
    the input, for those the double backward reads and the first-order backward has not saved
    (``saved_inputs`` False: this Node saved none, ``_group_reads_saved``: all it reads).

    NOTE (memory): each is packed as autograd packs ``save_for_backward``'s tensors where
    saved-tensor hooks are set (a ``SavedTensor``: the hooks see it, ``save_on_cpu()`` moves
    it; without hooks that is the tensor and its version, ``_Kept``), but unpacked only
    on the create_graph path, with PyTorch's own version check there: a first-order backward
    never reads it, so, as in eager, a later in-place change to it is no error then. Inputs
    neither backward reads are not kept: they are freed when the caller drops them.
    """
    key = "kept_positions" if saved_inputs else "every_read_position"
    positions = region.first_call_facts.get(key)
    if positions is None:  # (fixed per region: worked out at its first call)
        reads = region.double_backward_reads or (True,) * len(inputs)
        saved = {i for kind, i in region.saved if kind == "input"} if saved_inputs else set()
        positions = [i for i in range(len(inputs)) if reads[i] and i not in saved]
        region.first_call_facts[key] = positions
    kept = {}
    hooks = _saved_tensors_hooks(False) is not None
    for i in positions:
        t = inputs[i]
        if isinstance(t, torch.Tensor) and i in region.mutated_inputs:
            # NOTE: the region's own in-place writes land in this input after the forward; the
            # double backward recomputes from the value the forward read: a copy made before
            # the write (on its autograd history where it requires grad, ``_originals``).
            if t.requires_grad and i not in originals:
                continue
            t = originals[i] if t.requires_grad else t.detach().clone()
        elif isinstance(t, torch.Tensor) and i in region.written_later and not t.requires_grad:
            # NOTE: the function writes this input in place after the region (fuzz seed 3643). Eager's
            # double backward reads no value of a tensor that needs no gradient but through its own
            # saved values; ours recomputes from it: a copy of the value the forward read
            t = t.detach().clone()
        if not isinstance(t, torch.Tensor):
            kept[i] = _Constant(t)
        elif hooks:
            kept[i] = _make_saved_tensor(_savable(t), is_output=False)
        else:
            kept[i] = _Kept(t)
    return kept


_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def _savable(t):
    """``t`` as the region keeps it for backward. NOTE: an inference tensor (made under
    ``torch.inference_mode()``) can be neither saved nor version-checked; eager's ops never save
    one where the region may (to recompute a difference it read: fuzz seeds 2581, 4866). Its
    value cannot change outside inference mode, so a copy, made outside it, reads the same.
    (Called where reading a version failed: no cost to other tensors.)"""
    if isinstance(t, torch.Tensor) and t.is_inference():
        with torch.inference_mode(False):
            return t.clone()
    return t


class _Kept:
    """An input kept for the double backward while no saved-tensor hooks are set (the usual case):
    the tensor and its version, unpacked with the check ``SavedVariable.unpack`` makes and its
    message. A plain pair costs a fraction of a ``SavedTensor``, made per input per region call;
    with hooks set (``save_on_cpu()``, a checkpoint) the input is packed as autograd packs."""
    __slots__ = ("tensor", "version")

    def __init__(self, tensor):
        try:
            self.version = tensor._version
        except RuntimeError:  # an inference tensor (``_savable``)
            tensor = _savable(tensor)
            self.version = tensor._version
        self.tensor = tensor

    def unpack(self):
        if self.tensor._version != self.version:
            raise RuntimeError(_version_error(self.tensor, self.version))
        return self.tensor


class _Constant:
    """A non-tensor input kept for the double backward, unpacked like a saved tensor."""

    def __init__(self, value):
        self.value = value

    def unpack(self):
        return self.value


def _differentiable_backward(ctx, region: CompiledRegion, grads, build, saved):
    """create_graph=True: run the backward as a compiled region with its own backward (``build``:
    requires_grad pattern -> that region; of the full backward, or of one without the outputs
    outside the loss's graph). Its inputs are the forward's: from the saved tensors, or kept
    for it (``_keep_for_double_backward``); one that neither reads is None."""
    inputs = [None] * (len(ctx.needs_input_grad) - 2)
    for (kind, i), t in zip(region.saved, saved):
        if kind == "input":
            inputs[i] = t
    for i, packed in ctx.double_backward_inputs.items():
        inputs[i] = packed.unpack()  # version-checked by PyTorch
    pattern = tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs + grads)
    backward_region = build(pattern)
    backward_region.count_launches_in(region.stats)
    results = backward_region(inputs + grads)
    return [r if needs else None for r, needs in zip(results, ctx.needs_input_grad[2:])]


_GENERATED_SUFFIX = re.compile(r"Backward(?:0|([0-9]+))?$")


def _version_error(t: torch.Tensor, version: int, producer: str | None = None, shape=None) -> str:
    """PyTorch's own message for a saved tensor changed in place (torch/csrc/autograd/saved_variable.cpp).
    ``producer``: "output N of Op" as eager names the node that saved it (default: t's grad_fn);
    ``shape``: the saved tensor's, where ``t`` is the base it views (default: t's)."""
    if producer is None and t.grad_fn is not None:
        producer = f"output {t.output_nr} of {t.grad_fn.name()}"
    # (eager prints a node's name without "Backward" and a generated one's without its overload
    # number 0: "of Pow1" for PowBackward1, "of Exp" for ExpBackward0, "of Inplace" for a custom
    # Function Inplace; "torch::autograd::CopyBackwards" as it is)
    producer = f", which is {_GENERATED_SUFFIX.sub(lambda m: m.group(1) or '', producer)}," if producer else ""
    return ("one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{_type_name(t)} {list(t.shape if shape is None else shape)}]{producer} is at version {t._version}; "
            f"expected version {version} "
            "instead. Hint: enable anomaly detection to find the operation that failed to compute its gradient, "
            "with torch.autograd.set_detect_anomaly(True, check_nan=False).")


def _hooked_and_written(t: torch.Tensor, name: str) -> str:
    """Where eager's op saved its result under saved-tensor hooks and the function wrote it in place
    before backward: eager's backward reads the written value (hooks skip the version check), the
    compiled backward recomputes the value from the region's inputs. Raised rather than a gradient
    other than eager's (fuzz seed 687)."""
    return (f"symgrad: the result of an op that {name} saves under saved-tensor hooks ({_type_name(t)} "
            f"{list(t.shape)}) was changed in place before backward. Eager's backward would read the changed "
            "value (with hooks PyTorch checks no version); the compiled backward reads the value the op "
            "computed, so it stops here rather than return another gradient. Write into a copy "
            "(y = y * 2 instead of y.mul_(2)), or run this function with backend='eager'.")


def _type_name(t: torch.Tensor) -> str:
    """The tensor type as eager's message prints it: legacy names ("torch.FloatTensor") where the
    dtype has one, "CPUComplexFloatType" for newer dtypes (complex, bfloat16)."""
    if t.dtype in (torch.complex64, torch.complex128, torch.complex32, torch.bfloat16):
        scalar = t.type().rsplit(".", 1)[-1].removesuffix("Tensor")
        return f"{t.device.type.upper()}{scalar}Type"
    return t.type()
