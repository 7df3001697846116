"""Generated kernels compile for Hopper (sm_90) with Triton's real compiler, and do not spill.

The interpreter accepts code the GPU compiler may reject, and cannot tell a kernel that spills
registers from one that does not. Each kernel here goes through ``triton.compile`` with
``GPUTarget("cuda", 90, 32)`` — no GPU needed — in worker processes without TRITON_INTERPRET
(``benchmarks/sm90.py``), in two sets:

- **representative**: every kernel of benchmark workloads at moderate sizes — rows of 8192
  reduced in several RBLOCK steps, pointwise tiles of 1024, a transformer step — in float32
  and bfloat16 (the transformer under autocast), each compiled with the specialization its
  real launch gets (strides equal to 1 as constants, 16-byte alignment: what decides
  vectorized loads and registers). They must compile and must not spill registers.
- **the suite's**: the kernels the other tests generated (tiny shapes) in this session's kernel
  cache, one per family of ops and at most SUITE_SAMPLE (``SYMGRAD_HOPPER_ALL_KERNELS=1``: every
  one, minutes more), with aligned pointers and unspecialized strides. They must compile.

Ordered last by conftest.py. About 90 kernels of the representative set and 120 of the suite:
~10 s of tracing and ~0.5 s of CPU per kernel, over two compile workers.
"""

import os

import pytest
import torch

from benchmarks.sm90 import compile_launches, generic_launch
from benchmarks.step_trace import trace_workload
from compiler.fusion import tiling
from runtime.kernels import cache_dir

# NOTE: spills are a performance defect, not a wrong result; a kernel that spills is named with
# its spill bytes. Set to False only to land a change that knowingly adds spills.
ASSERT_NO_SPILLS = True

# Of the suite's ~300 kernel families, this many are compiled by default (~0.5 s each on one core).
SUITE_SAMPLE = 120

# (workload, sizes, dtype): moderate sizes that keep the kernels' real shapes (multi-block
# reductions, large tiles) while tracing stays quick (matmuls are never computed).
REPRESENTATIVE = [
    ("gelu", dict(t=32, i=8192), torch.float32),
    ("rmsnorm", dict(rows=32, cols=8192), torch.float32),
    ("softmax", dict(rows=16, vocab=8192), torch.float32),
    # long rows held whole in one block of 32 warps (tiling.holds_row): 16384 forward (one row
    # value) and backward (two), 32768 forward (its backward, two values, loops over the row twice
    # in one kernel: tiling.rereads_row_from_l2); rows
    # enough (>= tiling.MIN_PROGRAMS) that they are not split
    ("softmax", dict(rows=300, vocab=16384), torch.float32),
    ("softmax", dict(rows=300, vocab=16384), torch.bfloat16),
    ("softmax", dict(rows=300, vocab=32768), torch.float32),
    ("softmax", dict(rows=300, vocab=32768), torch.bfloat16),   # 64 registers: at the cap
    ("complex", dict(rows=1024, cols=1024), torch.float32),   # column sums of 1024 rows: 4x1024 tiles
    ("cnn_step", dict(batch=8, channels=128, size=32, classes=1000), torch.float32),
    ("swiglu", dict(t=32, i=8192), torch.bfloat16),
    # rows of 1024 (LayerNorm) and 5120 tokens: sums over tokens loop in RBLOCK steps, as at full
    # size; the cross-entropy over a vocabulary of 8192 too
    ("transformer_step", dict(batch=10, seq=512, dim=1024, heads=8, vocab=8192), torch.bfloat16),
    # the full size's 8192 tokens: the cross-entropy's target mask, valid count and picked log-probs
    # in one looped kernel (four loads, two of them int64 targets; spilled 4 B at 2048 a step)
    ("transformer_step", dict(batch=8, seq=1024, dim=128, heads=2, vocab=16384), torch.float32),
]


