"""Element offsets past 2**31 - 1: kernels compute them in 64 bits, and only kernels that must.

Triton (like CUDA) multiplies two int32 values in int32 and wraps, so ``row * stride`` of a
large tensor reads the wrong address. The sizes decide part of the width when the kernel is
written; the strides decide the rest at launch (they are not part of the guard key).

The parity tests hold a strided view whose offsets pass 2**31 over 4 GiB of uint8 storage
that is never written except at the few elements the view shows: the pages stay unbacked,
so a test keeps well under 1 GB resident. They are skipped where the allocation is refused.
The storage is larger than 2**32 so that a wrapped offset still lands inside it: the old
kernels read wrong values there instead of crashing.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import compiler
from tests.parity import assert_ran_compiled
from compiler.lower.program import lower
from compiler.fusion.fuse import fuse
from compiler.ir.graph import GraphBuilder, meta_of, numel
from compiler.ir.ops import catalog as C
from runtime import program as P

FAR = 2**31 - 1  # a stride that fits int32, whose doubles do not


@pytest.fixture
def storage():
    """4 GiB + 4 KiB of uint8, unwritten; the first 64 bytes hold 9s (where a wrapped offset reads)."""
    if torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
        pytest.skip("deterministic mode would fill (make resident) all 4 GiB")
    try:
        base = torch.empty(2**32 + 4096, dtype=torch.uint8)
    except RuntimeError as e:  # no address space for it: nothing resident is needed, but skip
        pytest.skip(f"cannot reserve 4 GiB of storage: {e}")
    base[:64] = 9
    yield base
    del base


def far_rows(storage, rows=3, cols=8):
    """A (rows, cols) view whose row r starts r · (2**31 - 1) elements in: rows >= 2 pass 2**31."""
    x = storage.as_strided((rows, cols), (FAR, 1), storage_offset=16)
    x.copy_(torch.arange(rows * cols, dtype=torch.uint8).reshape(rows, cols) * 3 + 1)
    return x


def compiled_matches_eager(fn, *args):
    """Record, then replay compiled kernels; both calls must give eager's values."""
    f = compiler.compile(fn, backend="interpret", fullgraph=True)
    expected = fn(*args)
    for _ in range(2):
        torch.testing.assert_close(f(*args), expected)
    assert_ran_compiled(f)
    return f


def test_softmax_of_rows_past_2_31(storage):
    compiled_matches_eager(lambda t: torch.softmax(t.float(), -1) * 2, far_rows(storage))


def test_reduction_across_rows_past_2_31(storage):
    # the reduced dim is the one with the large stride: its index comes from the reduction loop
    compiled_matches_eager(lambda t: (t.float().sum(0), t.float().amax(0), t.float().mean(1)), far_rows(storage))


def test_a_recording_made_with_small_strides_replays_a_far_view(storage):
    # same shape, dtype and device: one recording; the launch sees the strides and picks the
    # 64-bit kernel instead of wrapping
    fn = lambda t: (t.float() * 0.5).exp()  # noqa: E731
    f = compiler.compile(fn, backend="interpret", fullgraph=True)
    near = torch.arange(24, dtype=torch.uint8).reshape(3, 8)
    f(near), f(near)
    x = far_rows(storage)
    torch.testing.assert_close(f(x), fn(x))
    torch.testing.assert_close(f(near), fn(near))
    assert f.stats["captures"] == 1


def test_slice_inside_the_function_of_a_tensor_past_2_31(storage):
    # rows 0 and 3 of (4, 2**30): the kernel computes (row · 3) · 2**30, past 2**31 for the second
    x = storage[16:16 + 2**32].view(4, 2**30)
    x[::3, -8:] = torch.arange(16, dtype=torch.uint8).reshape(2, 8)
    x[::3, -12:-8] = 5
    compiled_matches_eager(lambda t: t[::3, -8:].float() * 2 + t[::3, -12:-8].float().sum(1, keepdim=True), x)


def test_reshape_inside_the_function_through_positions_past_2_31(storage):
    # (8, 2**29) -> (4, 2**30): the reshape's index map goes through row-major positions past 2**31
    x = storage[16:16 + 2**32].view(8, 2**29)
    x.view(4, 2**30)[::3, -8:] = torch.arange(16, dtype=torch.uint8).reshape(2, 8)
    compiled_matches_eager(lambda t: t.reshape(4, 2**30)[::3, -8:].float() + 1, x)


def test_strided_slice_of_a_dim_past_2_31(storage):
    # 1-D, 2**32 - 6 elements: [::2**31 - 4] computes index · step, past 2**31 for the third element
    x = storage[16:2**32 + 10]
    x[::2**31 - 4] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    compiled_matches_eager(lambda t: t[::2**31 - 4].float() * 2 + t[1::2**31 - 4].float(), x)


