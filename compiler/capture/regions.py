"""Capture's regions under construction and its in-place bookkeeping.

A ``Region`` collects the graph of one run of compilable calls. In-place ops are captured
functionally (the mutated value id maps to a new node); what that needs besides is here: a
view changed in place writes its base (``_update_base``, through each view op's
``scatter_back``), other views of the same memory go stale, and a write to a value autograd
may have saved starts a new region (so eager's version-counter error still fires).
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from compiler.ir.graph import GraphBuilder, OpKind, kind_of, meta_of, output_node, update_meta
from compiler.ir.ops import catalog as C
from runtime.program import ViewStep
from runtime.trace import NumberId, ValueId


@dataclass
class Region:
    """One region being recorded: its graph, the value ids it maps to nodes, its inputs and what
    it changed in place."""

    index: int
    grad_enabled: bool
    device: torch.device
    builder: GraphBuilder = field(default_factory=GraphBuilder)
    nodes: dict = field(default_factory=dict)       # value id -> graph node
    inputs: list = field(default_factory=list)      # value ids that became placeholders
    produced: list = field(default_factory=list)    # value ids made here, in order
    calls: list = field(default_factory=list)
    seeds: list = field(default_factory=list)       # input value ids that take a fresh RNG seed per call
    read_for_grad: set = field(default_factory=set)  # value ids read by calls that autograd records
    writes: dict = field(default_factory=dict)      # value id -> in-place ops that changed it here
    view_mutation: bool = False                     # an in-place op changed a view
    eager_reason: str | None = None                 # set when the region must run eagerly
    stale: set = field(default_factory=set)         # views whose memory an in-place op changed since
    eager_saved: dict = field(default_factory=dict)  # value id -> (eager grad_fn type, output_nr): saved result
    saved_by_consumers: set = field(default_factory=set)  # value ids an eager op of the region saved as an input
    # of those, written in place later: value id -> "output N of <its grad_fn then>", the producer
    # eager's version error names (the writer's node: our write-back's is a copy, not eager's)
    written_names: dict = field(default_factory=dict)
    consumer_outputs: dict = field(default_factory=dict)  # saved_by_consumers id -> those ops' output ids
    result_names: dict = field(default_factory=dict)  # eager_saved's names before a writer's replaced them
    # value ids read under autograd by calls other than view ops (whose backward reads no value):
    # what eager may have saved for backward
    saved_for_grad: set = field(default_factory=set)
    # a view written in place here -> (its base's value id, ViewSteps from base to view): the
    # runtime remakes it from the real base after the region, so it stays a view (issue 11)
    view_of: dict = field(default_factory=dict)
    saved_tensor_hooks: object = None  # the pack hook its calls ran under (``Capture._saved_tensor_hooks_in_effect``)
    # capture's ``(region) -> a region input holding a fresh RNG seed per call`` (dropout's)
    seed_input: object = None

    def __post_init__(self):
        if self.seed_input is not None:
            seed_input = self.seed_input
            self.builder = GraphBuilder(new_seed=lambda: seed_input(self))

    def run_eagerly(self, reason: str, keep_first: bool = True) -> None:
        """The region must run eagerly, because of ``reason`` (the first one given is kept,
        unless ``keep_first`` is False: a more precise reason replaces it)."""
        if self.eager_reason is None or not keep_first:
            self.eager_reason = reason

    def note_view_mutation(self) -> None:
        """An in-place op changed a view inside the region."""
        self.view_mutation = True

    def renumber(self, index: int) -> None:
        """The region's place among the regions, once capture cut some apart."""
        self.index = index

    def take_recorded_facts(self, old: Region) -> None:
        """What the recording learned about this region's calls, from ``old``, the region it was cut
        out of (``Capture._rebuild``): what eager's ops saved for backward (their results, their
        inputs), what eager's version error names, stale views and views made from their base; and
        why ``old`` must run eagerly, if it must.
        NOTE: a segment rebuilt without them saved an input written in place later as a copy, and its
        backward ran where eager's raises (API fuzz seed 40254); one cut out of a region that reads a
        stale view would have compiled it."""
        if old.eager_reason is not None:
            self.run_eagerly(old.eager_reason)
        produced = set(self.produced)
        known = produced | set(self.inputs)
        self.eager_saved.update((v, found) for v, found in old.eager_saved.items() if v in produced)
        for v, outputs in old.consumer_outputs.items():
            mine = outputs & produced  # (saved by an op of this segment: its outputs are made here)
            if v in known and mine:
                self.saved_by_consumers.add(v)
                self.consumer_outputs[v] = mine
        self.written_names.update((v, name) for v, name in old.written_names.items() if v in self.saved_by_consumers)
        self.result_names.update((v, name) for v, name in old.result_names.items() if v in produced)
        self.read_for_grad |= old.read_for_grad & known
        self.saved_for_grad |= old.saved_for_grad & known
        self.stale |= old.stale & known
        # (views of the segment's own values, as capture noted them: made from the real base)
        self.view_of.update((v, view) for v, view in old.view_of.items() if v in produced and view[0] in produced)


