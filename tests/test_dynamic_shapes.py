"""Shapes that change: dynamic dims, templates instantiated instead of recorded, the relations a
guard keeps (compiler.reuse.dynamic, runtime.dynamic_shapes). Eager PyTorch is the oracle throughout."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import compiler
from tests.devices import KERNELS  # noqa: E402  (the CUDA test mode's: tests/devices.py)


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# -- dynamic batch, dynamic sequence ------------------------------------------------------------------
def test_dynamic_batch_records_twice_then_instantiates():
    torch.manual_seed(0)
    lin = nn.Linear(6, 5)
    ref = copy.deepcopy(lin)

    def f(model, x):
        return (model(x).relu() ** 2).mean(0).sum()
    compiled = compiler.compile(f, backend=KERNELS)
    for batch in (4, 7, 3, 9, 5, 12):
        x = torch.randn(batch, 6)
        out = compiled(lin, x)
        expected = f(ref, x)
        _close(out, expected)
        out.backward(), expected.backward()
        _close(lin.weight.grad, ref.weight.grad)
        _close(lin.bias.grad, ref.bias.grad)
    assert compiled.stats["captures"] == 2
    assert compiled.stats["instantiations"] == 4


class Block(nn.Module):
    """nanoGPT's causal self-attention and MLP, with a position embedding of arange(T)."""

    def __init__(self, vocab=32, dim=12, heads=3, max_len=24):
        super().__init__()
        self.heads = heads
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.fc, self.head = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, vocab)
        self.register_buffer("bias", torch.tril(torch.ones(max_len, max_len)).view(1, 1, max_len, max_len))

    def forward(self, idx, targets):
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        C = x.size(-1)
        q, k, v = self.c_attn(self.ln1(x)).split(C, dim=2)
        hs = C // self.heads
        k = k.view(B, T, self.heads, hs).transpose(1, 2)
        q = q.view(B, T, self.heads, hs).transpose(1, 2)
        v = v.view(B, T, self.heads, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        logits = self.head(F.gelu(self.fc(self.ln2(x))))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def train_step(model, opt, idx, targets):
    loss = model(idx, targets)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_dynamic_sequence_training_steps_match_eager_with_at_most_two_recordings():
    torch.manual_seed(0)
    model = Block()
    ref = copy.deepcopy(model)
    # (SGD: Adam would turn the float noise of a gradient that is zero in exact math, the key
    # projection's bias under softmax, into steps of lr either way)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    compiled = compiler.compile(train_step, backend=KERNELS)
    lengths = (7, 10, 5, 13, 9, 14, 11, 17, 19, 15)  # 10 distinct lengths (none equal to a model size)
    g = torch.Generator().manual_seed(1)
    for T in lengths:
        idx, targets = torch.randint(0, 32, (2, T), generator=g), torch.randint(0, 32, (2, T), generator=g)
        _close(compiled(model, opt, idx, targets), train_step(ref, ref_opt, idx, targets))
    for p, q in zip(model.parameters(), ref.parameters()):
        _close(p, q)
    assert compiled.stats["captures"] <= 2
    assert compiled.stats["instantiations"] == len(lengths) - compiled.stats["captures"]
    assert compiled.stats["divergences"] <= 1  # (the first replay: the optimizer's state exists now)


def _clipped_step(model, opt, idx, targets):
    loss = model(idx, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad()
    return loss


def test_calls_instantiated_from_a_template_run_its_fused_optimizer_step():
    """A call instantiated at new sizes runs the template's fused optimizer step and clip_grad_norm_
    (the same calls, the same parameters at every size): before, its recording had no optimizer step
    to compile and the update ran eagerly on every instantiated call (SGD's mul_ and add_)."""
    torch.manual_seed(0)
    model = Block()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    compiled = compiler.compile(_clipped_step, backend=KERNELS)
    g = torch.Generator().manual_seed(2)
    launches = []
    for T in (7, 10, 5, 13, 9, 6):
        idx, targets = torch.randint(0, 32, (2, T), generator=g), torch.randint(0, 32, (2, T), generator=g)
        before = compiled.stats.get("optimizer_launches", 0)
        _close(compiled(model, opt, idx, targets), _clipped_step(ref, ref_opt, idx, targets))
        launches.append(compiled.stats.get("optimizer_launches", 0) - before)
        for p, q in zip(model.parameters(), ref.parameters()):
            _close(p, q)
    entry = compiled.last_entry
    assert entry.instantiated and compiled.stats["instantiations"] >= 3, compiled.stats
    assert entry.trace.fused_steps and entry.trace.fused_calls
    updates = {"Tensor.mul_", "Tensor.add_", "torch._foreach_mul_"}
    assert not updates & set(entry.report.eager_calls), entry.report.eager_calls
    assert all(n > 0 for n in launches[-3:]), launches  # (the instantiated calls launched the fused step)
    assert any(k.phase == "optimizer" for k in entry.report.kernels)


def test_a_batch_dynamic_only_at_a_smaller_last_batch_is_instantiated():
    # the lengths change first (2 recordings); the last batch is smaller: the batch becomes dynamic
    # only there, and batch x heads (8, inside the attention matmuls' reshapes) was never varied: a
    # constant of both recordings, re-read as 2 x batch when the reshape's shape rule refuses 8
    torch.manual_seed(0)
    model = Block(dim=12, heads=2)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    compiled = compiler.compile(train_step, backend=KERNELS)
    g = torch.Generator().manual_seed(1)
    for B, T in [(4, 7), (4, 10), (4, 5), (4, 13), (4, 9), (3, 11), (3, 14), (2, 6)]:
        idx, targets = torch.randint(0, 32, (B, T), generator=g), torch.randint(0, 32, (B, T), generator=g)
        _close(compiled(model, opt, idx, targets), train_step(ref, ref_opt, idx, targets))
    for p, q in zip(model.parameters(), ref.parameters()):
        _close(p, q)
    assert compiled.stats["captures"] == 2, compiled.stats
    assert compiled.stats["instantiations"] == 6, compiled.stats


def test_an_op_constant_equal_to_a_size_stays_a_constant():
    # eq's code in a comparison's expression is 4: with a dim of 4 seen once it was read as that
    # size, and at a size of 3 the comparison became another one (silently wrong values)
    def f(x):
        return torch.where(x == 0.5, 2.0, x).sum(0)
    compiled = compiler.compile(f, backend=KERNELS, dynamic=True)
    for rows in (4, 3, 5):
        x = torch.tensor([0.5, 0.25, 1.0, 0.75, 2.0, 0.5]).repeat(rows, 1)
        _close(compiled(x), f(x))
    assert compiled.stats["instantiations"] == 2, compiled.stats


_DIM_CALLS = {
    "permute": lambda x: x.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1).softmax(-1).sum(1),
    "transpose": lambda x: x.transpose(1, 3).reshape(x.shape[0], -1).softmax(-1) * 2,
    "softmax": lambda x: x.softmax(3).sum(2) + 1,
    "sum_and_mean": lambda x: x.sum(3) * x.mean(dim=3),
    "flatten": lambda x: x.flatten(2, 3).exp().sum(2),
    "select": lambda x: x.select(3, 1) * 2 + 1,
    "flip": lambda x: x.flip(3) * 2 + x.flip(2, 3),
    "max": lambda x: x.max(3)[0] * 2,
    "cat": lambda x: torch.cat([x, x * 2], 3).exp(),
    "narrow": lambda x: x.narrow(3, 1, 2).exp(),
}


@pytest.mark.parametrize("name", list(_DIM_CALLS))
def test_dim_indices_are_not_sizes(name):
    # NOTE: the dims (a permute's (0, 2, 1, 3), a softmax's 3) hold a 3 equal to the batch seen at
    # the recording: read as the batch, the template's call had a 2 at a batch of 2, the replay's
    # check of the constants Python passes failed, and every later call ran eagerly ("Tensor.permute
    # called with a different constant (3 != 2)"). Values agreed: only the kernels' launches and
    # the divergences count tell.
    f = _DIM_CALLS[name]
    compiled = compiler.compile(f, backend=KERNELS, dynamic=True)
    for batch in (3, 2, 5):
        x = torch.randn(batch, 5, 6, 4)
        launches = compiled.stats["kernel_launches"]
        _close(compiled(x), f(x))
        if batch != 3:  # (3: the recording, eager)
            assert compiled.stats["kernel_launches"] > launches, (batch, compiled.stats)
            assert compiled.last_backend == KERNELS, compiled.last_backend
    assert compiled.stats["divergences"] == 0, compiled.stats
    assert (compiled.stats["captures"], compiled.stats["instantiations"]) == (1, 2), compiled.stats


def _int_cases(k):
    """Calls passing a Python int ``k(x)`` that is not a size to the math, or is one."""
    return {
        "div": lambda x: x / k(x),
        "rsub": lambda x: k(x) - x,
        "pow": lambda x: x ** k(x),
        "where": lambda x: torch.where(x > 0, x, k(x)),
        "masked_fill": lambda x: x.masked_fill(x > 0, k(x)),
        "add_alpha": lambda x: x.add(x.exp(), alpha=k(x)),
        "addmm_beta": lambda x: torch.addmm(x[:, :4], x[:, :4], torch.eye(4), beta=k(x)),
        "norm_p": lambda x: x.norm(p=k(x), dim=-1),
        "tril": lambda x: x.tril(k(x)),
        "full": lambda x: torch.full((x.shape[0], 6), k(x)) * x,
        "new_full": lambda x: x.new_full((x.shape[0], 6), k(x)) * x,
        "cross_entropy_ignore_index": lambda x: F.cross_entropy(x, torch.arange(x.shape[0]) % 6, ignore_index=k(x)),
        "scatter": lambda x: x.scatter(1, torch.zeros(x.shape[0], 1, dtype=torch.long), k(x)) * 2,
        "index_add_alpha": lambda x: x.index_add(1, torch.tensor([0]), x[:, :1], alpha=k(x)),
        "softplus_beta": lambda x: F.softplus(x, beta=k(x)),
        "huber_delta": lambda x: F.huber_loss(x * 3, x, delta=k(x)),
    }


@pytest.mark.parametrize("passed", ["literal", "size"])
@pytest.mark.parametrize("name", list(_int_cases(len)))
@pytest.mark.allows_eager("a size passed to the math, or a literal equal to a size, leaves an instantiated recording "
                          "(the replay's check): right values, what it tests")
def test_ints_passed_to_the_math_give_eagers_values_at_every_size(name, passed):
    # NOTE: a constant of the math (x * 3, a norm's p) stays a constant in the graph's expressions;
    # read as a size in the recorded call while the graph kept it (or the other way round), a
    # size Python passes (x / x.shape[0]) passed the replay's check and the kernel used the
    # recording's number: wrong values at every other size (19 of these 32 before the fix)
    f = _int_cases(lambda x: 3 if passed == "literal" else x.shape[0])[name]
    compiled = compiler.compile(f, backend=KERNELS, dynamic=True)
    for batch in (3, 2, 5):
        torch.manual_seed(batch)
        x = torch.randn(batch, 6)
        _close(compiled(x), f(x))


@pytest.mark.parametrize("dynamic", [True, None])
@pytest.mark.parametrize("loss", [F.l1_loss, F.huber_loss, F.smooth_l1_loss, F.binary_cross_entropy_with_logits])
def test_a_loss_mean_divides_by_the_count_at_every_size(loss, dynamic):
    # NOTE: the losses divide their sum by float(numel): a Float 1/N in the graph, which no int of
    # the template held. The kernel divided by the recording's count at every other size, in the
    # default (automatic) mode too. Seen at one size, whether 1/N follows the sizes is a guess: record.
    def f(x, y):
        return loss(x, y.sigmoid())
    compiled = compiler.compile(f, backend=KERNELS, dynamic=dynamic)
    for batch in (3, 7, 2, 5):
        torch.manual_seed(batch)
        x, y = torch.randn(batch, 6, requires_grad=True), torch.randn(batch, 6)
        x_ref = x.detach().clone().requires_grad_()
        out, expected = compiled(x, y), f(x_ref, y)
        _close(out, expected)
        out.backward(), expected.backward()
        _close(x.grad, x_ref.grad)
    assert compiled.stats["instantiations"] == 2 and compiled.stats["divergences"] == 0, compiled.stats


@pytest.mark.allows_eager("a replay that leaves its recording runs the rest of the call eagerly: what it tests")
def test_a_replay_that_diverges_at_an_in_place_call_runs_the_rest_eagerly():
    # (the value the in-place call read is made by the call before it: recomputing it from the
    # in-place call itself recursed for ever)
    def f(x, v):
        return x.clone().fill_(v).add_(x) + x
    compiled = compiler.compile(f, backend=KERNELS)
    x = torch.randn(3, 4)
    for v in (2, 3, 4, 5):   # (from the third value on, v is no longer in the guard key: the replay checks it)
        _close(compiled(x, v), f(x, v))
    assert compiled.stats["divergences"] == 1, compiled.stats


def test_outputs_that_are_views_of_other_outputs_follow_the_sizes():
    def f(x):
        y = x.exp() * 2
        z = y.view(x.shape[0] * 2, -1)
        z.mul_(3)  # through the view: y changes too
        return y, z
    compiled = compiler.compile(f, backend=KERNELS)
    for n in (4, 6, 5, 7):
        x = torch.randn(n, 6)
        (y, z), (y_ref, z_ref) = compiled(x), f(x)
        _close(y, y_ref)
        _close(z, z_ref)
        assert z._base is y or z._base is y._base
    assert compiled.stats["instantiations"] == 2


# -- what stays specialized, and the relations a guard keeps ------------------------------------------------
def test_a_dim_no_expression_gives_stays_static_and_records_again():
    # x[:, 1:] reshaped by a Python constant: the reshape's size, D - 1, is no product or quotient
    # of D, so each new D records again (eager's numbers every time)
    def f(x):
        return x[:, 1:].reshape(x.shape[0], 2, -1).softmax(-1).sum(1)
    compiled = compiler.compile(f, backend=KERNELS)
    for d in (7, 9, 11, 13):
        x = torch.randn(3, d)
        _close(compiled(x), f(x))
    assert compiled.stats["captures"] == 4 and compiled.stats["instantiations"] == 0


def test_a_quotient_must_still_divide():
    def f(x):
        n = x.shape[0]
        return x[: n // 3].exp().sum(0) + x.view(n // 3, -1).sum(0).sum()
    compiled = compiler.compile(f, backend=KERNELS)
    for n in (6, 9, 15):  # n/3 fits: the third call is instantiated
        x = torch.randn(n, 4)
        _close(compiled(x), f(x))
    assert (compiled.stats["captures"], compiled.stats["instantiations"]) == (2, 1)
    x = torch.randn(10, 6)  # 10/3 does not divide: recorded again (eager's numbers)
    _close(compiled(x), f(x))
    assert (compiled.stats["captures"], compiled.stats["instantiations"]) == (3, 1)


def test_sizes_0_and_1_stay_specialized():
    compiled = compiler.compile(lambda x: (x.sin() * 2).sum(0), backend=KERNELS)
    for n in (4, 6, 5):
        x = torch.randn(n, 3)
        _close(compiled(x), (x.sin() * 2).sum(0))
    assert (compiled.stats["captures"], compiled.stats["instantiations"]) == (2, 1)
    for n in (1, 0):
        x = torch.randn(n, 3)
        _close(compiled(x), (x.sin() * 2).sum(0))
    assert (compiled.stats["captures"], compiled.stats["instantiations"]) == (4, 1)
    x = torch.randn(8, 3)
    _close(compiled(x), (x.sin() * 2).sum(0))
    assert compiled.stats["instantiations"] == 2


def test_dims_equal_at_recording_must_stay_equal():
    def f(x, y):
        return x.sum(0) * 2 + y.exp().sum(0)
    compiled = compiler.compile(f, backend=KERNELS)
    for n in (4, 6, 5):  # x and y always as long: the template relies on it
        x, y = torch.randn(n, 3), torch.randn(n, 3)
        _close(compiled(x, y), f(x, y))
    assert (compiled.stats["captures"], compiled.stats["instantiations"]) == (2, 1)
    x, y = torch.randn(7, 3), torch.randn(9, 3)  # not any more: recorded again, right values
    _close(compiled(x, y), f(x, y))
    assert (compiled.stats["captures"], compiled.stats["instantiations"]) == (3, 1)


# -- dynamic=, mark_dynamic ---------------------------------------------------------------------------------------
def _norm_rows(x):
    return (x - x.mean(-1, keepdim=True)).square().mean(-1).sqrt()


def test_dynamic_false_specializes_on_every_size():
    compiled = compiler.compile(_norm_rows, backend=KERNELS, dynamic=False)
    for n in (4, 6, 5, 7):
        x = torch.randn(n, 5)
        _close(compiled(x), _norm_rows(x))
    assert (compiled.stats["captures"], compiled.stats["instantiations"]) == (4, 0)


def test_dynamic_true_instantiates_from_the_first_recording():
    compiled = compiler.compile(_norm_rows, backend=KERNELS, dynamic=True)
    for n in (4, 6, 9):
        x = torch.randn(n, 5)
        _close(compiled(x), _norm_rows(x))
    assert (compiled.stats["captures"], compiled.stats["instantiations"]) == (1, 2)
    x = torch.randn(6, 7)  # every dim is dynamic: the row length too (the mean's 1/N follows it)
    _close(compiled(x), _norm_rows(x))
    assert (compiled.stats["captures"], compiled.stats["instantiations"]) == (1, 3)


def test_mark_dynamic_marks_one_dim_up_front():
    compiled = compiler.compile(_norm_rows, backend=KERNELS)
    x = torch.randn(4, 5)
    compiler.mark_dynamic(x, 0)
    _close(compiled(x), _norm_rows(x))
    y = torch.randn(6, 5)
    compiler.mark_dynamic(y, 0)
    _close(compiled(y), _norm_rows(y))
    assert (compiled.stats["captures"], compiled.stats["instantiations"]) == (1, 1)
    with pytest.raises(IndexError, match="out of range"):
        compiler.mark_dynamic(y, 2)


def test_a_constant_equal_to_a_size_seen_once_is_a_guess_the_shape_rules_check():
    def f(x):
        return x.view(x.shape[0], 4, -1).softmax(-1).sum(1)  # at the recording, the 4 equals the batch
    compiled = compiler.compile(f, backend=KERNELS)
    x = torch.randn(4, 20)
    compiler.mark_dynamic(x, 0)
    _close(compiled(x), f(x))
    y = torch.randn(6, 20)  # the guess (4 was the batch) gives view(6, 6, 5): not 120 elements; recorded
    compiler.mark_dynamic(y, 0)
    _close(compiled(y), f(y))
    assert (compiled.stats["captures"], compiled.stats["instantiations"]) == (2, 0)
    z = torch.randn(9, 20)  # two recordings now: the 4 stayed 4 between them, the batch did not
    compiler.mark_dynamic(z, 0)
    _close(compiled(z), f(z))
    assert (compiled.stats["captures"], compiled.stats["instantiations"]) == (2, 1)


def test_dynamic_true_keeps_dims_that_were_equal_equal():
    compiled = compiler.compile(lambda x: (x.exp() * 2).sum(0), backend=KERNELS, dynamic=True)
    x = torch.randn(5, 5)  # both dims 5: every 5 could be either
    _close(compiled(x), (x.exp() * 2).sum(0))
    x = torch.randn(7, 5)
    _close(compiled(x), (x.exp() * 2).sum(0))
    assert (compiled.stats["captures"], compiled.stats["instantiations"]) == (2, 0)


def test_dynamic_argument_is_checked():
    with pytest.raises(ValueError, match="dynamic="):
        compiler.compile(_norm_rows, dynamic="yes")


# -- everything else unchanged, with changing shapes ----------------------------------------------------------
def test_hooks_and_saved_tensors_with_changing_shapes():
    w = torch.randn(4, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_(True)
    seen = []

    def f(x, w):
        h = (x * w).tanh()
        h.register_hook(lambda g: seen.append(tuple(g.shape)) or g * 3)
        return h, (h * h).sum()
    compiled = compiler.compile(f, backend=KERNELS)
    for n in (3, 5, 7, 6):
        x = torch.randn(n, 4, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        h, loss = compiled(x, w)
        h_ref, loss_ref = f(x_ref, w_ref)
        _close(h, h_ref)
        loss.backward()  # after the call: the region's saved tensors, at this call's sizes
        loss_ref.backward()
        _close(x.grad, x_ref.grad)
        _close(w.grad, w_ref.grad)
    assert seen[0::2] == seen[1::2] == [(3, 4), (5, 4), (7, 4), (6, 4)]
    assert compiled.stats["instantiations"] == 2


def test_double_backward_with_changing_shapes():
    def f(x):
        y = (x.sin() * x).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        return (g * g).sum()
    compiled = compiler.compile(f, backend=KERNELS)
    for n in (4, 6, 5, 8):
        x = torch.randn(n, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        out, expected = compiled(x), f(x_ref)
        _close(out, expected)
        out.backward(), expected.backward()
        _close(x.grad, x_ref.grad)
    assert compiled.stats["instantiations"] == 2


def test_dropout_draws_a_fresh_mask_each_call_at_every_size():
    def f(x):
        return F.dropout(x, 0.5, training=True)
    compiled = compiler.compile(f, backend=KERNELS)
    masks = []
    for n in (64, 96, 80, 80, 112):
        x = torch.rand(n, 8) + 1.0
        x.requires_grad_(True)
        out = compiled(x)
        kept = out != 0
        _close(out[kept], 2 * x.detach()[kept])  # eager's scaling where kept
        out.sum().backward()
        _close(x.grad, 2.0 * kept)  # the gradient follows the same mask
        masks.append(kept)
        assert 0.3 < kept.float().mean() < 0.7
    assert not torch.equal(masks[2], masks[3])  # a fresh seed per call
    assert compiled.stats["instantiations"] >= 2


def test_the_recompiles_log_says_what_was_instantiated_and_why_a_call_records():
    import logging

    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())
    handler = Collect(logging.INFO)
    loggers = [logging.getLogger("symgrad.recompiles"), logging.getLogger("symgrad.guards")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:  # (a handler of our own: compiler.set_logs may have turned propagation off)
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        compiled = compiler.compile(lambda x, y: x.sum(0) + y.sum(0), backend=KERNELS)
        for n in (4, 6, 5):
            compiled(torch.randn(n, 3), torch.randn(n, 3))
        compiled(torch.randn(7, 3), torch.randn(8, 3))
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)
    text = "\n".join(messages)
    assert "instantiated its template for sizes 5, 5 (no recording)" in text
    assert "no template covers these sizes: sizes the recording had related" in text and "differ now: [7, 8]" in text
