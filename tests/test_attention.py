"""Scaled dot-product attention as flash attention (issue 34): every form the binding takes runs
our Triton flash kernels (in the interpreter here) or, on the CPU path, PyTorch's fused CPU
kernel; values and gradients equal eager's; nothing T x T is saved for backward; double
backward goes through the decomposed form, correctly.
"""

from __future__ import annotations

import logging
import math

import compiler  # (first: it chooses Triton's interpreter on a machine without a GPU, before Triton loads)
from tests.devices import KERNELS, BACKENDS  # noqa: E402  (the CUDA test mode's: tests/devices.py)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from compiler.ir.ops import catalog as C  # noqa: E402
from runtime import attention as runtime_attention  # noqa: E402
from runtime import extern_kernels  # noqa: E402
from tests.parity import TOLERANCE, check_parity, clone_inputs, run_eager  # noqa: E402


def _qkv(B, H, HK, M, N, D, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return [torch.randn(B, h, n, D, dtype=dtype, requires_grad=True) for h, n in ((H, M), (HK, N), (HK, N))]


def _attention_nodes(fn, args, backend=KERNELS) -> list:
    """The flash attention nodes of ``fn``'s captured graphs (each region's)."""
    report = compiler.explain(compiler.compile(fn, backend=backend), *clone_inputs(args))
    return [n for r in report.regions for n in r["captured"].nodes if n.op == "call_function"
            and n.target is C.ATTENTION and n.kwargs["which"] == "out"]


def _assert_flash(fn, args, expected=1):
    nodes = _attention_nodes(fn, args)
    assert len(nodes) == expected, f"{len(nodes)} flash attention nodes, expected {expected}"
    return nodes


FORMS = {
    "plain": (dict(), dict(B=2, H=2, HK=2, M=37, N=37, D=16)),
    "causal": (dict(is_causal=True), dict(B=2, H=2, HK=2, M=70, N=70, D=32)),
    "causal, fewer queries than keys": (dict(is_causal=True), dict(B=1, H=2, HK=2, M=20, N=45, D=16)),
    "scale": (dict(scale=0.37), dict(B=1, H=3, HK=3, M=33, N=65, D=24)),
    "gqa": (dict(enable_gqa=True, is_causal=True), dict(B=2, H=4, HK=2, M=40, N=40, D=16)),
    "head dim 80 (padded to 128)": (dict(), dict(B=1, H=1, HK=1, M=30, N=66, D=80)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("form", list(FORMS))
def test_flash_forms_match_eager(form, dtype):
    kwargs, sizes = FORMS[form]
    args = _qkv(**sizes, dtype=dtype)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    _assert_flash(f, args)
    compiled = check_parity(f, args, dtype=dtype, grad_seed=torch.randn(sizes["B"], sizes["H"], sizes["M"],
                                                                          sizes["D"], dtype=dtype))
    assert compiled.stats["kernel_launches"] >= 3   # the forward kernel, then dQ and dK/dV


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_masks_broadcast_over_batch_and_heads(kind):
    args = _qkv(2, 4, 4, 33, 70, 16, dtype=torch.float64)
    torch.manual_seed(1)
    if kind == "bool":
        mask = torch.rand(33, 70) > 0.4          # [M, N]: broadcast over batch and heads
        mask[5] = False                          # a row that sees no key: eager's 0, zero gradients
    else:
        mask = torch.randn(2, 1, 33, 70, dtype=torch.float64)   # over heads
        mask[1, 0, 7] = -math.inf
    args.append(mask)

    def f(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    _assert_flash(f, args)
    check_parity(f, args, dtype=torch.float64)


def test_fully_masked_rows_give_zero_and_no_nan():
    q, k, v = _qkv(1, 2, 2, 20, 20, 16)
    mask = torch.ones(20, 20, dtype=torch.bool)
    mask[3:9] = False

    def f(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    compiled = check_parity(f, [q, k, v, mask])
    out = compiled(q, k, v, mask)
    assert torch.equal(out[:, :, 3:9], torch.zeros_like(out[:, :, 3:9]))
    out.sum().backward()
    assert not any(torch.isnan(t.grad).any() for t in (q, k, v))


def test_hugging_face_repeat_kv_is_read_not_made():
    """Llama's ``repeat_kv`` (x[:, :, None].expand(...).reshape(...)) before SDPA: the kernels read
    the 2 key/value heads for their 4 query heads; the repeated tensor is never an argument."""
    args = _qkv(2, 4, 2, 24, 24, 16)

    def repeat_kv(x, groups):
        b, h, n, d = x.shape
        return x[:, :, None, :, :].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)
    node, = _assert_flash(f, args)
    assert [tuple(a.meta["symgrad"].shape) for a in node.args[1:3]] == [(2, 2, 24, 16)] * 2
    check_parity(f, args)


def test_three_dimensional_inputs():
    torch.manual_seed(0)
    args = [torch.randn(3, 29, 16, requires_grad=True) for _ in range(3)]

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    _assert_flash(f, args)
    check_parity(f, args)


def test_views_of_a_projection_are_read_where_they_lie():
    """nanoGPT: q, k, v split from one projection and transposed to [B, H, T, D]: the kernels
    read them through their strides, and nothing copies them first (no kernel but the flash
    ones, forward and backward, besides the gradient's layout)."""
    torch.manual_seed(0)
    B, T, H, D = 2, 40, 2, 16
    x = torch.randn(B, T, 3 * H * D, requires_grad=True)

    def f(x):
        q, k, v = x.split(H * D, dim=2)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, H * D)
    _assert_flash(f, [x])
    check_parity(f, [x])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_as_close_to_the_exact_result_as_eager(dtype):
    """bf16/fp16 inputs, float32 accumulation: the kernels' error against a float64 evaluation is
    within 2x eager's own (eager's CPU kernel computes in float32 too)."""
    q, k, v = _qkv(1, 2, 2, 70, 70, 32, dtype=dtype)
    g = torch.randn(1, 2, 70, 32, dtype=dtype)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    exact_out, exact_grads = run_eager(f, [t.detach().double().requires_grad_() for t in (q, k, v)], g.double())
    eager_out, eager_grads = run_eager(f, [q, k, v], g)
    compiled = compiler.compile(f, backend=KERNELS)
    compiled(*clone_inputs([q, k, v]))
    inputs = clone_inputs([q, k, v])
    out = compiled(*inputs)
    out.backward(g)
    assert compiled.stats["kernel_launches"] >= 3
    for ours, theirs, exact in zip([out] + [t.grad for t in inputs], [eager_out] + eager_grads,
                                   [exact_out] + exact_grads):
        ours_error = (ours.double() - exact).abs().max().item()
        eager_error = (theirs.double() - exact).abs().max().item()
        assert ours_error <= 2 * eager_error + 1e-3 * exact.abs().max().item(), (ours_error, eager_error)


# ------------------------------------------------------------------------------ dropout
@triton.jit
def _philox_grid(Seed, Out, n):
    offsets = tl.arange(0, 1024) + tl.program_id(0) * 1024
    tl.store(Out + offsets, tl.rand(tl.load(Seed), offsets.to(tl.int64)), mask=offsets < n)


def _kernel_random_numbers(seed: torch.Tensor, shape) -> torch.Tensor:
    """What ``tl.rand(seed, position)`` gives at each position of ``shape`` (row-major)."""
    out = torch.empty(math.prod(shape))
    _philox_grid[(triton.cdiv(out.numel(), 1024),)](seed, out, out.numel())
    return out.view(shape)


@pytest.mark.parametrize("gqa", [False, True])
def test_dropout_regenerates_the_same_numbers_in_backward(gqa):
    """The kernels drop exactly the weights whose Philox number (by the weight's position) is
    below p, in forward and again in backward: values and gradients equal the math with that
    keep mask, and nothing is stored between the two."""
    B, H, HK, T, D, p = 1, 4, 2 if gqa else 4, 45, 16, 0.3
    q, k, v = _qkv(B, H, HK, T, T, D, dtype=torch.float64)
    seed = torch.tensor(1234, dtype=torch.int64)
    keep = _kernel_random_numbers(seed, (B, H, T, T)) >= p
    groups = H // HK

    def math_form(q, k, v):
        kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        weights = torch.softmax((q @ kk.transpose(-2, -1)) / math.sqrt(D) + torch.full((T, T), -math.inf,
                                dtype=q.dtype).triu(1), -1)
        return torch.where(keep, weights / (1 - p), 0.0) @ vv
    g = torch.randn(B, H, T, D, dtype=torch.float64)
    expected = math_form(q, k, v)
    expected_grads = torch.autograd.grad(expected, (q, k, v), g)
    parameters = dict(is_causal=True, scale=1 / math.sqrt(D), dropout_p=p, has_mask=False)
    out, lse = runtime_attention.forward(q.detach(), k.detach(), v.detach(), seed, **parameters)
    grads = runtime_attention.backward(g, q.detach(), k.detach(), v.detach(), out, lse, seed, which=("q", "k", "v"),
                                       **parameters)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float64])
    for ours, theirs in zip(grads, expected_grads):
        torch.testing.assert_close(ours, theirs, **TOLERANCE[torch.float64])


def test_compiled_dropout_follows_the_generator_and_changes_per_call():
    q, k, v = _qkv(1, 2, 2, 64, 64, 16)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    _assert_flash(f, [q, k, v])
    compiled = compiler.compile(f, backend=KERNELS)
    compiled(q, k, v)
    torch.manual_seed(7)
    first = compiled(q, k, v)
    torch.manual_seed(7)
    again = compiled(q, k, v)
    other = compiled(q, k, v)
    assert torch.equal(first, again) and not torch.equal(first, other)
    no_dropout = F.scaled_dot_product_attention(q, k, v)
    # E[dropout(w)] = w: the mean over many positions is close to the undropped output's
    assert abs(first.mean().item() - no_dropout.mean().item()) < 0.1
    first.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# ------------------------------------------------------------------------------ the CPU path
@pytest.mark.parametrize("form", ["causal", "gqa", "scale"])
def test_cpu_path_runs_pytorchs_fused_kernel(form):
    """backend="torch": the same graph, attention by PyTorch's CPU flash kernel (eager's own): the
    values are eager's to the bit."""
    kwargs, sizes = FORMS[form]
    args = _qkv(**sizes)
    g = torch.randn(sizes["B"], sizes["H"], sizes["M"], sizes["D"])

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    _assert_flash(f, args)
    compiled = compiler.compile(f, backend="torch")
    ref_out, ref_grads = run_eager(f, args, g)
    compiled(*clone_inputs(args))
    inputs = clone_inputs(args)
    out = compiled(*inputs)
    out.backward(g)
    assert compiled.stats["divergences"] == 0 and compiled.last_backend == "torch"
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for ours, theirs in zip([t.grad for t in inputs], ref_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ saved bytes
@pytest.mark.parametrize("backend", BACKENDS)
def test_nothing_t_by_t_is_saved(backend):
    """Issue 34's measure (``benchmarks.attention_saved``) at T=128, every form (SDPA's and nanoGPT's
    written out): at most 1.25x eager's saved bytes, and no saved tensor with two dimensions of
    length T but the user's own mask."""
    from benchmarks import attention_saved

    T = 128
    for name, (fn, args) in attention_saved.forms(T).items():
        eager = attention_saved.measure(fn, args, T, None)
        ours = attention_saved.measure(fn, args, T, backend)
        assert ours["replayed"] and ours["bytes"] <= 1.25 * eager["bytes"], (name, ours, eager)
        user_masks = sum(1 for a in args if not a.requires_grad and a.dim() >= 2)
        assert ours["square"] <= user_masks, (name, ours)


# ------------------------------------------------------------------------------ double backward
class _Said(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("form", ["causal", "gqa", "mask"])
def test_double_backward_through_the_decomposed_form(form):
    """create_graph=True: eager's CPU flash kernel has no double backward (it raises), its math
    kernel does; ours runs the flash kernels for the first backward and differentiates the
    decomposed form for the second, and says so in the ``backward`` log."""
    H, HK = (4, 2) if form == "gqa" else (2, 2)
    q, k, v = _qkv(1, H, HK, 9, 11, 16, dtype=torch.float64)
    mask = torch.randn(9, 11, dtype=torch.float64) if form == "mask" else None

    def f(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=form == "causal",
                                             enable_gqa=form == "gqa")
        g, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        return g.sin().sum()
    with sdpa_kernel(SDPBackend.MATH):
        expected = f(q, k, v)
        expected_grads = torch.autograd.grad(expected, (q, k, v))
    said = _Said()
    logging.getLogger("symgrad.backward").addHandler(said)
    compiler.set_logs("backward")
    try:
        compiled = compiler.compile(f, backend=KERNELS)
        with sdpa_kernel(SDPBackend.MATH):  # (the recording call runs eagerly)
            compiled(q, k, v)
        out = compiled(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v))
    finally:
        compiler.set_logs()
        logging.getLogger("symgrad.backward").removeHandler(said)
    assert any("runs attention in its decomposed form" in m for m in said.messages), said.messages
    assert compiled.stats["divergences"] == 0 and compiled.stats["kernel_launches"] > 0
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float64])
    for ours, theirs in zip(grads, expected_grads):
        torch.testing.assert_close(ours, theirs, **TOLERANCE[torch.float64])
    assert _attention_nodes(f, [q, k, v]), "the first backward did not run the flash kernels"


