"""Values a saved tensor's pack hook makes: they leave the recording's sight through C++.

``y.grad_fn._raw_saved_self.register_hooks(pack, unpack)`` (the autograd notes, "Hooks for saved
tensors") calls ``pack`` at once, from C++, with the recording's mode on the stack. The calls the
hook makes are recorded like any other, but what it returns goes into autograd's ``SavedVariable``:
no recorded call reads it, and backward frees it before the function returns, so escape analysis
(``Capture.finish``) saw neither a reader nor a reference. Kept inside the fused kernels on replay,
the value was a stand-in, and the unpack hook handed autograd its NaN storage: NaN gradients, with no
error (issue 32).

So every value made while a pack hook runs is marked as escaping (``Capture.escaping``): the replay
materializes it. A pack hook's values are few (a copy, a cast), and what it returns may hold them in
any structure (a tuple, an object, a dict it writes to), so all of them are kept, not only the ones
found in its result.

NOTE: hooks set with ``torch.autograd.graph.saved_tensors_hooks`` need nothing: autograd calls them
inside the op that saves, where the mode does not see calls (a mode is off its stack while it runs
one), and the replay's own regions save through ``ctx.save_for_backward``, which calls them the same
way. Only ``register_hooks`` calls a hook from Python's level.
"""

from __future__ import annotations

import threading

import torch

_recording = threading.local()  # .mode: the Capture recording in this thread, if any


class recording_in_this_thread:
    """``with recording_in_this_thread(mode):`` while ``mode`` records (``compiler.capture.recorder.capture``)."""

    def __init__(self, mode):
        self.mode = mode

    def __enter__(self):
        self.outer = getattr(_recording, "mode", None)
        _recording.mode = self.mode

    def __exit__(self, *exc):
        _recording.mode = self.outer


def _watched(pack_hook):
    """``pack_hook``, run with the recording (if any) told that what it makes escapes."""
    def pack(tensor):
        mode = getattr(_recording, "mode", None)
        if mode is None:
            return pack_hook(tensor)
        with mode.pack_hook_running():
            return pack_hook(tensor)
    return pack


def _register_hooks(saved, pack_hook, unpack_hook, /):
    # (torch's checks and errors as they are: a hook that is no function is refused there)
    return _register_hooks_of_torch(saved, _watched(pack_hook) if callable(pack_hook) else pack_hook, unpack_hook)


_SavedTensor = torch._C._autograd.SavedTensor
# (torch's own method, also where this module is imported again: never a wrapper of a wrapper)
_register_hooks_of_torch = getattr(_SavedTensor.register_hooks, "of_torch", _SavedTensor.register_hooks)
_register_hooks.of_torch = _register_hooks_of_torch
_register_hooks.__doc__ = _register_hooks_of_torch.__doc__
_SavedTensor.register_hooks = _register_hooks
