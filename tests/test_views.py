"""Views as one class each (``compiler.ir.ops.views``), with ``flip`` as the example of adding one.

* flip gives eager's values and gradients, fused into the kernels around it (an index map,
  ``size - 1 - i``), also where the runtime applies it to a buffer (a matmul's operand);
* flip copies in eager, so an in-place op on its result leaves its source alone, and a flip
  of an input that the function then changes keeps the old values;
* the reference executor (a ``torch.fx.Interpreter`` over the catalog) evaluates every view
  and structural op with the op's own ``evaluate``/``apply``, as eager computes it.
"""

import pytest
import torch
import torch.nn.functional as F

import compiler
from compiler.ir.graph import GraphBuilder
from compiler.ir.ops import catalog as C
from compiler.ir.reference import run_graph
from tests.call_modes import CALLS, assert_ran_as, compiled as compile_for
from tests.parity import check_parity

F64 = torch.float64


# ----------------------------------------------------------------------------- flip
def flip_cases():
    return {
        "tensor_method": lambda x: (x * 2).flip(0).sin(),
        "torch_flip_two_dims": lambda x: torch.flip(x.exp(), (0, 1)) * x,
        "negative_dim_keyword": lambda x: (x + 1).flip(dims=[-1]).tanh(),
        "varargs": lambda x: x.flip(1, 0) - x,
        "fliplr_flipud": lambda x: torch.fliplr(x) * torch.flipud(x),
        "of_a_slice": lambda x: x[1:, ::2].flip(1).cos(),
        "of_a_transpose": lambda x: x.t().flip(0) * 3,
        "twice": lambda x: x.flip(0).flip(0) + x.flip(1).flip(0),
        "into_a_reduction": lambda x: (x.flip(1) * x).sum(1),
        "softmax_of_flipped": lambda x: F.softmax(x.flip(0), dim=1),
        "size_one_dim": lambda x: x[:1].flip(0) + x[1:2],
        "matmul_operand": lambda x: x.flip(0) @ x.t(),
    }


@pytest.mark.parametrize("name", sorted(flip_cases()))
def test_flip_gives_eagers_values_and_gradients(name):
    x = torch.randn(4, 6, dtype=F64, requires_grad=True)
    check_parity(flip_cases()[name], [x])


def test_flip_of_a_3d_tensor_and_of_complex_values():
    x = torch.randn(2, 3, 5, dtype=F64, requires_grad=True)
    check_parity(lambda x: torch.flip(x, (0, 2)).sigmoid() * x, [x])
    z = torch.randn(3, 4, dtype=torch.complex128, requires_grad=True)
    check_parity(lambda z: (z.flip(1) * z).abs().sum(), [z])


def test_flip_fuses_into_the_kernel_that_reads_it():
    x = torch.randn(8, 16, requires_grad=True)
    report = compiler.explain(lambda x: ((x * 2).flip(0) + 1).sin(), x)
    assert report.fallbacks == []
    assert len(report.forward_kernels) == 1  # no kernel of its own: an index map
    assert "7 - (i0)" in report.forward_kernels[0].source
    assert len(report.backward_kernels) == 1  # the gradient's flip fuses as well


@pytest.mark.parametrize("call", CALLS)
def test_in_place_on_a_flip_leaves_its_source_alone(call):
    def f(x, w):
        y = x.flip(0)
        y.mul_(w)
        y[0].add_(1)  # a view of the flip's result: writes the flip's result, not x
        return x * 1, y
    x, w = torch.randn(4, 3, dtype=F64), torch.randn(4, 3, dtype=F64)
    fn = compile_for(f, call)
    fn(x.clone(), w)
    got, want = fn(x.clone(), w), f(x.clone(), w)
    assert_ran_as(fn, call)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("call", CALLS)
def test_flip_of_an_input_changed_afterwards_keeps_the_old_values(call):
    def f(x):
        y = x.flip(1)
        x.add_(1)
        return y
    x = torch.randn(3, 4, dtype=F64)
    fn = compile_for(f, call)
    fn(x.clone())
    mine, theirs = x.clone(), x.clone()
    torch.testing.assert_close(fn(mine), f(theirs))
    assert_ran_as(fn, call)
    torch.testing.assert_close(mine, theirs)


