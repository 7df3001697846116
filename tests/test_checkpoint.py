"""``torch.utils.checkpoint`` inside a compiled function.

Eager PyTorch is the oracle for values and gradients. Non-reentrant checkpoints compose with
the compiled regions: the block's values are not saved but recomputed by the region's own
backward kernels (the block's Python never runs again in backward), and what the region saves
goes through the saved-tensor hooks around the checkpoint. Reentrant checkpoints run their
block eagerly, as a custom autograd.Function, and stay right.
"""

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import compiler
from tests.parity import assert_ran_compiled


def _linear_gelu():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))


class Calls:
    """A block that counts how often its Python runs (eager's recomputation runs it again)."""

    def __init__(self, fn):
        self.fn, self.count = fn, 0

    def __call__(self, *args):
        self.count += 1
        return self.fn(*args)


def _check_against_eager(step, make_inputs, params, calls=3, **compile_kwargs):
    """Run ``step`` compiled and eagerly on equal inputs; compare losses and every gradient."""
    f = compiler.compile(step, **compile_kwargs)
    for _ in range(calls):
        inputs, eager_inputs = make_inputs(), make_inputs()
        for p in params:
            p.grad = None
        loss = f(*inputs)
        loss.backward()
        grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        expected = step(*eager_inputs)
        expected.backward()
        torch.testing.assert_close(loss, expected)
        for g, p in zip(grads, params):
            torch.testing.assert_close(g, p.grad)
        for x, e in zip(inputs, eager_inputs):
            if x.requires_grad:
                torch.testing.assert_close(x.grad, e.grad)
    backend = compile_kwargs.get("backend", "auto")
    assert_ran_compiled(f, backend="interpret" if backend == "auto" else backend)
    return f


def _x(shape=(8, 16)):
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(*shape, generator=gen).requires_grad_(),)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_linear_gelu_block_matches_eager(use_reentrant):
    model = _linear_gelu()

    def step(x):
        y = checkpoint(model, x, use_reentrant=use_reentrant)
        return (y * y).sum()
    _check_against_eager(step, _x, list(model.parameters()))


def test_recomputation_runs_in_the_compiled_backward():
    # eager's checkpoint runs the block's Python again in backward; the compiled region
    # recomputes it in its backward kernels: the block runs once per call, and nothing eagerly
    model = _linear_gelu()
    block = Calls(lambda x: torch.tanh(model(x)) * 2)

    def step(x):
        y = checkpoint(block, x, use_reentrant=False)
        return (y * y).sum()
    f = _check_against_eager(step, _x, list(model.parameters()), fullgraph=True)
    block.count = 0
    f(*_x()).backward()
    assert block.count == 1
    report = compiler.explain(f, *_x())
    recomputed = [n for n in report.backward_graph.nodes if getattr(n.target, "name", None) in ("addmm", "gelu")]
    assert recomputed, "the backward should recompute the block's matmul and GELU"
    assert not report.fallbacks


def _saved_bytes(fn, inputs, params) -> int:
    """Bytes the call packs through saved-tensor hooks around it, leaving out the tensors that
    are alive anyway (inputs, parameters, and views of them)."""
    alive = {t.untyped_storage().data_ptr() for t in list(inputs) + list(params)}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in alive and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(*inputs)
    loss.backward()
    return total


@pytest.mark.allows_eager("KNOWN BUG, reported (issue 32): the measuring pack hook's untyped_storage() calls during a "
                          "replay leave the recording, so the checkpointed call runs partly eagerly")
def test_checkpoint_saves_less():
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
              for _ in range(2)]
    params = [p for layer in layers for p in layer.parameters()]

    def plain(x):
        for layer in layers:
            x = x + layer(x)
        return x.square().sum()

    def checkpointed(x):
        for layer in layers:
            x = x + checkpoint(layer, x, use_reentrant=False)
        return x.square().sum()

    def x():
        return torch.randn(32, 64, requires_grad=True)
    ours_plain, ours_checkpointed = compiler.compile(plain), compiler.compile(checkpointed)
    for f in (ours_plain, ours_checkpointed):
        for _ in range(2):
            f(x()).backward()
    saved = {name: _saved_bytes(f, (x(),), params) for name, f in
             [("ours", ours_plain), ("ours checkpointed", ours_checkpointed), ("eager checkpointed", checkpointed)]}
    # eager keeps each layer's input, and the square's input; ours no more than that
    assert saved["ours checkpointed"] <= saved["eager checkpointed"], saved
    assert saved["ours checkpointed"] < saved["ours"] / 3, saved


