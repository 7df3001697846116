"""Column sums beside their rows (fusion.split_column_sum): a norm's weight and bias gradients
(sums over the rows of values the input-gradient kernel reads anyway) are computed by that kernel,
each program summing one chunk of rows into a [chunks, N] buffer, then a small kernel sums the
chunks; before, a kernel of their own read the rows from memory again (layer_norm / rms_norm
backward at (32768, 4096): 1.67x the minimal bytes)."""

import re

import pytest
import torch
import torch.nn.functional as F

import compiler
from compiler.fusion import fuse as fusion
from compiler.fusion import tiling
from tests.parity import check_parity, clone_inputs, run_eager
from tests.small_grids import fewer_programs

# enough rows for MIN_PROGRAMS chunks of COLUMN_CHUNK_MIN_ROWS rows; a row not a power of two
ROWS, COLS = tiling.MIN_PROGRAMS * fusion.COLUMN_CHUNK_MIN_ROWS * 2, 96
TOL = dict(rtol=1e-4, atol=1e-3)


def _rows(monkeypatch) -> int:
    """Rows for a value test: as ROWS, for the MIN_PROGRAMS in effect (tests/small_grids.py)."""
    return fewer_programs(monkeypatch) * fusion.COLUMN_CHUNK_MIN_ROWS * 2


def _assert_beside_the_rows(fn, args):
    """The backward's first kernel sums the chunks' columns (the path the value tests check)."""
    rows_kernel = compiler.explain(fn, *args).backward_kernels[0]
    assert rows_kernel.source.count("for xoffset") == 1 and "cacc0" in rows_kernel.source


def layer_norm(x, w, b):
    return F.layer_norm(x, (COLS,), w, b)


def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _args(dtype, n, rows=ROWS):
    torch.manual_seed(0)
    return [torch.randn(rows, COLS, dtype=dtype, requires_grad=True)] + \
        [torch.randn(COLS, dtype=dtype, requires_grad=True) for _ in range(n)]


@pytest.mark.parametrize("fn,n", [(layer_norm, 2), (rms_norm, 1)], ids=["layer_norm", "rms_norm"])
def test_norm_weight_gradients_beside_the_rows_match_eager(fn, n, monkeypatch):
    rows = _rows(monkeypatch)
    _assert_beside_the_rows(fn, _args(torch.float32, n, rows))
    check_parity(fn, _args(torch.float32, n, rows), tol=TOL, grad_seed=torch.randn(rows, COLS))


@pytest.mark.parametrize("fn,n", [(layer_norm, 2), (rms_norm, 1)], ids=["layer_norm", "rms_norm"])
def test_bf16_norm_weight_gradients_are_as_close_to_exact_as_eager(fn, n, monkeypatch):
    """bf16: eager's CPU kernels round the sums over the rows as they go (off by tens at 16896 rows);
    ours sum in fp32, so both are compared with the float64 gradients."""
    rows = _rows(monkeypatch)
    args, grad = _args(torch.bfloat16, n, rows), torch.randn(rows, COLS).to(torch.bfloat16)
    _assert_beside_the_rows(fn, args)
    exact = run_eager(fn, [a.double().detach().requires_grad_() for a in args], grad.double())[1]
    eager = run_eager(fn, args, grad)[1]
    compiled = compiler.compile(fn, backend="interpret", fullgraph=True)
    compiled(*clone_inputs(args))                       # records
    inputs = clone_inputs(args)
    compiled(*inputs).backward(grad)
    assert compiled.last_backend == "interpret" and compiled.stats["kernel_launches"] > 0
    for a, e, x in zip(inputs, eager, exact):
        ours_error, eager_error = (a.grad.double() - x).abs().max(), (e.double() - x).abs().max()
        assert ours_error <= eager_error + 0.01 * x.abs().max(), (ours_error, eager_error)


@pytest.mark.parametrize("dims", ["2d", "3d"])
@pytest.mark.parametrize("fn,n", [(layer_norm, 2), (rms_norm, 1)], ids=["layer_norm", "rms_norm"])
def test_norm_backward_reads_its_rows_once(fn, n, dims):
    """Also the sums over B and T of a (B, T, C) norm's backward (3d): computed beside the rows as
    the 2-D ones (was: a kernel of their own re-reading x and grad, 1.67x the minimal bytes)."""
    report = compiler.explain(fn, *(_args(torch.float32, n) if dims == "2d" else _args_3d(n)))
    rows, *small = report.backward_kernels
    # the input gradient's kernel also sums the weight (and bias) gradients' chunks; the chunks are
    # summed by one small kernel (was: a second kernel re-reading x and grad for the column sums)
    assert len(report.backward_kernels) == 2, report
    assert rows.source.count("for xoffset") == 1 and "cacc0" in rows.source
    activation = ROWS * COLS * 4
    # x and grad in, grad_x out; plus the row statistics and the [chunks, N] partial sums
    assert rows.bytes_moved < 3 * activation * 1.1, rows.bytes_moved
    assert small[0].bytes_moved < activation * 0.1


def test_column_sum_without_row_sums_keeps_its_split():
    """A column sum with no row kernel beside it (a bias gradient) keeps the plain split."""
    x = torch.randn(ROWS, COLS, requires_grad=True)
    report = compiler.explain(lambda x: (x * 2).sum(0), x)
    assert all("for xoffset" not in k.source for k in report.forward_kernels)


