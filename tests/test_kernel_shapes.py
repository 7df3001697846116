"""Kernel shapes a GPU user gets, checked without a GPU: launches are recorded (not run) and
compiled for Hopper (sm_90) as they would launch (see tests/sm90.py).

- No kernel of a LayerNorm -> GELU -> Linear block's forward and backward spills registers
  (fixed 4-warp 4x1024 tiles did, in fp32 and bf16).
- Reductions get enough programs to fill an H100 (132 SMs): column sums of a tall tensor and
  a few very long rows are split in two stages.
- Column sums load whole vectors of contiguous columns.
"""

import pytest
import torch

import compiler
from compiler.tiling import MIN_PROGRAMS
from tests.sm90 import compile_for_sm90, layer_norm_gelu_linear, recorded_launches


def _launches(fn, *args):
    f = compiler.compile(fn)
    out = f(*args)  # the first call records eagerly
    if out.requires_grad:
        out.backward()
    with recorded_launches() as launches:
        out = f(*args)
        if out.requires_grad:
            out.backward()
    return launches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_norm_gelu_linear_kernels_do_not_spill_on_hopper(dtype):
    block, x = layer_norm_gelu_linear(4096, 1024, dtype)
    stats = compile_for_sm90(_launches(block, x))
    table = "\n".join(f"{s.name}: grid {s.grid}, {s.num_warps} warps, {s.constants}, {s.registers} registers, "
                      f"{s.spill_bytes} B spilled, {s.vector_loads}/{s.global_loads} vector loads" for s in stats)
    assert len(stats) >= 4, table
    assert all(s.spill_bytes == 0 for s in stats), table
    # the input gradient's kernel (a row reduction) and the norm weight/bias gradients
    # (column sums) read their big operands with vector loads
    assert all(s.vector_load_share >= 0.5 for s in stats if s.global_loads >= 4), table


@pytest.mark.parametrize("shape, dim", [((1 << 20, 16), 0), ((8, 1 << 22), 1), ((4096, 1024), 0), ((1 << 22,), 0)],
                         ids=str)
def test_starved_reductions_are_split_to_fill_the_gpu(shape, dim):
    x = torch.randn(shape)
    launches = _launches(lambda x: x.sum(dim), x)
    assert len(launches) == 2, [(launch.name, launch.grid) for launch in launches]
    assert launches[0].grid >= MIN_PROGRAMS - 8, [(launch.name, launch.grid) for launch in launches]


def test_column_sums_load_vectors_of_contiguous_columns():
    x = torch.randn(4096, 1024)
    stats = compile_for_sm90(_launches(lambda x: x.sum(0), x))
    first = stats[0]
    assert first.constants["XBLOCK"] >= 32 and first.vector_loads == first.global_loads, stats
