"""Every code example of PyTorch's "Autograd mechanics" notes (saved tensors and their hooks,
multithreaded autograd, backward hooks, grad modes, in-place checks), run inside a compiled
function: eagerly, on the first call and on a replay, each prints the same
(tests/notes_examples.py). The notes' other examples: tests/test_autograd_notes_api.py."""

from __future__ import annotations

import os
import tempfile
import threading
import uuid

import pytest
import torch
from torch import nn

from tests.notes_examples import cases, check_example

EXAMPLES = []


def example(fn):
    EXAMPLES.append(fn)
    return fn


_tmp_dir = tempfile.mkdtemp(prefix="symgrad-notes-")


# == Autograd mechanics: saved tensors ======================================================

@example
def saved_self_is_the_input():
    x = torch.randn(5, requires_grad=True)
    y = x.pow(2)
    print(x.equal(y.grad_fn._saved_self))  # True
    print(x is y.grad_fn._saved_self)  # True


@example
def saved_result_is_another_object():
    x = torch.randn(5, requires_grad=True)
    y = x.exp()
    print(y.equal(y.grad_fn._saved_result))  # True
    print(y is y.grad_fn._saved_result)  # False


@example
def saved_self_printed():  # the Chinese notes print the tensors too
    x = torch.tensor([2., 3.], requires_grad=True)
    y = x ** 2
    itself = y.grad_fn._saved_self
    print(itself, itself is x, itself.equal(x))


@example
def saved_result_printed():
    x = torch.tensor([2., 3.], requires_grad=True)
    y = torch.exp(x)
    result = y.grad_fn._saved_result
    print(result, result is y, result.equal(y))


# == Hooks for saved tensors ================================================================

class SelfDeletingTempFile():
    def __init__(self):
        self.name = os.path.join(_tmp_dir, str(uuid.uuid4()))

    def __del__(self):
        os.remove(self.name)


def pack_hook(tensor):
    temp_file = SelfDeletingTempFile()
    torch.save(tensor, temp_file.name)
    return temp_file


def unpack_hook(temp_file):
    return torch.load(temp_file.name)


@example
def saved_tensors_on_disk():
    x = torch.randn(5, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, unpack_hook):
        y = (x.sin() * x).sum()
    y.backward()
    print(x.grad)
    print(sorted(os.listdir(_tmp_dir)))  # every temporary file deleted with its graph


@example
def register_hooks_on_a_saved_tensor():
    x = torch.randn(5, requires_grad=True)
    y = x.pow(2)
    y.grad_fn._raw_saved_self.register_hooks(pack_hook, unpack_hook)
    print(y.grad_fn._saved_self.equal(x))  # unpacked from the file
    y.sum().backward()
    print(x.grad)


@example
def register_hooks_after_backward_is_forbidden():
    x = torch.randn(5, requires_grad=True)
    y = x.pow(2)
    saved = y.grad_fn._raw_saved_self
    y.sum().backward()
    try:
        saved.register_hooks(pack_hook, unpack_hook)
    except RuntimeError as e:
        print("RuntimeError:", e)


# Only save on disk tensors that have size >= 1000
SAVE_ON_DISK_THRESHOLD = 1000


def threshold_pack_hook(x):
    if x.numel() < SAVE_ON_DISK_THRESHOLD:
        return x
    temp_file = SelfDeletingTempFile()
    torch.save(tensor, temp_file.name)  # noqa: F821 (the notes' typo: eager raises NameError)
    return temp_file


def threshold_unpack_hook(tensor_or_sctf):
    if isinstance(tensor_or_sctf, torch.Tensor):
        return tensor_or_sctf
    return torch.load(tensor_or_sctf.name)


class HookedModel(nn.Module):
    def forward(self, x):
        with torch.autograd.graph.saved_tensors_hooks(threshold_pack_hook, threshold_unpack_hook):
            # ... compute output
            output = (x * x).tanh()
        return output


@example
def default_hooks_inside_a_module_and_dataparallel():
    model = HookedModel()
    net = nn.DataParallel(model)  # on a machine without GPUs: the module itself
    x = torch.randn(10, requires_grad=True)
    net(x).sum().backward()
    print(x.grad)
    big = torch.randn(1000, requires_grad=True)
    try:  # the notes' hook names an undefined `tensor` for big tensors: eager's NameError
        net(big)
    except NameError as e:
        print("NameError:", e)


@example
def identity_hooks_make_new_tensor_objects():
    x = torch.randn(5, requires_grad=True)
    y = x * x
    print(x is y.grad_fn._saved_self, x is y.grad_fn._saved_other)  # True True
    with torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x):
        x = torch.randn(5, requires_grad=True)
        y = x * x
    print(x is y.grad_fn._saved_self, x is y.grad_fn._saved_other,
          y.grad_fn._saved_self.equal(x))  # False False True


# == Multithreaded autograd ==================================================================

