"""Every code example of PyTorch's autograd notes (the spec of eager semantics: the English
"Autograd mechanics" and the Chinese notes on autograd, double backward with custom
Functions and ``torch.autograd``), run inside a compiled function.

Each example is the notes' code as a function that prints what the notes print. It runs
three times from the same random seed: eagerly, as a compiled function's first call (the
recording) and as its second call (a replay); the three printouts must be equal. Where the
notes write to a GPU or to ``G:/``, the example uses the CPU and a temporary directory.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile
import threading
import uuid

import pytest
import torch
from torch import Tensor, nn
from torch.autograd import Function
from torch.autograd.function import once_differentiable

import compiler

EXAMPLES = []


def example(fn):
    EXAMPLES.append(fn)
    return fn


def run_three_ways(fn):
    """``fn``'s printout eagerly, on a compiled first call and on a replay; and the compiled
    function. Each run starts from the same seed."""
    compiled = compiler.compile(fn, backend="interpret")
    printouts = []
    for run in (fn, compiled, compiled):
        torch.manual_seed(0)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            run()
        printouts.append(out.getvalue())
    return printouts, compiled


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

_tmp_dir = tempfile.mkdtemp(prefix="symgrad-notes-")


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


# == Double backward with custom Functions (the Chinese notes) ================================

class SquareFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 2

    @staticmethod
    def backward(ctx, grad_output):
        x, = ctx.saved_tensors
        return grad_output * 2 * x


@example
def square_function_gradcheck():
    x = torch.rand((3, 3), dtype=torch.double, requires_grad=True)
    # Use double precision because finite differencing method magnifies errors
    c1 = torch.autograd.gradcheck(SquareFunction.apply, x)
    # Use gradcheck to verify second-order derivatives
    c2 = torch.autograd.gradgradcheck(SquareFunction.apply, x)
    print(c1, c2)


@example
def square_function_double_backward():
    x = torch.tensor(3.14, requires_grad=True)
    out = SquareFunction.apply(x)
    grad_x, = torch.autograd.grad(out, x, create_graph=True)
    print(x, out, grad_x, sep='\n')


class ExpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ret = torch.exp(x)
        ctx.save_for_backward(ret)
        return ret

    @staticmethod
    def backward(ctx, grad_output):
        ret, = ctx.saved_tensors
        return grad_output * ret


@example
def exp_function_double_backward():
    x = torch.tensor(3.14, requires_grad=True)
    out = ExpFunction.apply(x)
    grad_x, = torch.autograd.grad(out, x, create_graph=True)
    print(x, out, grad_x, sep='\n')


class SinhFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        expx = torch.exp(x)
        expnegx = torch.exp(-x)
        ctx.save_for_backward(expx, expnegx)
        return (expx - expnegx) / 2, expx, expnegx

    @staticmethod
    def backward(ctx, grad_output, grad_expx, grad_expnegx):
        expx, expnegx = ctx.saved_tensors
        grad_input = grad_output * (expx + expnegx) / 2
        grad_input += grad_expx * expx
        grad_input -= grad_expnegx * expnegx
        return grad_input


def sinh(x):
    return SinhFunction.apply(x)[0]


@example
def sinh_function_saving_intermediate_results():
    x = torch.tensor([[1., 2.], [3., 4.]], requires_grad=True)
    out = torch.sum(sinh(x))
    grad_x, = torch.autograd.grad(out, x, create_graph=True)
    print(x, out, grad_x, sep='\n')


class SinhBadFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        expx = torch.exp(x)
        expnegx = torch.exp(-x)
        ctx.save_for_backward(expx, expnegx)
        return (expx - expnegx) / 2

    @staticmethod
    def backward(ctx, grad_output):
        expx, expnegx = ctx.saved_tensors
        grad_input = grad_output * (expx + expnegx) / 2
        return grad_input


@example
def sinh_bad_function_has_no_double_backward():
    x = torch.tensor([[1., 2.], [3., 4.]], requires_grad=True)
    out = torch.sum(SinhBadFunction.apply(x))
    grad_x, = torch.autograd.grad(out, x, create_graph=True)
    print(grad_x, grad_x.requires_grad, grad_x.grad_fn)  # not part of a backward graph


# Assume these four functions are implemented in C++.
def cube_forward(x: Tensor):
    return x**3


def cube_backward(grad_cube: Tensor, x: Tensor):
    return grad_cube * 3 * x**2


def cal_d_grad_cube(grad_help: Tensor, x: Tensor):
    return grad_help * 3 * x**2


def cal_d_x(grad_help: Tensor, grad_cube: Tensor, x: Tensor):
    return grad_help * grad_cube * 6 * x


class CubeHelpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, grad_cube: Tensor, x: Tensor):
        ctx.save_for_backward(grad_cube, x)
        return cube_backward(grad_cube, x)

    @staticmethod
    def backward(ctx, grad_help: Tensor):
        grad_cube, x = ctx.saved_tensors
        d_grad_cube = cal_d_grad_cube(grad_help, x)
        d_x = cal_d_x(grad_help, grad_cube, x)
        return d_grad_cube, d_x


class CubeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor):
        ctx.save_for_backward(x)
        return cube_forward(x)

    @staticmethod
    def backward(ctx, grad_out):
        x, = ctx.saved_tensors
        # return cube_backward(grad_out, x)
        return CubeHelpFunction.apply(grad_out, x)


@example
def cube_function_gradcheck():
    x = torch.randn((3, 3), requires_grad=True, dtype=torch.double)
    c1 = torch.autograd.gradcheck(CubeFunction.apply, x)
    c2 = torch.autograd.gradgradcheck(CubeFunction.apply, x)
    print(c1, c2)


@example
def cube_function_when_backward_is_not_tracked():
    x = torch.tensor([[1., 2., 3., 4.]], requires_grad=True)
    out = torch.sum(CubeFunction.apply(x))
    grad_x, = torch.autograd.grad(out, x, create_graph=True)
    print(x, out, grad_x, sep='\n')


# == torch.autograd (the Chinese notes) =======================================================

def what(**tensors):
    for name, t in tensors.items():
        print(f"name: {name:5} | type: {type(t)} | shape: {t.shape} | value: {t}")


@example
def chain_rule_by_hand():
    x = torch.tensor([2., 3., 4.], requires_grad=True)
    y = torch.pow(x, 2)
    z = torch.sum(y)
    dz_dy = torch.autograd.grad(z, y, retain_graph=True)[0]
    dz_dx = torch.autograd.grad(y, x, grad_outputs=dz_dy, retain_graph=True)[0]
    g = torch.autograd.grad(z, x)[0]
    what(dz_dy=dz_dy, dz_dx=dz_dx, g=g)


@example
def grad_of_a_tensor_needs_grad_outputs():
    x = torch.tensor([[2., 3.], [4., 5.]], requires_grad=True)
    y = torch.matmul(x.t(), x)
    try:
        torch.autograd.grad(y, x)
    except RuntimeError as e:
        print("RuntimeError:", e)
    g = torch.autograd.grad(y, x, grad_outputs=torch.ones_like(x))[0]
    print(g)


@example
def gradient_layouts_set_to_none():
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    for it in range(2):
        for param in model.parameters():
            param.grad = None
        loss = model(x).pow(2).sum()
        loss.backward()
    for it in range(2):
        optimizer.zero_grad(set_to_none=True)
        loss = model(x).pow(2).sum()
        loss.backward()
        optimizer.step()
    print([p.grad.stride() for p in model.parameters()], loss)


@example
def manual_gradient_layout():
    param = nn.Parameter(torch.randn(3, 4))
    param.grad = torch.zeros(4, 3).t()  # a chosen stride, kept by accumulation
    (param * 2).sum().backward()
    print(param.grad.stride(), param.grad)


class Exp(Function):
    @staticmethod
    def forward(ctx, inputs):
        result = inputs.exp()
        ctx.save_for_backward(result)
        return result

    @staticmethod
    def backward(ctx, grad_output):
        result, = ctx.saved_tensors
        return grad_output * result


@example
def custom_function_exp():
    inputs = torch.randn(4, requires_grad=True)
    # Use it by calling the apply method
    output = Exp.apply(inputs)
    output.sum().backward()
    print(output, inputs.grad)


class Inplace(Function):
    @staticmethod
    def forward(ctx, x):
        x_npy = x.numpy()  # x_npy shares storage with x
        x_npy += 1
        ctx.mark_dirty(x)
        return x

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        return grad_output


@example
def mark_dirty():
    a = torch.tensor(1., requires_grad=True).clone()
    b = a * a
    # This would lead to wrong gradients!
    # But the engine would not know unless we mark_dirty().
    Inplace.apply(a)
    try:
        b.backward()
    except RuntimeError as e:  # one of the variables needed for gradient computation ...
        print("RuntimeError:", str(e).split(";")[0])


class Func(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor, z: int):
        w = x * z
        out = x * y + y * z + w * y
        ctx.save_for_backward(x, y, w, out)
        ctx.z = z  # z is not a tensor
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, y, w, out = ctx.saved_tensors
        z = ctx.z
        gx = grad_out * (y + y * z)
        gy = grad_out * (x + z + w)
        gz = None
        return gx, gy, gz


@example
def save_for_backward_and_ctx_attributes():
    a = torch.tensor(1., requires_grad=True)
    b = torch.tensor(2., requires_grad=True)
    c = 4
    d = Func.apply(a, b, c)
    d.backward()
    print(d, a.grad, b.grad)
    try:  # once_differentiable: no double backward
        e = Func.apply(a, b, c)
        g, = torch.autograd.grad(e, a, create_graph=True)
        g.backward()
    except RuntimeError as err:
        print("RuntimeError:", err)


class MyFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp):
        return inp.clone()

    @staticmethod
    def backward(ctx, g0):
        # Error during the backward pass
        raise RuntimeError("Some error in backward")
        return g0.clone()


@example
def detect_anomaly():
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autograd.detect_anomaly():
                inp = torch.rand([10, 10], requires_grad=True)
                out = MyFunc.apply(inp).sum()
                out.backward()
        except RuntimeError as e:
            print("RuntimeError:", e)
    # anomaly mode warns once when enabled, and once with the forward's traceback
    print(sorted({str(w.message).split("\n")[0][:60] for w in caught}))


class MyExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *args, **kwargs):
        print('### MyExp.forward()')
        inp = args[0]
        out = inp.exp()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, *grad_outputs):
        print('### MyExp.backward()')
        grad_output = grad_outputs[0]
        out = ctx.saved_tensors[0]
        return out * grad_output


class SelfDeletingTempFileCN:
    def __init__(self):
        self.path = os.path.join(_tmp_dir, str(uuid.uuid4()))

    def __del__(self):
        os.remove(self.path)


def my_pack_hook(tensor):
    print('### my_pack_hook()')
    temp_file = SelfDeletingTempFileCN()
    torch.save(tensor, temp_file.path)
    return temp_file


def my_unpack_hook(temp_file):
    print('### my_unpack_hook()')
    return torch.load(temp_file.path)


@example
def saved_tensors_hooks_printing():
    x = torch.tensor([2., 3., 4.], requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(my_pack_hook, my_unpack_hook):
        y = MyExp.apply(x)
    y = y.sum()
    y.backward()
    print(x.grad)


@example
def save_on_cpu():
    x = torch.tensor([2., 3., 4.], requires_grad=True)  # the notes: device='cuda'
    with torch.autograd.graph.save_on_cpu():
        y = MyExp.apply(x)
    y = y.sum()
    y.backward()
    print(x.grad)


@example
def profiler_around_a_training_loop():
    # NOTE: a profile's table reports timings and, inside compiled code, the kernels that
    # ran: it differs between any two runs by nature. What the loop computes must not.
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.MSELoss()
    data_loader = [(torch.randn(3, 4), torch.randn(3, 2)) for _ in range(2)]
    with torch.autograd.profiler.profile(profile_memory=True) as prof:
        for samples, targets in data_loader:
            outputs = model(samples)
            loss = loss_fn(outputs, targets)
            # Back Propagation
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(loss)
    print(len(prof.key_averages()) > 0)


# Examples whose replay differs from eager today, and why (README: "Known limits").
KNOWN_LIMITS = {
    "shared_graph_between_threads_needs_retain_graph": (
        "a value computed inside the compiled function and used only by another thread is invisible to "
        "the recording, so the replay keeps it inside the kernels; the thread's use raises a clear error "
        "(tests/test_first_call.py) instead of computing on a missing value"),
}


def _cases():
    for fn in EXAMPLES:
        reason = KNOWN_LIMITS.get(fn.__name__)
        yield pytest.param(fn, marks=pytest.mark.xfail(reason=reason, strict=True)) if reason else fn


@pytest.mark.parametrize("fn", list(_cases()), ids=lambda f: getattr(f, "__name__", None))
def test_example_prints_what_eager_prints(fn):
    (eager, first_call, replay), compiled = run_three_ways(fn)
    assert eager.strip(), "the example prints nothing"
    assert first_call == eager
    assert replay == eager
    assert (compiled.stats["captures"], compiled.stats["replays"]) == (1, 1), compiled.stats
    assert compiled.stats["divergences"] == 0, compiled.last_backend
