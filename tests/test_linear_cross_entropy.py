"""A linear layer's cross-entropy over many classes runs in row chunks (issue 37): the logits are
never whole, values and gradients equal eager's for every form the binding takes (ignore_index,
label smoothing, class weights, each reduction), on every backend; where the logits are read by
something else the loss is the ordinary one; double backward goes through the decomposed form.

The tests chunk small heads: ``SYMGRAD_CHUNKED_LOSS_MIN_LOGITS`` lowers the size from which a loss
is chunked, ``SYMGRAD_LOSS_CHUNK_MB`` the chunk's budget (a few rows per chunk).
"""

from __future__ import annotations

import os

import compiler  # (first: it chooses Triton's interpreter on a machine without a GPU, before Triton loads)
from tests.devices import BACKENDS  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from runtime import linear_cross_entropy as runtime_loss  # noqa: E402

N, D, V = 45, 16, 301


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setenv("SYMGRAD_CHUNKED_LOSS_MIN_LOGITS", "1000")
    monkeypatch.setenv("SYMGRAD_LOSS_CHUNK_MB", "0.02")   # 0.02 MiB / (301 classes * 4 B): 17 rows a chunk of
    # float32 logits, 34 of bf16 for the Triton kernel, 8 for PyTorch's ops


class _LargestMade(TorchDispatchMode):
    """The most elements of any tensor an operator made with a row per position (the logits' first
    dim; the interpreter's blocks and the weight's gradient have other shapes)."""

    def __init__(self, rows=(N,)):
        super().__init__()
        self.largest, self.rows = 0, rows

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.ndim == 2 and t.shape[0] in self.rows:
                # (its memory's: the replay's stand-ins are a 0-d value expanded, nothing allocated)
                self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size())
        return out


def _inputs(seed=0, ignored=5, dtype=torch.float32):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(D, V).to(dtype)
    h = torch.randn(N, D, dtype=dtype, requires_grad=True)
    target = torch.randint(0, V, (N,))
    target[:ignored] = -100
    return layer, h, target


def _step(fn, layer, h, target, grad):
    """fn's loss and the gradients of h, the weight and the bias, for the incoming ``grad``."""
    layer.zero_grad()
    h.grad = None
    out = fn(h, target)
    out.backward(grad(out))
    return [out.detach(), h.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad]


def _grad(out):
    return torch.full_like(out, 0.7) if out.ndim == 0 else torch.linspace(-1, 1, out.numel()).reshape(out.shape)