class ViewMutation(Exception):
    """A view changed in place in a way the functional capture cannot follow."""


class InPlaceTracking:
    """The in-place half of ``compiler.capture.recorder.Capture`` (a mixin): relies on its ``current``
    region, ``regions``, ``ids`` (id(tensor) -> (weakref, value id)) and ``produced_by``."""

    def _split_before_overwriting_a_saved_value(self, out_tensors) -> None:
        """An in-place op on a value that an earlier op of this region read under autograd
        (which may have saved it for backward) starts a new region. The write-back into the
        real tensor then bumps its version after the earlier region saved it, so a backward
        that needs the old value raises eager's "modified by an inplace operation" error
        instead of silently using a copy."""
        region = self.current
        if region is None or not region.read_for_grad:
            return
        for t in out_tensors:
            entry = self.ids.get(id(t))
            if entry is None or entry[0]() is not t:
                continue  # a new tensor: no in-place op
            # NOTE: a view of a saved value changed in place (y = x.exp(); y[1:].mul_(2)) does not
            # split: the view, made in this region, would become an output that is a view of
            # another, which PyTorch refuses to change in place (fuzz KNOWN: not refused)
            if entry[1] in region.read_for_grad:
                self.current = None
                return

    def _refuse_write_into_view_of_saved(self, region, t) -> str | None:
        """Why an in-place op on ``t`` must run eagerly, or None: ``t`` shares memory (so a version
        counter) with another value, a view or the base, that an earlier op of this region read
        under autograd, which eager may have saved for backward (y = x.exp(); y[1:].mul_(2); or
        r = y.reshape(-1); z = w * r; y.mul_(2)). (A base itself saved and then written is eager's
        error raised by the region's backward: ``outputs_written_later``.) Eager's backward then raises
        "modified by an inplace operation"; the fused region would compute from the old value, and
        a split cannot help (the view would be an output that views another output of the region,
        which PyTorch refuses to change in place). Whether ``t`` requires grad does not matter: a
        multiplication saves a factor that needs no gradient for the other's (v = sin(x); r =
        v.reshape(()); y = w * r; v[0:] = 0.5, x needing none: eager's backward raises)."""
        if not region.saved_for_grad:
            return None
        if any(vid in region.saved_for_grad and not (is_t and t._base is None) for vid, is_t in self._sharers(t)):
            return ("an in-place op on a value sharing memory with one that an earlier op of this region may have "
                    "saved for backward (eager's version check would refuse that backward); the region runs eagerly")
        return None

    def _sharers(self, t) -> list:
        """(value id, whether it is ``t``) of each live tensor sharing ``t``'s memory: its base, its
        views, ``t`` itself."""
        root = t._base if t._base is not None else t
        found = []
        for ref, vid in list(self.ids.values()):
            u = ref()
            if u is not None and (u._base if u._base is not None else u) is root:
                found.append((vid, u is t))
        return found

    def _refuse_earlier_saved_views(self, region, t, op: str) -> None:
        """An in-place op on ``t`` changes the version of every tensor sharing its memory: where an
        earlier region's eager op saved another of them as its input (a view read by a
        multiplication, its base written by a later region), that region runs eagerly, so that
        eager's backward raises its version error; the fused one would compute from the old value.
        (``t`` itself saved and written later: ``outputs_written_later`` raises eager's error.)"""
        earlier = [r for r in self.regions if r is not region and r.saved_by_consumers and r.eager_reason is None]
        others = {vid for vid, is_t in self._sharers(t) if not is_t} if earlier else set()
        for r in earlier:
            if others & r.saved_by_consumers:
                r.run_eagerly(f"{op} later changed in place a value sharing memory with one that an op of this "
                              "region may have saved for backward (eager's version check would refuse that "
                              "backward); the region runs eagerly")

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
            elif (u._base if u._base is not None else u) is root:
                # (a view made by an earlier region, one that ended before this write: that
                # region must not output it, and this one must not read it)
                owner = next((r for r in self.regions if other in r.nodes), None)
                if owner is not None:
                    owner.stale.add(other)
                    region.stale.add(other)

    def _note_view(self, region, vid, node, t) -> None:
        """A new view ``t`` of a value of this region, made by view nodes from its base's node:
        ``region.view_of`` (if the base becomes an output too, the runtime makes this view from
        the real base; returned by the region it would be a view PyTorch refuses to write in
        place: "a function that returns multiple views")."""
        entry = self.ids.get(id(t._base))
        base_vid = entry[1] if entry is not None and entry[0]() is t._base else None
        base_node = region.nodes.get(base_vid) if base_vid is not None else None
        if base_node is None or base_node.op == "placeholder":
            return  # (views of inputs: the build takes them out of the graph already)
        chain = []
        while node is not base_node and kind_of(node) == OpKind.VIEW:
            chain.append(node)
            node = node.args[0]
        if node is base_node and chain:
            region.view_of[vid] = (base_vid, _view_steps(chain))

    def _update_base(self, region, vid, old_node, new_node, base, index):
        """An in-place op changed a view: its base changes too (eager views share memory).

        The base's new value is the view's new value mapped back through the view ops that
        made the view, last first (``View.scatter_back``: reshape and permute are inverted, a
        slice is written into its source); the runtime writes it back.
        """
        entry = self.ids.get(id(base))
        base_vid = entry[1] if entry is not None and entry[0]() is base else None
        base_node = region.nodes.get(base_vid) if base_vid is not None else None
        chain, node = [], old_node
        while node is not base_node and kind_of(node) == OpKind.VIEW:
            chain.append(node)
            node = node.args[0]
        if base_node is None or node is not base_node or not all(n.target.writes_back for n in chain):
            raise ViewMutation(
                "an in-place op on a view whose base is outside this region, or made by a view op "
                "other than reshape, permute or slicing; "
                "the region runs eagerly")
        region.view_of[vid] = (base_vid, _view_steps(chain))
        value = new_node
        for view in chain:  # undo the views, last first
            value = view.target.scatter_back(region.builder, view, value)
        region.nodes[base_vid] = value
        region.produced.append(base_vid)
        self.produced_by[base_vid] = index


