"""Every code example of the Chinese autograd notes beyond "Autograd mechanics" — double
backward with custom Functions, the torch.autograd API (grad, gradient layouts, Function and
its ctx, anomaly detection, saved-tensor hooks, save_on_cpu, the profiler) — run inside a
compiled function: eagerly, on the first call and on a replay, each prints the same
(tests/notes_examples.py)."""

from __future__ import annotations

import os
import tempfile
import uuid

import pytest
import torch
from torch import Tensor, nn
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from tests.notes_examples import cases, check_example

EXAMPLES = []


def example(fn):
    EXAMPLES.append(fn)
    return fn


_tmp_dir = tempfile.mkdtemp(prefix="symgrad-notes-")


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
    for _ in range(2):
        for param in model.parameters():
            param.grad = None
        loss = model(x).pow(2).sum()
        loss.backward()
    for _ in range(2):
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


KNOWN_LIMITS: dict = {}  # (none: every example replays as eager runs)


@pytest.mark.parametrize("fn", list(cases(EXAMPLES, KNOWN_LIMITS)), ids=lambda f: getattr(f, "__name__", None))
@pytest.mark.allows_eager("the notes' examples make calls the compiler runs eagerly (module init, gradcheck's "
                          "Tensor.stride): the test compares what they print")
def test_example_prints_what_eager_prints(fn):
    check_example(fn)