# ------------------------------------------------------------------------------ Hopper
def test_flash_kernels_compile_for_hopper_without_spills():
    """Issue 34: the forward and both backward kernels compile for sm_90 (Triton's real compiler,
    the specializations a launch gives them, the tiles ``runtime.attention.tiles`` picks) and spill
    no registers: head dims 64 and 128 in bfloat16 and float16, 64 in float32; causal, GQA; and with
    the rotary embedding applied inside (bfloat16)."""
    from benchmarks.sm90 import Launch, compile_launches, describe_args
    from runtime import attention_kernels
    from runtime.kernels import cache_dir

    import inspect
    source = inspect.getsource(attention_kernels)
    launches = []

    def record(kernel, grid, args, options, cost):
        options = dict(options)
        warps = options.pop("num_warps")
        launches.append(Launch(kernel.fn.__name__, source, describe_args(args), options, warps, list(grid)))
    with extern_kernels.launches_recorded(record):
        for head_dim, dtype, rotary in [(64, torch.bfloat16, False), (128, torch.bfloat16, False),
                                        (64, torch.float16, False), (128, torch.float16, False),
                                        (64, torch.float32, False), (64, torch.bfloat16, True),
                                        (128, torch.bfloat16, True)]:
            q = torch.empty(2, 4, 1024, head_dim, dtype=dtype)
            kv = torch.empty(2, 2, 1024, head_dim, dtype=dtype)
            rot = [torch.empty(2, 1, 1024, head_dim, dtype=dtype)] * 2 if rotary else []
            parameters = dict(is_causal=True, scale=0.125, dropout_p=0.0, has_mask=False, rotary=rotary)
            out, lse = runtime_attention.forward(q, kv, kv, *rot, **parameters)
            runtime_attention.backward(q, q, kv, kv, out, lse, *rot, which=("q", "k", "v"), **parameters)
    assert len(launches) == 21
    results = compile_launches(launches, processes=2, cache_dir=cache_dir())
    errors = [f"{launch.name}: {r['error']}" for launch, r in zip(launches, results) if r["error"]]
    assert not errors, "\n".join(errors)
    spills = [f"{launch.name} {launch.args[0][1]} BLOCK_D={launch.constexprs['BLOCK_D']} "
              f"rotary={launch.constexprs['ROTARY']}: {r['spill_bytes']} B"
              for launch, r in zip(launches, results) if r["spill_bytes"]]
    assert not spills, "\n".join(spills)


