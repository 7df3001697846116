"""Test set-up: Triton's interpreter (set before triton is imported), a kernel cache of
this session's own, so the Hopper compile test can find every kernel the suite generated,
strict mode: a compiler bug raises instead of falling back to eager (SYMGRAD_STRICT), and
backend="auto" on CPU tensors running the real Triton kernels in Triton's interpreter
(SYMGRAD_CPU_BACKEND=interpret; tests/test_cpu_backend.py runs the CPU path explicitly), and
no recordings stored across calls of compile() (SYMGRAD_STORED_RECORDINGS=0): a test's first call
of a function must record, not replay what an earlier test of the same code stored
(tests/test_stored_recordings.py turns them on).

Under strict mode, a test that claims compiled parity must also run compiled: any part of a
compiled call that runs eagerly during the test (a deliberate fallback, a replay that diverged
from its recording, a whole call run eagerly: ``runtime.dispatch.watch_eager_runs``) fails it, as
an internal error does. A test about such a path says so: ``@pytest.mark.allows_eager("why")``
(``SYMGRAD_CHECK_EAGER_RUNS=0`` turns the check off).

``SYMGRAD_COUNT_LAUNCHES=path`` (off by default) appends one JSON line per test to ``path``: the
calls, replays and kernel launches of the compiled functions it called, and the eager runs seen,
so tests that compile but launch no kernel can be listed::

    SYMGRAD_COUNT_LAUNCHES=/tmp/launches.jsonl python -m pytest -q -n 2
    python -c "import json; [print(r['test']) for r in map(json.loads, open('/tmp/launches.jsonl'))
               if r['calls'] and not r['kernel_launches']]"
"""

import os
import shlex
import tempfile

from tests import devices  # (first: whether this run is the CUDA test mode decides the interpreter)

if not devices.CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SYMGRAD_CACHE_DIR", tempfile.mkdtemp(prefix="symgrad-test-kernels-"))
os.environ.setdefault("SYMGRAD_STRICT", "1")
os.environ.setdefault("SYMGRAD_CPU_BACKEND", "interpret")
os.environ.setdefault("SYMGRAD_STORED_RECORDINGS", "0")

import json  # noqa: E402

import pytest  # noqa: E402

import compiler  # noqa: E402,F401  (import order: before anything imports triton)
from runtime import dispatch  # noqa: E402
from runtime.fallback import strict  # noqa: E402

COUNT_LAUNCHES = os.environ.get("SYMGRAD_COUNT_LAUNCHES")


# files whose tests count their own fallbacks (the OpInfo sweep, the fuzzers): they allow eager runs
ALLOWS_EAGER_FILES = {
    "test_opinfo.py": "the OpInfo sweep counts and lists its fallbacks itself (tests/opinfo/RESULTS.md)",
    "test_fuzz.py": "the fuzzer's programs call ops that fall back; its checker tells the allowed ones",
    "test_fuzz_api.py": "the API fuzzer's programs take other paths on purpose; its checker compares with eager",
}


def pytest_configure(config):
    # With -n (pytest-xdist): each file on one worker, so its module fixtures (the Hopper compile run, the
    # OpInfo sweep's totals) are built once and see their whole file. Set here, not as ``--dist loadfile``
    # in addopts: a plain ``pytest`` where xdist is not installed (a GPU machine's own environment)
    # would refuse the option. (``load``: what xdist makes of ``-n`` without ``--dist``; a ``--dist``
    # given on the command line, in PYTEST_ADDOPTS or in addopts is kept.)
    if getattr(config.option, "dist", "no") == "load" and not _dist_given(config):
        config.option.dist = "loadfile"
    if devices.MODE in ("cuda", "cpu-rehearsal"):
        import torch

        # (tensors made without a device, the tests' and their models', are the mode's)
        torch.set_default_device(devices.DEVICE)
        _widen_fp32_tolerances(torch)