@pytest.fixture(scope="module")
def compiled():
    """(representative results, suite results): one compile run for both tests."""
    representative = []
    for name, sizes, dtype in REPRESENTATIVE:
        trace = trace_workload(name, sizes, dtype)
        label = f"{name} {trace.dtype} {'x'.join(str(v) for v in sizes.values())}"
        representative += [(label, ours.launch) for ours in trace.launches]
    suite = [("suite", launch) for launch in _suite_kernels(cache_dir())]
    launches = representative + suite
    results = compile_launches([launch for _, launch in launches], processes=2, cache_dir=cache_dir())
    rows = [(label, launch, result) for (label, launch), result in zip(launches, results)]
    return rows[:len(representative)], rows[len(representative):]


def _suite_kernels(directory: str) -> list:
    """The kernels the suite generated (files in the kernel cache): one per family (kernels named
    by the same ops, ``fused_abs_add_pw``, differ in sizes, dtypes and index arithmetic), at most
    SUITE_SAMPLE of them; every one with SYMGRAD_HOPPER_ALL_KERNELS=1 (~800 kernels: minutes)."""
    every = os.environ.get("SYMGRAD_HOPPER_ALL_KERNELS", "") not in ("", "0")
    families, files = set(), []
    for file in sorted(os.listdir(directory)):
        family = file.rsplit("_", 1)[0]
        if file.startswith("optimizer_"):
            continue  # optimizer steps' combo kernels: compiled with their real arguments in test_optimizer_step.py
        if file.endswith(".py") and (every or family not in families):
            families.add(family)
            files.append(file)
    if not every and len(files) > SUITE_SAMPLE:   # evenly spread over the families' names
        files = [files[i * len(files) // SUITE_SAMPLE] for i in range(SUITE_SAMPLE)]
    launches = []
    for file in files:
        with open(os.path.join(directory, file)) as f:
            launches.append(generic_launch(file[:-3], f.read()))
    return launches


def test_every_generated_kernel_compiles_for_hopper(compiled):
    representative, suite = compiled
    assert len(representative) >= 30, "the representative set lost kernels: did a workload stop compiling?"
    failures = [f"{launch.name} ({label}): {result['error']}" for label, launch, result in representative + suite
                if result["error"]]
    assert not failures, f"{len(failures)} kernels do not compile for sm_90:\n" + "\n".join(failures)


def test_representative_set_holds_long_rows_whole(compiled):
    """The no-spill check below covers the long-row kernels the register rule admits."""
    representative, _ = compiled
    long_rows = {(label.split()[1], launch.name) for label, launch, _ in representative   # (dtype, kernel)
                 if label.startswith("softmax") and launch.constexprs["RBLOCK"] > tiling.PERSISTENT_MAX
                 and launch.num_warps == tiling.LONG_ROW_WARPS}
    per_dtype = {dtype: sum(1 for d, _ in long_rows if d == dtype) for dtype, _ in long_rows}
    # forward and backward, fp32 and bf16; and the row of 32768 (fp32 forward)
    assert len(per_dtype) == 2 and min(per_dtype.values()) >= 2, long_rows
    assert any(launch.constexprs["RBLOCK"] == tiling.LONG_ROW_MAX and launch.num_warps == tiling.LONG_ROW_WARPS
               for _, launch, _ in representative)


def test_representative_kernels_do_not_spill_on_hopper(compiled):
    representative, _ = compiled
    assert all(result["registers"] for _, _, result in representative), "ptxas reported no register counts"
    spills = [f"{launch.name} ({label}): {result['spill_bytes']} bytes spilled, {result['registers']} registers, "
              f"XBLOCK={launch.constexprs['XBLOCK']} RBLOCK={launch.constexprs['RBLOCK']}, {launch.num_warps} warps"
              for label, launch, result in representative if result["spill_bytes"]]
    if ASSERT_NO_SPILLS:
        assert not spills, f"{len(spills)} kernels spill registers on sm_90:\n" + "\n".join(spills)