# ------------------------------------------------------------------------------ written out
def _runs_flash_backward(fn, args) -> bool:
    """Whether ``fn``'s compiled backward is the flash kernels' (the written-out pattern rewritten)."""
    report = compiler.explain(compiler.compile(fn, backend=KERNELS), *clone_inputs(args))
    return any(n.op == "call_function" and n.target is C.ATTENTION_BACKWARD
               for r in report.regions if r.get("backward_graph") is not None for n in r["backward_graph"].nodes)


def _nanogpt_buffer(bias):
    def f(q, k, v):
        T = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(bias[:, :, :T, :T] == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ v
    return f


def _written_causal(q, k, v):
    T = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
    att = att.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool)), float("-inf"))
    return F.softmax(att, dim=-1) @ v


def _written_additive(q, k, v, mask):
    w = torch.matmul(q, k.transpose(2, 3)) * 0.25 + mask
    return torch.matmul(F.softmax(w, dim=-1), v)


def _written_plain(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2), -1) @ v


@pytest.mark.parametrize("form", ["nanogpt buffer", "causal from positions", "additive, a row all -inf", "plain"])
def test_written_out_attention_becomes_flash(form):
    """softmax(q kᵀ · scale [+ mask | masked_fill]) @ v written out: the same kernels as SDPA when
    nothing else reads the weights, values and gradients eager's (a row every key is masked
    from stays NaN, as softmax makes it)."""
    args = _qkv(2, 2, 2, 40, 40, 16, dtype=torch.float64)
    if form == "nanogpt buffer":
        fn = _nanogpt_buffer(torch.tril(torch.ones(1, 1, 64, 64, dtype=torch.float64)))
    elif form == "causal from positions":
        fn = _written_causal
    elif form == "plain":
        fn = _written_plain
    else:
        mask = torch.randn(2, 1, 40, 40, dtype=torch.float64)
        mask[0, 0, 3] = -math.inf
        fn, args = _written_additive, args + [mask]
    assert _runs_flash_backward(fn, args)
    check_parity(fn, args, dtype=torch.float64)


