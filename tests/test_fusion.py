"""Kernel counts: fused chains are one kernel forward and one backward."""

import copy

import torch
import torch.nn.functional as F

import compiler
from compiler.ir.graph import meta_of
from tests.parity import check_parity


def issue_example(x, y):
    return (torch.sin(x) * y + torch.exp(-x)).sum()


def test_issue_example_is_one_kernel_each_way():
    x = torch.randn(64, 32, requires_grad=True)
    y = torch.randn(64, 32, requires_grad=True)
    report = compiler.explain(issue_example, x, y)
    assert report.fallbacks == []
    assert len(report.forward_kernels) == 1
    assert len(report.backward_kernels) == 1
    assert "tl.sin" in report.forward_kernels[0].source and "tl.sum" in report.forward_kernels[0].source
    text = str(report)
    assert "backward graph" in text and "fallbacks: none" in text
    assert any(n.op == "call_function" for n in report.graph.nodes)
    for node in report.graph.nodes:  # capture records each value's metadata
        if node.op != "output":
            m = meta_of(node)
            assert isinstance(m.shape, tuple) and isinstance(m.dtype, torch.dtype) and m.device is not None
    assert report.backward_graph is not None
    compiled = check_parity(issue_example, [x, y])
    assert compiled.stats["kernel_launches"] == 2  # one forward, one backward


def test_broadcast_chain_with_reduction_is_one_kernel():
    def f(x, b):
        return (torch.tanh(x * b + 1) - x).mean(dim=1)
    x = torch.randn(16, 24, requires_grad=True)
    b = torch.randn(24, requires_grad=True)
    report = compiler.explain(f, x, b)
    assert len(report.forward_kernels) == 1
    # backward: x's gradient (pointwise) and b's (a sum over rows) share one kernel
    assert len(report.backward_kernels) == 1
    check_parity(f, [x, b])


def test_views_fuse_into_the_kernel():
    def f(x):
        return (x.t() * 2).reshape(-1).sin().sum()
    x = torch.randn(6, 10, requires_grad=True)
    report = compiler.explain(f, x)
    assert len(report.forward_kernels) == 1 and len(report.backward_kernels) == 1
    check_parity(f, [x])


def test_mlp_kernel_counts():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    report = compiler.explain(lambda x, y: F.mse_loss(model(x), y), x, y)
    # forward: bias+GELU after the first matmul, then bias+loss+mean after the second
    assert len(report.forward_kernels) == 2
    # backward: dloss (with the second bias's gradient), then GELU' (with the first bias's)
    assert len(report.backward_kernels) == 2
    assert report.fallbacks == []


def test_inner_reduction_up_to_8192_elements_is_not_split():
    # the mlp_step benchmark's loss: mean over a (64, 128) batch, 8192 elements. One looped program
    # (Inductor's no-split threshold on sm_90), not a split sum and a second kernel for the 32 partials.
    x, y = torch.randn(64, 128, requires_grad=True), torch.randn(64, 128)
    report = compiler.explain(lambda x, y: F.mse_loss(x.sin(), y), x, y)
    assert len(report.forward_kernels) == 1
    check_parity(lambda x, y: F.mse_loss(x.sin(), y), [x, y])
    # above the threshold (or over outer dims: column sums) it is still split in two stages
    big = compiler.explain(lambda x: (x.sin() * x).mean(), torch.randn(64, 129, requires_grad=True))
    assert len(big.forward_kernels) == 2


def test_kernels_are_cached_by_source():
    from runtime.kernels import _loaded
    x = torch.randn(5, 7, requires_grad=True)
    f1 = compiler.compile(lambda x: (x.sin() * 3).sum(), backend="interpret")
    f2 = compiler.compile(lambda x: (x.sin() * 3).sum(), backend="interpret")
    f1(x), f1(x)
    loaded = len(_loaded)
    f2(x), f2(x)
    assert len(_loaded) == loaded


