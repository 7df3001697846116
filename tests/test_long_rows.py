"""Softmax over rows longer than PERSISTENT_MAX that still fit the registers of one block
(``tiling.holds_row``): the whole row is held in one program of LONG_ROW_WARPS warps, so the
forward and the backward each read their inputs once and write once, in one kernel; values and
gradients as eager gives. Rows past LONG_ROW_MAX stay on the looped kernels
(tests/test_online_softmax.py)."""

import pytest
import torch

import compiler
from compiler.fusion import tiling
from tests.parity import check_parity
from tests.small_grids import fewer_programs

# enough rows that the reductions are not split (tiling.MIN_PROGRAMS programs), rows past one
# ordinary block and not a power of two (a masked tail in the block)
ROWS, COLS = tiling.MIN_PROGRAMS, 6000
assert tiling.PERSISTENT_MAX < COLS <= tiling.LONG_ROW_MAX

# bf16: the gradient g - p * sum(g) cancels
TOL = {torch.float32: dict(rtol=1e-4, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=5e-2)}


def _rows(monkeypatch) -> int:
    """Rows for a value test: enough that its reductions are not split at the MIN_PROGRAMS in effect
    (lowered by tests/small_grids.py, so the interpreter runs 16 long rows, not 264)."""
    return max(16, fewer_programs(monkeypatch))


def _input(dtype, rows=ROWS):
    torch.manual_seed(0)
    x = torch.randn(rows, COLS, dtype=torch.float64) * 3
    x[torch.rand(rows, COLS) < 0.1] = float("-inf")   # masked entries
    x[7, 5990:] = 40.0                                  # the max at the end of the row
    return x.to(dtype).requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_long_row_values_and_gradients_match_eager(op, dtype, monkeypatch):
    fn, rows = getattr(torch, op), _rows(monkeypatch)
    _assert_kernels(lambda x: fn(x, -1), _input(dtype, rows), [1, 1], row_loops=0)
    check_parity(lambda x: fn(x, -1), [_input(dtype, rows)], tol=TOL[dtype],
                 grad_seed=torch.randn(rows, COLS, dtype=torch.float64).to(dtype))


def _assert_kernels(fn, x, counts, row_loops):
    """The path a value test checks: kernels a phase, and loops over the row in each."""
    report = compiler.explain(fn, x)
    assert [len(report.forward_kernels), len(report.backward_kernels)] == counts, report
    assert all(k.source.count("for roffset") == row_loops for k in report.forward_kernels + report.backward_kernels)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_long_row_softmax_is_one_kernel_per_phase(op):
    x = torch.randn(ROWS, COLS, requires_grad=True)
    report = compiler.explain(lambda x: getattr(torch, op)(x, -1), x)
    # was 2 and 2: an online max-and-sum pass, then a pass that reads the row again
    assert [len(report.forward_kernels), len(report.backward_kernels)] == [1, 1], report
    source = report.forward_kernels[0].source
    assert f"NUM_WARPS = {tiling.LONG_ROW_WARPS}" in source and "for roffset" not in source


def test_long_row_max_propagates_nan_as_eager(monkeypatch):
    """A long row's max is one NaN-propagating reduction (codegen/reductions.py): a NaN anywhere in
    a row makes its softmax NaN, as eager's; an infinite row too."""
    rows = _rows(monkeypatch)
    x = _input(torch.float32, rows).detach()
    x[3, 17], x[9, 5999], x[11, :] = float("nan"), float("nan"), float("inf")
    _assert_kernels(lambda x: torch.softmax(x, -1), x.requires_grad_(), [1, 1], row_loops=0)
    check_parity(lambda x: torch.softmax(x, -1), [x], tol=TOL[torch.float32],
                 grad_seed=torch.randn(rows, COLS))


def _looped(monkeypatch):
    """LONG_ROW_MAX lowered, so the interpreter runs a short row on the path a row past it takes."""
    monkeypatch.setattr(tiling, "LONG_ROW_MAX", tiling.PERSISTENT_MAX)


def test_rows_past_the_register_file_loop_twice_in_one_kernel(monkeypatch):
    """A row the registers cannot hold is looped over twice in one kernel: its max and sum (online),
    then the values that read them (forward); its sum of grad * softmax, then the gradient
    (backward), as eager's cunn_SoftMaxBackward does: the second loop finds the row in L2
    (``tiling.rereads_row_from_l2``), so the phase moves each input once. Was two kernels a phase,
    the second reading the row from memory again (softmax backward at (8192, 32768): 1.67x the
    minimal bytes)."""
    _looped(monkeypatch)
    x = torch.randn(ROWS, COLS, requires_grad=True)
    report = compiler.explain(lambda x: torch.softmax(x, -1), x)
    assert [len(report.forward_kernels), len(report.backward_kernels)] == [1, 1], report
    for kernel in report.forward_kernels + report.backward_kernels:
        assert kernel.source.count("for roffset") == 2
        assert f"NUM_WARPS = {tiling.TWO_PASS_WARPS}" in kernel.source
    row_bytes = ROWS * COLS * 4
    # forward: x in, y out; backward: x (softmax recomputed from x and its row statistics) and
    # grad in, grad_x out; plus a few values a row
    assert report.forward_kernels[0].bytes_moved < 2 * row_bytes + 64 * ROWS
    assert report.backward_kernels[0].bytes_moved < 3 * row_bytes + 64 * ROWS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_rows_looped_twice_give_eager_values_and_gradients(op, dtype, monkeypatch):
    _looped(monkeypatch)
    fn, rows = getattr(torch, op), _rows(monkeypatch)
    _assert_kernels(lambda x: fn(x, -1), _input(dtype, rows), [1, 1], row_loops=2)
    check_parity(lambda x: fn(x, -1), [_input(dtype, rows)], tol=TOL[dtype],
                 grad_seed=torch.randn(rows, COLS, dtype=torch.float64).to(dtype))


def test_rows_past_l2_take_a_second_kernel(monkeypatch):
    """Where the rows in flight would not fit L2, the second loop is a kernel of its own."""
    _looped(monkeypatch)
    monkeypatch.setattr(tiling, "L2_BYTES", tiling.SM_COUNT * COLS * 4 - 1)
    x = torch.randn(ROWS, COLS, requires_grad=True)
    report = compiler.explain(lambda x: torch.softmax(x, -1), x)
    assert [len(report.forward_kernels), len(report.backward_kernels)] == [2, 2], report
    assert "for roffset" in report.forward_kernels[0].source


def test_softmax_backward_at_full_size_rereads_from_l2():
    """The benchmark's softmax (8192, 32768) fp32 backward: two row values do not fit the registers
    of one block (holds_row), but fit L2 for a second loop."""
    assert not tiling.holds_row((8192, 32768), (1,), row_values=2)
    assert tiling.rereads_row_from_l2((8192, 32768), (1,), [4, 4])
    assert not tiling.rereads_row_from_l2((8192, 65536), (1,), [4, 4])
