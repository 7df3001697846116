"""Graph-level passes that cut memory traffic: checked by bytes moved (``explain``, which builds
kernels without running them) and by value parity with eager in the interpreter.

* cross-entropy picks the target's logit with an inline gather, not a one-hot pass over all classes;
* a linear's bias rides in the matmul (``addmm``), not in a pass of its own;
* the backward of LayerNorm -> GELU -> Linear computes each forward value it needs once.
"""

import pytest
import torch
import torch.nn.functional as F

import compiler
from tests.parity import check_parity


def _phase_bytes(report, phase):
    return sum(k.bytes_moved for k in report.kernels if k.phase == phase)


# ----------------------------------------------------------------------------- cross-entropy
# rows longer than one block (the large-vocabulary case: looped, not persistent, reductions)
CE_ROWS, CE_CLASSES = 8, 5000


def test_cross_entropy_reads_the_logits_at_most_twice_forward_and_once_backward():
    x = torch.randn(CE_ROWS, CE_CLASSES, requires_grad=True)
    target = torch.randint(0, CE_CLASSES, (CE_ROWS,))
    report = compiler.explain(lambda x, t: F.cross_entropy(x, t), x, target)
    assert report.fallbacks == []
    logits = x.numel() * x.element_size()
    small = 64 * CE_ROWS * 8    # per-row statistics, targets, the loss
    # forward: the row max and the sum of exponentials (the target's logit is one gathered element a row)
    assert _phase_bytes(report, "forward") <= 2 * logits + small
    # backward: one kernel reads the logits once and writes their gradient, (softmax - onehot) * grad
    assert _phase_bytes(report, "backward") <= 2 * logits + small
    assert len(report.backward_kernels) == 1


def _ignored(t, value=-100):
    return torch.where(torch.arange(len(t)) % 3 == 0, value, t)


# (loss, targets made from random class indices)
CE_CASES = {
    "mean": (lambda x, t: F.cross_entropy(x, t), lambda t: t),
    "sum": (lambda x, t: F.cross_entropy(x, t, reduction="sum"), lambda t: t),
    "none": (lambda x, t: F.cross_entropy(x, t, reduction="none"), lambda t: t),
    "ignore_index": (lambda x, t: F.cross_entropy(x, t), _ignored),
    "ignore_index_custom": (lambda x, t: F.cross_entropy(x, t, ignore_index=3), lambda t: _ignored(t, 3)),
    "ignore_index_none": (lambda x, t: F.cross_entropy(x, t, reduction="none"), _ignored),
    "ignore_index_sum": (lambda x, t: F.cross_entropy(x, t, reduction="sum"), _ignored),
    "nll_of_log_softmax": (lambda x, t: F.nll_loss(F.log_softmax(x, 1), t), _ignored),
    "nll_weighted": (lambda x, t: F.nll_loss(F.log_softmax(x, 1), t, weight=WEIGHT), _ignored),
    "nll_weighted_sum": (lambda x, t: F.nll_loss(x, t, weight=WEIGHT, reduction="sum"), _ignored),
    "weighted": (lambda x, t: F.cross_entropy(x, t, weight=WEIGHT), _ignored),
    "weighted_none": (lambda x, t: F.cross_entropy(x, t, weight=WEIGHT, reduction="none"), _ignored),
    "smoothing": (lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), _ignored),
    "smoothing_sum": (lambda x, t: F.cross_entropy(x, t, label_smoothing=0.2, reduction="sum"), _ignored),
    "smoothing_none": (lambda x, t: F.cross_entropy(x, t, label_smoothing=0.2, reduction="none"), _ignored),
    "smoothing_weighted": (lambda x, t: F.cross_entropy(x, t, weight=WEIGHT, label_smoothing=0.3), _ignored),
    "smoothing_weighted_none": (lambda x, t: F.cross_entropy(x, t, weight=WEIGHT, label_smoothing=0.3,
                                                             reduction="none"), _ignored),
    "probabilities": (lambda x, p: F.cross_entropy(x, p), "probabilities"),
    "probabilities_smoothing_weighted": (lambda x, p: F.cross_entropy(x, p, weight=WEIGHT, label_smoothing=0.2,
                                                                      reduction="sum"), "probabilities"),
}
WEIGHT = torch.rand(11, dtype=torch.float64) + 0.5


