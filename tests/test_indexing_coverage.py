"""Indexing, scatters and mixture-of-experts routing compiled whole (``fullgraph=True``):
values, gradients, integer outputs and errors on bad indices, eager PyTorch as the oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import compiler
from tests.parity import check_parity


def _x(*shape, dtype=torch.float64, grad=True):
    torch.manual_seed(sum(shape))
    return torch.randn(*shape, dtype=dtype, requires_grad=grad)


# ----------------------------------------------------------------------------- order
@pytest.mark.parametrize("largest", [True, False])
def test_topk_values_indices_and_gradient(largest):
    def f(x):
        values, indices = torch.topk(x, 3, dim=1, largest=largest)
        return values.sin() * (indices + 1)
    check_parity(f, [_x(4, 7)])


def test_topk_of_one_and_method_form():
    check_parity(lambda x: x.topk(1, dim=-1).values.exp(), [_x(5, 6)])


def test_sort_with_ties_is_eagers_order():
    x = torch.tensor([[3.0, 1.0, 3.0, 2.0, 1.0, 3.0]], dtype=torch.float64, requires_grad=True)

    def f(x):
        values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
        return values * 10 + indices
    check_parity(f, [x], expect_kernels=True)


def test_argsort_integer_output():
    check_parity(lambda x: torch.argsort(x, dim=0) * 2, [_x(6, 3, grad=False)])


def test_sort_of_integers_like_moe_routing():
    ids = torch.tensor([2, 0, 3, 0, 1, 2, 2, 1])

    def f(ids):
        sorted_ids, perm = torch.sort(ids)
        return sorted_ids * 100 + perm // 2
    check_parity(f, [ids])


# ----------------------------------------------------------------------------- cumsum, histc
def test_cumsum_gradient_is_reversed_running_sum():
    check_parity(lambda x: (torch.cumsum(x, dim=1) ** 2), [_x(3, 5)])


def test_cumsum_of_integers_sums_in_int64():
    check_parity(lambda x: x.cumsum(0) + 1, [torch.tensor([1, 2, 3, 4], dtype=torch.int32)])


def test_cumsum_with_dtype():
    check_parity(lambda x: torch.cumsum(x, -1, dtype=torch.float64) * 3,
                 [_x(2, 4, dtype=torch.float32)], tol=dict(rtol=1e-6, atol=1e-6))


def test_histc_counts():
    x = torch.tensor([0.0, 1.0, 1.0, 3.0, 2.5, 7.0, -1.0])
    check_parity(lambda x: torch.histc(x, bins=4, min=0, max=3) + 0.5, [x])


# ----------------------------------------------------------------------------- integer // and %
def test_integer_floor_division_and_remainder_follow_python():
    a = torch.tensor([-7, -6, -1, 0, 1, 6, 7, 9])
    d = torch.tensor([2, -4, 3, 5, -2, 4, 3, -3])
    check_parity(lambda a, d: (a // d) * 1000 + a % d + (a // 3) * 10 + a % 4, [a, d])


def test_integer_division_by_zero_raises_as_eager():
    f = compiler.compile(lambda a, d: a // d + 1, fullgraph=True)
    a, d = torch.tensor([4, 5]), torch.tensor([2, 1])
    f(a, d)
    f(a, d)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        f(a, torch.tensor([2, 0]))


# ----------------------------------------------------------------------------- grouped matmul
def test_grouped_mm_values_and_gradients():
    a = _x(6, 8, dtype=torch.float32)
    w = _x(3, 8, 4, dtype=torch.float32)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)
    check_parity(lambda a, w, offs: torch._grouped_mm(a, w, offs=offs).tanh(), [a, w, offs],
                 tol=dict(rtol=1e-5, atol=1e-5))


# ----------------------------------------------------------------------------- advanced indexing
def test_several_index_tensors_broadcast():
    i = torch.tensor([[0], [2], [-1]])
    j = torch.tensor([1, 3, 1, 0])
    check_parity(lambda x, i, j: x[i, j] * 2, [_x(4, 5), i, j])


def test_index_tensors_after_a_whole_dim():
    i, j = torch.tensor([0, 2, 2]), torch.tensor([1, 0, 1])
    check_parity(lambda x, i, j: x[:, i, j].exp(), [_x(2, 3, 4), i, j])


def test_several_index_tensors_out_of_range_raise():
    f = compiler.compile(lambda x, i, j: x[i, j], fullgraph=True)
    x = torch.randn(3, 4)
    f(x, torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(IndexError):
        f(x, torch.tensor([3]), torch.tensor([1]))
    with pytest.raises(IndexError):
        x[torch.tensor([3]), torch.tensor([1])]


def test_setitem_with_an_index_tensor_inverse_permutation():
    def f(perm):
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        return inv * 1
    check_parity(f, [torch.tensor([3, 0, 4, 1, 2])], expect_kernels=False)


def test_setitem_values_gradient():
    def f(x, v, idx):
        y = x * 1
        y[idx] = v * 2
        return y.sin()
    check_parity(f, [_x(5, 3), _x(2, 3), torch.tensor([4, 1])])


def test_setitem_boolean_mask_with_a_number():
    def f(x):
        y = x * 2
        y[x > 0] = 0.5
        return y
    check_parity(f, [_x(4, 4)])


def test_index_put_accumulate():
    def f(x, v, i, j):
        return x.index_put((i, j), v, accumulate=True) * 3
    check_parity(f, [_x(3, 4), _x(5), torch.tensor([0, 0, 2, 1, 0]), torch.tensor([1, 1, 3, 0, 1])])


# ----------------------------------------------------------------------------- scatters, one_hot
def test_scatter_add_gradients():
    index = torch.tensor([[0, 1, 0], [2, 2, 1]])
    check_parity(lambda x, src, index: x.scatter_add(1, index, src).cos(), [_x(2, 4), _x(2, 3), index])


def test_scatter_gradients():
    index = torch.tensor([[0, 1, 3], [2, 0, 1]])
    check_parity(lambda x, src, index: torch.scatter(x, 1, index, src) * 2, [_x(2, 4), _x(2, 3), index])


def test_scatter_value_in_place():
    def f(x, index):
        y = x * 1
        y.scatter_(0, index, 7.0)
        return y
    check_parity(f, [_x(3, 2), torch.tensor([[2, 0]])])


def test_index_add_like_moe_combine():
    index = torch.tensor([0, 2, 0, 3])

    def f(x, src, index):
        out = x * 1
        out.index_add_(0, index, src, alpha=0.5)
        return out.tanh()
    check_parity(f, [_x(5, 3), _x(4, 3), index])


def test_index_add_out_of_range_raises():
    f = compiler.compile(lambda x, i, s: x.index_add(0, i, s), fullgraph=True)
    x, s = torch.zeros(3, 2), torch.ones(1, 2)
    f(x, torch.tensor([1]), s)
    with pytest.raises((IndexError, RuntimeError)):
        f(x, torch.tensor([5]), s)


def test_one_hot():
    check_parity(lambda i: F.one_hot(i, num_classes=5) * 3, [torch.tensor([[0, 4], [2, 2]])])


def test_one_hot_out_of_range_raises():
    f = compiler.compile(lambda i: F.one_hot(i, num_classes=3) + 1, fullgraph=True)
    f(torch.tensor([0, 2]))
    with pytest.raises((IndexError, RuntimeError)):
        f(torch.tensor([0, 3]))
    with pytest.raises(RuntimeError):
        F.one_hot(torch.tensor([0, 3]), num_classes=3)


def test_setitem_out_of_range_raises_as_eager():
    def f(x, idx):
        y = x * 1
        y[idx] = 2.0
        return y
    compiled = compiler.compile(f, fullgraph=True)
    x = torch.randn(4, 2)
    compiled(x, torch.tensor([1, 3]))
    with pytest.raises(IndexError):
        compiled(x, torch.tensor([1, 4]))
    with pytest.raises(IndexError):
        f(x, torch.tensor([1, 4]))


def test_scatter_add_out_of_range_raises_as_eager():
    f = compiler.compile(lambda x, i, s: x.scatter_add(0, i, s), fullgraph=True)
    x, s = torch.zeros(3), torch.ones(2)
    f(x, torch.tensor([0, 2]), s)
    with pytest.raises(RuntimeError, match="out of bounds"):
        f(x, torch.tensor([0, 3]), s)
    with pytest.raises(RuntimeError, match="out of bounds"):
        x.scatter_add(0, torch.tensor([0, 3]), s)


@pytest.mark.allows_eager("a fallback with its reason: what it tests")
def test_setitem_boolean_mask_with_a_value_that_requires_grad_runs_eagerly():
    def f(x, v):
        y = x * 1
        y[x > 0] = v
        return y.sum()
    x, v = torch.randn(5), torch.tensor(2.0, requires_grad=True)
    report = compiler.explain(f, x, v)
    assert any("boolean mask" in r for r in report.fallbacks)


def test_moe_routing_like_transformers_grouped_mm():
    """Tokens sorted by expert, counted with histc, offsets by cumsum, one grouped matmul, the
    inverse permutation written with x[perm] = arange, combined with a sum over top-k."""
    torch.manual_seed(0)
    hidden, weight = _x(5, 8, dtype=torch.float32), _x(3, 8, 4, dtype=torch.float32)
    router = _x(5, 3, dtype=torch.float32)

    def moe(hidden, weight, router):
        weights, experts = torch.topk(router.softmax(-1), 2, dim=-1)
        expert_ids = experts.reshape(-1)
        sorted_ids, perm = torch.sort(expert_ids)
        tokens = hidden[perm // 2]
        counts = torch.histc(sorted_ids.float(), bins=3, min=0, max=2)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        out = torch._grouped_mm(tokens, weight, offs=offsets) * weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.size(0))
        return out[inverse].view(5, 2, 4).sum(1)
    check_parity(moe, [hidden, weight, router], tol=dict(rtol=1e-5, atol=1e-5))
