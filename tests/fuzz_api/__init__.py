"""Fuzzing the autograd API around compiled code against eager PyTorch.

``program`` draws random training-step-like programs: a few small tensors and maybe a tiny
module with an optimizer, ops from a small menu, and at random points the autograd API a user
calls around them (tensor hooks, Node pre/post hooks, post-accumulate-grad hooks, saved-tensor
hooks in every form, ``retain_grad``, ``retain_graph`` twice, ``torch.autograd.grad`` with
inputs, grad-mode switches, optimizer steps). ``check`` runs one program several times
eagerly and compiled (a recording, replays, and a second compile that loads the stored
recording) and compares values, gradients, parameters, optimizer state, every hook call (its
order and arguments) and errors. ``python -m tests.fuzz_api`` is the long run;
tests/test_fuzz_api.py the CI-sized one.
"""