def test_written_out_attention_whose_weights_are_read_stays_written_out():
    args = _qkv(1, 2, 2, 24, 24, 16)

    def f(q, k, v):
        weights = torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1)
        return weights @ v, weights
    assert not _runs_flash_backward(f, args)
    check_parity(lambda q, k, v: sum(t.sum() for t in f(q, k, v)), args)


def test_written_out_dropout_draws_the_numbers_sdpa_draws():
    """nanoGPT's written-out dropout on the weights becomes the kernels' in-kernel dropout: the same
    call seed gives exactly what the SDPA form gives (the Philox numbers at each weight's position)."""
    q, k, v = _qkv(2, 2, 2, 40, 40, 16)

    def written(q, k, v):
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~torch.tril(torch.ones(40, 40, dtype=torch.bool)), float("-inf"))
        return F.dropout(F.softmax(att, dim=-1), 0.2, training=True) @ v

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.2)
    ours, theirs = compiler.compile(written, backend=KERNELS), compiler.compile(sdpa, backend=KERNELS)
    ours(q, k, v), theirs(q, k, v)
    torch.manual_seed(5)
    a = ours(q, k, v)
    torch.manual_seed(5)
    b = theirs(q, k, v)
    torch.testing.assert_close(a, b)
    assert ours.stats["kernel_launches"] == theirs.stats["kernel_launches"] == 1   # the flash forward alone