def test_large_full_reductions_run_in_two_stages():
    # one program would reduce 2^17 elements alone: split into parallel chunks, then combine
    x = torch.randn(512, 256, dtype=torch.float64, requires_grad=True)
    report = compiler.explain(lambda x: (x.sin() * x).mean(), x)
    assert len(report.forward_kernels) == 2
    first = report.forward_kernels[0].source
    assert "tl.sin" in first and "tl.sum" in first  # the chain fused into the first stage
    check_parity(lambda x: (x.sin() * x).mean(), [x])
    small = compiler.explain(lambda x: (x.sin() * x).mean(), torch.randn(64, 32, requires_grad=True))
    assert len(small.forward_kernels) == 1


def test_softmax_and_layer_norm_are_one_kernel_each_way():
    # rows that fit one block: the reductions and the values that use them share a kernel
    x = torch.randn(16, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    softmax = compiler.explain(lambda x: F.softmax(x, dim=-1), x)
    assert (len(softmax.forward_kernels), len(softmax.backward_kernels)) == (1, 1)
    layer_norm = compiler.explain(lambda x, w: F.layer_norm(x, (64,), w), x, w)
    assert len(layer_norm.forward_kernels) == 1
    assert len(layer_norm.backward_kernels) <= 2  # input grad per row; weight grad over rows
    check_parity(lambda x: F.softmax(x, dim=-1), [x])
    check_parity(lambda x, w: F.layer_norm(x, (64,), w), [x, w])


def test_overlapping_window_gradients_are_materialized_not_inlined_per_read():
    """An unfold's gradient is read `size` times per input element, a small max pool's input and
    its gradient once per window element: inlining them (and, nested, the next pool's) would
    multiply the kernel's code (two 3x3 pools: 2,092 lines); each is computed once into memory,
    by a kernel of its own, and read there."""
    x = torch.randn(2, 3, 9, 8, requires_grad=True)
    report = compiler.explain(lambda x: F.max_pool2d(F.max_pool2d(x.relu(), 3, 2, 1), 3, 1, 1), x)
    assert report.fallbacks == []
    assert max(len(k.source.splitlines()) for k in report.kernels) < 250
    windows = compiler.explain(lambda x: F.avg_pool2d(F.avg_pool2d(x.relu(), 3, 2, 1), 3, 1, 1), x)
    assert windows.fallbacks == []
    assert max(len(k.source.splitlines()) for k in windows.kernels) < 150


def test_windows_that_tile_are_a_reshape_and_overlapping_ones_read_a_stored_input():
    """Pooling windows that tile their dims (kernel == stride: an adaptive pool to 1x1, a 4x4/4 avg
    pool) are a reshape of the input, so the gradient goes back through the reshape, with no
    slice_scatter per window position; a max pool over overlapping windows (3x3/2) reads a computed
    input (a batch norm's ReLU) from memory, computed once, not at each of the windows that read it,
    and its first maximum's position is saved, not found again by the backward. (A small max pool
    is elementwise over strided views, tiling or not: ``test_cpp_backend``.)"""
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    for fn in (lambda x: F.adaptive_avg_pool2d(x.relu(), 1).sin(), lambda x: F.avg_pool2d(x.relu(), 4).sin()):
        report = compiler.explain(fn, x)
        assert report.fallbacks == []
        names = [getattr(n.target, "name", n.target) for n in report.backward_graph.nodes]
        assert "slice_scatter" not in names and "unfold" not in names, names
    bn = torch.nn.BatchNorm2d(3)
    report = compiler.explain(lambda x: F.max_pool2d(bn(x).relu(), 3, 2, 1), x)
    stored = [n for n in report.graph.nodes if n.op == "call_function" and meta_of(n).materialize]
    assert [getattr(n.target, "name", n.target) for n in stored] == ["relu"], stored
    saved = [n.name for n in report.backward_graph.nodes if n.op == "placeholder"]
    assert any(name.startswith("saved_where") for name in saved), saved   # (the position: a where's value)
    assert not any(getattr(n.target, "name", None) in ("gt", "amax") for n in report.backward_graph.nodes)


def test_a_rows_values_from_its_reductions_are_computed_in_its_kernel():
    """Layer norm's statistics kept for the backward (rstd, a value per row) are computed and
    stored by the kernel that reduces the rows, and the normalized rows that read them join it:
    one forward kernel, where a kernel over the rows' statistics alone split it in three."""
    torch.manual_seed(0)
    x = torch.randn(2, 32, 64, requires_grad=True)
    w, b = torch.randn(64, requires_grad=True), torch.randn(64, requires_grad=True)
    m = torch.randn(64, 16, requires_grad=True)

    def f(x, w, b, m):
        return F.layer_norm(x * 2, (64,), w, b) @ m
    report = compiler.explain(f, x, w, b, m)
    assert report.fallbacks == []
    assert len(report.forward_kernels) == 1, [k.name for k in report.forward_kernels]
    source = report.forward_kernels[0].source
    assert "tl.sqrt_rn" in source and source.count("tl.sum(") == 2   # the statistics and rstd, one kernel
    # (the weight's and bias's gradients are sums over 64 rows, in another order than eager's: each is
    # as close to float64's as eager's is, ~1.5e-5, and they differ from eager's by up to twice that)
    check_parity(f, [x, w, b, m], tol=dict(rtol=1e-4, atol=1e-4))


def test_a_losss_mean_is_divided_in_the_kernel_that_sums_it():
    logits = torch.randn(32, 40, requires_grad=True)
    targets = torch.randint(0, 40, (32,))
    targets[3] = -100   # ignored: the count of targets is a reduction too
    report = compiler.explain(lambda z, t: F.cross_entropy(z, t), logits, targets)
    assert len(report.forward_kernels) == 2, [k.name for k in report.forward_kernels]  # rows' logsumexp; the mean
    check_parity(lambda z, t: F.cross_entropy(z, t), [logits, targets])


def test_batch_norms_running_statistics_are_updated_by_its_statistics_kernel():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8)

    def f(model, x):
        return (model(x) ** 2).mean()
    report = compiler.explain(f, model, x)
    # num_batches_tracked += 1; the statistics with both running updates; the normalized rows and loss
    assert len(report.forward_kernels) == 3, [k.name for k in report.forward_kernels]
    stats = next(k for k in report.forward_kernels if "mean" in k.name and "tl.sqrt_rn" not in k.source)
    assert stats.source.count("tl.store(") == 4   # mean, variance, running mean, running variance
    model, reference = copy.deepcopy(reference), reference
    compiled = compiler.compile(f, backend="interpret")
    for _ in range(3):
        torch.testing.assert_close(compiled(model, x), f(reference, x))
        for ours, theirs in zip(model.buffers(), reference.buffers()):
            torch.testing.assert_close(ours, theirs)
    assert compiled.stats["replays"] == 2 and compiled.stats["divergences"] == 0