def _dist_given(config) -> bool:
    """Whether the run names xdist's ``--dist`` itself."""
    args = [*config.invocation_params.args, *shlex.split(os.environ.get("PYTEST_ADDOPTS", "")),
            *config.getini("addopts")]
    return any(a == "--dist" or a.startswith("--dist=") for a in map(str, args))


def _widen_fp32_tolerances(torch) -> None:
    """In the CUDA test mode, assert_close compares fp32 at the GPU's tolerances (``tests.devices.GPU_FP32``,
    which says why) where a test asks for tighter ones or none."""
    if not devices.CUDA:
        return
    original = torch.testing.assert_close

    def assert_close(actual, expected, *args, rtol=None, atol=None, **kwargs):
        dtype = getattr(actual, "dtype", None)
        wide = devices.tolerances(dtype)
        if wide:
            rtol, atol = max(rtol or 0.0, wide["rtol"]), max(atol or 0.0, wide["atol"])
        return original(actual, expected, *args, rtol=rtol, atol=atol, **kwargs)
    torch.testing.assert_close = assert_close


_SKIP_CPU_TEST = pytest.mark.skip(reason="the CUDA test mode (pytest -m gpu) runs the tests marked gpu only")
_SKIP_NO_GPU = pytest.mark.skip(reason="no CUDA device here; SYMGRAD_TEST_DEVICE=cpu rehearses the gpu tests "
                                       "on the CPU")


def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = ALLOWS_EAGER_FILES.get(item.path.name)
        if reason is not None:
            item.add_marker(pytest.mark.allows_eager(reason))
        if item.path.name in devices.GPU_FILES:
            item.add_marker(pytest.mark.gpu)
            if devices.MODE == "skip":
                item.add_marker(_SKIP_NO_GPU)
        elif devices.MODE in ("cuda", "cpu-rehearsal"):
            item.add_marker(_SKIP_CPU_TEST)
    # The Hopper compile test compiles every kernel the other tests generated: run it last.
    items.sort(key=lambda item: "test_hopper" in item.nodeid)


def _counts(stats) -> dict:
    # (launches: the fused kernels', and the fused optimizer steps' and gradient clips' own counts)
    return {id(s): (s, s["calls"], s["replays"], sum(v for k, v in s.items() if k.endswith("launches")))
            for s in stats}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    allowed = item.get_closest_marker("allows_eager") is not None
    before = _counts(f.stats for f in list(dispatch.COMPILED)) if COUNT_LAUNCHES else None
    with dispatch.watch_eager_runs() as watch:
        result = yield
    if before is not None:
        _write_counts(item, before, watch, allowed)
    if watch.events and not allowed and strict() and os.environ.get("SYMGRAD_CHECK_EAGER_RUNS", "1") != "0":
        seen = list(dict.fromkeys(f"{name}: {what}: {reason}" for name, what, reason in watch.events))
        pytest.fail(f"{len(watch.events)} part(s) of compiled calls ran eagerly in a test that does not allow "
                    "it (mark it @pytest.mark.allows_eager(\"why\") if that is what it tests):\n  "
                    + "\n  ".join(seen[:10]), pytrace=False)
    return result


def _write_counts(item, before, watch, allowed) -> None:
    # functions alive before the test (module-level ones) and those compiled during it
    after = _counts([f.stats for f in list(dispatch.COMPILED)] + watch.stats)
    calls = replays = launches = 0
    for key, (_, c, r, k) in after.items():
        _, c0, r0, k0 = before.get(key, (None, 0, 0, 0))
        calls, replays, launches = calls + c - c0, replays + r - r0, launches + k - k0
    line = {"test": item.nodeid, "calls": calls, "replays": replays, "kernel_launches": launches,
            "eager_runs": len(watch.events), "allows_eager": allowed}
    with open(COUNT_LAUNCHES, "a") as out:   # (one short line per write: workers append whole lines)
        out.write(json.dumps(line) + "\n")