FORMS = {
    "mean": {},
    "sum": dict(reduction="sum"),
    "none": dict(reduction="none"),
    "label smoothing": dict(label_smoothing=0.15),
    "class weights": dict(weight="w"),
    "weights, smoothing, sum": dict(weight="w", label_smoothing=0.3, reduction="sum"),
    "weights, smoothing, none": dict(weight="w", label_smoothing=0.2, reduction="none"),
    "ignore_index 7": dict(ignore_index=7),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", list(FORMS))
def test_every_form_matches_eager_in_chunks(form, backend):
    layer, h, target = _inputs()
    kwargs = dict(FORMS[form])
    if kwargs.get("weight") == "w":
        kwargs["weight"] = torch.rand(V, generator=torch.Generator().manual_seed(3))
    if kwargs.get("ignore_index") == 7:
        target[:14] = 7   # (the -100s too: with another ignore_index they would be out of range)

    def loss(h, target):
        return F.cross_entropy(layer(F.gelu(h)), target, **kwargs)

    expected = _step(loss, layer, h, target, _grad)
    compiled = compiler.compile(loss, backend=backend, fullgraph=True)
    _step(compiled, layer, h, target, _grad)                      # records
    launches = compiled.stats["kernel_launches"]
    with _LargestMade() as made:
        got = _step(compiled, layer, h, target, _grad)            # replays
    assert compiled.stats["replays"] >= 1 and compiled.stats["divergences"] == 0
    if backend != "torch":
        assert compiled.stats["kernel_launches"] > launches, "no generated kernel ran (the GELU's)"
    assert made.largest < N * V, f"a tensor of {made.largest} elements: the logits ({N} x {V}) were made whole"
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_nll_of_log_softmax_is_chunked_too(reduction):
    layer, h, target = _inputs()
    weight = torch.rand(V, generator=torch.Generator().manual_seed(3))

    def loss(h, target):
        return F.nll_loss(F.log_softmax(layer(h), dim=-1), target, weight=weight, reduction=reduction)

    expected = _step(loss, layer, h, target, _grad)
    compiled = compiler.compile(loss, backend="torch", fullgraph=True)
    _step(compiled, layer, h, target, _grad)
    with _LargestMade() as made:
        got = _step(compiled, layer, h, target, _grad)
    assert made.largest < N * V
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_the_forward_makes_the_gradients_once():
    """A mean's gradients are made by the forward's call, with the loss: one pass over the chunks,
    no logits made again in backward (3 matmuls a chunk in all, as eager's 3)."""
    layer, h, target = _inputs()
    compiled = compiler.compile(lambda h, t: F.cross_entropy(layer(h), t), backend="torch", fullgraph=True)
    _step(compiled, layer, h, target, _grad)
    chunks = -(-N // runtime_loss.chunk_rows(N, V, torch.float32))
    with _Matmuls() as mm:
        _step(compiled, layer, h, target, _grad)
    assert mm.count == 3 * chunks


class _Matmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket.__name__ in ("mm", "addmm", "addmm_"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_logits_read_elsewhere_keep_the_ordinary_loss():
    """A z-loss reads the logits too (and the function returns them): they are made whole anyway,
    so the loss is eager's ordinary form, not chunked (which would make them twice)."""
    layer, h, target = _inputs()

    def loss(h, target):
        logits = layer(h)
        ce = F.cross_entropy(logits, target)
        return ce + 1e-3 * torch.logsumexp(logits, -1).pow(2).mean(), logits

    compiled = compiler.compile(loss, backend="interpret", fullgraph=True)
    compiled(h, target)
    with _Matmuls() as mm:   # eager's three: the logits, then the gradients of h and of the weight
        out, logits = compiled(h, target)
        (out + logits.sum()).backward()
    assert mm.count == 3
    e_out, e_logits = loss(h, target)
    torch.testing.assert_close(out, e_out)
    torch.testing.assert_close(logits, e_logits)


def test_a_language_model_step_under_autocast_matches_eager():
    """nanoGPT's loss: the head's bf16 logits widened to float32 (autocast) and flattened; the
    model returns them, the step does not. Chunked, and eager's numbers over three AdamW steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(V, D), torch.nn.LayerNorm(D), torch.nn.Linear(D, V, bias=False))
    twin = __import__("copy").deepcopy(model)
    ids = torch.randint(0, V, (3, 15))
    targets = ids.roll(1, 1)

    def make_step(m):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)

        def step(ids, targets):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = m(ids)
                loss = F.cross_entropy(logits.view(-1, V), targets.view(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step

    eager, compiled = make_step(twin), compiler.compile(make_step(model), backend="interpret")
    for _ in range(3):
        torch.testing.assert_close(compiled(ids, targets), eager(ids, targets), rtol=2e-2, atol=2e-2)
    assert compiled.stats["replays"] >= 2 and compiled.stats["eager_calls"] == 0
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-2)
    with _LargestMade(rows=(ids.numel(),)) as made:
        compiled(ids, targets)
    assert made.largest < ids.numel() * V


def test_double_backward_goes_through_the_decomposed_loss():
    layer, h, target = _inputs(ignored=0)

    def grad_norm(h, target):
        loss = F.cross_entropy(layer(h), target, label_smoothing=0.1)
        (g,) = torch.autograd.grad(loss, h, create_graph=True)
        return g.pow(2).sum()

    compiled = compiler.compile(grad_norm, backend="interpret", fullgraph=True)
    expected = torch.autograd.grad(grad_norm(h, target), h)[0]
    compiled(h, target)
    got = torch.autograd.grad(compiled(h, target), h)[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_every_row_ignored(reduction):
    """A mean over no counted row is NaN (0/0) as eager's, and its gradients are 0, not NaN."""
    layer, h, target = _inputs(ignored=N)
    expected = _step(lambda h, t: F.cross_entropy(layer(h), t, reduction=reduction), layer, h, target, _grad)
    compiled = compiler.compile(lambda h, t: F.cross_entropy(layer(h), t, reduction=reduction), backend="torch")
    for _ in range(2):
        got = _step(compiled, layer, h, target, _grad)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, equal_nan=True)


@pytest.mark.parametrize("backend", ["torch", "interpret"])
@pytest.mark.parametrize("bad", [V, -3])
def test_a_target_out_of_range_raises_eagers_error(backend, bad):
    """Eager's IndexError, not another error (the CPU path's gather) or a read outside the row (the
    kernel's), on a replay whose targets went out of range."""
    layer, h, target = _inputs()
    loss = compiler.compile(lambda h, t: F.cross_entropy(layer(h), t), backend=backend)
    loss(h, target), loss(h, target)
    target[20] = bad
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
        F.cross_entropy(layer(h), target)
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
        loss(h, target)


def test_chunk_rows_follow_the_budget(monkeypatch):
    monkeypatch.delenv("SYMGRAD_LOSS_CHUNK_MB")
    assert runtime_loss.chunk_rows(8192, 50257, torch.bfloat16, fused=True) == (128 << 20) // (50257 * 2) == 1335
    assert runtime_loss.chunk_rows(8192, 50257, torch.float32) == (128 << 20) // (50257 * 4) == 667   # (in place)
    monkeypatch.setenv("SYMGRAD_LOSS_CHUNK_MB", "64")
    assert runtime_loss.chunk_rows(8192, 50257, torch.bfloat16) == (64 << 20) // (50257 * 8)
    assert runtime_loss.chunk_rows(8192, 50257, torch.float32) == (64 << 20) // (50257 * 4)
    assert runtime_loss.chunk_rows(10, 50257, torch.float32) == 10
    monkeypatch.setenv("SYMGRAD_LOSS_CHUNK_MB", "0.001")
    assert runtime_loss.chunk_rows(8192, 50257, torch.float32) == 1


class _Counted:
    """A kernel whose launches are counted (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["mean", "sum", "weights, smoothing, sum", "ignore_index 7"])
def test_the_chunk_kernel_matches_pytorchs_ops(form, dtype, monkeypatch):
    """The Triton chunk kernel (in the interpreter) against the CPU path's PyTorch ops: the loss and
    the three gradients, bf16 logits too (rounded as eager rounds them)."""
    from runtime import linear_cross_entropy_kernel as kernels

    counted = _Counted(kernels.chunk_loss_kernel)
    monkeypatch.setattr(kernels, "chunk_loss_kernel", counted)
    layer, h, target = _inputs(dtype=dtype)
    kwargs = dict(FORMS[form])
    weight = torch.rand(V, generator=torch.Generator().manual_seed(3)).to(dtype) if "weight" in kwargs else None
    ignore_index = kwargs.get("ignore_index", -100)
    if ignore_index == 7:
        target[:14] = 7
    operands = [h.detach(), layer.weight.detach().t(), layer.bias.detach(), target]
    operands += [weight] if weight is not None else []
    common = dict(which=("loss", "grad_a", "grad_m", "grad_bias"), reduction=kwargs.get("reduction", "mean"),
                  ignore_index=ignore_index, label_smoothing=kwargs.get("label_smoothing", 0.0), has_bias=True,
                  has_weight=weight is not None, loss_dtype=torch.float32)
    expected = runtime_loss.forward(*operands, backend="torch", **common)
    got = runtime_loss.forward(*operands, backend="interpret", **common)
    assert counted.launches == -(-N // runtime_loss.chunk_rows(N, V, dtype, fused=True))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.float(), e.float(), **tol)


def test_the_memory_benchmark_measures_less_than_half_of_eagers_peak(monkeypatch):
    """``benchmarks.chunked_loss`` at a small size (its committed run: 50,257 classes, 2,048 rows):
    the CPU path's peak is under half of eager's, and nothing ran eagerly."""
    from benchmarks import chunked_loss

    monkeypatch.setenv("SYMGRAD_CHUNKED_LOSS_MIN_LOGITS", str(1 << 22))
    monkeypatch.setenv("SYMGRAD_LOSS_CHUNK_MB", "4")
    monkeypatch.setenv("SYMGRAD_CPU_BACKEND", "torch")
    form = "label smoothing 0.1"
    (row,) = chunked_loss.measure(rows=600, width=32, classes=8192, forms={form: form})
    assert row["eager_calls"] == 0
    assert row["ratio"] <= 0.5, row


# (``SYMGRAD_LOSS_FUZZ=120``: more cases; 120 passed on 2026-11-28)
LOSS_FUZZ_CASES = int(os.environ.get("SYMGRAD_LOSS_FUZZ", 16))


@pytest.mark.parametrize("seed", range(LOSS_FUZZ_CASES))
def test_random_heads_match_eager(seed, monkeypatch):
    """Random shapes, forms and layouts (a 3-D input flattened, a bias or none, weights, smoothing,
    any ignore_index, rows all ignored now and then, a single class), each chunked, on a backend
    drawn too: eager's values and gradients."""
    import random

    rnd = random.Random(seed)
    monkeypatch.setenv("SYMGRAD_CHUNKED_LOSS_MIN_LOGITS", "1")
    n, k, c = rnd.randint(1, 70), rnd.randint(1, 24), rnd.choice([1, 2, 7, 130, 401])
    torch.manual_seed(seed)
    layer = torch.nn.Linear(k, c, bias=rnd.random() < 0.5)
    batch = rnd.choice([1, 2]) if n % 2 == 0 else 1
    h = torch.randn(batch, n // batch, k, requires_grad=True)
    target = torch.randint(0, c, (n,))
    ignore_index = rnd.choice([-100, 0, c - 1])
    target[torch.rand(n) < rnd.choice([0.0, 0.3, 1.0])] = ignore_index
    kwargs = dict(reduction=rnd.choice(["mean", "sum", "none"]), ignore_index=ignore_index,
                  label_smoothing=rnd.choice([0.0, 0.1, 1.0]))
    if rnd.random() < 0.4:
        kwargs["weight"] = torch.rand(c)

    def loss(h, target):
        return F.cross_entropy(layer(h).reshape(-1, c), target, **kwargs)

    backend = rnd.choice(BACKENDS)
    expected = _step(loss, layer, h, target, _grad)
    compiled = compiler.compile(loss, backend=backend, fullgraph=True)
    for _ in range(2):
        got = _step(compiled, layer, h, target, _grad)
    assert compiled.stats["replays"] >= 1 and compiled.stats["divergences"] == 0
    for g, e in zip(got, expected):
        if e is None:
            assert g is None
        else:
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5, equal_nan=True, msg=lambda m: f"{kwargs}: {m}")