def _attention_block(dim=16, heads=2):
    torch.manual_seed(0)
    norm1, norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
    qkv, proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
    mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
    modules = [norm1, norm2, qkv, proj, mlp]

    def block(x):
        batch, seq, _ = x.shape
        q, k, v = qkv(norm1(x)).reshape(batch, seq, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / (dim // heads) ** 0.5
        mask = torch.ones(seq, seq, dtype=torch.bool).tril()
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + proj((attn @ v).transpose(1, 2).reshape(batch, seq, dim))
        return x + mlp(norm2(x))
    return block, [p for m in modules for p in m.parameters()]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_transformer_block_matches_eager(use_reentrant):
    block, params = _attention_block()

    def step(x):
        return checkpoint(block, x, use_reentrant=use_reentrant).square().mean()
    _check_against_eager(step, functools.partial(_x, (2, 4, 16)), params, calls=2)


def test_same_block_checkpointed_twice_in_a_call():
    # two calls of one block (consecutive checkpoints), and a block inside another
    model = _linear_gelu()

    def step(x):
        y = checkpoint(model, x, use_reentrant=False)
        y = checkpoint(model, torch.tanh(y), use_reentrant=False)
        z = checkpoint(lambda a: checkpoint(model, a.sin(), use_reentrant=False) * a, y, use_reentrant=False)
        return z.sum()
    _check_against_eager(step, _x, list(model.parameters()), fullgraph=True)


def test_output_of_the_block_is_returned():
    # the loss is computed outside the compiled function from the block's output
    model = _linear_gelu()

    def fn(x):
        return checkpoint(model, x, use_reentrant=False)

    def step(x):
        return (compiled(x) ** 2).sum() if step.compiled else (fn(x) ** 2).sum()
    compiled = compiler.compile(fn)
    params = list(model.parameters())
    for _ in range(3):
        (x,), (eager_x,) = _x(), _x()
        for p in params:
            p.grad = None
        (compiled(x) ** 2).sum().backward()
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        (fn(eager_x) ** 2).sum().backward()
        torch.testing.assert_close(x.grad, eager_x.grad)
        for g, p in zip(grads, params):
            torch.testing.assert_close(g, p.grad)


def test_dropout_mask_is_recomputed_from_the_same_seed():
    def step(x):
        y = checkpoint(lambda a: torch.nn.functional.dropout(a, 0.5, training=True) * 3, x, use_reentrant=False)
        return y.sum(), y.detach()
    f = compiler.compile(step)
    for _ in range(3):
        x = torch.rand(64, 64).add_(0.5).requires_grad_()
        loss, y = f(x)
        loss.backward()
        torch.testing.assert_close(x.grad, (y != 0).float() * 6)


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


@pytest.mark.allows_eager("a checkpoint block with an eager call runs eagerly whole: what it tests")
def test_block_with_an_eager_call_runs_eagerly_whole():
    # a custom autograd.Function inside the block saves into the checkpoint's holders, and
    # eager's recomputation reruns the whole block: the block's compiled ops run eagerly too
    model = _linear_gelu()

    def step(x):
        y = checkpoint(lambda a: _Square.apply(model(a)).tanh(), x, use_reentrant=False)
        return (y * x).sum()
    f = _check_against_eager(step, _x, list(model.parameters()))
    assert any("checkpoint" in reason for reason in compiler.explain(f, *_x()).fallbacks)


def test_save_on_cpu_around_a_checkpoint():
    model = _linear_gelu()

    def step(x):
        with torch.autograd.graph.save_on_cpu():
            y = checkpoint(model, x, use_reentrant=False)
        return (y * y).sum()
    _check_against_eager(step, _x, list(model.parameters()))
