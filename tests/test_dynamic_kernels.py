"""Shape-generic kernels (``build_region(..., shape_generic=True)``, issue 15): sizes are kernel
arguments, so builds of one region that differ only in sizes within a bucket write the SAME
source (one compiled kernel), and every build computes eager's values and gradients.

Each test compiles a function with every region built shape-generic (``compiler.api``'s
``build_region`` stood in for by one that passes ``shape_generic=True``); the guard key is still
per shape (``dynamic=False``: no instantiation), so each size records and builds its own region and
the kernels of the builds are compared by position (forward, then backward, in schedule order).
Each size is called twice: the first call records (eagerly), the second replays the generic kernels,
and that is the call compared with eager.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

import compiler
from tests.devices import KERNELS  # noqa: E402  (the CUDA test mode's: tests/devices.py)
import compiler.api as api
from compiler.fusion import tiling
from compiler.build import build_region
from benchmarks.generic_kernels import built, regions_built_by
from benchmarks.workloads import TinyTransformer


@pytest.fixture
def generic_builds(monkeypatch):
    """Regions built shape-generic; yields the list of builds, each the kernels of one region
    (``KernelSource``, forward then backward)."""
    builds = []

    def build(graph, *args, **kwargs):
        region, details = build_region(graph, *args, **{**kwargs, "shape_generic": True})
        builds.append(details["forward_kernels"] + details["backward_kernels"])
        return region, details
    monkeypatch.setattr(api, "build_region", build)
    monkeypatch.setenv("SYMGRAD_REGION_CACHE", "0")  # (built here, never loaded from the cache)
    return builds


def _twins(args):
    return [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]


def _check_sizes(builds, fn, make_args, sizes, atol=1e-5):
    """Run ``compile(fn)`` on ``make_args(size)`` twice for each size (the first call records, eagerly;
    the second replays the shape-generic kernels) and eager ``fn``: the replay's outputs and the
    gradients of every input that requires grad agree with eager's, and kernels ran. Returns the
    kernels built per size."""
    compiled = compiler.compile(fn, dynamic=False)  # (each size records: builds compared by position)
    per_size = []
    for size in sizes:
        torch.manual_seed(size)
        args = make_args(size)
        start = len(builds)
        compiled(*_twins(args))          # the recording: eager's own ops, no kernel of the builds runs
        assert len(builds) > start, f"size {size}: nothing was built (a cached region?)"
        launches = compiled.stats["kernel_launches"]
        twins = _twins(args)
        out, expected = compiled(*args), fn(*twins)
        # NOTE: without the second call no generic kernel ever ran, and the values compared were eager's
        assert compiled.stats["kernel_launches"] > launches, f"size {size}: the replay launched no kernel"
        torch.testing.assert_close(out, expected, atol=atol, rtol=1e-5)
        if out.requires_grad:
            grad = torch.randn_like(out)
            out.backward(grad)
            expected.backward(grad)
            for a, b in zip(args, twins):
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    torch.testing.assert_close(a.grad, b.grad, atol=atol, rtol=1e-5)
        per_size.append([k for build in builds[start:] for k in build])
    assert compiled.stats["divergences"] == 0 and compiled.last_backend == KERNELS, \
        (compiled.stats, compiled.last_backend)
    return per_size


def _same_sources(per_size):
    """Every build wrote the same kernels, and each takes its sizes as arguments."""
    first = per_size[0]
    for kernels in per_size[1:]:
        assert [k.name for k in kernels] == [k.name for k in first]
        assert [k.source for k in kernels] == [k.source for k in first]
    return first


def _randn(*shape, grad=True):
    return torch.randn(*shape, requires_grad=grad)


def test_elementwise_with_broadcasting_has_one_source_for_every_size(generic_builds):
    def fn(x, w, b):
        return torch.tanh(x * w + b) * 0.5 + x.sigmoid()
    per_size = _check_sizes(generic_builds, fn, lambda t: (_randn(3, t, 8), _randn(8), _randn(t, 1)), (5, 7, 12, 30))
    kernels = _same_sources(per_size)
    assert all("xmask = xindex < ks0" in k.source for k in kernels), kernels[0].source
    # the sizes differ per build, the source does not
    assert len({k.sizes for ks in per_size for k in ks}) > 1


def test_views_reshape_transpose_slice_flip(generic_builds):
    def fn(x):
        y = x.transpose(1, 2).reshape(x.shape[0], -1)        # (B, C * T): index maps through T
        return (y[:, 1::2].flip(1) * 3).exp() + x.sum()
    per_size = _check_sizes(generic_builds, fn, lambda t: (_randn(2, t, 4),), (9, 11, 20))
    _same_sources(per_size)


def test_slice_from_the_end_takes_its_start_as_an_argument(generic_builds):
    def fn(x):
        return x[:, -3:].cos() + x[:, :3]
    per_size = _check_sizes(generic_builds, fn, lambda t: (_randn(4, t),), (9, 12, 25))
    _same_sources(per_size)


def test_sum_mean_var_over_a_dynamic_dim(generic_builds):
    def fn(x):
        return x.sum(1) + x.mean(1) * 2 + x.var(1) + x.std(1, keepdim=True).squeeze(1)
    per_size = _check_sizes(generic_builds, fn, lambda t: (_randn(3, t, 5),), (9, 17, 32))
    kernels = _same_sources(per_size)
    # a mean's 1/N (forward: a division by the count; backward: an fp32 constant) is an argument
    assert any("kf" in k.source for k in kernels) and not any("0.0" in k.source.split("def ")[1].split("\n")[0]
                                                              for k in kernels)


def test_softmax_layer_norm_cross_entropy_over_dynamic_rows(generic_builds):
    weight, bias = _randn(16), _randn(16)

    def fn(x, logits, target):
        att = torch.softmax(logits, -1)                       # rows of the dynamic length
        y = F.layer_norm(x, (16,), weight, bias)
        return (att @ y).sum() + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    def make(t):
        return _randn(2, t, 16), _randn(2, t, t), torch.randint(0, t, (2, t))
    per_size = _check_sizes(generic_builds, fn, make, (10, 20, 31), atol=1e-4)
    kernels = _same_sources(per_size)
    assert any("rmask = rindex < ks" in k.source for k in kernels)
    assert weight.grad is not None


def test_matmul_epilogues_and_bias_gradients(generic_builds):
    w, b = _randn(12, 6), _randn(12)

    def fn(x):
        return F.gelu(F.linear(x, w, b)) * x.mean()
    per_size = _check_sizes(generic_builds, fn, lambda t: (_randn(2, t, 6),), (9, 13, 30), atol=1e-4)
    _same_sources(per_size)


def test_gathers_slice_scatters_unfold_and_complex(generic_builds):
    """Embedding rows (a gather bounded by the table's size), a slice written into a fill (cat),
    windows (unfold) and complex math take their sizes as arguments too."""
    table = _randn(7, 4)

    def fn(x, z, ids):
        y = torch.cat([x[:, :2] * 2, x[:, 2:].flip(1)], 1).unfold(1, 3, 2).sum(-1)
        return y.sum(1, keepdim=True) + F.embedding(ids, table).sum(-1) + (z * z.conj()).real.mean(1, keepdim=True)

    def make(t):
        return _randn(4, t), torch.randn(4, t, dtype=torch.complex64, requires_grad=True), torch.randint(0, 7, (4, 1))
    per_size = _check_sizes(generic_builds, fn, make, (9, 13, 15), atol=1e-4)   # 4..7 windows: one bucket
    _same_sources(per_size)


def test_rows_in_another_bucket_get_another_block_and_stay_right(generic_builds):
    """Rows of 8 and of 20 are in different buckets (``tiling.size_bucket``): another RBLOCK, so
    another source; both compute eager's values."""
    assert tiling.size_bucket(8) != tiling.size_bucket(20)
    per_size = _check_sizes(generic_builds, lambda x: torch.softmax(x, -1) * 2, lambda t: (_randn(6, t),), (5, 8, 20))
    assert [k.source for k in per_size[0]] == [k.source for k in per_size[1]]
    assert [k.source for k in per_size[1]] != [k.source for k in per_size[2]]
    assert "RBLOCK_DEFAULT = 8" in per_size[0][0].source and "RBLOCK_DEFAULT = 32" in per_size[2][0].source


def test_rows_that_cross_into_a_looped_kernel(generic_builds):
    """Softmax holds a row whole up to LONG_ROW_MAX elements and loops over longer ones (online
    max and sum, then a second pass): the looped kernels have one source for every such length
    (any RBLOCK is right for a loop), another than the rows held whole."""
    def fn(x):
        return torch.softmax(x, -1) * 3
    long = tiling.LONG_ROW_MAX
    per_size = _check_sizes(generic_builds, fn, lambda t: (_randn(2, t),), (100, long + 100, long + 3000))
    _same_sources(per_size[1:])
    assert [k.name for k in per_size[0]] != [k.name for k in per_size[1]]
    assert all("for roffset in range(0, ks" in k.source for k in per_size[1])
    assert not any("for roffset" in k.source for k in per_size[0])


def test_static_builds_keep_their_sizes_as_literals():
    """shape_generic=False (the default) writes today's kernels: sizes as literals, no arguments."""
    graphs = []
    for t in (9, 20):
        report = compiler.explain(lambda x: torch.softmax(x, -1).sum(0), torch.randn(3, t, requires_grad=True))
        graphs.append(report.regions[0]["captured"])
        assert all("ks0" not in k.source and f"< {t}" in "".join(s.source for s in report.kernels)
                   for k in report.kernels)
    static = [build_region(_copy(g))[1]["forward_kernels"] for g in graphs]
    generic = [build_region(_copy(g), shape_generic=True)[1]["forward_kernels"] for g in graphs]
    assert static[0][0].source != static[1][0].source and static[0][0].sizes == ()
    assert generic[0][0].source == generic[1][0].source and generic[0][0].sizes != generic[1][0].sizes


def test_dropout_positions_take_sizes_as_arguments():
    """Random numbers are drawn at each element's position in the shape (``KernelWriter.random``):
    with the strides of that shape as arguments, one source for every size."""
    sources, values = [], []
    for t in (9, 14):
        x = torch.ones(3, t, requires_grad=True)
        graph = compiler.explain(lambda x: F.dropout(x, 0.5) * 2, x).regions[0]["captured"]
        kernels = build_region(_copy(graph), shape_generic=True)[1]["forward_kernels"]
        sources.append([k.source for k in kernels])
        values.append([k.sizes for k in kernels])
    assert sources[0] == sources[1] and values[0] != values[1]
    assert any("tl.rand(" in s for s in sources[0])


def _copy(graph):
    from compiler.ir.graph import copy_graph
    return copy_graph(graph)


def _Transformer(vocab=11, dim=16, heads=2, seq=40):
    """The benchmarks' nanoGPT-style block, small enough for the interpreter."""
    return TinyTransformer(vocab, dim, heads, seq)


def test_transformer_step_one_source_per_kernel_within_a_bucket(generic_builds):
    """A transformer's forward and backward at lengths 9..32 (one bucket) and batches 3 and 4:
    every kernel one source; gradients as eager's."""
    model = _Transformer()
    eager = _Transformer()
    eager.load_state_dict(model.state_dict())

    def step(m, idx, targets):
        loss = m(idx, targets)
        loss.backward()
        return loss.detach()
    compiled = compiler.compile(step, dynamic=False)
    per_build = []
    for t, b in ((9, 3), (20, 3), (32, 4)):   # batches 3 and 4: one bucket (tiling.size_bucket)
        idx, targets = torch.randint(0, 11, (b, t)), torch.randint(0, 11, (b, t))
        start = len(generic_builds)
        for _ in ("record", "replay"):  # the first call of a shape records (eagerly); the second runs the kernels
            launches = compiled.stats["kernel_launches"]
            torch.testing.assert_close(compiled(model, idx, targets), step(eager, idx, targets), atol=1e-5, rtol=1e-5)
            for p, q in zip(model.parameters(), eager.parameters()):
                torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
                p.grad, q.grad = None, None
        assert compiled.stats["kernel_launches"] > launches, f"({t}, {b}): the replay launched no kernel"
        per_build.append(sorted(k.source for build in generic_builds[start:] for k in build))
    assert compiled.stats["divergences"] == 0 and compiled.last_backend == KERNELS, compiled.stats
    assert per_build[0] and per_build[0] == per_build[1] == per_build[2]


@functools.lru_cache(maxsize=None)
def _generic_and_static_launches(seq_lengths=(20, 100)):
    """(generic, static) Hopper launches of a transformer step's kernels recorded at each length."""
    from benchmarks.sm90 import recorded_launches

    launches = {True: {}, False: {}}
    for generic in (True, False):
        with regions_built_by(built(generic)):
            model = _Transformer(vocab=64, dim=64, heads=4, seq=128)
            compiled = compiler.compile(lambda m, i, t: m(i, t).backward(), dynamic=False)
            for t in seq_lengths:
                idx = torch.randint(0, 64, (8, t))
                compiled(model, idx, idx)     # the first call of a shape records (eagerly)
                with recorded_launches(compute_extern_calls=False) as recorded:
                    compiled(model, idx, idx)
                for launch in recorded:
                    if "XBLOCK" in launch.constexprs:   # (generated; not the flash-attention kernels)
                        launches[generic].setdefault(launch.name, launch)
    return list(launches[True].values()), list(launches[False].values())


def test_generic_kernels_compile_for_hopper_without_spills():
    """The shape-generic kernels of a transformer step (sizes as i32 arguments, not specialized)
    compile for sm_90 with Triton's real compiler and spill no registers."""
    from benchmarks.sm90 import compile_launches
    from runtime.kernels import cache_dir

    generic, static = _generic_and_static_launches()
    assert len(generic) >= 15 and sum("ks0" in _params(launch.source) for launch in generic) >= len(generic) - 2
    results = compile_launches(generic, processes=2, cache_dir=cache_dir())
    errors = [f"{launch.name}: {r['error']}" for launch, r in zip(generic, results) if r["error"]]
    assert not errors, "\n".join(errors)
    spills = [f"{launch.name}: {r['spill_bytes']} bytes" for launch, r in zip(generic, results) if r["spill_bytes"]]
    assert not spills, "\n".join(spills)


def _params(source: str) -> list:
    header = source.split("def ", 1)[1].split("(", 1)[1].split(")", 1)[0]
    return [p.split(":")[0].strip() for p in header.split(",")]


def test_generated_launch_passes_the_sizes_after_the_outputs():
    """The straight-line launch (``runtime.launcher.generate_launch``) of a shape-generic kernel
    passes its size arguments, fixed for the build, as literals between the outputs and the
    constexprs: the order of the kernel's parameters."""
    from types import SimpleNamespace

    from runtime.launcher import generate_launch

    calls = []
    bound = SimpleNamespace(enter_hook=None, exit_hook=None, function="f", metadata="m", constants=(64, 8),
                            kernel=None, runner=lambda *args: calls.append(args))
    x = torch.randn(6, 4)
    launch = generate_launch([0], [(1, (6, 4), torch.float32)], [x], bound, 3, lambda index: "stream",
                             sizes=(24, 4, 0.25))
    env = {0: x}
    assert launch.run(env, torch.device("cpu"))
    *_, given_x, s0, s1, out, ks0, ks1, kf0, xblock, rblock = calls[0]
    assert given_x is x and (s0, s1) == x.stride() and out is env[1]
    assert (ks0, ks1, kf0, xblock, rblock) == (24, 4, 0.25, 64, 8)
