"""Values of reductions in every layout the kernels use, against eager: column sums (a tile of
contiguous columns per program, looping over rows), rows split in two stages (partial
results, then a small reduction), persistent rows, keepdim, and the dtypes reductions take."""

import pytest
import torch

import compiler
from tests.devices import KERNELS  # noqa: E402  (the CUDA test mode's: tests/devices.py)
from tests.parity import check_parity

TOL = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float32: dict(rtol=1e-4, atol=1e-4),    # thousands of terms summed in another order than eager's
       torch.float64: None}


def _tol(dtype):
    return TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1000, 24), (1500, 40), (40, 7), (200, 96)], ids=str)
def test_column_sums(shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    check_parity(lambda x: (x * 2).sum(0), [x], tol=_tol(dtype))
    check_parity(lambda x: x.mean(0, keepdim=True) * x, [x], tol=_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape, dim", [((8, 5000), 1), ((3, 4999), 1), ((6, 3, 4500), (0, 2)),
                                        ((1 << 12, 3), 0), ((5, 900, 2), 1)], ids=str)
def test_starved_reductions_split_in_two_stages(shape, dim, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    check_parity(lambda x: x.sum(dim), [x], tol=_tol(dtype))
    check_parity(lambda x: x.mean(dim, keepdim=True), [x], tol=_tol(dtype))


@pytest.mark.parametrize("shape, dim", [((1 << 14,), 0), ((8, 5000), 1), ((1 << 12, 4), 0)], ids=str)
def test_split_amax_is_the_max_and_keeps_nan(shape, dim):
    torch.manual_seed(0)
    x = torch.randn(shape)
    f = compiler.compile(lambda x: x.amax(dim), backend=KERNELS)
    f(x)
    torch.testing.assert_close(f(x), x.amax(dim))   # the partial maxima were summed
    x.view(-1)[1234] = float("nan")
    torch.testing.assert_close(f(x), x.amax(dim), equal_nan=True)


def test_split_amax_gradient_is_shared_among_ties():
    x = torch.zeros(1 << 14, requires_grad=True)
    check_parity(lambda x: (x * 1.0).amax(), [x])


def test_column_sums_of_a_fused_chain_with_row_statistics():
    """A layer norm's weight gradient: column sums of a chain that reads per-row statistics."""
    torch.manual_seed(0)
    x = torch.randn(1000, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    b = torch.randn(40, requires_grad=True)
    check_parity(lambda x, w, b: torch.nn.functional.layer_norm(x, (40,), w, b).sin(), [x, w, b],
                 tol=dict(rtol=1e-4, atol=1e-4))