def complex_gate(z, w, b):
    u = z * w + b
    return u * torch.sigmoid(u.abs())


def _complex_args(rows=2048):
    torch.manual_seed(0)
    return [torch.randn(rows, 64, dtype=torch.complex64, requires_grad=True),
            torch.randn(64, dtype=torch.complex64, requires_grad=True),
            torch.randn(64, dtype=torch.complex64, requires_grad=True)]


def test_elementwise_gradient_and_its_column_sums_match_eager(monkeypatch):
    rows = 2048 if fewer_programs(monkeypatch) == tiling.MIN_PROGRAMS else 128   # 4 chunks of 32 rows
    assert len(compiler.explain(complex_gate, *_complex_args(rows)).backward_kernels) == 2
    check_parity(complex_gate, _complex_args(rows), tol=TOL, grad_seed=torch.randn(rows, 64, dtype=torch.complex64))


def test_elementwise_gradient_is_stored_by_its_column_sums_kernel():
    """The complex gate's backward: z's gradient is stored by the loop that sums the gain's and the
    bias's gradients over chunks of rows (KernelPlan.loops_over_chunks), computed once per element;
    was a kernel for z's gradient and another re-reading z and grad for the column sums (the
    benchmark's (8192, 8192): 1.67x the minimal bytes)."""
    report = compiler.explain(complex_gate, *_complex_args())
    first, second = report.backward_kernels
    assert first.source.count("tl.exp(") == 1, "the sigmoid's backward is computed once an element"
    z_bytes = 2048 * 64 * 8
    assert first.bytes_moved < 3 * z_bytes * 1.05, first.bytes_moved   # z, grad in; z's gradient out
    assert second.bytes_moved < 0.05 * z_bytes


# A (B, T, C) activation (a transformer's): the weight gradients sum over B and T, as the (B*T, C) rows.
BATCH = 4


def _args_3d(n, rows=ROWS):
    torch.manual_seed(0)
    return [torch.randn(BATCH, rows // BATCH, COLS, requires_grad=True)] + \
        [torch.randn(COLS, requires_grad=True) for _ in range(n)]


@pytest.mark.parametrize("fn,n", [(layer_norm, 2), (rms_norm, 1)], ids=["layer_norm", "rms_norm"])
def test_3d_norm_weight_gradients_beside_the_rows_match_eager(fn, n, monkeypatch):
    rows = _rows(monkeypatch)
    _assert_beside_the_rows(fn, _args_3d(n, rows))
    check_parity(fn, _args_3d(n, rows), tol=TOL, grad_seed=torch.randn(BATCH, rows // BATCH, COLS))


def _launch_shape(kernel):
    """(xnumel, XBLOCK, RBLOCK) of a kernel's source."""
    def number(pattern):
        return int(re.search(pattern, kernel.source).group(1))
    return number(r"xmask = xindex < (\d+)"), number(r"XBLOCK_DEFAULT = (\d+)"), number(r"RBLOCK_DEFAULT = (\d+)")


def test_3d_column_sum_without_row_sums_runs_as_the_2d_one():
    """A bias gradient over (B, T, C) is split and tiled as the (B*T, C) one: a tile of contiguous
    columns a program, chunks of rows, then the chunks summed."""
    x3 = torch.randn(BATCH, ROWS // BATCH, COLS, requires_grad=True)
    x2 = x3.detach().reshape(ROWS, COLS).requires_grad_()
    three = compiler.explain(lambda x: (x * 2).sum((0, 1)), x3).forward_kernels
    two = compiler.explain(lambda x: (x * 2).sum(0), x2).forward_kernels
    assert len(three) == len(two) == 2
    assert [_launch_shape(k) for k in three] == [_launch_shape(k) for k in two]


def test_3d_column_sum_without_row_sums_matches_eager(monkeypatch):
    x = torch.randn(BATCH, _rows(monkeypatch) // BATCH, COLS, requires_grad=True)
    check_parity(lambda x: (x * 2).sum((0, 1)), [x], tol=TOL)


def test_a_bias_gradient_joins_the_norms_column_sums_over_the_same_rows():
    """A residual block's output projection: its bias gradient is the column sum of the residual's
    gradient, which the final norm's backward computes. With rows too few to split among that
    row kernel's programs, the sum over (B, T) joins the kernel summing the norms' weight and bias
    gradients over the same rows (3 backward kernels, was 4: one of its own), eager's values."""
    torch.manual_seed(0)
    ln, fc, ln_f = torch.nn.LayerNorm(32), torch.nn.Linear(32, 32), torch.nn.LayerNorm(32)
    x = torch.randn(2, 8, 32, requires_grad=True)

    def block(x):
        return (ln_f(x + fc(ln(x))) ** 2).sum()
    report = compiler.explain(compiler.compile(block, backend="interpret"), x)
    assert len(report.backward_kernels) == 3, [k.name for k in report.backward_kernels]
    params = [*ln.parameters(), *fc.parameters(), *ln_f.parameters()]
    compiled = compiler.compile(block, backend="interpret")
    compiled(x)                                   # the recording
    compiled(x).backward()                        # a replay: the bias gradient from the column sums
    ours = [p.grad for p in params]
    for p in params:
        p.grad = None
    block(x).backward()
    for got, p in zip(ours, params):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-4)