def _view_steps(chain) -> tuple:
    """The runtime's steps that remake a view from its base: ``chain``'s view nodes, base first."""
    return tuple(ViewStep(n.target, tuple(n.kwargs.items())) for n in reversed(chain))


def saves_result(t: torch.Tensor) -> bool:
    """Whether eager's autograd node that made ``t`` saved ``t`` itself for backward (exp, relu,
    softmax, polar: ``grad_fn._saved_result``), asked of the node's type, so nothing is unpacked."""
    return t.requires_grad and t.grad_fn is not None and hasattr(type(t.grad_fn), "_saved_result")


@functools.lru_cache(maxsize=None)
def _saved_attributes(node_type) -> tuple:
    """The ``_saved_<arg>`` attributes of an eager autograd node type, but its own result's."""
    return tuple(n for n in dir(node_type) if n.startswith("_saved_") and n != "_saved_result")


def saved_inputs(t: torch.Tensor, inputs: list) -> list:
    """Which of ``inputs`` (the call's tensors) eager's node that made ``t`` saved for backward
    (``minimum`` saves both operands; ``where`` its condition only): its ``_saved_<arg>`` is the
    input itself (a saved input unpacks to the very tensor). Asked only where no saved-tensor
    hooks are active: unpacking would run the user's unpack hook."""
    fn = t.grad_fn
    if fn is None or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return []
    found = []
    for name in _saved_attributes(type(fn)):
        try:
            value = getattr(fn, name)
        except RuntimeError:  # (not saved for this call: an operand that needs no gradient)
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        found.extend(x for x in inputs if any(x is v for v in values if isinstance(v, torch.Tensor)))
    return found


SAVED_BY_CONSUMERS = "saved_by_consumers"  # the output node's fx meta key: output positions an eager op saved
SAVED_INPUTS = "saved_inputs"  # the output node's fx meta key: input positions an eager op of the region saved


EAGER_SAVED = "eager_saved"  # the output node's fx meta key: {output position: (grad_fn name, output_nr)}
EAGER_NAMES = "eager_names"  # the output node's fx meta key: {("input"|"output", position): producer in eager's error}