@pytest.mark.parametrize("case", list(CE_CASES))
def test_cross_entropy_matches_eager(case):
    torch.manual_seed(0)
    x = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    fn, make_target = CE_CASES[case]
    if make_target == "probabilities":
        target = torch.rand(6, 11, dtype=torch.float64).softmax(1)
    else:
        target = make_target(torch.randint(0, 11, (6,)))
    check_parity(lambda x: fn(x, target), [x], dtype=torch.float64)


def test_cross_entropy_over_spatial_dims_matches_eager():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 4, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 5, (2, 3, 4))
    target[0, 0, 0] = -100
    check_parity(lambda x: F.cross_entropy(x, target), [x], dtype=torch.float64)
    weight = torch.rand(5, dtype=torch.float64)
    check_parity(lambda x: F.cross_entropy(x, target, weight=weight, label_smoothing=0.1), [x], dtype=torch.float64)


def test_cross_entropy_with_label_smoothing_still_reads_the_logits_twice():
    x = torch.randn(CE_ROWS, CE_CLASSES, requires_grad=True)
    target = torch.randint(0, CE_CLASSES, (CE_ROWS,))
    weight = torch.rand(CE_CLASSES)
    report = compiler.explain(lambda x, t: F.cross_entropy(x, t, weight=weight, label_smoothing=0.1), x, target)
    assert report.fallbacks == []
    logits, small = x.numel() * x.element_size(), 64 * CE_ROWS * 8 + 2 * weight.numel() * 4
    assert _phase_bytes(report, "forward") <= 2 * logits + small
    assert _phase_bytes(report, "backward") <= 2 * logits + small


def test_cross_entropy_target_out_of_range_raises_like_eager():
    x = torch.randn(4, 5, requires_grad=True)
    bad = torch.tensor([0, 1, 7, 2])
    f = compiler.compile(lambda x, t: F.cross_entropy(x, t), backend="interpret")
    f(x, torch.tensor([0, 1, 2, 3]))
    f(x, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(IndexError):
        f(x, bad)


def test_gather_of_one_element_per_row_has_an_inline_gradient():
    """torch.gather picking one element along a dim: its gradient is a one-hot where inside
    the consuming kernel, not a scatter-add into a zero tensor run as a separate op."""
    torch.manual_seed(0)
    x = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 9, (5, 1))
    fn = lambda x: (torch.gather(x.sin(), 1, index) * 3).sum()  # noqa: E731
    report = compiler.explain(fn, x)
    assert all("index_backward" not in str(n.target) for n in report.backward_graph.nodes)
    check_parity(fn, [x], dtype=torch.float64)


# ----------------------------------------------------------------------------- linear with bias
def _externs(graph):
    return [n.target.name for n in graph.nodes if getattr(n.target, "kind", None) == "extern"]