# -- what the generated source does, without running it ----------------------------------------
def kernels(build):
    b = GraphBuilder()
    b.output([build(b)])
    return lower(b.graph, fuse(b.graph))[1]


def small_pointwise(b):
    return C.emit_pointwise(b, "exp", [b.placeholder("x", (3, 8), torch.float32)], dtype=torch.float32)


def softmax_of_last_position(b):
    """The issue's example: softmax(x[:, -1, :]) of a (32, 4096, 32000) bf16 tensor."""
    x = b.placeholder("x", (32, 4096, 32000), torch.bfloat16)
    last = C.emit_view(b, "reshape", C.emit_slice(b, x, 1, 4095, 1, 1), shape=(32, 32000))
    e = C.emit_pointwise(b, "exp", [C.emit_pointwise(b, "identity", [last], dtype=torch.float32)],
                         dtype=torch.float32)
    return C.emit_pointwise(b, "div", [e, C.emit_reduction(b, "sum", e, (1,), keepdim=True)], dtype=torch.float32)


def huge_pointwise(b):
    return C.emit_pointwise(b, "exp", [b.placeholder("x", (2, 2**30 + 1), torch.float16)], dtype=torch.float16)


def huge_sum(b):
    return C.emit_reduction(b, "sum", b.placeholder("x", (2**31 + 7,), torch.float32), (0,))


def strided_slice_of_a_huge_dim(b):
    x = C.emit_slice(b, b.placeholder("x", (2**32,), torch.uint8), 0, 0, 2**31 - 4, 3)
    return C.emit_pointwise(b, "identity", [x], dtype=torch.float32)


def test_small_kernels_stay_32_bit_with_a_64_bit_twin():
    for build in (small_pointwise, softmax_of_last_position):
        for k in kernels(build):
            assert "tl.int64" not in k.source and "i64" not in k.signature.values(), k.source
            # the twin multiplies every stride in int64, and only that
            assert k.wide_source and k.wide_name != k.name
            assert all(k.wide_source.count(f"{s} = tl.cast({s}, tl.int64)") == 1
                       for s in k.signature if "_s" in s), k.wide_source
            assert "program_id(0).to(tl.int64)" not in k.wide_source


def test_kernels_whose_sizes_pass_2_31_compute_indices_in_64_bits():
    for build in (huge_pointwise, huge_sum, strided_slice_of_a_huge_dim):
        # (the second stage of a split sum reads the small partial sums: it stays 32-bit)
        huge = [k for k in kernels(build) if any(numel(meta_of(n).shape) >= 2**31 for n in k.loads + k.stores)]
        assert huge
        for k in huge:
            assert k.wide_source is None, k.source
            assert "tl.program_id(0).to(tl.int64)" in k.source, k.source
            assert all(v == "i64" for s, v in k.signature.items() if "_s" in s)
            assert "rindex" not in k.source or "tl.arange(0, RBLOCK).to(tl.int64)" in k.source, k.source


def test_the_launch_picks_the_64_bit_twin_when_strides_reach_past_2_31(monkeypatch):
    k, = kernels(small_pointwise)
    launch = P.KernelLaunch(k.name, k.source, [0], [(1, (3, 8), torch.float32)], k.grid, 32, 1, 0,
                            wide_name=k.wide_name, wide_source=k.wide_source)
    ran = []
    monkeypatch.setattr(P, "load_kernel", lambda name, source: _Recorder(ran, name))
    meta = torch.device("meta")  # strides without storage: the stand-in kernel reads nothing
    # last element offsets: 23, 2**31 + 7, 2**31 + 5, 7 · 2**31 + 2
    for strides in ((8, 1), (2**30, 1), (2**30 - 1, 1), (1, 2**31)):
        launch.run([torch.empty_strided((3, 8), strides, device=meta), None], meta)
    launch.run([torch.empty_strided((3, 8), (2**30 - 4, 1), device=meta), None], meta)  # 2**31 - 1: fits
    assert ran == [k.name, k.wide_name, k.wide_name, k.wide_name, k.name]


