"""Capture's record of ``torch.utils.checkpoint`` blocks (non-reentrant).

Eager saves nothing inside a checkpointed block but the block's inputs, and recomputes the
rest in backward. Capture tags every node a call inside one emits with the block's number
(``NodeMeta.checkpoint``, of the outermost block where they nest); the saved-set cut
(``compiler.autodiff.saved_set``) then never saves a value that only the block's own ops read: the
backward kernels recompute it, fused, from what is saved. The block's outputs read after it
stay saveable, as eager's ops after the block save them.

A block with a call that runs eagerly (an op the compiler lacks) runs eagerly whole, with
every checkpoint around it: eager's recomputation reruns the block's Python and checks that it
saved as many tensors as the forward did, which the fused part's own saving would break.
(``runtime.checkpoints`` is the other half: a region saves outside the checkpoint's hooks.)
"""

from __future__ import annotations

import weakref

from compiler.ir.graph import update_meta
from runtime.checkpoints import checkpoint_frames

MIXED_BLOCK = ("a torch.utils.checkpoint block with a call the compiler runs eagerly runs eagerly whole "
               "(eager's recomputation reruns the block and expects its own saved tensors)")


class CheckpointedCalls:
    """Which recorded calls ran inside a checkpointed block, and which blocks run eagerly."""

    def __init__(self):
        self._numbers = weakref.WeakKeyDictionary()  # checkpoint frame -> block number
        self._blocks: dict = {}   # compiled call index -> block numbers it ran in, outermost first
        self._mixed: set = set()  # block numbers with an eager call inside
        self.current: tuple = ()  # the blocks of the call being recorded
        self._next = 0

    def begin(self) -> None:
        """Before recording a call: note the blocks it runs in.

        (Under no_grad too: a custom autograd.Function's forward runs there, eagerly, and the
        Function saves into the checkpoint's holders.)"""
        self.current = tuple(self._number(f) for f in checkpoint_frames())

    def end(self, index: int, compiled: bool, makes_tensors: bool) -> None:
        """After recording call ``index``: a compiled call is remembered; an eager one that made
        tensors (and may have saved some) marks its blocks as run eagerly."""
        if not self.current:
            return
        if compiled:
            self._blocks[index] = self.current
        elif makes_tensors:
            self._mixed.update(self.current)

    @property
    def block(self) -> int | None:
        """The outermost block of the call being recorded (the tag its nodes get), or None."""
        return self.current[0] if self.current else None

    def block_of(self, index: int) -> int | None:
        blocks = self._blocks.get(index)
        return blocks[0] if blocks else None

    def to_run_eagerly(self) -> set:
        """Compiled calls inside a block that runs eagerly whole."""
        return {i for i, blocks in self._blocks.items() if self._mixed.intersection(blocks)}

    def _number(self, frame) -> int:
        if frame not in self._numbers:
            self._numbers[frame] = self._next
            self._next += 1
        return self._numbers[frame]


def tag_block(nodes, block: int | None) -> None:
    """Tag nodes a call inside checkpointed block ``block`` emitted (no-op for None)."""
    if block is None:
        return
    for node in nodes:
        update_meta(node, checkpoint=block)
