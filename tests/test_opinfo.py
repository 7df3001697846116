"""PyTorch's OpInfo samples for every op the README claims, compiled vs eager (values,
dtypes, gradients; float32, float64 and bfloat16 where the OpInfo takes them, complex64 where
the README claims it), through the generated kernels in Triton's interpreter: no sample may
mismatch or hit an internal compiler error, and at most 1% may fall back.

The default run checks a fixed subset (the first and the middle sample of each op and
dtype, ``tests/opinfo/sweep.py``); ``SYMGRAD_OPINFO=full`` checks every sample, and
``python -m tests.opinfo --results tests/opinfo/RESULTS.md`` writes the per-op table.
"""

import collections

import pytest

pytest.importorskip("expecttest")  # op_db's module needs it

from tests.opinfo import sweep  # noqa: E402

_INFOS = None
TALLY = collections.Counter()


def _infos():
    global _INFOS
    if _INFOS is None:
        _INFOS = sweep.opinfos()
    return _INFOS


@pytest.mark.parametrize("name", list(sweep.OPS))
def test_opinfo_samples_match_eager(name):
    infos = _infos()
    assert name in infos, f"{name} is not in op_db (renamed?)"
    failures = []
    for dtype in sweep.OPS[name]:
        for index, outcome in sweep.run(name, infos[name], dtype, sweep.full_sweep()):
            TALLY[outcome.kind] += 1
            if outcome.kind in ("mismatch", "internal"):
                failures.append(f"{dtype} sample {index}: {outcome.kind}: {outcome.detail}")
    assert not failures, "\n".join(failures)


def _forms():
    """(OpInfo name, input, args, kwargs) for forms of the compiled decompositions that op_db's
    samples leave out (the sweep covers the rest): nonzero counts of NaN and inf, ceil_mode's
    extra windows without padding counted, adaptive windows of two lengths on two dims, 'same'
    padding in one dim, unbatched cross entropy."""
    import torch

    torch.manual_seed(0)

    def t(*shape, dtype=torch.float64, grad=True):
        return torch.randn(*shape, dtype=dtype).requires_grad_(grad)

    special = torch.tensor([[0.0, float("nan"), 1.5], [float("inf"), -0.0, -2.0]], dtype=torch.float64)
    special.requires_grad_()
    return [
        ("linalg.vector_norm", special, (0,), {"dim": 1}),
        ("norm", t(3, 4), (0,), {"dim": (0, 1), "keepdim": True}),
        ("nn.functional.normalize", t(2, 3, 4), (), {"p": 3.0, "dim": -1}),
        ("logsumexp", t(3, 4, 5), ((0, 2),), {"keepdim": True}),
        ("nn.functional.avg_pool1d", t(2, 3, 10), (4,), {"stride": 3, "padding": 2, "ceil_mode": True,
                                                         "count_include_pad": False}),
        ("nn.functional.avg_pool2d", t(1, 2, 7, 7), (3,), {"stride": 2, "padding": 1, "ceil_mode": True,
                                                           "count_include_pad": False}),
        ("nn.functional.avg_pool2d", t(1, 2, 8, 7), ((3, 2),), {"stride": (2, 3), "ceil_mode": True}),
        ("nn.functional.adaptive_avg_pool2d", t(2, 3, 7, 5), ((3, 4),), {}),
        ("nn.functional.adaptive_avg_pool2d", t(3, 6, 5), ((3, 3),), {}),
        ("nn.functional.adaptive_avg_pool1d", t(1, 9), (4,), {}),
        ("nn.functional.conv1d", t(2, 3, 9), (t(4, 3, 4),), {"padding": "same"}),
        ("nn.functional.conv2d", t(1, 2, 6, 7), (t(3, 2, 2, 3), t(3)), {"padding": "same", "dilation": (1, 2)}),
        ("nn.functional.cross_entropy", t(5), (torch.tensor(3),), {"label_smoothing": 0.1}),
        ("nn.functional.cross_entropy", t(5), (torch.rand(5, dtype=torch.float64),), {"reduction": "none"}),
        ("nn.functional.nll_loss", t(4), (torch.tensor(2),), {"weight": torch.rand(4, dtype=torch.float64)}),
        ("gather", t(()), (0, torch.tensor([0, 0])), {}),
        ("index_select", t(()), (0, torch.tensor(0)), {}),
    ]


@pytest.mark.parametrize("form", range(len(_forms())))
def test_decompositions_match_eager_on_forms_the_samples_miss(form):
    from torch.testing._internal.opinfo.core import SampleInput

    name, x, args, kwargs = _forms()[form]
    outcome = sweep.check_sample(name, _infos()[name], SampleInput(x, args=args, kwargs=kwargs), x.dtype)
    assert outcome.kind == "pass", f"{name}: {outcome}"


def test_bf16_results_pass_only_as_accurate_as_eager():
    """The sweep's bfloat16 rule (``sweep._as_accurate_as_eager``): a result rounded once from
    float32 passes where it differs from eager's op-by-op rounding; one element 5% off does not."""
    import torch
    from torch.testing._internal.opinfo.core import SampleInput

    x = torch.linspace(1, 3, 16, dtype=torch.bfloat16).requires_grad_()
    sample = SampleInput(x)

    def fn(t):
        return t.exp() * t

    eager = sweep._grads(fn, [x], sample)
    wide = x.detach().float().requires_grad_()
    out = fn(wide)
    (grad,) = torch.autograd.grad(sweep._seeded_loss([out]), [wide])
    assert sweep._as_accurate_as_eager(fn, [x], sample, (out.detach().bfloat16(), (grad.bfloat16(),)), eager)
    off = eager[0].detach().clone()
    off[3] *= 1.05
    assert not sweep._as_accurate_as_eager(fn, [x], sample, (off, eager[1]), eager)
    off_grad = eager[1][0].clone()
    off_grad[5] *= 1.05
    assert not sweep._as_accurate_as_eager(fn, [x], sample, (eager[0], (off_grad,)), eager)


def test_opinfo_dtypes_are_what_each_op_takes():
    """OPS lists bfloat16 for every op whose OpInfo takes it on CPU, complex64 only where the
    OpInfo takes it, and no dtype an OpInfo lacks."""
    from torch import complex64
    for name, dtypes in sweep.OPS.items():
        takes = sweep.dtypes_of(_infos()[name])
        assert set(dtypes) <= takes, f"{name}: {set(dtypes) - takes} is not among its OpInfo's dtypes"
        assert takes - {complex64} <= set(dtypes), f"{name} leaves out {takes - {complex64} - set(dtypes)}"


def test_opinfo_fallbacks_stay_under_one_percent():
    """Runs after the per-op tests (file order) and counts what they checked (the full run's
    fallbacks, each with its reason: tests/opinfo/RESULTS.md)."""
    compared = sum(n for kind, n in TALLY.items() if kind != "skip")
    if compared == 0:
        pytest.skip("no OpInfo samples ran in this session")
    assert TALLY["fallback"] <= 0.01 * compared, f"{TALLY['fallback']} of {compared} samples fell back"
