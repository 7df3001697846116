"""``python -m benchmarks.kernels``: every fused kernel of every workload, compiled for Hopper as
its real launch would be, and a roofline prediction of ours against eager — no GPU needed.

    python -m benchmarks.kernels --size small --dtype float32          # a table on stdout
    python -m benchmarks.kernels --size full --dtype bfloat16 --out benchmarks/results

Per kernel: its grid, tiles, warps, registers, spills, share of vectorized global loads, bytes
and predicted H100 time. Per workload and phase: our bytes against the minimum, and our predicted
time against eager's (``benchmarks.roofline``). See benchmarks/README.md, "Kernels on Hopper".

From Python: ``benchmarks.kernels.run(size="tiny", dtype="float32", only=["gelu"])`` returns the
JSON document (``kernels``, ``workloads``, ``failures``, ``meta``).
"""

import compiler  # noqa: F401  (first: before anything imports triton)

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from benchmarks import roofline  # noqa: E402
from benchmarks.progress import Progress  # noqa: E402
from benchmarks.sm90 import compile_launches  # noqa: E402
from benchmarks.step_trace import PHASES, trace_workload  # noqa: E402
from benchmarks.workloads import WORKLOADS  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# complex64 has no bfloat16 counterpart (torch's complex32 is built of float16 parts)
_NO_BFLOAT16 = {"complex"}


def run(size: str = "small", dtype: str = "float32", only=None, processes: int = 2, progress: bool = True) -> dict:
    """Trace each workload, compile its kernels for sm_90 and model both backends (see module doc)."""
    names = [n for n in (only or WORKLOADS) if not (dtype == "bfloat16" and n in _NO_BFLOAT16)]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    started = time.perf_counter()
    bar = Progress(len(names), enabled=progress)
    traces, failures = [], []
    for name in names:
        bar.start(f"{name}: tracing eager and ours ({size}, {dtype})")
        try:
            traces.append(trace_workload(name, size, DTYPES[dtype]))
        except Exception as e:  # noqa: BLE001 — one workload's failure is reported, the others still run
            failures.append({"workload": name, "error": f"{type(e).__name__}: {str(e)[:500]}"})
            bar.note(f"{name}: FAILED {type(e).__name__}: {str(e)[:200]}")
        bar.done()
    bar.close()

    launches = [ours.launch for trace in traces for ours in trace.launches]
    compile_bar = {}

    def compiled(done, total, name):
        if progress and "bar" not in compile_bar:
            compile_bar["bar"] = Progress(total)
        if progress:
            bar = compile_bar["bar"]
            bar.count = done
            bar.start(f"sm_90: {name}")

    results = compile_launches(launches, processes=processes, progress=compiled)
    if "bar" in compile_bar:
        compile_bar["bar"].close()
    it = iter(results)
    kernels = [_kernel_row(trace, ours, next(it)) for trace in traces for ours in trace.launches]
    workloads = [row for trace in traces for row in _workload_rows(trace)]
    return {
        "meta": {"size": size, "dtype": dtype, "seconds": round(time.perf_counter() - started, 1),
                 "copy_bandwidth": roofline.COPY_BANDWIDTH, "launch_us": roofline.LAUNCH_US,
                 "matmul_peak": {str(k).replace("torch.", ""): v for k, v in roofline.MATMUL_PEAK.items()},
                 "torch": torch.__version__, "triton": _version("triton"), "target": "cuda sm_90 (GPUTarget)"},
        "kernels": kernels,
        "workloads": workloads,
        "fallbacks": {t.workload: t.fallbacks for t in traces if t.fallbacks},
        "failures": failures,
    }


def _kernel_row(trace, ours, result) -> dict:
    launch = ours.launch
    return {
        "workload": trace.workload, "dtype": trace.dtype, "phase": ours.phase, "name": launch.name,
        # (a flash-attention kernel's tiles: rows x keys)
        "grid": launch.grid, "xblock": launch.constexprs.get("XBLOCK", launch.constexprs.get("BLOCK_M")),
        "rblock": launch.constexprs.get("RBLOCK", launch.constexprs.get("BLOCK_N")),
        "num_warps": launch.num_warps, "registers": result["registers"], "spill_bytes": result["spill_bytes"],
        "loads": result["loads"], "vector_loads": result["vector_loads"], "vector_share": result["vector_share"],
        "int_constants": result["int_constants"], "bytes": ours.bytes,
        "predicted_us": ours.predicted_us, "error": result["error"],
    }


