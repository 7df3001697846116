"""Writing results: a CSV (every number), a markdown table (the ones to read) and PNG plots.
Each file starts with the machine, device and library versions it was measured with.

>>> import tempfile
>>> write([], {"device": "cpu"}, tempfile.mkdtemp(), "cpu-tiny", "tiny")[0].endswith("cpu-tiny.csv")
True
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import sys

from benchmarks.interpreter_check import SIZE as CHECK_SIZE
from benchmarks.workloads import WORKLOADS

INTERPRETER = "interpreter, not a speed measurement"
CHECK_ONLY = "a check, not timed"   # the interpreter check's rows (benchmarks.interpreter_check)
_COLORS = {"eager": "#7f7f7f", "torch.compile": "#1f77b4", "ours": "#d62728",
           "torch.compile:max-autotune-no-cudagraphs": "#17becf", "torch.compile:reduce-overhead": "#9467bd"}


def write(results, environment, out_dir, tag, size) -> list:
    """Write ``<tag>.csv``, ``<tag>.md`` and ``<tag>.png`` into ``out_dir``; return their paths
    (the PNG only where matplotlib is installed)."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{tag}.{ext}") for ext in ("csv", "md", "png")]
    write_csv(results, environment, paths[0])
    with open(paths[1], "w") as f:
        f.write(markdown(results, environment, tag, size))
    try:
        plot(results, environment, paths[2], tag)
    except ImportError:
        print("benchmarks: matplotlib is not installed, no plots (pip install matplotlib)", file=sys.stderr)
        paths.pop()
    return paths


# -- CSV --------------------------------------------------------------------------------------------
def write_csv(results, environment, path):
    """One row per workload and backend; the environment as ``# key: value`` lines on top
    (``pandas.read_csv(path, comment="#")`` reads it); lists joined by `` | ``."""
    from benchmarks.harness import Result

    columns = [f.name for f in dataclasses.fields(Result)]
    with open(path, "w", newline="") as f:
        for key, value in environment.items():
            f.write(f"# {key}: {value}\n")
        writer = csv.writer(f)
        writer.writerow(columns)
        for r in results:
            writer.writerow([_csv_value(getattr(r, c)) for c in columns])


def _csv_value(value):
    if value is None:
        return ""
    if isinstance(value, list):
        return " | ".join(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


# -- markdown ---------------------------------------------------------------------------------------
_COLUMNS = ["workload", "backend", "check", "ran", "step ms: median (p20–p80)", "× eager", "× torch.compile",
            "compile s: cold / warm", "kernels / step", "our bytes / step", "GB/s (of copy)", "TFLOP/s",
            "peak MB (eager ÷ this)", "saved MB (eager ÷ this)"]


def markdown(results, environment, tag, size) -> str:
    out = [f"# Benchmarks: {tag}", ""]
    out += ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in environment.items()]
    out += ["", f"Sizes: `{size}`. Each result is checked against a float64 eager reference "
            f"(max error relative to each tensor's scale) before it is timed.", ""]
    out += ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    previous = None
    for r in results:
        out.append("| " + " | ".join(_table_row(r, show_workload=r.workload != previous)) + " |")
        previous = r.workload
    if any(r.timing == INTERPRETER for r in results):
        out += ["", f"† {INTERPRETER}: our kernels ran in Triton's CPU interpreter (`SYMGRAD_CPU_BACKEND="
                "interpret`), which checks them but is orders of magnitude slower than compiled code; compare "
                "compile times, kernel counts and bytes moved instead, and see the per-call overhead below."]
    out += _cpu_notes(results, size)
    out += _fallbacks_section(results)
    out += _overhead_section(results)
    out += _problems_section(results)
    out += ["", "## Workloads", ""]
    shapes = {}
    for r in results:  # (the timed rows' sizes, not the interpreter check's)
        shapes.setdefault(r.workload, r.shape)
    out += [f"- `{name}` ({WORKLOADS[name].group}): {WORKLOADS[name].description}; {shape}"
            for name, shape in shapes.items()]
    out += ["", "Columns are explained in `benchmarks/README.md`.", ""]
    return "\n".join(out)