def test_the_output_is_written_in_the_layout_its_transpose_back_makes():
    """nanoGPT's block: y.transpose(1, 2).contiguous().view(B, T, C) before the projection. The
    flash kernel writes y as [B, T, H, D], so neither that copy nor the backward's copy of y for
    the projection's weight gradient is made: no forward kernel at all but attention's."""
    torch.manual_seed(0)
    B, T, H, D = 2, 16, 2, 16
    c_attn, c_proj = torch.nn.Linear(H * D, 3 * H * D), torch.nn.Linear(H * D, H * D)
    x = torch.randn(B, T, H * D, requires_grad=True)

    def block(x):
        q, k, v = c_attn(x).split(H * D, dim=2)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return c_proj(y.transpose(1, 2).contiguous().view(B, T, H * D))
    report = compiler.explain(compiler.compile(block, backend=KERNELS), x)
    assert report.forward_kernels == [], [k.name for k in report.forward_kernels]
    assert not [k.name for k in report.backward_kernels if k.name.startswith("fused_identity")]
    check_parity(block, [x])


def _random_written_out(rng):
    """A random written-out attention from ``rng`` (a ``random.Random``): (function, arguments,
    whether its weights escape)."""
    B, H, D = rng.choice([1, 2]), rng.choice([1, 3]), rng.choice([8, 16, 24])
    N = rng.randint(5, 40)
    mask_form = rng.choice(["none", "causal", "bool", "additive", "buffer"])
    M = rng.randint(3, N) if mask_form in ("causal", "buffer") else rng.randint(3, 40)
    scale_form, softmax_form, escapes = rng.choice(["mul", "div", "none"]), rng.choice(["torch", "F", "method"]), \
        rng.random() < 0.25
    g = torch.Generator().manual_seed(rng.randint(0, 10**6))
    q = torch.randn(B, H, M, D, generator=g, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    mask = {"bool": torch.rand(M, N, generator=g) > 0.3, "additive": torch.randn(B, 1, M, N, generator=g,
            dtype=torch.float64), "buffer": torch.ones(1, 1, 48, 48, dtype=torch.float64).tril()}.get(mask_form)
    if mask_form == "additive":
        mask[0, 0, 1] = -math.inf

    def f(q, k, v):
        s = q @ k.transpose(-2, -1)
        s = s * 0.3 if scale_form == "mul" else s / math.sqrt(D) if scale_form == "div" else s
        if mask_form == "causal":
            s = s.masked_fill(~torch.tril(torch.ones(M, N, dtype=torch.bool)), float("-inf"))
        elif mask_form == "bool":
            s = s.masked_fill(~mask, float("-inf"))
        elif mask_form == "additive":
            s = s + mask
        elif mask_form == "buffer":
            s = s.masked_fill(mask[:, :, :M, :N] == 0, float("-inf"))
        w = torch.softmax(s, -1) if softmax_form == "torch" else F.softmax(s, dim=-1) if softmax_form == "F" \
            else s.softmax(-1)
        out = w @ v
        return out.sum() + w.square().sum() if escapes else out
    return f, [q, k, v], escapes


def test_random_written_out_attention_is_eagers():
    """A small fuzz of the written-out pattern: scalings, masks (causal from positions, boolean,
    additive with a row all -inf, nanoGPT's buffer), softmax spellings, lengths; the weights read
    elsewhere in a quarter of them. Each equals eager (float64), and runs the flash kernels exactly
    when its weights do not escape."""
    import random

    rng = random.Random(34)
    for _ in range(16):
        fn, args, escapes = _random_written_out(rng)
        assert _runs_flash_backward(fn, args) == (not escapes)
        check_parity(fn, args, dtype=torch.float64)


# ------------------------------------------------------------------------------ rotary embeddings
def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _llama_attention(cache: bool):
    """Llama's attention after its projections: rotary on q and k (HF's apply_rotary_pos_emb), then
    SDPA with GQA; ``cache``: k and v appended to an empty key/value cache first (torch.cat)."""
    def f(q, k, v, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if cache:
            empty = k.new_zeros(k.shape[0], k.shape[1], 0, k.shape[3])
            k, v = torch.cat([empty, k], dim=2), torch.cat([empty, v], dim=2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return f


def _rotary_args(dtype, B=2, H=4, HK=2, T=24, D=16):
    args = _qkv(B, H, HK, T, T, D, dtype=dtype)
    positions = torch.arange(T, dtype=dtype)[:, None] * torch.rand(D // 2, dtype=dtype)[None]
    angles = torch.cat((positions, positions), -1)[None].expand(B, T, D)
    return args + [angles.cos(), angles.sin()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cache", [False, True])
def test_rotary_embedding_is_applied_inside_the_kernels(dtype, cache):
    """q * cos + rotate_half(q) * sin (and k's) is read inside the flash kernels: no kernel writes
    the rotated q and k, and the gradients of q and k are taken back through the rotation there.
    Values and gradients are eager's, on the interpreter and the CPU path."""
    fn, args = _llama_attention(cache), _rotary_args(dtype)
    report = compiler.explain(compiler.compile(fn, backend=KERNELS), *clone_inputs(args))
    assert report.forward_kernels == [], [k.name for k in report.forward_kernels]
    flash = [n for r in report.regions for n in r["backward_graph"].nodes
             if n.op == "call_function" and n.target is C.ATTENTION_BACKWARD]
    assert flash and all(n.kwargs["rotary"] for n in flash)
    check_parity(fn, args, dtype=dtype)
    compiled = compiler.compile(fn, backend="torch")
    compiled(*clone_inputs(args))
    inputs = clone_inputs(args)
    out = compiled(*inputs)
    out.sum().backward()
    expected, grads = run_eager(fn, args, torch.ones_like(out))
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    for ours, theirs in zip([t.grad for t in inputs[:3]], grads):
        torch.testing.assert_close(ours, theirs, **TOLERANCE[dtype])


def test_double_backward_through_rotary_attention():
    fn = _llama_attention(cache=False)
    args = _rotary_args(torch.float64, B=1, T=9)

    def f(q, k, v, cos, sin):
        g, = torch.autograd.grad(fn(q, k, v, cos, sin).square().sum(), q, create_graph=True)
        return g.sin().sum()
    with sdpa_kernel(SDPBackend.MATH):
        expected = f(*args)
        expected_grads = torch.autograd.grad(expected, args[:3])
    compiled = compiler.compile(f, backend=KERNELS)
    with sdpa_kernel(SDPBackend.MATH):
        compiled(*args)
    out = compiled(*args)
    grads = torch.autograd.grad(out, args[:3])
    assert compiled.stats["divergences"] == 0 and compiled.stats["kernel_launches"] > 0
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float64])
    for ours, theirs in zip(grads, expected_grads):
        torch.testing.assert_close(ours, theirs, **TOLERANCE[torch.float64])
