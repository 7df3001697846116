"""The long API fuzz run: ``python -m tests.fuzz_api --count 10000 --seed 0 [--results tests/fuzz_api/RESULTS.md]``.

Program k is drawn from ``random.Random(seed + k)``, so ``--seed S --count 1`` reproduces one
case and ``--minimize S`` shrinks it. The run does not stop at a failure: it checks every
program, prints each failure with its source and writes a summary (``--results``; several runs
side by side each write their own part: ``--results /tmp/part1.md``, then ``--merge``).
Stored recordings are on, in a kernel/recording cache folder of the run's own: each program's
second compile loads what its first stored (tests/fuzz_api/check.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")
# a compiler exception is a failure of the run (as in the test suite), not a quiet eager fallback
os.environ.setdefault("SYMGRAD_STRICT", "1")
os.environ.setdefault("SYMGRAD_CACHE_DIR", tempfile.mkdtemp(prefix="symgrad-fuzz-api-"))
# the second compile of each program loads the recording the first stored
os.environ["SYMGRAD_STORED_RECORDINGS"] = "1"

import compiler  # noqa: E402,F401  (before anything imports triton)
from tests.fuzz.check import BACKEND, BACKEND_LABELS  # noqa: E402
from tests.fuzz_api.check import IllConditioned, KnownBug, Mismatch, check_program  # noqa: E402
from tests.fuzz_api.program import RandomChooser, draw_program  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", help="write a markdown summary here (and its counts as JSON next to it)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="merge the counts of several runs into --results")
    parser.add_argument("--minimize", type=int, metavar="SEED", help="shrink the failing program of this seed")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--commit", help="the commit the run checks, for --results (default: git's HEAD)")
    args = parser.parse_args(argv)
    if args.minimize is not None:
        from tests.fuzz_api.minimize import minimize
        program, failure = minimize(draw_program(RandomChooser(args.minimize)))
        print(f"{program}\n{failure}")
        return 0
    if args.merge:
        counts = _merge([json.load(open(path)) for path in args.merge])
        _write_results(args.results, counts)
        return 1 if counts["failures"] else 0
    counts = _empty_counts()
    started = time.time()
    for k in range(args.count):
        seed = args.seed + k
        program = draw_program(RandomChooser(seed))
        for feature in set(program.features):
            counts["features"][feature] = counts["features"].get(feature, 0) + 1
        try:
            info = check_program(program)
            counts["eager errors"] += info["eager error"]
            for key in ("replayed with kernels", "loaded", "stored replayed with kernels", "leaf hook order differs"):
                counts[key] += info[key]
            for reason in set(info["fallbacks"]):
                counts["fallbacks"][reason] = counts["fallbacks"].get(reason, 0) + 1
        except KnownBug as e:
            name = str(e).split(":")[0]
            counts["known"][name] = counts["known"].get(name, 0) + 1
        except IllConditioned as e:  # (eager differs as much from itself: listed, not a failure)
            counts["ill-conditioned"].append([seed, str(e).split("\n")[0]])
        except Exception as e:  # noqa: BLE001 — a crash of the checker is a failure too
            kind = "mismatch" if isinstance(e, Mismatch) else f"crash ({type(e).__name__})"
            detail = str(e) if isinstance(e, Mismatch) else traceback.format_exc(limit=-6)
            counts["failures"].append([seed, kind, detail, str(program)])
            print(f"--- seed {seed}: {kind}\n{program}\n{detail}\n", flush=True)
        counts["programs"] += 1
        done = counts["programs"]
        if not args.quiet and done % 50 == 0:
            print(f"{done} programs, {len(counts['failures'])} failures, {time.time() - started:.0f} s", flush=True)
        if args.results and done % 250 == 0:  # a run cut short still leaves its results so far
            _save(args, counts, started)
    elapsed = time.time() - started
    print(f"{counts['programs']} programs, {len(counts['failures'])} failures, known bugs met: "
          f"{counts['known'] or 'none'}, {elapsed:.0f} s")
    if args.results:
        _save(args, counts, started)
    return 1 if counts["failures"] else 0


def _save(args, counts, started):
    elapsed = time.time() - started
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    prefix = "" if BACKEND == "interpret" else f"SYMGRAD_FUZZ_BACKEND={BACKEND} "
    counts["runs"] = [{"command": f"{prefix}python -m tests.fuzz_api --count {args.count} --seed {args.seed}",
                       "seeds": f"{args.seed}-{args.seed + counts['programs'] - 1}", "programs": counts["programs"],
                       "of": args.count, "seconds": round(elapsed), "commit": commit,
                       "failures": len(counts["failures"])}]
    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    with open(os.path.splitext(args.results)[0] + ".json", "w") as f:
        json.dump(counts, f)
    _write_results(args.results, counts)


def _empty_counts():
    return {"runs": [], "programs": 0, "eager errors": 0, "replayed with kernels": 0, "loaded": 0,
            "stored replayed with kernels": 0, "leaf hook order differs": 0, "fallbacks": {}, "known": {},
            "features": {}, "failures": [], "ill-conditioned": []}


def _merge(parts):
    total = _empty_counts()
    for part in parts:
        for key, value in part.items():
            if isinstance(value, int):
                total[key] += value
            elif isinstance(value, list):
                total[key] += value
            else:
                for k, n in value.items():
                    total[key][k] = total[key].get(k, 0) + n
    return total


def _ill_conditioned(counts) -> str:
    found = counts.get("ill-conditioned", [])
    return f"{len(found)}" + (" (seeds " + ", ".join(str(seed) for seed, _ in found) + ")" if found else "")


def _by_kind(failures):
    kinds = {}
    for _, kind, _, _ in failures:
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _percent(n, total):
    return f"{n} ({100 * n / max(total, 1):.1f}%)"


def _write_results(path, counts):
    n = counts["programs"]
    seconds = sum(run["seconds"] for run in counts["runs"])
    lines = [
        "# API fuzz run results", "",
        f"- written: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- run with `SYMGRAD_STRICT=1` (a compiler exception is a failure), backend `{BACKEND}`, stored "
        "recordings on in a cache folder of the run's own", "",
        "| commit | command | seeds | programs | time | failures |",
        "|---|---|---|---|---|---|"]
    lines += [f"| {r['commit']} | `{r['command']}` | {r['seeds']} | {r['programs']} of {r['of']} | {r['seconds']} s "
              f"| {r['failures']} |" for r in counts["runs"]]
    lines += [
        "",
        f"- programs checked: {n} ({counts['eager errors']} of them raise in eager; the compiled calls must raise "
        "the same)",
        f"- time: {seconds} s of process time ({n / max(seconds, 1):.2f} programs a second a process, "
        f"{BACKEND_LABELS[BACKEND]}, "
        "2 processes side by side)",
        f"- replayed with kernels (a call after the recording replayed, launched kernels and did not diverge): "
        f"{_percent(counts['replayed with kernels'], n)}",
        f"- second compile loaded the stored recording: {_percent(counts['loaded'], n)} (replayed kernels from its "
        f"first call: {_percent(counts['stored replayed with kernels'], n)}; a recording that holds a hook function "
        "is not stored)",
        f"- hooks of different leaves called in another order than eager's (README, Known limits: leaves ready "
        f"at the same moment), each leaf's own in eager's order: {_percent(counts['leaf hook order differs'], n)}",
        f"- new failures: {len(counts['failures'])}" + (
            f" ({', '.join(f'{k}x {kind}' for kind, k in sorted(_by_kind(counts['failures']).items()))})"
            if counts["failures"] else ""),
        f"- known bugs met (strict-xfail regression tests in tests/test_fuzz_api.py): {counts['known'] or 'none'}",
        "- ill-conditioned, not failures (compiled differs from eager where eager itself is out of tolerance of "
        "the program run in float64 from the same values: float32 does not determine the value, "
        f"``check.IllConditioned``): {_ill_conditioned(counts)}"]
    if counts.get("reclassified"):
        seeds = ", ".join(f"seed {seed} ({name})" for seed, name in counts["reclassified"])
        lines.append("- of them found as failures by the run and re-checked after their KNOWN entry was added (same "
                     f"compiler, the checker's newer KNOWN_BUGS): {seeds}")
    if counts.get("passes on re-check"):
        seeds = "; ".join(f"seed {seed} ({first})" for seed, first in counts["passes on re-check"])
        lines.append("- found as failures by the run and passing when re-checked (same compiler) with the checker's "
                     f"final tolerances: {seeds}")
    lines.append("")
    if counts["features"]:
        lines += ["API features drawn (programs using each):", ""]
        lines += [f"- {feature}: {k}" for feature, k in sorted(counts["features"].items())] + [""]
    if counts["fallbacks"]:
        lines += ["Fallbacks seen (programs; each region that runs eagerly, with its reason):", ""]
        lines += [f"- {k}x {reason}" for reason, k in sorted(counts["fallbacks"].items(), key=lambda kv: -kv[1])] + [""]
    for seed, kind, detail, source in counts["failures"]:
        lines += [f"## seed {seed}: {kind}", "", "```python", source, "```", "", "```", detail.strip(), "```", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