def _table_row(r, show_workload):
    interpreted = r.timing == INTERPRETER
    if r.status == "ok":
        check = f"ok ({r.max_err:.0e})"
    elif r.status == "mismatch":
        check = f"**MISMATCH** ({r.max_err:.0e})"
    else:
        check = f"**{r.status.upper()}**"
    step = "-"
    if r.step_ms is not None:
        step = f"{_num(r.step_ms)} ({_num(r.step_p20_ms)}–{_num(r.step_p80_ms)})" + (" †" if interpreted else "")
    compile_s = "-" if r.compile_cold_s is None and r.compile_warm_s is None else \
        f"{_num(r.compile_cold_s)} / {_num(r.compile_warm_s)}"
    kernels = _num(r.kernels_per_step)
    if r.fused_kernels is not None:
        kernels += f" ({r.fused_kernels} fused)"
    gbps = "-" if r.gbps is None else f"{r.gbps:.0f}" + (f" ({r.copy_bw_fraction:.0%})" if r.copy_bw_fraction else "")
    memory = _megabytes(r.peak_mem_mb, r.mem_ratio_vs_eager)
    saved = _megabytes(r.saved_mb, r.saved_ratio_vs_eager)
    return [f"`{r.workload}`" if show_workload else "", r.backend, check, r.ran or "-", step,
            _ratio(r.speedup_vs_eager), _ratio(r.speedup_vs_torch_compile), compile_s, kernels,
            _bytes(r.bytes_moved), gbps, _num(r.tflops), memory, saved]


def _cpu_notes(results, size):
    """What ours means in a CPU run (where it was timed), and what the interpreter check rows are."""
    out = []
    timed = [r for r in results if r.device == "cpu" and r.backend == "ours" and r.timing != INTERPRETER]
    if timed:
        ran = ", ".join(f"`{w}`" for w in sorted({r.ran for r in timed if r.ran})) or "-"
        out += ["", "On CPU, `ours` is `compiler.compile(fn)` (`backend=\"auto\"`), timed as eager and "
                f"torch.compile are (ran: {ran}); its peak and saved MB are that step's, its kernels / step "
                "and bytes its GPU program's (the Triton kernels and the operators between them)."]
        if size in ("small", "tiny"):
            out[-1] += (f" At `{size}` sizes a step is microseconds of work: fixed per-call costs (Python, "
                        "dispatch, our guards and replay) dominate every backend's time; `--cpu` times the work.")
    checks = [r for r in results if r.timing == CHECK_ONLY]
    if checks:
        passed = sum(r.status == "ok" for r in checks)
        out += ["", f"`{checks[0].backend}`: our Triton kernels (the GPU program) in Triton's CPU interpreter at "
                f"`{CHECK_SIZE}` sizes, checked against float64 eager as every row is; not timed (the interpreter "
                f"is orders of magnitude slower than compiled code). {passed} of {len(checks)} passed."]
    return out


def _megabytes(mb, ratio):
    if mb is None:
        return "n/a"
    return f"{_num(mb)}" + (f" ({_num(ratio)}×)" if ratio else "")


def _fallbacks_section(results):
    ours = [r for r in results if r.backend == "ours" and r.status != "not run"]
    if not ours:
        return []
    out = ["", "## Our compiler: what ran eagerly", "",
           "From `compiler.explain(...)`: each reason an op or region fell back to eager PyTorch.", ""]
    for r in ours:
        if r.fallbacks:
            out.append(f"- `{r.workload}` ({_num(r.regions)} compiled regions):")
            out += [f"  - {reason}" for reason in r.fallbacks]
        elif r.fused_kernels is not None:
            out.append(f"- `{r.workload}`: none, fully compiled ({r.fused_kernels} fused kernels)")
    return out


def _overhead_section(results):
    rows = [r for r in results if r.workload == "overhead_step" and r.timing != CHECK_ONLY]
    if not rows:
        return []
    out = ["", "## Per-call overhead (`overhead_step`)", "",
           "A step this small is overhead-bound: its time is mostly each backend's per-call host work."]
    for r in rows:
        line = f"- {r.backend}: step {_num(r.step_ms)} ms" + (" †" if r.timing == INTERPRETER else "")
        if r.stubbed_ms is not None:
            line += (f"; with our Triton launches skipped (host overhead, matmuls and eager ops only): "
                     f"{_num(r.stubbed_ms)} ms (the default, checking replay, wall time; `compile(..., "
                     "skip_python=True)` and thread CPU time: `python -m benchmarks.host_step`)")
        if r.launch_us is not None:
            line += (f"; {_num(r.launch_us)} µs of host work per launch up to the driver call "
                     "(`launch_us`, outputs' allocation aside: `python -m benchmarks.launch`)")
        out.append(line)
    return out


