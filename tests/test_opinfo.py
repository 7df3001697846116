"""PyTorch's OpInfo samples for every op the README claims, compiled vs eager (values,
dtypes, gradients; float32, float64 and bfloat16 where the OpInfo takes them, complex64 where
the README claims it), through the generated kernels in Triton's interpreter: no sample may
mismatch or hit an internal compiler error, and at most 5% may fall back.

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


def test_opinfo_dtypes_are_what_each_op_takes():
    """OPS lists bfloat16 for every op whose OpInfo takes it on CPU, complex64 only where the
    OpInfo takes it, and no dtype an OpInfo lacks."""
    from torch import complex64
    for name, dtypes in sweep.OPS.items():
        takes = sweep.dtypes_of(_infos()[name])
        assert set(dtypes) <= takes, f"{name}: {set(dtypes) - takes} is not among its OpInfo's dtypes"
        assert takes - {complex64} <= set(dtypes), f"{name} leaves out {takes - {complex64} - set(dtypes)}"


def test_opinfo_fallbacks_stay_under_five_percent():
    """Runs after the per-op tests (file order) and counts what they checked."""
    compared = sum(n for kind, n in TALLY.items() if kind != "skip")
    if compared == 0:
        pytest.skip("no OpInfo samples ran in this session")
    assert TALLY["fallback"] <= 0.05 * compared, f"{TALLY['fallback']} of {compared} samples fell back"