def mark_eager_saved(graph, region: Region, outputs: list, inputs: list) -> None:
    """Record on the region graph's output node which outputs eager's op saved for its backward
    (``saves_result``): the compiled region checks their version counters at backward, as
    eager's saved variables do, even where its own backward does not read them."""
    output = output_node(graph)
    marked = {i: region.eager_saved[v] for i, v in enumerate(outputs) if v in region.eager_saved}
    if marked:
        output.meta[EAGER_SAVED] = marked
    consumed = {i for i, v in enumerate(outputs) if v in region.saved_by_consumers}
    if consumed:
        output.meta[SAVED_BY_CONSUMERS] = consumed
    saved = {i for i, v in enumerate(inputs) if v in region.saved_by_consumers}
    if saved:
        output.meta[SAVED_INPUTS] = saved
    names = {(kind, i): region.written_names[v] for kind, values in (("input", inputs), ("output", outputs))
             for i, v in enumerate(values) if v in region.written_names}
    if names:
        output.meta[EAGER_NAMES] = names


def keep_overwritten_history(b: GraphBuilder, nodes: list, out_tensors, mapped, leaves, start: int) -> None:
    """An in-place op whose new value no longer reads the old one (``x[:] = c``, ``x.fill_(c)``,
    ``x.copy_(y)``, ``x.zero_()``): eager's result still has the in-place op as its grad_fn,
    which passes a zero gradient back to the old value (not None, and the old value's history
    stays in the graph). The binding's value has no path to the old node, so it is tied to it
    by ``where(True, new, old)``: the same value, and a zero gradient for ``old``. Changes
    ``nodes`` in place; ``start`` is where the binding's nodes begin in ``b.created``."""
    made = set(b.created[start:])
    for i, (node, t) in enumerate(zip(nodes, out_tensors)):
        if not t.requires_grad:
            continue
        old = next((n for n, x in zip(mapped, leaves) if x is t and isinstance(n, fx.Node)), None)
        if old is None or old is node or not meta_of(old).requires_grad or _reads(node, old, made):
            continue
        m = meta_of(node)
        keep = C.emit_fill(b, m.shape, torch.bool, True)
        nodes[i] = C.emit_pointwise(b, "where", [keep, node, old], dtype=m.dtype, requires_grad=True)


def _reads(node, target, made: set) -> bool:
    """Whether ``node`` (made by this binding, or ``target``'s own) reads ``target``."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n is target:
            return True
        if n in seen or n not in made:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def apply_writes(region: Region, writes) -> None:
    """Inputs a binding changes in place without returning them (batch norm's running
    statistics): their new values become the region's, written back into the real tensors.
    Eager's operator writes them inside its kernel, where autograd's version counter does not
    see it (``native_batch_norm``'s running statistics keep their version): no bump is counted."""
    for target, value in writes:
        vid = next(v for v, n in region.nodes.items() if n is target)
        region.nodes[vid] = value
        region.produced.append(vid)
        region.writes[vid] = region.writes.get(vid, 0)


def map_to_nodes(region: Region, recorded, metas) -> list:
    """A call's recorded leaves with each value id replaced by the region's node for it;
    a value the region has not seen yet becomes a placeholder (a region input)."""
    mapped = []
    for leaf in recorded:
        if not isinstance(leaf, (ValueId, NumberId)):
            mapped.append(leaf)
            continue
        node = region.nodes.get(leaf)
        if node is None:
            m = metas[leaf]
            node = region.builder.placeholder(f"v{leaf}", m.shape, m.dtype, m.requires_grad and region.grad_enabled,
                                              device=m.device)
            if isinstance(leaf, NumberId):  # (a Python number taken at run time: promotes as one)
                update_meta(node, number=True)
            region.nodes[leaf] = node
            region.inputs.append(leaf)
        mapped.append(node)
    return mapped


def forget_input(region: Region, leaf, start: int) -> None:
    """Take input ``leaf`` back out of ``region`` with what a failed binding made from index ``start``
    of its builder's nodes on (capture's retry of a call with its numbers as constants)."""
    b = region.builder
    for node in reversed(b.created[start:]):
        if not node.users:
            b.graph.erase_node(node)
    del b.created[start:]
    node = region.nodes.pop(leaf)
    region.inputs.remove(leaf)
    b.graph.erase_node(node)