def _problems_section(results):
    bad = [r for r in results if r.status != "ok" or r.detail]
    if not bad:
        return []
    return ["", "## Failures and notes", ""] + [f"- `{r.workload}` · {r.backend}: {r.status}; {r.detail}"
                                                for r in bad]


def _num(x):
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:.0f}"
    return f"{x:.3g}" if abs(x) >= 1e-3 else f"{x:.1e}"


def _ratio(x):
    return "-" if x is None else f"{x:.2f}×"


def _bytes(n):
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


# -- plots ------------------------------------------------------------------------------------------
def plot(results, environment, path, tag):
    """Four panels: speedup over eager, compile time, kernels per step, and memory (peak and
    saved for backward, each eager's over this backend's). Failed results are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in results if r.timing != CHECK_ONLY]  # (checks have no numbers to plot)
    good = [r for r in results if r.status == "ok"]
    workloads = list(dict.fromkeys(r.workload for r in results))
    backends = list(dict.fromkeys(r.backend for r in results))
    fig, axes = plt.subplots(2, 2, figsize=(15, 9.5))

    speed = [b for b in backends if b != "eager"]
    interpreted = sorted({r.backend for r in good if r.timing == INTERPRETER})
    _bars(axes[0, 0], workloads, speed, {(r.workload, r.backend): r.speedup_vs_eager for r in good},
          "step time: speedup over eager (×, log)", log=True, baseline=1.0,
          note=f"{', '.join(interpreted)}: kernels in Triton's interpreter, not timed" if interpreted else None)
    compile_values = {}
    for r in good:
        compile_values[(r.workload, f"{r.backend} cold")] = r.compile_cold_s
        compile_values[(r.workload, f"{r.backend} warm")] = r.compile_warm_s
    _bars(axes[0, 1], workloads, [f"{b} {w}" for b in speed for w in ("cold", "warm")], compile_values,
          "compile time, s (log): cold = fresh process, empty caches", log=True)
    _bars(axes[1, 0], workloads, backends, {(r.workload, r.backend): r.kernels_per_step for r in good},
          "kernels launched per step")
    memory = {}
    for r in good:
        if r.backend != "eager":
            memory[(r.workload, f"{r.backend} peak")] = r.mem_ratio_vs_eager
            memory[(r.workload, f"{r.backend} saved")] = r.saved_ratio_vs_eager
    if any(v for v in memory.values()):
        _bars(axes[1, 1], workloads, [f"{b} {k}" for b in speed for k in ("peak", "saved")], memory,
              "memory: eager / this (×, above 1 is less); saved = kept for backward", baseline=1.0)
    else:
        moved = {(r.workload, "ours"): r.bytes_moved / 2**20 for r in good if r.backend == "ours" and r.bytes_moved}
        _bars(axes[1, 1], workloads, ["ours"], moved, "bytes moved per step by our kernels, MiB")
    summary = " · ".join(f"{k}: {environment[k]}" for k in ("device", "torch", "triton", "symgrad", "date")
                         if k in environment)
    fig.suptitle(f"symgrad benchmarks: {tag}", fontsize=14)
    fig.text(0.5, 0.01, summary + "\n" + environment.get("machine", ""), ha="center", fontsize=8, wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax, workloads, series, values, title, log=False, baseline=None, note=None):
    from matplotlib.ticker import FuncFormatter

    width = 0.8 / max(len(series), 1)
    for i, name in enumerate(series):
        xs, heights = [], []
        for j, w in enumerate(workloads):
            v = values.get((w, name))
            x = j - 0.4 + width * (i + 0.5)
            if v is not None and v > 0 and math.isfinite(v):
                xs.append(x)
                heights.append(v)
        if not xs:
            continue
        backend, _, kind = name.partition(" ")
        ax.bar(xs, heights, width, label=name, color=_COLORS.get(backend, None),
               hatch="//" if kind in ("warm", "saved") else None, alpha=0.6 if kind in ("warm", "saved") else 1.0)
    if baseline is not None:
        ax.axhline(baseline, color="black", linewidth=0.8)
    if log:
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads, rotation=30, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
    if note:
        ax.text(0.01, 0.98, note, transform=ax.transAxes, va="top", fontsize=8, color="#d62728")
    ax.grid(axis="y", alpha=0.3)