@pytest.mark.parametrize("batch", [(16,), (4, 5)], ids=["2d", "3d"])
def test_linear_bias_is_added_by_the_matmul(batch):
    """F.linear with a bias is one addmm (cuBLAS adds the bias in its epilogue): no kernel
    reads the product again to add it. Its values are eager's own (eager calls addmm too)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(*batch, 64, requires_grad=True)
    report = compiler.explain(lambda x: lin(x), x)
    assert report.fallbacks == []
    assert _externs(report.graph) == ["addmm"]
    assert report.forward_kernels == []
    # backward: x's and the weight's gradients are matmuls; the bias's a column sum
    assert len(report.backward_kernels) == 1
    compiled = check_parity(lambda x: lin(x), [x], expect_kernels=False)
    assert torch.equal(compiled(x), lin(x))


def test_linear_bias_gradients_match_eager():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    check_parity(lambda x, w, bias: F.linear(x, w, bias).tanh(), [x, w, bias], dtype=torch.float64)
    check_parity(lambda x, w, bias: F.linear(x, w, bias), [x, w, bias], dtype=torch.float64, expect_kernels=False)


# ----------------------------------------------------------------------------- LayerNorm -> GELU -> Linear
def _block(width):
    torch.manual_seed(0)
    norm, linear = torch.nn.LayerNorm(width), torch.nn.Linear(width, width)
    return lambda x: linear(F.gelu(norm(x)))


def test_layer_norm_gelu_linear_backward_recomputes_the_gelu_output_once():
    """The GELU output is the matmul's operand. memory="balanced" (issue 14) does not keep it
    between forward and backward: the backward kernel that reads x and the row statistics
    computes the normalization and the GELU again and writes the operand once more — one
    activation written in backward for one activation less held (it used to be saved)."""
    rows, width = 64, 128
    x = torch.randn(rows, width, requires_grad=True)
    report = compiler.explain(_block(width), x)
    assert report.fallbacks == []
    activation = x.numel() * x.element_size()
    small = 16 * width * 4 + 16 * rows * 4  # parameters, their gradients, row statistics
    # dx (rows): read x and the GELU output's gradient, write dx; dgamma, dbeta, dbias (columns):
    # read x, the GELU output's gradient and the output's gradient; the GELU output written again
    assert _phase_bytes(report, "backward") <= 7 * activation + small
    check_parity(_block(width), [torch.randn(8, width, requires_grad=True)], tol=dict(rtol=1e-4, atol=1e-5))


@pytest.mark.parametrize("fn", [
    lambda x, w: F.cross_entropy(x * w, TARGET3, weight=WEIGHT5, label_smoothing=0.1),
    lambda x, w: (torch.gather(x.sin(), 1, TARGET3[:, None]) * w[:, :1]).sum(),
    lambda x, w: F.linear(x, w, w[:, 0]).tanh().sum(),
], ids=["cross_entropy", "gather", "linear_bias"])
def test_second_derivatives_through_the_new_gradients_match_eager(fn):
    """gradgradcheck through the one-hot gradient of a gather and through addmm's VJP."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    c = compiler.compile(fn, backend="interpret")
    c(x, w)
    assert torch.autograd.gradgradcheck(c, (x, w))
    assert c.stats["kernel_launches"] > 0


TARGET3 = torch.tensor([0, 4, 2])
WEIGHT5 = torch.rand(5, dtype=torch.float64) + 0.5


def test_wide_layer_norm_backward_reduces_its_rows_in_one_pass():
    """Rows longer than one block: the input's gradient needs two sums per row (of dy*w and of
    dy*w*xhat); they are independent, so one pass computes both and a second writes dx (and
    sums dgamma and dbeta over the rows) — not one pass per sum. (64 rows starve the GPU, so
    the row sums are split in two stages: the second, over 64 x 8 partial sums, is small.)"""
    rows, width = 64, 8192
    x = torch.randn(rows, width, requires_grad=True)
    w, bias = torch.randn(width, requires_grad=True), torch.randn(width, requires_grad=True)
    report = compiler.explain(lambda x, w, bias: F.layer_norm(x, (width,), w, bias), x, w, bias)
    activation = x.numel() * x.element_size()
    small = 8 * width * 4 + 16 * rows * 4   # parameters, their gradients, row statistics
    # both row sums: read x and dy; dx with dgamma and dbeta: read x and dy, write dx
    assert _phase_bytes(report, "backward") <= 5 * activation + small
    passes_over_rows = [k for k in report.backward_kernels if k.bytes_moved > small]
    assert len(passes_over_rows) == 2


def test_layer_norm_second_derivatives_match_eager():
    torch.manual_seed(0)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    c = compiler.compile(lambda x, w: F.layer_norm(x, (6,), w) * x, backend="interpret")
    c(x, w)
    assert torch.autograd.gradgradcheck(c, (x, w))


@pytest.mark.parametrize("kwargs", [{}, {"beta": 0.5, "alpha": 2.0}], ids=["plain", "scaled"])
def test_addmm_matches_eager(kwargs):
    """torch.addmm as GPT-2's Conv1D calls it: bias + x @ weight."""
    torch.manual_seed(0)
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    check_parity(lambda x, w, bias: torch.addmm(bias, x, w, **kwargs).sin(), [x, w, bias], dtype=torch.float64)
    if not kwargs:
        assert _externs(compiler.explain(lambda x, w, bias: torch.addmm(bias, x, w), x, w, bias).graph) == ["addmm"]
