"""DTensors in the training step's bookkeeping: FSDP2's sharded parameters, their gradients and
their optimizer state (issue 38).

A DTensor is a wrapper: each rank holds its local shard, a plain dense tensor, and the DTensor's
ops run the same op on the shards where the placements agree. An optimizer's update is
elementwise, so the fused step runs its kernels on the local shards of a parameter, its gradient
and its state when all three are placed alike (what eager's per-op DTensor dispatch then does,
without its per-op overhead). A gradient norm (``clip_grad_norm_``) is not local: over shards,
each rank reduces its own, then one all-reduce combines them (``combine_norms``).

No DTensor exists unless ``torch.distributed.tensor`` was imported: the checks below cost nothing
in a process that never imports it.
"""

from __future__ import annotations

import sys

import torch


def dtensor_class():
    """DTensor where torch.distributed.tensor is imported, else None."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(t) -> bool:
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t):
    """The local shard of a DTensor (a plain tensor sharing its memory); any other tensor itself."""
    return t._local_tensor if is_dtensor(t) else t


def placed_like(t, reference) -> bool:
    """Whether ``t`` is a DTensor on ``reference``'s mesh with its placements and shape: their
    local shards then line up element by element."""
    return is_dtensor(t) and t.device_mesh == reference.device_mesh and t.placements == reference.placements \
        and t.shape == reference.shape


def refuse_update(p, others) -> str | None:
    """Why the fused optimizer step cannot update DTensor parameter ``p`` on its local shard (its
    gradient and state tensors ``others`` placed otherwise), or None where it can."""
    if not is_dtensor(p):
        return f"is a {type(p).__name__} (a tensor subclass), not a plain tensor"
    for t in others:
        if t is not None and not placed_like(t, p):
            return (f"is a DTensor placed {p.placements} with a {type(t).__name__} gradient or state placed "
                    f"{getattr(t, 'placements', 'as a plain tensor')}: eager's step would redistribute")
    return None


def refuse_norm(p, g) -> str | None:
    """Why a gradient norm over DTensor gradient ``g`` cannot be one reduction per rank and an
    all-reduce: it must be sharded (each element on exactly one rank) on a one-dimensional mesh."""
    if not is_dtensor(g):
        return f"is a {type(p).__name__} with a {type(g).__name__} gradient (a tensor subclass)"
    if g.device_mesh.ndim != 1 or not all(placement.is_shard() for placement in g.placements):
        return (f"has a DTensor gradient placed {g.placements} on a {g.device_mesh.ndim}-dimensional mesh "
                "(fused where every gradient is sharded on one mesh dimension, as FSDP2's are)")
    return None


def combine_norms(local_norm: torch.Tensor, norm_type: float, mesh) -> torch.Tensor:
    """The norm of all ranks' shards from each rank's norm of its own (``local_norm``, 0-dim): an
    all-reduce over ``mesh`` of the norms raised to ``norm_type`` (summed; for inf, the largest)."""
    import torch.distributed as dist

    group = mesh.get_group()
    if norm_type == float("inf"):
        value = local_norm.clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return value
    value = local_norm if norm_type == 1.0 else local_norm * local_norm
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value if norm_type == 1.0 else value.sqrt()


def replicated(total: torch.Tensor, mesh):
    """``total`` (the same on every rank) as the replicated DTensor eager's clip_grad_norm_ returns."""
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False)
