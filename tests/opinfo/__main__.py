"""The whole OpInfo sweep with a report: ``python -m tests.opinfo --results tests/opinfo/RESULTS.md``.

Runs every sample of every op in ``tests/opinfo/sweep.py``'s ``OPS`` (``--default``: the CI
subset), prints each failure, and writes a markdown table of per-op pass / fallback /
mismatch / internal-error counts (per op and dtype, and per dtype) with the fallback reasons.
Run it from the repository root. On a shared machine, run parts of the op list side by side
and merge their tables::

    python -m tests.opinfo --ops add,sub,... --part /tmp/a.json
    python -m tests.opinfo --ops amax,... --part /tmp/b.json
    python -m tests.opinfo --merge /tmp/a.json /tmp/b.json --results tests/opinfo/RESULTS.md
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SYMGRAD_STRICT", "1")
# as tests/conftest.py: every sample's function has the same code, so a stored recording of one
# sample would be loaded by the next one's first call (which then leaves it and runs eagerly)
os.environ.setdefault("SYMGRAD_STORED_RECORDINGS", "0")
os.environ.setdefault("SYMGRAD_CACHE_DIR", tempfile.mkdtemp(prefix="symgrad-opinfo-kernels-"))

import compiler  # noqa: E402,F401  (before anything imports triton)
from tests.opinfo import sweep  # noqa: E402

KINDS = ("pass", "fallback", "mismatch", "internal", "known", "skip")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", help="write a markdown summary here")
    parser.add_argument("--default", action="store_true", help="only the CI subset of samples")
    parser.add_argument("--ops", help="comma-separated OpInfo names (default: all of OPS)")
    parser.add_argument("--part", help="also write this run's rows here (JSON), for --merge")
    parser.add_argument("--merge", nargs="+", metavar="PART", help="run nothing: merge the --part files of "
                        "runs over parts of the op list (in OPS order) and write --results")
    args = parser.parse_args(argv)
    if args.merge:
        return _merge(args.merge, args.results)
    started = time.time()
    infos = sweep.opinfos()
    names = args.ops.split(",") if args.ops else list(sweep.OPS)
    rows, reasons, failures = [], collections.defaultdict(collections.Counter), []
    for name in names:
        for dtype in sweep.OPS[name]:
            counts = collections.Counter()
            for index, outcome in sweep.run(name, infos[name], dtype, full=not args.default):
                counts[outcome.kind] += 1
                if outcome.kind == "fallback":
                    reasons[name][outcome.detail] += 1
                if outcome.kind in ("mismatch", "internal", "known"):
                    failures.append(f"{name} {dtype} sample {index}: {outcome.kind}: {outcome.detail}")
                    print(failures[-1], flush=True)
            rows.append((name, str(dtype).replace("torch.", ""), counts))
            print(name, dtype, dict(counts), flush=True)
    total = collections.Counter()
    for _, _, c in rows:
        total.update(c)
    compared = sum(total[k] for k in KINDS if k != "skip")  # (known mismatches count as compared)
    share = total["fallback"] / max(compared, 1)
    elapsed = time.time() - started
    print(f"{len(names)} ops, {compared} samples: {dict(total)}; fallbacks {share:.1%}; {elapsed:.0f} s")
    if args.part:
        with open(args.part, "w") as f:
            json.dump({"rows": [(n, d, dict(c)) for n, d, c in rows],
                       "reasons": {n: dict(c) for n, c in reasons.items()},
                       "failures": failures, "elapsed": elapsed, "default": args.default}, f)
    if args.results:
        _write(args.results, rows, total, compared, share, reasons, failures, elapsed, len(names), args.default)
    return 1 if failures else 0


def _merge(paths, results):
    """One table from the --part files of runs over parts of the op list, rows in OPS order."""
    parts = []
    for path in paths:
        with open(path) as f:
            parts.append(json.load(f))
    order = {name: i for i, name in enumerate(sweep.OPS)}
    rows = sorted(((n, d, collections.Counter(c)) for p in parts for n, d, c in p["rows"]), key=lambda r: order[r[0]])
    reasons = collections.defaultdict(collections.Counter)
    for name in sorted({n for p in parts for n in p["reasons"]}, key=order.get):
        for p in parts:
            reasons[name].update(p["reasons"].get(name, {}))
    total = collections.Counter()
    for _, _, c in rows:
        total.update(c)
    compared = sum(total[k] for k in KINDS if k != "skip")
    share = total["fallback"] / max(compared, 1)
    elapsed = max(p["elapsed"] for p in parts)  # the parts ran side by side
    names = {n for n, _, _ in rows}
    print(f"{len(names)} ops, {compared} samples: {dict(total)}; fallbacks {share:.1%}")
    if results:
        _write(results, rows, total, compared, share, reasons, [f for p in parts for f in p["failures"]], elapsed,
               len(names), any(p["default"] for p in parts), parts=len(parts))
    return 0


def _write(path, rows, total, compared, share, reasons, failures, elapsed, n_ops, default, parts=1):
    how = f"`python -m tests.opinfo{' --default' if default else ''} --results {path}`"
    if parts > 1:
        how = (f"{parts} processes side by side, each `python -m tests.opinfo{' --default' if default else ''} "
               f"--ops ... --part ...` over a part of the op list, merged by `--merge ... --results {path}`")
    lines = [
        "# OpInfo sweep results",
        "",
        f"{datetime.date.today()}, {how} ({'the CI subset' if default else 'every sample'}; "
        f"{elapsed / 60:.0f} min wall on a 2-core CPU, Triton's interpreter).",
        "",
        f"**{n_ops} ops, {compared} samples compared: {total['pass']} pass, {total['fallback']} fallback "
        f"({share:.1%}), {total['mismatch']} mismatch, {total['internal']} internal error, {total['known']} known "
        "mismatch (listed below, reported)** "
        f"({total['skip']} skipped: eager raises, or the sample draws random numbers).",
    ]
    by_dtype = collections.defaultdict(collections.Counter)
    for _, dtype, c in rows:
        by_dtype[dtype].update(c)
    lines += ["", "By dtype:", "", "| dtype | ops | pass | fallback | mismatch | internal | known | skip |",
              "|---|---|---|---|---|---|---|---|"]
    for dtype, c in by_dtype.items():
        n = sum(1 for _, d, _ in rows if d == dtype)
        lines.append(f"| {dtype} | {n} | " + " | ".join(str(c[k]) for k in KINDS) + " |")
    lines += ["", "| op | dtype | pass | fallback | mismatch | internal | known | skip |",
              "|---|---|---|---|---|---|---|---|"]
    for name, dtype, c in rows:
        lines.append(f"| {name} | {dtype} | " + " | ".join(str(c[k]) for k in KINDS) + " |")
    lines += ["", "## Fallback reasons", ""]
    for name, counter in reasons.items():
        for reason, n in counter.most_common():
            lines.append(f"- {name} ({n}): {reason}")
    if failures:
        lines += ["", "## Failures", ""] + [f"- {f}" for f in failures]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