# ----------------------------------------------------------------------------- the reference executor
def _graph(inputs, build):
    b = GraphBuilder()
    nodes = [b.placeholder(f"in{i}", t.shape, t.dtype) for i, t in enumerate(inputs)]
    b.output([build(b, *nodes)])
    return b.graph


X = torch.randn(4, 6, dtype=F64)
REFERENCE_CASES = {
    "reshape": ([X], lambda b, x: C.emit_view(b, "reshape", x, shape=(6, 4)), lambda x: x.reshape(6, 4)),
    "permute": ([X], lambda b, x: C.emit_view(b, "permute", x, dims=(1, 0)), lambda x: x.t()),
    "expand": ([X[:1]], lambda b, x: C.emit_view(b, "expand", x, shape=(3, 6)), lambda x: x.expand(3, 6)),
    "slice": ([X], lambda b, x: C.emit_slice(b, x, 1, 1, 2, 2), lambda x: x[:, 1:5:2]),
    "unfold": ([X], lambda b, x: C.emit_view(b, "unfold", x, dim=1, size=3, step=2), lambda x: x.unfold(1, 3, 2)),
    "flip": ([X], lambda b, x: C.emit_view(b, "flip", x, dims=(0, 1)), lambda x: x.flip(0, 1)),
    "view_as_real": ([X.to(torch.complex128)], lambda b, x: C.emit_view(b, "view_as_real", x),
                     torch.view_as_real),
    "view_as_complex_of_permuted": (
        [X.reshape(2, 2, 6)],
        lambda b, x: C.emit_view(b, "view_as_complex", C.emit_view(b, "permute", x, dims=(0, 2, 1))),
        lambda x: torch.view_as_complex(x.permute(0, 2, 1).contiguous())),
    "sum": ([X], lambda b, x: C.emit_reduction(b, "sum", x, (1,)), lambda x: x.sum(1)),
    "amax_keepdim": ([X], lambda b, x: C.emit_reduction(b, "amax", x, (0,), keepdim=True),
                     lambda x: x.amax(0, keepdim=True)),
    "iota": ([], lambda b: C.emit_iota(b, (3, 4), 1), lambda: torch.arange(4).expand(3, 4)),
    "gather": ([X, torch.tensor([[0, 5], [1, 1], [2, 3], [4, 0]])],
               lambda b, x, i: C.emit_gather(b, x, i, "gather", 1), lambda x, i: torch.gather(x, 1, i)),
    "index_select_wrapped": ([X, torch.tensor([-1, 0, 2])], lambda b, x, i: C.emit_gather(b, x, i, "index_select", 1,
                                                                                          wrap=True),
                             lambda x, i: x[:, i]),
    "embedding": ([X, torch.tensor([[3, 0], [1, 1]])], lambda b, x, i: C.emit_gather(b, x, i, "embedding", 0),
                  lambda x, i: F.embedding(i, x)),
    "slice_scatter": ([X, X[:, :2] * 10], lambda b, x, s: C.emit_slice_scatter(b, x, s, 1, 1, 2, 2),
                      lambda x, s: x.clone().index_copy_(1, torch.tensor([1, 3]), s)),
    "mm": ([X, X.t()], lambda b, x, y: C.emit_extern(b, "mm", x, y), torch.mm),
    "index_backward": ([X[:, :2], torch.tensor([[0, 5], [1, 1], [2, 3], [4, 0]])],
                       lambda b, g, i: b.call(C.EXTERNS["index_backward"], [g, i],
                                              {"mode": "gather", "dim": 1, "shape": (4, 6)},
                                              shape=(4, 6), dtype=F64, requires_grad=False),
                       lambda g, i: torch.zeros(4, 6, dtype=F64).scatter_add_(1, i, g)),
}


@pytest.mark.parametrize("name", sorted(REFERENCE_CASES))
def test_reference_executor_evaluates_each_op_as_eager(name):
    inputs, build, expected = REFERENCE_CASES[name]
    (value,) = run_graph(_graph(inputs, build), inputs)
    torch.testing.assert_close(value, expected(*inputs))