def test_a_row_value_after_a_looped_reduction():
    """A reduction no other value of the row reads runs as a loop over the row; the value per
    row computed from the sum (here returned: stored) comes after the loop, in the same kernel."""
    x = torch.randn(8, 4096, requires_grad=True)

    def f(x):
        return (x * x).sum(-1) * 0.5 + 1.0
    report = compiler.explain(f, x)
    assert len(report.forward_kernels) == 1 and "for roffset" in report.forward_kernels[0].source
    check_parity(f, [x], tol=dict(rtol=1e-4, atol=1e-3))


def test_attention_operands_are_copied_by_one_kernel_not_by_host_reshapes():
    """q, k and v, slices of one projection split into heads, reach their matmuls through views
    PyTorch can only make with a copy: a kernel writes the three in the heads' layout (no
    ``aten::clone`` on the host), and the values are eager's. (Sigmoid attention: a softmax's
    would be flash attention, which reads the views where they lie: tests/test_attention.py.)"""
    torch.manual_seed(0)
    b, t, heads, d = 2, 8, 2, 16
    qkv = torch.nn.Linear(d, 3 * d)
    x = torch.randn(b, t, d, requires_grad=True)

    def attention(x):
        q, k, v = qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, heads, -1).transpose(1, 2) for z in (q, k, v))
        y = torch.sigmoid(q @ k.transpose(-2, -1)) @ v
        return y.transpose(1, 2).reshape(b, t, d)
    report = compiler.explain(attention, x)
    copies = [k for k in report.forward_kernels if k.name.startswith("fused_addmm_identity")]
    assert len(copies) == 1 and copies[0].source.count("tl.store(") == 3, [k.name for k in report.forward_kernels]
    compiled = check_parity(attention, [x])
    with torch.profiler.profile() as prof:
        compiled(x).sum().backward()
    assert not [e.name for e in prof.events() if e.name in ("aten::clone", "aten::contiguous")]