@example
def hogwild_threads():
    results = {}

    # Define a train function to be used in different threads
    def train_fn(i):
        x = torch.ones(5, 5, requires_grad=True)
        # forward
        y = (x + 3) * (x + 4) * 0.5
        # backward
        y.sum().backward()
        # potential optimizer update
        # (the Chinese notes print the thread's name: names count threads process-wide, so
        # the example keeps a result per thread instead)
        results[i] = (y.detach().sum().item(), x.grad.sum().item())

    # User write their own threading code to drive the train_fn
    threads = []
    for i in range(10):
        p = threading.Thread(target=train_fn, args=(i,))
        p.start()
        threads.append(p)

    for p in threads:
        p.join()
    print(sorted(results.items()))


@example
def shared_graph_between_threads_needs_retain_graph():
    x = torch.randn(4, requires_grad=True)
    shared = x.exp() * 2  # the first part of the forward, in one thread
    errors = []

    def second_part():
        try:
            shared.sum().backward()
        except RuntimeError as e:
            errors.append(str(e).split(".")[0])
    for _ in range(2):
        t = threading.Thread(target=second_part)
        t.start()
        t.join()
    print(errors, x.grad)


# == Backward hooks execution =================================================================

@example
def hook_registered_after_an_in_place_op():
    seen = []

    def fn(grad):
        seen.append(grad)
    t = torch.tensor(1., requires_grad=True).sin()
    t.cos_()
    t.register_hook(fn)
    t.backward()
    print(seen)


@example
def hook_registered_before_an_in_place_op():
    seen = []
    x = torch.tensor(1., requires_grad=True)
    t = x.sin()
    t.register_hook(lambda g: seen.append(("before", g)))
    t.cos_()
    t.register_hook(lambda g: seen.append(("after", g)))
    t.backward()
    print(seen, x.grad)


@example
def the_order_hooks_fire_in():
    order = []
    x = torch.randn(3, requires_grad=True)
    x.register_post_accumulate_grad_hook(lambda p: order.append("5 post-accumulate-grad"))
    h = x.sin() * 2
    h.retain_grad()
    h.register_hook(lambda g: order.append("1 tensor hook"))
    h.grad_fn.register_prehook(lambda go: order.append("2 node pre-hook"))
    h.grad_fn.register_hook(lambda gi, go: order.append(f"6 node post-hook {type(h.grad).__name__}"))
    (h * h).sum().backward()
    print(order, type(h.grad_fn).__name__)


@example
def node_hooks_under_grad_and_backward_with_inputs():
    fired = []
    x = torch.randn(3, requires_grad=True)
    h = x.exp()
    h.grad_fn.register_hook(lambda gi, go: fired.append("h's node"))
    out = (h * 2).sum()
    torch.autograd.grad(out, [h], retain_graph=True)  # h's node need not run
    print(fired)
    out.backward(inputs=[h])  # .backward() runs it
    print(fired, h.grad)


@example
def multi_grad_hook_and_module_full_backward_hook():
    events = []
    lin = nn.Linear(3, 2)
    lin.register_full_backward_hook(lambda m, gi, go: events.append(("module", [g.shape for g in go])))
    x = torch.randn(4, 3, requires_grad=True)
    a, b = x.sin(), lin(x)
    torch.autograd.graph.register_multi_grad_hook((a, b), lambda grads: events.append(("multi", len(grads))))
    (a.sum() + b.sum()).backward()
    print(events, x.grad)


@example
def post_accumulate_grad_hook_on_a_non_leaf_errors():
    x = torch.randn(3, requires_grad=True)
    h = x * 2
    try:
        h.register_post_accumulate_grad_hook(lambda p: None)
    except RuntimeError as e:
        print("RuntimeError:", e)


# == Grad modes, requires_grad, in-place correctness checks ====================================

@example
def grad_modes():
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        a = x * 2
    with torch.inference_mode():
        b = x * 2
    c = x * 2
    print(a.requires_grad, b.requires_grad, b.is_inference(), c.requires_grad, c.grad_fn is not None)
    try:
        (b * x).sum().backward()
    except RuntimeError as e:
        print("RuntimeError:", e)


@example
def freezing_parameters():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model[0].requires_grad_(False)
    model(torch.randn(2, 3)).sum().backward()
    print([p.grad is None for p in model.parameters()])


@example
def in_place_correctness_check():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3)
    out = (a * b).sum()
    b.add_(1)  # b is saved for backward
    try:
        out.backward()
    except RuntimeError as e:
        print("RuntimeError:", str(e).split(";")[0])
    print(a.grad)


# Examples whose replay differs from eager today, and why (README: "Known limits").
KNOWN_LIMITS = {
    "shared_graph_between_threads_needs_retain_graph": (
        "a value computed inside the compiled function and used only by another thread is invisible to "
        "the recording, so the replay keeps it inside the kernels; the thread's use raises a clear error "
        "(tests/test_first_call.py) instead of computing on a missing value"),
}


@pytest.mark.parametrize("fn", list(cases(EXAMPLES, KNOWN_LIMITS)),
                         ids=lambda f: getattr(f, "__name__", None))
@pytest.mark.allows_eager("the notes' examples make calls the compiler runs eagerly (module init, "
                          "Tensor.is_inference): the test compares what they print")
def test_example_prints_what_eager_prints(fn):
    check_example(fn)
