"""A region's backward handed out in segments, one autograd Node each (issue 38).

A compiled region is one autograd Node, so every gradient it computes is accumulated only after
its whole backward: DDP's reducer then hands every bucket to its all-reduce at the end, where
eager's overlap the rest of the backward. Under DDP (a ``DistributedDataParallel`` module ran in
the recording) the region's parameters are grouped, in the order the backward program finishes
their gradients (``Program.ready_after``), into segments of about one DDP bucket's bytes
(``bucket_bytes_cap``). Each segment but the first is a Node of its own (``_LaterSegment``), chained
behind the region's Node through a 0-dim *carrier* tensor: in the forward the last segment's Node is
made first and the region's Node last, so the engine runs the region's Node first, then each
segment's in order. The region's Node runs the backward program up to the step where its own
parameters' gradients are final and returns them (AccumulateGrad runs next: the reducer sees them);
each later Node runs the program on to its segment's end (``ProgramRun``), from the slots the
earlier ones left. No kernel is split or run twice: segments end between steps. Where the later
segments take only parameters (and inputs needing no gradient), their Nodes are made once per region
and shared by its calls' graphs (``SharedLaterNodes``): each call's run is found by the backward's
graph task; else they are made per call, before the region's Node (``later_segments``).

Where the backward is not the plain one (some outputs without a gradient, create_graph, anomaly
mode), the region's Node computes every gradient as before and the later Nodes hand theirs out
(``SegmentChain.stash``): the same values, without the overlap.
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass

import torch

from runtime import function_apply


def ddp_bucket_bytes(module_modes) -> int:
    """The bucket size of the DistributedDataParallel modules a recording ran (``Recording.module_modes``:
    (weak reference, training) pairs), the smallest; 0 where none ran or ``SYMGRAD_DDP_SEGMENTS=0``."""
    if os.environ.get("SYMGRAD_DDP_SEGMENTS", "1") == "0":
        return 0
    from torch.nn.parallel import DistributedDataParallel

    caps = [getattr(module, "bucket_bytes_cap", 0) for module in (ref() for ref, _ in module_modes)
            if isinstance(module, DistributedDataParallel)]
    return min((int(cap) for cap in caps if cap), default=0)


@dataclass(frozen=True)
class Segment:
    inputs: tuple   # region input positions whose gradients this segment returns
    last_step: int  # the backward program's step after which they are all final


@dataclass(frozen=True)
class SegmentPlan:
    first: Segment   # the region's own Node's
    later: tuple     # Segments, in the order the backward reaches them

    @functools.cached_property
    def later_inputs(self) -> frozenset:
        """The input positions whose gradients the later segments' Nodes return (worked out once)."""
        return frozenset(k for segment in self.later for k in segment.inputs)


def plan_segments(program, inputs, segment_bytes: int) -> SegmentPlan | None:
    """Group the parameters (leaf tensors that require grad) among ``inputs`` by when ``program``
    (the region's backward: one output per input) finishes their gradients, about ``segment_bytes``
    of gradients a segment; every other input goes with the last. None where that makes one segment."""
    ready = program.ready_after()
    if len(ready) != len(inputs):
        return None
    last = len(program.steps) - 1
    params = sorted((ready[k], k) for k, t in enumerate(inputs)
                    if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is None and ready[k] is not None)
    groups, current, size = [], [], 0
    for step, k in params:
        if current and size >= segment_bytes and step > current[-1][0]:
            groups.append(current)
            current, size = [], 0
        current.append((step, k))
        size += inputs[k].numel() * inputs[k].element_size()
    if current:
        groups.append(current)
    if len(groups) < 2:
        return None
    taken = {k for group in groups for _, k in group}
    rest = tuple(k for k in range(len(inputs)) if k not in taken)
    segments = [Segment(tuple(k for _, k in group), max(step for step, _ in group)) for group in groups]
    segments[-1] = Segment(segments[-1].inputs + rest, last)
    return SegmentPlan(segments[0], tuple(segments[1:]))


class SegmentChain:
    """One backward pass through a segmented region: the program's run the Nodes share, or the
    gradients the region's Node computed whole (``stash``). ``shared``: the region's later Nodes,
    made once (``SharedLaterNodes``), where this call's graph goes through them."""

    def __init__(self, plan: SegmentPlan, shared: SharedLaterNodes | None = None):
        self.plan = plan
        self.shared = shared
        self.run = None
        self.stashed = None

    def restart(self) -> None:
        """A backward pass begins (again, under retain_graph): nothing run, nothing stashed."""
        self.run = self.stashed = None

    def first(self, program, args: list, stats) -> list:
        """The region's Node: run the backward up to its segment's end; its gradients (None elsewhere)."""
        self.stashed = None
        self.run = program.start(args, stats)
        results = [None] * len(program.outputs)
        for k, grad in zip(self.plan.first.inputs, self.run.until(self.plan.first.last_step, self.plan.first.inputs)):
            results[k] = grad
        return results

    def stash(self, results: list) -> None:
        """The region's Node computed every gradient (not the plain backward): the later Nodes return theirs."""
        self.run, self.stashed = None, list(results)

    def own(self, results: list) -> list:
        """``results`` with the later segments' gradients taken out (their Nodes return them)."""
        later = self.plan.later_inputs
        return [None if k in later else r for k, r in enumerate(results)]

    def segment(self, j: int) -> list:
        """Later segment ``j``'s gradients: the program run on to its end, or the stashed ones."""
        segment = self.plan.later[j]
        if self.stashed is not None:
            return [self.stashed[k] for k in segment.inputs]
        if self.run is None:   # (the region's Node had nothing to compute: no gradient reached it)
            return [None] * len(segment.inputs)
        grads = self.run.until(segment.last_step, segment.inputs)
        if j == len(self.plan.later) - 1:
            self.run = None   # (the program's slots are freed with it)
        return grads