def test_a_linear_layers_bias_gradient_is_summed_where_its_gradient_is_computed():
    """A bias gradient is the column sum of the output's gradient flattened to the matmul's rows;
    summed over the activation's own (B, T, N) it joins the kernel that computes that gradient
    (the GELU's backward, the loss's): two backward kernels where there were four."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
    x = torch.randn(2, 8, 16, requires_grad=True)

    def f(x):
        return (second(F.gelu(first(x))) ** 2).sum()
    report = compiler.explain(compiler.compile(f, backend="interpret"), x)
    assert len(report.backward_kernels) == 2, [k.name for k in report.backward_kernels]
    assert all("tl.sum(" in k.source for k in report.backward_kernels)
    compiled = check_parity(f, [x], tol=dict(rtol=1e-4, atol=1e-4))
    for p in (*first.parameters(), *second.parameters()):
        p.grad = None
    compiled(x).backward()                       # a replay: the bias gradients from the fused kernels
    ours = [p.grad for p in (first.bias, second.bias)]
    first.bias.grad = second.bias.grad = None
    f(x).backward()
    for got, p in zip(ours, (first.bias, second.bias)):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-4)


def test_small_copies_of_different_shapes_share_one_kernel():
    """An attention block's backward copies several operands into the layouts its batched
    matmuls need: the output's gradient, q, k and v split into heads, k transposed, and the saved
    attention output for the projection's weight gradient. Copies with as many elements are made
    by one kernel, each stored in order, or by the kernel that is there when they are needed (the
    softmax's backward, for those its matmuls read): four kernels in all, with eager's gradients.
    (Scores scaled by a tensor: the written-out attention stays written out, not flash attention.)"""
    torch.manual_seed(0)
    b, t, heads, d = 2, 8, 2, 16
    qkv, proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
    x = torch.randn(b, t, d, requires_grad=True)
    temperature = torch.tensor(0.5)

    def block(x):
        q, k, v = qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, heads, -1).transpose(1, 2) for z in (q, k, v))
        y = torch.softmax(q @ k.transpose(-2, -1) * temperature, dim=-1) @ v
        return proj(y.transpose(1, 2).reshape(b, t, d)).square().sum()
    report = compiler.explain(compiler.compile(block, backend="interpret"), x)
    copies = [k for k in report.backward_kernels if k.name.startswith("fused_identity")
              or k.name.startswith("fused_mm_identity")]
    assert len(copies) == 1, [k.name for k in report.backward_kernels]
    assert copies[0].source.count("tl.store(") >= 3
    assert len(report.backward_kernels) == 4, [k.name for k in report.backward_kernels]
    compiled = check_parity(block, [x], tol=dict(rtol=1e-4, atol=1e-4))
    for p in (*qkv.parameters(), *proj.parameters()):
        p.grad = None
    compiled(x).backward()                       # a replay: the weight gradients read the copies
    ours = [p.grad for p in (*qkv.parameters(), *proj.parameters())]
    for p in (*qkv.parameters(), *proj.parameters()):
        p.grad = None
    block(x).backward()
    for got, p in zip(ours, (*qkv.parameters(), *proj.parameters())):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- deep networks (issue 37)
def _residual_stack(layers: int, width: int = 32):
    """Pre-norm residual blocks, x = x + W2 gelu(W1 norm(x)): a transformer's residual stream."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width),
                                                     torch.nn.GELU(), torch.nn.Linear(4 * width, width))
                                 for _ in range(layers))

    def net(x):
        for block in blocks:
            x = x + block(x)
        return x.square().mean()
    return net