class _Recorder:
    """A stand-in jit function: records which kernel was launched."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append(self.name)


# -- the device a launch goes to ----------------------------------------------------------------
def test_cuda_launches_run_under_the_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device and its stream: the launch must make the
    tensors' device current. Checked without a GPU: torch.cuda.device is replaced by a
    recorder, and the kernel by one that notes which device is current when it runs."""
    current = ["cuda:0"]
    entered = []

    class FakeDeviceGuard:
        def __init__(self, device):
            self.device = str(device)

        def __enter__(self):
            entered.append(self.device)
            self.previous, current[0] = current[0], self.device

        def __exit__(self, *exc):
            current[0] = self.previous

    monkeypatch.setattr(torch.cuda, "device", FakeDeviceGuard)
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(current[0])

    k, = kernels(small_pointwise)
    launch = P.KernelLaunch(k.name, k.source, [0], [], k.grid, 32, 1, 0, _fn=Kernel())
    launch.run([torch.zeros(3, 8)], torch.device("cuda", 1))
    assert seen == ["cuda:1"] and current == ["cuda:0"]
    launch.run([torch.zeros(3, 8)], torch.device("cpu"))  # CPU (the interpreter): no CUDA guard
    assert seen == ["cuda:1", "cuda:0"] and entered == ["cuda:1"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_compiled_call_on_the_second_gpu():
    x = torch.randn(4, 1000, device="cuda:1")
    f = compiler.compile(lambda t: torch.softmax(t, -1) * 2)
    f(x)  # (records, eagerly)
    torch.testing.assert_close(f(x), torch.softmax(x, -1) * 2)
    # NOTE: values alone would pass had the backend fallen back to eager on the second device
    assert f.last_backend == "triton", f.last_backend
    assert f.stats["kernel_launches"] > 0 and f.stats["divergences"] == 0 and f.stats["eager_calls"] == 0, f.stats


# -- the address arithmetic Triton's real compiler emits for Hopper -----------------------------
PTX_SCRIPT = textwrap.dedent("""
    import importlib.util, json, os, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    out = {}
    for path in sys.argv[1:]:
        name = os.path.basename(path)[:-3]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        constexprs = {"XBLOCK": module.XBLOCK_DEFAULT, "RBLOCK": module.RBLOCK_DEFAULT}
        compiled = triton.compile(ASTSource(getattr(module, name), module.SIGNATURE, constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        out[name] = compiled.asm["ptx"]
        # Triton's JIT passes a stride equal to 1 as a constexpr: that must compile too
        last = [k for k in module.SIGNATURE if k.startswith("in0_s")][-1]
        signature = dict(module.SIGNATURE, **{last: "constexpr"})
        compiled = triton.compile(ASTSource(getattr(module, name), signature, dict(constexprs, **{last: 1})),
                                  target=GPUTarget("cuda", 90, 32))
        out[name + ":unit"] = compiled.asm["ptx"]
    print(json.dumps(out))
""")


def hopper_ptx(sources: dict, tmp_path) -> dict:
    """name -> PTX for sm_90 of each kernel source (a subprocess with Triton's real compiler)."""
    paths = []
    for name, source in sources.items():
        (tmp_path / f"{name}.py").write_text(source)
        paths.append(str(tmp_path / f"{name}.py"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-c", PTX_SCRIPT, *paths], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def stride_products(ptx: str, name: str, param: int) -> set:
    """The multiply instructions (``mul.lo.s32``, ``mul.wide.s32``, ``mad.lo.s64``, ...) that take
    the kernel's parameter number ``param`` (a stride), or its widening, as an operand."""
    regs = set(re.findall(rf"ld\.param\.[bus](?:32|64)\s+(%\w+),\s*\[{name}_param_{param}\]", ptx))
    assert regs, f"parameter {param} not found in the PTX"
    for line in ptx.splitlines():  # follow conversions: cvt.s64.s32 %rd, %r
        m = re.match(r"\s*cvt\.[su]64\.[su]32\s+(%\w+),\s*(%\w+);", line)
        if m and m.group(2) in regs:
            regs.add(m.group(1))
    found = set()
    for line in ptx.splitlines():
        m = re.match(r"\s*((?:mul|mad)\.(?:lo|wide)\.[su](?:32|64))\s+[^;]*;", line)
        if m and any(re.search(rf"{re.escape(r)}\b", line.split(None, 1)[1].split(",", 1)[1]) for r in regs):
            found.add(m.group(1))
    return found


def test_hopper_address_math_is_64_bit_exactly_where_needed(tmp_path):
    k, = kernels(small_pointwise)
    big = kernels(huge_pointwise)[0]
    ptx = hopper_ptx({k.name: k.source, k.wide_name: k.wide_source, big.name: big.source}, tmp_path)
    # parameter 1 is in0_s0, the row stride: rows * stride in 32 bits for the small kernel ...
    narrow = stride_products(ptx[k.name], k.name, 1)
    assert narrow and all(op.endswith("s32") and ".lo." in op for op in narrow), narrow
    # ... in 64 bits for its twin and for the kernel whose iteration space passes 2**31
    for name in (k.wide_name, big.name, k.wide_name + ":unit"):
        wide = stride_products(ptx[name], name.split(":")[0], 1)
        assert wide and all(op.endswith("64") or op.startswith("mul.wide") for op in wide), (name, wide)
