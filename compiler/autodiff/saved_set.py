"""What the forward saves for backward: a minimum cut over the joint graph.

Every forward value that backward reads is either saved by the forward or recomputed inside
the backward's kernels from other values that are. The choice is a minimum s-t cut, as in
AOTAutograd's min-cut partitioner (torch/_functorch/partitioners.py, ``min_cut_rematerialization_
partition``; the idea, not its code): each forward value ``v`` is an edge ``v_in -> v_out``
whose capacity is the bytes saving it costs; each use ``u -> v`` is an edge ``u_out -> v_in``
of infinite capacity; values that cannot be recomputed in backward hang from the source, values
backward reads hang from the sink. A cut separates what the forward computes (source side)
from what backward recomputes (sink side); the cut edges are the values saved, and their bytes
are as few as any choice can keep. Each value is saved at its own dtype: a bfloat16 activation
at two bytes an element (its float32 upcast costs twice as much, so the cut keeps the narrow
one), a reduction's float32 statistic (mean, rstd, logsumexp) as float32.

Policies (``compile(..., memory=...)``):

- ``"balanced"`` (default): pointwise values, views, gathers, iotas and random numbers (from
  their saved seed) are recomputed where that saves bytes; reductions and externs (matmuls,
  convolutions) are always saved, since recomputing them costs a pass over their inputs or
  FLOPs. A value the forward writes for a matmul anyway is recomputed too (the backward kernel
  that reads its inputs writes it once more): fewer bytes held between forward and backward
  for one extra write.
- ``"min"``: the fewest bytes: reductions are recomputed too (only externs are always saved).
- ``"cpu"`` (not a user's choice: what ``"balanced"`` becomes for a region the CPU path runs,
  ``compiler.api``): pointwise values are saved too, as eager saves them. There every kernel is
  a sequence of PyTorch CPU ops that write each value to memory anyway, so recomputing a GELU
  in the backward costs its full time again (a small MLP's step: two extra GELUs), where on a
  GPU it hides in a memory-bound kernel; only views are recomputed.

Under every policy a value marked ``NodeMeta.never_recomputed`` by its binding is saved: the
bytes a cut counts do not see what recomputing it costs (a max pool's first maximal position:
nine reads of the pool's input and a scan, again at each of the nine views the backward reads).

Inside a ``torch.utils.checkpoint`` block (nodes tagged ``NodeMeta.checkpoint`` by capture) a
value that only the block's own ops read is never saved, whatever its kind (a matmul too): the
backward recomputes it, as eager's checkpoint does. The block's outputs that later ops read stay
saveable, as eager's later ops save them. (Only where nothing else is possible, an input changed in
place after the forward, is the block's value saved after all.)

Inputs and user outputs cost nothing to save: they are alive anyway. An input the region
overwrites in place costs its bytes (a copy of its old value is saved). No value is recomputed
from an input that is changed in place after the forward read it (by the region itself or later
in the recorded function): eager saved what it needed before the change, so the value that
reads it directly is saved instead.
"""

from __future__ import annotations

import math

import torch.fx as fx

from compiler.ir.graph import OpKind, kind_of, meta_of

POLICIES = ("balanced", "min")
_ALWAYS_SAVED = {"balanced": (OpKind.REDUCTION, OpKind.EXTERN), "min": (OpKind.EXTERN,),
                 "cpu": (OpKind.REDUCTION, OpKind.EXTERN, OpKind.POINTWISE, OpKind.GATHER, OpKind.IOTA, OpKind.RAND,
                         OpKind.SCATTER)}
_SOURCE, _SINK = "source", "sink"


def check_policy(memory: str) -> str:
    """``memory`` if it names a policy; else a ValueError that lists them."""
    if memory not in POLICIES:
        raise ValueError(f"compile(memory={memory!r}): choose one of {', '.join(repr(p) for p in POLICIES)}")
    return memory


