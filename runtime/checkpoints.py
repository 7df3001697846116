"""``torch.utils.checkpoint`` (non-reentrant) as the compiled regions meet it.

A non-reentrant checkpoint runs its block under saved-tensor hooks of its own: each tensor an
op saves is packed as an empty holder, and the first unpack in backward runs the block again,
eagerly, and checks that it saved as many tensors as the forward did.

A compiled region does the checkpoint's work itself: capture tags the ops the block ran
(``checkpoint_frames``), the saved-set cut recomputes their values inside the backward kernels
instead of saving them, and the region saves what it does keep *outside* the checkpoint's hooks
(``outside_checkpoints``), under the hooks around the checkpoint (a ``save_on_cpu()``), as eager
saves the block's inputs. The checkpoint then packed nothing, so it never reruns the block: its
recomputation is the region's, fused.
"""

from __future__ import annotations

import contextlib

import torch

_top = torch._C._autograd._top_saved_tensors_default_hooks
_pop = torch._C._autograd._pop_saved_tensors_default_hooks
_push = torch._C._autograd._push_saved_tensors_default_hooks


def is_checkpoint_hook(pack) -> bool:
    """Whether ``pack`` is the pack hook of a non-reentrant ``torch.utils.checkpoint`` call."""
    return getattr(pack, "__module__", None) == "torch.utils.checkpoint" and \
        getattr(pack, "__qualname__", "").startswith("_checkpoint_hook.")


def in_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are a checkpoint's (what an op saves now is
    recomputed by that checkpoint in backward, in eager)."""
    top = _top(False)
    return top is not None and is_checkpoint_hook(top[0])


def checkpoint_frames() -> list:
    """The checkpoints an op running now is inside, outermost first (their ``_CheckpointFrame``
    objects, which tell one checkpoint call from another), when the innermost saved-tensor
    hooks are a checkpoint's; else []. (Under user hooks inside a checkpoint, eager saves
    through those hooks: nothing is recomputed.)"""
    if not in_checkpoint():
        return []
    hooks = []
    try:
        while (top := _top(False)) is not None:  # the stack has no reader but its top
            hooks.append(top)
            _pop()
    finally:
        for pack, unpack in reversed(hooks):
            _push(pack, unpack)
    return [_frame_of(pack) for pack, _ in reversed(hooks) if is_checkpoint_hook(pack)]


def _frame_of(pack):
    """The ``_CheckpointFrame`` a checkpoint's pack hook appends to (from its closure)."""
    for cell in pack.__closure__ or ():
        value = cell.cell_contents
        if type(value).__name__ == "_CheckpointFrame":
            return value
    return pack  # (another torch's layout: the hook itself still names the call)


@contextlib.contextmanager
def outside_checkpoints():
    """Run the body with the innermost checkpoints' saved-tensor hooks set aside: tensors saved
    there go through the hooks around them, as eager saves a checkpoint's inputs."""
    popped = []
    while (top := _top(False)) is not None and is_checkpoint_hook(top[0]):
        popped.append(top)
        _pop()
    try:
        yield
    finally:
        for pack, unpack in reversed(popped):
            _push(pack, unpack)
