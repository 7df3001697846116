"""``python -m benchmarks.kernels``: its JSON schema and numbers, and the pieces it is built of —
the roofline, eager operators' costs, and Triton's launch specialization for sm_90."""

import json

import pytest
import torch

from benchmarks import kernels, roofline
from benchmarks.sm90 import Launch, compile_launches, generic_launch, load_counts

KERNEL_KEYS = {"workload", "phase", "name", "grid", "xblock", "rblock", "num_warps", "registers", "spill_bytes",
               "vector_share", "bytes", "predicted_us"}
WORKLOAD_KEYS = {"workload", "phase", "bytes", "min_bytes", "ours_us", "eager_us"}


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    path = tmp_path_factory.mktemp("kernels") / "tiny.json"
    assert kernels.main(["--size", "tiny", "--only", "gelu,layernorm", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_json_has_a_row_per_kernel_and_per_workload_phase(doc):
    assert doc["failures"] == []
    expected = {(name, phase) for name in ("gelu", "layernorm") for phase in ("forward", "backward")}
    assert {(k["workload"], k["phase"]) for k in doc["kernels"]} >= expected
    for k in doc["kernels"]:
        assert KERNEL_KEYS <= k.keys()
        assert k["error"] is None and k["registers"] > 0 and k["spill_bytes"] >= 0
        assert k["predicted_us"] > roofline.LAUNCH_US and k["bytes"] > 0 and k["grid"] >= 1
        assert 0 <= k["vector_share"] <= 1
    phases = {(w["workload"], w["phase"]) for w in doc["workloads"]}
    assert phases == {(n, p) for n in ("gelu", "layernorm") for p in ("forward", "backward", "step")}
    for w in doc["workloads"]:
        assert WORKLOAD_KEYS <= w.keys()
        assert 0 < w["min_bytes"] <= w["bytes"], w
        assert w["ours_us"] > roofline.LAUNCH_US and w["eager_us"] > roofline.LAUNCH_US


def test_gelu_is_one_kernel_per_phase_at_the_minimum_bytes(doc):
    # gelu forward reads x and writes y; backward reads x and grad_out and writes grad_x: one
    # fused kernel each moves exactly that, as eager's single gelu / gelu_backward operators do.
    for w in doc["workloads"]:
        if w["workload"] == "gelu":
            assert w["bytes"] == w["min_bytes"] == w["eager_bytes"]
            assert w["kernels"] == w["eager_ops"] == (2 if w["phase"] == "step" else 1)
            assert w["ours_us"] == pytest.approx(w["eager_us"])


def test_markdown_lists_every_kernel(doc):
    text = kernels.markdown(doc)
    assert all(f"`{k['name']}`" in text for k in doc["kernels"])


def test_roofline_is_bandwidth_or_compute_bound_plus_a_launch():
    assert roofline.predicted_us(3e6, 0, None) == pytest.approx(1.0 + roofline.LAUNCH_US)
    # a 4096^3 bfloat16 matmul: 137 GFLOP at 800 TFLOP/s, far above its 100 MB at 3 TB/s
    flops = 2.0 * 4096**3
    assert roofline.predicted_us(1e8, flops, torch.bfloat16) == pytest.approx(flops / 800e12 * 1e6 + 4.0)
    assert roofline.predicted_us(1e8, flops, torch.float32) > 10 * roofline.predicted_us(1e8, flops, torch.bfloat16)


def test_op_cost_counts_inputs_once_outputs_once_and_matmul_flops():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    out = a @ b
    moved, flops, dtype = roofline.op_cost(torch.ops.aten.mm.default, (a, b), {}, out)
    assert (moved, flops, dtype) == (4 * (8 * 16 + 16 * 4 + 8 * 4), 2.0 * 8 * 16 * 4, torch.float32)
    x = torch.randn(8, 16)
    moved, _, _ = roofline.op_cost(torch.ops.aten.mul.Tensor, (x, x), {}, x * x)   # x read once
    assert moved == 2 * x.nbytes
    bias = torch.randn(16).expand(8, 16)                                        # broadcast: read once
    assert roofline.distinct_bytes(bias) == 16 * 4
    assert not roofline.launches_kernel(torch.ops.aten.t.default, (a,), a.t())
    assert roofline.launches_kernel(torch.ops.aten.add_.Tensor, (x, x), x)


def test_eager_layer_norm_backward_is_priced_as_its_two_cuda_kernels():
    """dX, then dweight and dbias in a kernel that reads dY and X again (layer_norm_kernel.cu)."""
    x, w, b = torch.randn(64, 32), torch.randn(32), torch.randn(32)
    y, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [32], w, b, 1e-5)
    dy = torch.randn_like(y)
    func = torch.ops.aten.native_layer_norm_backward.default
    args = (dy, x, [32], mean, rstd, w, b, [True, True, True])
    out = func(*args)
    dx_kernel, dw_kernel = roofline.op_kernels(func, args, {}, out)
    assert dx_kernel[0] == dy.nbytes + x.nbytes + mean.nbytes + rstd.nbytes + w.nbytes + dy.nbytes
    assert dw_kernel[0] == dy.nbytes + x.nbytes + mean.nbytes + rstd.nbytes + 2 * w.nbytes
    args = (dy, x, [32], mean, rstd, w, b, [True, False, False])          # no weight gradients asked
    assert len(roofline.op_kernels(func, args, {}, func(*args))) == 1
    a = torch.randn(8, 16)
    assert roofline.op_kernels(torch.ops.aten.neg.default, (a,), {}, -a) == [(2 * a.nbytes, 0.0, None)]


def test_eager_layer_norm_statistics_are_priced_in_float32_as_on_cuda():
    """CPU's bf16 layer norm returns bf16 mean and rstd; CUDA's are float32 (its accumulation type)."""
    x, w, b = (t.to(torch.bfloat16) for t in (torch.randn(64, 32), torch.randn(32), torch.randn(32)))
    func = torch.ops.aten.native_layer_norm.default
    args = (x, [32], w, b, 1e-5)
    (moved, _, _), = roofline.op_kernels(func, args, {}, func(*args))
    assert moved == 2 * x.nbytes + w.nbytes + b.nbytes + 2 * 64 * 4


SIGNATURE = {"in0_ptr": "*fp32", "in0_s0": "i32", "in0_s1": "i32", "out0_ptr": "*fp32",
             "XBLOCK": "constexpr", "RBLOCK": "constexpr"}
KERNEL = f'''import triton
import triton.language as tl

XBLOCK_DEFAULT = 1024
RBLOCK_DEFAULT = 1
SIGNATURE = {SIGNATURE!r}


@triton.jit
def copy_kernel(in0_ptr, in0_s0, in0_s1, out0_ptr, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    xmask = xindex < 65536
    t0 = tl.load(in0_ptr + (xindex // 256) * in0_s0 + (xindex % 256) * in0_s1, mask=xmask, other=0)
    tl.store(out0_ptr + xindex, t0, mask=xmask)
'''


def test_specialization_is_what_decides_vectorized_loads(tmp_path):
    """A contiguous, aligned input (strides 256 and 1) loads 4 floats at a time; the same kernel
    with unknown strides, or on a view whose first element is 4 bytes off, loads scalars."""
    aligned = Launch("copy_kernel", KERNEL, [["ptr", "torch.float32", 0], ["int", 256], ["int", 1],
                                             ["ptr", "torch.float32", 0]], {"XBLOCK": 1024, "RBLOCK": 1})
    offset = Launch("copy_kernel", KERNEL, [["ptr", "torch.float32", 4], ["int", 256], ["int", 1],
                                            ["ptr", "torch.float32", 0]], {"XBLOCK": 1024, "RBLOCK": 1})
    generic = generic_launch("copy_kernel", KERNEL)
    results = compile_launches([aligned, offset, generic], cache_dir=str(tmp_path))
    assert [r["error"] for r in results] == [None, None, None]
    fast, misaligned, unknown = results
    assert fast["int_constants"] == ["in0_s1"] and unknown["int_constants"] == []
    assert fast["vector_share"] == 1.0
    assert misaligned["vector_share"] == 0.0 and unknown["vector_share"] == 0.0
    again = compile_launches([aligned], cache_dir=str(tmp_path))   # from the disk cache
    assert again == [fast]


def test_vector_share_leaves_out_broadcast_loads():
    """A scalar load of an address loaded again reads one value for several elements (a row's
    mean): nothing could vectorize it, so it does not count against the share."""
    ptx = """
        @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
        @%p1 ld.global.b32 { %r5 }, [ %rd2 + 0 ];
        @%p2 ld.global.b32 { %r6 }, [ %rd2 + 0 ];
        @%p1 ld.global.b32 { %r7 }, [ %rd3 + 0 ];
    """
    assert load_counts(ptx) == (4, 1, 2)


@pytest.mark.parametrize("index", [[0, 3, 9], [0, 3, 1234567]], ids=["in-range", "garbage"])
def test_recorded_index_check_runs_as_on_a_gpu_whatever_the_index_holds(index):
    """A traced program's index check is the range test and an asynchronous assert, as on a GPU; the
    index may be a skipped kernel's output (garbage), which once took the CPU error path's extra
    operators (cross-entropy's forward: 8 host operators in one table, 4 in another)."""
    from benchmarks.sm90 import recorded_launches
    from benchmarks.step_trace import _Tracer
    from runtime.program import IndexCheck, Program, ValueRef

    check = IndexCheck([ValueRef(0)], size=10, wrap=False, what="cross_entropy")
    program = Program(1, 1, [check], [None], frees=[[]])
    tracer = _Tracer()
    tracer.ops = []
    with recorded_launches(), tracer:
        program.run([torch.tensor(index)])
    assert [op.name for op in tracer.ops] == ["ge", "lt", "bitwise_and", "all", "_assert_async"]