def choose_saved(forward_nodes, needed, free, unreadable, policy="balanced", only_from=None) -> set | None:
    """The forward nodes to save, of ``forward_nodes`` (placeholders and call_function nodes).

    ``needed``: nodes backward reads; ``free``: nodes that cost nothing to save (inputs, user
    outputs); ``unreadable``: placeholders changed in place after the forward reads them (saving
    one costs its bytes: a copy; its direct users are not recomputed). ``only_from``: names
    of the only nodes that may be saved (a backward for some outputs, reading what the full
    backward's forward saved); None where that is not enough.
    """
    chosen = _min_cut(forward_nodes, needed, free, unreadable, policy, only_from, checkpointed=True)
    if chosen is None:  # a checkpointed value reads an input changed in place later: saved after all
        chosen = _min_cut(forward_nodes, needed, free, unreadable, policy, only_from, checkpointed=False)
    return chosen


def _min_cut(forward_nodes, needed, free, unreadable, policy, only_from, checkpointed) -> set | None:
    import networkx as nx  # a dependency of torch

    graph = nx.DiGraph()
    nodes = set(forward_nodes)
    always_saved = _ALWAYS_SAVED[policy if policy == "cpu" else check_policy(policy)]
    inside = _inside_checkpoints(forward_nodes, nodes) if checkpointed and only_from is None else set()
    for node in forward_nodes:
        cost = _cost(node, free, unreadable)
        if only_from is not None:
            cost = 0 if node.name in only_from else math.inf
        recomputable = node.op == "call_function" and (node in inside or (
            kind_of(node) not in always_saved and not meta_of(node).never_recomputed)) \
            and not any(a in unreadable for a in node.all_input_nodes)
        if node in inside and cost:
            cost = math.inf
        if recomputable and not cost and kind_of(node) == OpKind.VIEW:
            # NOTE: a view of a value saved for free (an input's transpose): save the value, the
            # backward makes the view again where it reads it, and a transpose of that transpose
            # folds away (``build._fold_permutes``): no host view call at all
            cost = 1e-6
        if recomputable and cost:
            # NOTE: of equal sizes, save the value that is not recomputable (a reduction's
            # result rather than a pointwise function of it): the forward writes it anyway,
            # while saving a pointwise value makes its kernel write one more output.
            cost *= 1.001
        graph.add_edge((node, "in"), (node, "out"), capacity=cost)
        if not recomputable:
            graph.add_edge(_SOURCE, (node, "in"), capacity=math.inf)
        if node in needed:
            graph.add_edge((node, "out"), _SINK, capacity=math.inf)
        for user in node.users:
            if user in nodes:
                graph.add_edge((node, "out"), (user, "in"), capacity=math.inf)
    if _SINK not in graph:
        return set()
    cut, (source_side, _) = nx.minimum_cut(graph, _SOURCE, _SINK)
    if cut == math.inf:
        return None
    return {n for n in forward_nodes if (n, "in") in source_side and (n, "out") not in source_side}


def _inside_checkpoints(forward_nodes, nodes: set) -> set:
    """Values of a checkpointed block that only the same block's ops read (in the forward)."""
    inside = set()
    for node in forward_nodes:
        block = meta_of(node).checkpoint
        if block is not None and node.op == "call_function" and \
                all(meta_of(u).checkpoint == block for u in node.users if u in nodes):
            inside.add(node)
    return inside


def _cost(node: fx.Node, free, unreadable) -> float:
    """Bytes that saving ``node`` keeps alive: a view keeps its base's storage (nothing more
    where the base is alive anyway)."""
    base = node
    while kind_of(base) == OpKind.VIEW:
        base = base.args[0]
    return _nbytes(base) if base in unreadable or base not in free else 0


def _nbytes(node: fx.Node) -> int:
    m = meta_of(node)
    if m.shape is None or m.dtype is None:
        return 1
    return max(1, math.prod(m.shape) * m.dtype.itemsize)
