"""The long fuzz run: ``python -m tests.fuzz --count 10000 --seed 0 [--results tests/fuzz/RESULTS.md]``.

Program k is drawn from ``random.Random(seed + k)``, so ``--seed S --count 1`` reproduces
one case. Unlike the pytest run it does not stop at the first failure: it checks every
program, prints each failure with its source, and (with ``--results``) writes a summary.
Run it from the repository root (kernels go to ``$SYMGRAD_CACHE_DIR``). With
``SYMGRAD_FUZZ_SKIP_PYTHON=1`` each program is compiled with ``skip_python=True``: its replayed
call makes the recorded calls without the program's Python (last run: RESULTS-skip-python.md).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")
# a compiler exception is a failure of the run (as in the test suite), not a quiet eager fallback
os.environ.setdefault("SYMGRAD_STRICT", "1")
os.environ.setdefault("SYMGRAD_CACHE_DIR", tempfile.mkdtemp(prefix="symgrad-fuzz-kernels-"))
# each program's checks compile it afresh and expect a recording first (as the test suite does)
os.environ.setdefault("SYMGRAD_STORED_RECORDINGS", "0")

import compiler  # noqa: E402,F401  (before anything imports triton)
from tests.fuzz.check import BACKEND, BACKEND_LABELS, SKIP_PYTHON, KnownBug, Mismatch, check_program  # noqa: E402
from tests.fuzz.program import RandomChooser, draw_program  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", help="write a markdown summary here")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    started, failures, errors_checked, fallbacks, known = time.time(), [], 0, {}, {}
    done = 0
    for k in range(args.count):
        seed = args.seed + k
        program = draw_program(RandomChooser(seed))
        try:
            stats = check_program(program)
            errors_checked += program.eager_error is not None
            for reason in stats["fallbacks"]:
                fallbacks[reason] = fallbacks.get(reason, 0) + 1
        except KnownBug as e:
            name = str(e).split(":")[0]
            known[name] = known.get(name, 0) + 1
        except Exception as e:  # noqa: BLE001 — a crash of the checker is a failure too
            kind = "mismatch" if isinstance(e, Mismatch) else f"crash ({type(e).__name__})"
            detail = str(e) if isinstance(e, Mismatch) else traceback.format_exc(limit=4)
            failures.append((seed, kind, detail, str(program)))
            print(f"--- seed {seed}: {kind}\n{program}\n{detail}\n", flush=True)
        done += 1
        if not args.quiet and done % 50 == 0:
            print(f"{done} programs, {len(failures)} failures, {time.time() - started:.0f} s", flush=True)
        if args.results and done % 250 == 0:  # a run cut short still leaves its results so far
            _write_results(args, done, errors_checked, failures, fallbacks, known, time.time() - started)
    elapsed = time.time() - started
    print(f"{done} programs ({errors_checked} where eager raises), {len(failures)} failures, "
          f"known bugs met: {known or 'none'}, {elapsed:.0f} s")
    if args.results:
        _write_results(args, done, errors_checked, failures, fallbacks, known, elapsed)
    return 1 if failures else 0


def _write_results(args, done, errors_checked, failures, fallbacks, known, elapsed):
    lines = [
        "# Fuzz run results", "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- command: `{'SYMGRAD_FUZZ_SKIP_PYTHON=1 ' if SKIP_PYTHON else ''}"
        f"{'' if BACKEND == 'interpret' else f'SYMGRAD_FUZZ_BACKEND={BACKEND} '}"
        f"python -m tests.fuzz --count {args.count} "
        f"--seed {args.seed}`" + (" (the replayed call makes the recorded calls without the program's Python: "
                                  "compile(..., skip_python=True))" if SKIP_PYTHON else ""),
        f"- programs checked: {done} of {args.count} ({errors_checked} of them raise in eager; "
        "the compiled call must raise the same)",
        f"- time: {elapsed:.0f} s ({elapsed / max(done, 1):.2f} s a program, "
        f"{BACKEND_LABELS[BACKEND]})",
        f"- new failures: {len(failures)}",
        f"- known bugs met (xfail regression tests in tests/test_fuzz.py): {known or 'none'}", ""]
    if fallbacks:
        lines += ["Allowed fallbacks seen:", ""]
        lines += [f"- {n}x {reason}" for reason, n in sorted(fallbacks.items())] + [""]
    for seed, kind, detail, source in failures:
        lines += [f"## seed {seed}: {kind}", "", "```python", source, "```", "", "```", detail.strip(), "```", ""]
    with open(args.results, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