def test_the_residual_stream_is_not_recomputed_by_every_layer():
    """Each layer's sum x + y is read by its norm and, past the layer's matmuls, by the next sum:
    inlined, every norm computed the whole stream again (its kernel's bytes grew with depth). Now
    a long chain is stored: the norms' kernels move about as many bytes at every depth."""
    x = torch.randn(64, 32, requires_grad=True)
    report = compiler.explain(compiler.compile(_residual_stack(8), backend="interpret"), x)
    norms = [k.bytes_moved for k in report.forward_kernels if "mean" in k.name]
    assert len(norms) >= 7
    assert max(norms[3:]) <= max(norms[1:3]), norms   # (before: 25 KB at the second, 66 KB at the seventh)
    check_parity(_residual_stack(8), [x], tol=dict(rtol=1e-4, atol=1e-5))


def test_a_deep_backward_shares_its_column_sum_kernels():
    """Six pre-norm blocks at GPT-2's width, traced on meta tensors. The backward, in the forward's
    reverse order, emits each norm's weight and bias gradients before the row sums of its input's:
    their partial sums are moved beside those rows (one pass over the layer's gradient), and the
    second stages of every layer's column sums, small, are made at the end, where they share
    kernels. (Measured: 22 kernels; 28 and 0.43 GB more without the first, 38 without the second.)"""
    from benchmarks.step_trace import _meta_runs_as_cpu

    with torch.device("meta"):
        net = _residual_stack(6, width=768)
        x = torch.randn(8192, 768, requires_grad=True)
    with _meta_runs_as_cpu():
        report = compiler.explain(compiler.compile(net, backend="interpret"), x)
    assert report.fallbacks == []
    assert len(report.backward_kernels) <= 22, [k.name for k in report.backward_kernels]
    assert sum(k.bytes_moved for k in report.backward_kernels) < 3.7e9


def test_a_backward_recomputes_each_matmul_operand_near_its_matmul(monkeypatch):
    """The balanced policy recomputes the norms' and GELUs' outputs in backward (the weight
    gradients' operands) rather than saving them. Made by the first backward kernel of their shape,
    they were all alive from the start of the backward; now each is made at most four matmuls
    before its own."""
    from compiler.fusion import fuse

    monkeypatch.setattr(fuse, "HOIST_MIN_BYTES", 0)   # (the rule's size floor: the sizes here are small)
    layers = 6
    x = torch.randn(64, 32, requires_grad=True)
    report = compiler.explain(compiler.compile(_residual_stack(layers), backend="interpret"), x)
    stores = [k.source.count("tl.store(") for k in report.backward_kernels]
    assert max(stores[:2]) <= 4, stores   # (before: the first two stored 8 each, every layer's operands)
    # and the norms' gradients do not re-read the stream either (before: 33 KB to 75 KB); the first
    # layer's, last, reads the region's input instead of a stored sum: fewer bytes
    norms = [k.bytes_moved for k in report.backward_kernels if "sub_mm_pw_sum" in k.name]
    assert len(norms) >= layers - 1 and max(norms[:-1]) <= 1.2 * min(norms[:-1]), norms
    check_parity(_residual_stack(layers), [x], tol=dict(rtol=1e-4, atol=1e-5))