class SharedLaterNodes:
    """A region's later segments' Nodes made once, on its parameters, and shared by every call's
    graph: each call's region Node takes the same carrier. NOTE (speed): made per call they were two
    ``Function.apply`` a step, 0.3 ms of a 2.6 ms forward of the DDP benchmark's step on this CPU (the
    step begins with the autograd's C++ and our objects out of the caches); shared, none.

    They hold no state of a call: the region's Node of each call registers its run (``SegmentChain``)
    under the backward's graph task when it runs (``register``); each later Node continues the runs
    registered under its own graph task, and the last forgets them. A backward through several calls'
    graphs (losses summed before one backward) runs every one: their gradients are summed, as the
    engine sums what several Nodes give one AccumulateGrad. Runs are held weakly (a backward that
    raised leaves nothing alive); the calls' region Nodes hold them.

    NOTE (memory): the Nodes' edges hold the parameters (their AccumulateGrad Nodes) while the region
    lives, where per-call Nodes held them while a call's graph did; under DDP the module holds them too.
    NOTE (order): the engine runs the ready Node made last first; shared Nodes were made at the first
    call. Only a region whose gradient-taking inputs are all leaves shares them (an activation from
    upstream goes with the last segment, ``plan_segments``: Nodes per call), and its backward runs last
    on its path; a branch of the graph beside it (a second tower) may now run before its later segments."""

    def __init__(self, plan: SegmentPlan, inputs: list):
        self.plan = plan
        # (position, weak reference to the parameter there, or None where the input needs no gradient)
        self.expected = tuple((k, weakref.ref(inputs[k]) if _requires_grad(inputs[k]) else None)
                              for k in sorted(plan.later_inputs))
        self.pending: dict = {}   # graph task id -> weak references to the runs registered under it
        carrier, me = None, weakref.ref(self)
        for j in reversed(range(len(plan.later))):
            carrier = function_apply.apply(_LaterSegment, me, j, carrier, *[inputs[k] for k in plan.later[j].inputs])
        self.carrier = carrier

    @staticmethod
    def shareable(plan: SegmentPlan, inputs: list) -> bool:
        """Whether the later segments' inputs can be taken once: each a leaf that requires grad (a
        parameter: the same tensor at every call, the replay's guards say) or one that needs none."""
        return all(not _requires_grad(inputs[k]) or inputs[k].grad_fn is None for k in plan.later_inputs)

    def fits(self, inputs: list) -> bool:
        """Whether ``inputs`` are the tensors these Nodes were made on (those needing no gradient: still none)."""
        for k, ref in self.expected:
            if _requires_grad(inputs[k]) if ref is None else ref() is not inputs[k]:
                return False
        return True

    def register(self, chain: SegmentChain) -> None:
        """A call's region Node runs in the current backward: its later Nodes continue ``chain``."""
        task = _current_graph_task()
        runs = self.pending.get(task)
        if runs is None:
            if len(self.pending) >= 8:   # (backwards that raised before the last Node: their runs are gone)
                for old in [t for t, refs in self.pending.items() if all(r() is None for r in refs)]:
                    del self.pending[old]
            runs = self.pending[task] = []
        runs.append(weakref.ref(chain))

    def gradients(self, j: int) -> list:
        """Later segment ``j``'s gradients in the current backward: each registered run's, summed."""
        task = _current_graph_task()
        runs = self.pending.pop(task, ()) if j == len(self.plan.later) - 1 else self.pending.get(task, ())
        chains = [chain for chain in (ref() for ref in runs) if chain is not None]
        if not chains:
            raise RuntimeError("symgrad internal error: a region's later segment ran in a backward where none of "
                               "its calls' region Nodes ran; set SYMGRAD_DDP_SEGMENTS=0 to compile such regions "
                               "as one autograd Node, and please report it")
        grads = chains[0].segment(j)
        for chain in chains[1:]:
            grads = [a if b is None else b if a is None else a + b for a, b in zip(grads, chain.segment(j))]
        return grads


_current_graph_task = torch._C._current_graph_task_id


def _requires_grad(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


class _LaterSegment(torch.autograd.Function):
    """A later segment's Node: its inputs are the segment's parameters (and the next segment's
    carrier); its output, a 0-dim carrier, is an input of the Node before it. Its gradients come
    from one call's run (``source``: a ``SegmentChain``, Nodes made per call) or from the runs
    registered under the backward (a weak reference to ``SharedLaterNodes``)."""

    @staticmethod
    def forward(ctx, source, j: int, carrier, *tensors):
        ctx.source, ctx.j, ctx.has_carrier = source, j, carrier is not None
        # (tensors[0]: a parameter, as every segment begins with its own)
        return torch.zeros((), device=tensors[0].device)

    @staticmethod
    def backward(ctx, carried):
        source = ctx.source
        if type(source) is SegmentChain:
            grads = source.segment(ctx.j)
        else:   # (its region's calls hold it while their graphs live: alive in their backward)
            grads = source().gradients(ctx.j)
        # (the carriers' gradients are zeros that nothing reads or writes: this one is handed on)
        return (None, None, carried if ctx.has_carrier else None, *grads)


def later_segments(chain: SegmentChain, inputs: list):
    """Make the later segments' Nodes of one call (the last first) on ``inputs``; the carrier the
    region's Node takes. (Where ``SharedLaterNodes`` cannot stand for them.)"""
    carrier = None
    for j in reversed(range(len(chain.plan.later))):
        segment = chain.plan.later[j]
        carrier = function_apply.apply(_LaterSegment, chain, j, carrier, *[inputs[k] for k in segment.inputs])
    return carrier