def _workload_rows(trace) -> list:
    rows = []
    phases = [p for p in PHASES if p in trace.min_bytes]
    for phase in phases + ["step"]:
        def pick(items):
            return [x for x in items if phase == "step" or x.phase == phase]
        launches, ops, eager = pick(trace.launches), pick(trace.our_ops), pick(trace.eager_ops)
        kernel_bytes = sum(k.bytes for k in launches)
        ours_bytes = kernel_bytes + sum(o.bytes for o in ops)
        ours_us = sum(k.predicted_us for k in launches) + sum(o.predicted_us for o in ops)
        eager_us = sum(o.predicted_us for o in eager)
        min_bytes = sum(trace.min_bytes.values()) if phase == "step" else trace.min_bytes[phase]
        rows.append({
            "workload": trace.workload, "dtype": trace.dtype, "phase": phase,
            "kernels": len(launches), "other_ops": len(ops), "eager_ops": len(eager),
            "bytes": ours_bytes, "kernel_bytes": kernel_bytes, "min_bytes": min_bytes,
            "eager_bytes": sum(o.bytes for o in eager), "ours_us": ours_us, "eager_us": eager_us,
            "speedup": eager_us / ours_us if ours_us else None,
            **({"ours_peak": trace.ours_peak, "eager_peak": trace.eager_peak} if phase == "step" else {}),
            "other_op_names": dict(collections.Counter(o.name for o in ops)),
        })
    return rows


def _version(package: str) -> str:
    from importlib.metadata import version
    return version(package)


