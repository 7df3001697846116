"""Tensor-like handles (compiler/capture/bindings/handles.py): each operation appends the catalog op the
binding code would, in Python's evaluation order, with eager's dtype promotion; ``on_handles``
keeps the registry's node-in, node-out convention. Values are checked against eager PyTorch
through the reference interpreter."""

import pytest
import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

from compiler.capture.bindings.handles import Tensor, handle, on_handles, pointwise, where
from compiler.capture.bindings.norms import _normalize
from compiler.capture.bindings.reductions import log_softmax
from compiler.capture.bindings.registry import Writes
from compiler.ir.graph import GraphBuilder, meta_of
from compiler.ir.reference import run_graph


def _inputs(*specs):
    b = GraphBuilder()
    return b, [handle(b, b.placeholder(f"x{i}", shape, dtype, requires_grad=dtype.is_floating_point))
               for i, (shape, dtype) in enumerate(specs)]


def _ops(b):
    return [n.target.name for n in b.created]


def _evaluate(b, outputs, values):
    b.output([o.node for o in outputs])
    return run_graph(b.graph, values)


def test_an_expression_appends_its_ops_in_evaluation_order_with_operands_in_order():
    b, (x,) = _inputs(((4, 8), torch.float32))
    centered = x - x.mean(1, keepdim=True)
    assert _ops(b) == ["mean", "sub"]
    assert centered.node.args == (x.node, b.created[0])
    assert (centered.shape, centered.dtype, centered.requires_grad) == ((4, 8), torch.float32, True)
    y = 1.0 - x  # a reflected operator keeps the scalar first
    assert meta_of(y.node).expr == 1.0 - sympy.Symbol("a0", real=True)


def test_python_scalars_stay_as_given():
    b, (x,) = _inputs(((3,), torch.float32))
    assert meta_of((x ** 2).node).expr != meta_of((x ** 2.0).node).expr


def test_dtypes_follow_eager_promotion():
    b, (x, i, m) = _inputs(((3,), torch.bfloat16), ((3,), torch.int64), ((3,), torch.bool))
    assert (x + i).dtype == torch.bfloat16
    assert (i * 2).dtype == torch.int64
    compare = x > 0.5
    assert compare.dtype == torch.bool and not compare.requires_grad
    assert _ops(b)[-1] == "gt"
    both = m + m  # bool arithmetic is logic in eager (True + True is True)
    assert b.created[-1].target.name == "logical_or" and both.dtype == torch.bool
    assert (m & ~m).dtype == torch.bool
    assert where(m, x, 0.0).dtype == torch.bfloat16
    assert where(m, i, 0.5).dtype == torch.float32
    assert where(m, i, 0.5, dtype=torch.float64).dtype == torch.float64


def test_to_detach_and_views_of_no_effect():
    b, (x,) = _inputs(((2, 3), torch.float32))
    assert x.to(torch.float32) is not None and b.created == []  # same dtype: no node
    assert x.reshape(2, 3).node is x.node and x.permute(0, 1).node is x.node
    detached = x.detach()
    assert _ops(b) == ["identity"] and not detached.requires_grad
    assert x.unsqueeze(-1).shape == (2, 3, 1)
    assert x.permute(-1, 0).shape == (3, 2) and x.t().shape == (3, 2) and x.mT.shape == (3, 2)
    assert x.expand(4, 2, 3).shape == (4, 2, 3)


def test_statistics_of_half_types_are_float32():
    b, (x,) = _inputs(((4, 8), torch.bfloat16))
    mean = x.statistic("mean", (1,))
    assert (mean.shape, mean.dtype) == ((4, 1), torch.float32)
    assert x.sum().shape == () and x.sum(1).dtype == torch.bfloat16


def test_on_handles_converts_at_the_boundary():
    seen = {}

    @on_handles
    def bind(b, x, tensors, *, scale=1.0):
        seen["types"] = (type(x), [type(t) for t in tensors], type(scale))
        return x * scale, Writes(x + 1.0, [(tensors[0], tensors[0] * 2.0)])

    b = GraphBuilder()
    x = b.placeholder("x", (3,), torch.float32, requires_grad=True)
    y = b.placeholder("y", (3,), torch.float32)
    result, writes = bind(b, x, [y], scale=2.0)
    assert seen["types"] == (Tensor, [Tensor], float)
    assert isinstance(result, fx.Node) and isinstance(writes.result, fx.Node)
    assert writes.writes[0][0] is y and isinstance(writes.writes[0][1], fx.Node)
    assert bind(b, Tensor(b, x), [y])[0].op == "call_function"  # handles are accepted too


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_normalize_and_log_softmax_match_eager(dtype):
    b, (x,) = _inputs(((4, 8), dtype))
    layer, _, _ = _normalize(x, (1,), 1e-5)
    rms, _, _ = _normalize(x, (1,), 1e-5, centered=False)
    logp = log_softmax(x, 1)
    value = torch.randn(4, 8, dtype=dtype)
    got = _evaluate(b, [layer, rms, logp], [value])
    torch.testing.assert_close(got[0], F.layer_norm(value, (8,), eps=1e-5))
    torch.testing.assert_close(got[1], value * torch.rsqrt(value.pow(2).mean(1, keepdim=True) + 1e-5))
    torch.testing.assert_close(got[2], F.log_softmax(value, 1))


def test_pointwise_catalog_ops_without_a_method():
    b, (x, y) = _inputs(((5,), torch.float32), ((5,), torch.float32))
    loss = pointwise("huber", x - y, 1.5)
    a, c = torch.randn(5), torch.randn(5)
    got = _evaluate(b, [loss], [a, c])
    torch.testing.assert_close(got[0], F.huber_loss(a, c, reduction="none", delta=1.5))


def test_a_handle_has_no_truth_value():
    b, (x,) = _inputs(((3,), torch.float32))
    with pytest.raises(TypeError, match="no truth value"):
        if x > 0:
            pass
