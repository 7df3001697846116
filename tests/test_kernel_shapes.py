"""Kernel shapes a GPU user gets, checked without a GPU: launches are recorded (not run) and
compiled for Hopper (sm_90) as they would launch (see benchmarks/sm90.py).

- No kernel of a LayerNorm -> GELU -> Linear block's forward and backward spills registers
  (fixed 4-warp 4x1024 tiles did, in fp32 and bf16).
- Reductions get enough programs to fill an H100 (132 SMs): column sums of a tall tensor and
  a few very long rows are split in two stages.
- Column sums load whole vectors of contiguous columns.
"""

import pytest
import torch

import compiler
from benchmarks.sm90 import compile_launches, recorded_launches
from compiler.fusion.tiling import MIN_PROGRAMS


def layer_norm_gelu_linear(rows: int, dim: int, dtype: torch.dtype):
    """The block the spill checks use: LayerNorm -> GELU -> Linear, summed (a step's loss)."""
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(dim).to(dtype)
    linear = torch.nn.Linear(dim, dim).to(dtype)

    def block(x):
        return linear(torch.nn.functional.gelu(norm(x))).float().sum()

    x = torch.randn(rows, dim, dtype=dtype, requires_grad=True)
    return block, x


def _launches(fn, *args):
    f = compiler.compile(fn)
    out = f(*args)  # the first call records eagerly
    if out.requires_grad:
        out.backward()
    # matmuls run on the meta device: only their outputs' shapes matter here
    with recorded_launches(compute_extern_calls=False) as launches:
        out = f(*args)
        if out.requires_grad:
            out.backward()
    return launches


def _compiled(launches):
    """Each distinct launch (kernel and specialization) with its sm_90 result."""
    unique = list({launch.key(): launch for launch in launches}.values())
    results = compile_launches(unique)
    assert [r["error"] for r in results] == [None] * len(results), results
    return list(zip(unique, results))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_norm_gelu_linear_kernels_do_not_spill_on_hopper(dtype):
    block, x = layer_norm_gelu_linear(4096, 1024, dtype)
    compiled = _compiled(_launches(block, x))
    table = "\n".join(f"{launch.name}: grid {launch.grid}, {launch.num_warps} warps, {launch.constexprs}, "
                      f"{r['registers']} registers, {r['spill_bytes']}+{r['spill_loads']} B spilled, "
                      f"{r['vector_loads']}/{r['loads'] - r['broadcast_loads']} streamed loads vectorized"
                      for launch, r in compiled)
    assert len(compiled) >= 4, table
    assert all(r["spill_bytes"] == 0 and r["spill_loads"] == 0 for _, r in compiled), table
    # the input gradient's kernel (a row reduction) and the norm weight/bias gradients
    # (column sums) read their big operands with vector loads
    assert all(r["vector_share"] >= 0.5 for _, r in compiled if r["loads"] >= 4), table


@pytest.mark.parametrize("shape, dim", [((1 << 20, 16), 0), ((8, 1 << 22), 1), ((4096, 1024), 0), ((1 << 22,), 0)],
                         ids=str)
def test_starved_reductions_are_split_to_fill_the_gpu(shape, dim):
    x = torch.randn(shape)
    launches = _launches(lambda x: x.sum(dim), x)
    assert len(launches) == 2, [(launch.name, launch.grid) for launch in launches]
    assert launches[0].grid >= MIN_PROGRAMS - 8, [(launch.name, launch.grid) for launch in launches]


def test_column_sums_load_vectors_of_contiguous_columns():
    x = torch.randn(4096, 1024)
    (first, result), = _compiled(_launches(lambda x: x.sum(0), x)[:1])   # the column sums' chunks (not their sum)
    assert first.constexprs["XBLOCK"] >= 32 and result["vector_loads"] == result["loads"], (first, result)