# -- the markdown ---------------------------------------------------------------------------------
def markdown(doc: dict) -> str:
    """The JSON document as tables (workloads, then kernels, then notes)."""
    meta = doc["meta"]
    peaks = ", ".join(f"{k} {v / 1e12:.0f}" for k, v in meta["matmul_peak"].items())
    out = [f"# Kernels on Hopper (sm_90), predicted: {meta['size']} size, {meta['dtype']}", "",
           f"Roofline of an H100 SXM: copy {meta['copy_bandwidth'] / 1e12:.1f} TB/s, matmul peak (TFLOP/s) {peaks}, "
           f"{meta['launch_us']:.0f} µs per launch. torch {meta['torch']}, triton {meta['triton']}; "
           f"made in {meta['seconds']:.0f} s by `python -m benchmarks.kernels` (see benchmarks/README.md)."
           + "".join(f" Rerun with `--update` ({u['seconds']:.0f} s): {', '.join(u['workloads'])}."
                     for u in meta.get("updated", [])), "",
           *(["Workloads marked (autocast) are training steps with float32 weights under "
              "`torch.autocast(dtype=torch.bfloat16)`; the others take bfloat16 tensors.", ""]
             if any("autocast" in r["dtype"] for r in doc["workloads"]) else []),
           "## Per workload and phase", "",
           "| workload | phase | our kernels + other ops | our MB | min MB | ours ÷ min | eager ops | eager MB "
           "| ours µs | eager µs | × eager |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["workloads"]:
        name = f"{r['workload']} (autocast)" if "autocast" in r["dtype"] else r["workload"]
        ratio = r["bytes"] / r["min_bytes"] if r["min_bytes"] else float("nan")
        out.append(f"| {name} | {r['phase']} | {r['kernels']} + {r['other_ops']} | {_mb(r['bytes'])} | "
                   f"{_mb(r['min_bytes'])} | {ratio:.2f} | {r['eager_ops']} | {_mb(r['eager_bytes'])} | "
                   f"{r['ours_us']:.1f} | {r['eager_us']:.1f} | "
                   f"{'-' if r['speedup'] is None else format(r['speedup'], '.2f')} |")
    out += ["", "## Peak memory per step", "",
            "The most allocated during one traced step above its start (outputs as a GPU allocates them; "
            "kernels' own workspaces not counted), eager against ours.", "",
            "| workload | eager peak MB | our peak MB | ours ÷ eager |", "|---|---|---|---|"]
    for r in doc["workloads"]:
        if r["phase"] == "step" and r.get("eager_peak"):
            out.append(f"| {r['workload']} | {_mb(r['eager_peak'])} | {_mb(r['ours_peak'])} | "
                       f"{r['ours_peak'] / r['eager_peak']:.2f} |")
    out += ["", "## Kernels", "",
            "| workload | phase | kernel | grid | XBLOCK×RBLOCK | warps | regs | spill B | vector loads | MB | µs |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in doc["kernels"]:
        share = "-" if k["vector_share"] is None else f"{k['vector_loads']}/{k['loads']}"
        regs = "ERROR" if k["error"] else k["registers"]
        out.append(f"| {k['workload']} | {k['phase']} | `{k['name']}` | {k['grid']} | {k['xblock']}×{k['rblock']} | "
                   f"{k['num_warps']} | {regs} | {k['spill_bytes']} | {share} | {_mb(k['bytes'])} | "
                   f"{k['predicted_us']:.1f} |")
    out += ["", "## Operators between our kernels (matmuls, eager calls, copies), per step", ""]
    for r in doc["workloads"]:
        if r["phase"] == "step" and r["other_op_names"]:
            ops = ", ".join(f"{n}×{c}" for n, c in sorted(r["other_op_names"].items()))
            out.append(f"- {r['workload']}: {ops}")
    spills = [k for k in doc["kernels"] if k["spill_bytes"]]
    errors = [k for k in doc["kernels"] if k["error"]]
    out += ["", "## Notes", ""]
    out.append("- spilling kernels: " + (", ".join(f"`{k['name']}` ({k['workload']}, {k['spill_bytes']} B)"
                                                  for k in spills) if spills else "none"))
    out += [f"- did not compile: `{k['name']}` ({k['workload']}): {k['error']}" for k in errors]
    out += [f"- {w} ran partly eagerly: {'; '.join(reasons)}" for w, reasons in doc["fallbacks"].items()]
    out += [f"- {f['workload']} FAILED: {f['error']}" for f in doc["failures"]]
    return "\n".join(out) + "\n"


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f}" if n >= 1e8 else f"{n / 1e6:.3g}" if n >= 1e4 else f"{n / 1e6:.2g}"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=(
        "Every fused kernel of every benchmark workload compiled for sm_90 with its launch's "
        "specialization (no GPU needed), and a roofline prediction of ours vs eager on an H100."))
    parser.add_argument("--size", choices=("full", "small", "tiny"), default="small")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--only", help=f"comma-separated workloads: {', '.join(WORKLOADS)}")
    parser.add_argument("--json", help="write the JSON document here")
    parser.add_argument("--out", help="write kernels-<size>-<dtype>.md and .json into this directory")
    parser.add_argument("--processes", type=int, default=2, help="sm_90 compile workers (default: %(default)s)")
    parser.add_argument("--update", action="store_true", help=(
        "with --out and --only: rerun only those workloads and replace their rows in the existing "
        "kernels-<size>-<dtype>.json (the other workloads' rows are kept as they were)"))
    args = parser.parse_args(argv)
    if args.update and not (args.out and args.only):
        parser.error("--update needs --out (the tables to update) and --only (the workloads to rerun)")
    doc = run(args.size, args.dtype, args.only.split(",") if args.only else None, args.processes)
    if args.update:
        doc = _updated(os.path.join(args.out, f"kernels-{args.size}-{args.dtype}.json"), doc)
    if args.json:
        _write(args.json, json.dumps(doc, indent=1))
    stem = args.out and os.path.join(args.out, f"kernels-{args.size}-{args.dtype}")
    if stem:
        _write(stem + ".json", json.dumps(doc, indent=1))   # before the table: a long run's data is kept
    text = markdown(doc)
    if stem:
        _write(stem + ".md", text)
        print(f"wrote {stem}.md and .json", file=sys.stderr)
    print(text)
    return 1 if doc["failures"] else 0


def _updated(path: str, fresh: dict) -> dict:
    """The document at ``path`` with the rows of ``fresh``'s workloads replaced by ``fresh``'s, in
    the same order; ``meta.updated`` records which workloads were rerun, and how long that took."""
    with open(path) as f:
        doc = json.load(f)
    rerun = {r["workload"] for r in fresh["workloads"]} | {f["workload"] for f in fresh["failures"]}

    def merged(key):
        old, new = doc[key], [r for r in fresh[key] if r["workload"] in rerun]
        order = list(dict.fromkeys(r["workload"] for r in old + new))
        return [r for w in order for r in (new if w in rerun else old) if r["workload"] == w]

    doc["kernels"], doc["workloads"] = merged("kernels"), merged("workloads")
    doc["fallbacks"] = {**{w: v for w, v in doc["fallbacks"].items() if w not in rerun}, **fresh["fallbacks"]}
    doc["failures"] = [f for f in doc["failures"] if f["workload"] not in rerun] + fresh["failures"]
    doc["meta"]["updated"] = doc["meta"].get("updated", []) + [
        {"workloads": sorted(rerun), "seconds": fresh["meta"]["seconds"]}]
    return doc


def _write(path, text):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
