"""Cold compile of a training step's kernels for sm_90: one thread against the ahead-of-time pool.

What ``runtime.ahead_of_time`` does when a region is built for compiled Triton — every forward and
backward kernel compiled in a thread pool before the first replay — timed without a GPU: the
step's launches are recorded as a GPU would get them (``benchmarks.sm90.recorded_launches``:
their real arguments, tiles and warps), then a fresh process (no interpreter, an empty Triton
cache per run) compiles each one for sm_90 through ``runtime.ahead_of_time.compile_jobs`` with
pools of the sizes asked for. The same kernels, the same pool code; only the target is named
rather than read from a driver.

    python -m benchmarks.ahead_of_time --workload transformer_step --size full --dtype bfloat16 \\
        --workers 1,2 --json benchmarks/results/ahead-of-time-cpu.json

On this project's 2-core machine the figure is bounded by its cores; a GPU machine's 16 give the
pool more (``gpu_check`` measures it there, with the driver's own target).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def record(workload: str, size: str, dtype: str) -> list:
    """The distinct kernel launches (as ``benchmarks.sm90.Launch`` dicts) of one step of ``workload``."""
    import compiler  # noqa: F401  (first: Triton's interpreter on a machine without a GPU)
    import torch

    from benchmarks.kernels import trace_workload

    trace = trace_workload(workload, size, getattr(torch, dtype))
    launches = {}
    for ours in trace.launches:
        launches.setdefault(ours.launch.key(), dataclasses.asdict(ours.launch))
    return list(launches.values())


def measure(jobs: list, pools: list) -> list:
    """Rows {workers, seconds, kernels}: each pool size's cold compile of ``jobs``, in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="symgrad-aot-") as tmp:
        path = os.path.join(tmp, "jobs.json")
        with open(path, "w") as f:
            json.dump(jobs, f)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(TRITON_INTERPRET="0", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
                   TRITON_DEFAULT_FP_FUSION=env.get("TRITON_DEFAULT_FP_FUSION", "1"))
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", path,
                               ",".join(map(str, pools))], env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"the compile process failed: {done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


class _Sm90Launcher:
    """What ``compile_jobs`` asks of a launcher, compiling for sm_90 (``benchmarks.sm90``)."""

    def __init__(self, job: dict, workdir: str):
        from benchmarks.sm90 import load_job

        self.job = job
        self.fn, self.args = load_job(job, workdir)

    def prepare(self, args, key) -> None:
        from benchmarks.sm90 import compile_for_sm90

        compile_for_sm90(self.fn, self.args, self.job)


def _worker(path: str, pools: str) -> None:
    import triton

    from runtime.ahead_of_time import Job, compile_jobs

    with open(path) as f:
        launches = json.load(f)
    rows = []
    for size in map(int, pools.split(",")):
        with tempfile.TemporaryDirectory(prefix="symgrad-aot-run-") as workdir:
            triton.knobs.cache.dir = os.path.join(workdir, "triton-cache")   # cold: an empty cache
            sys.path.insert(0, workdir)
            jobs = [Job(launch["name"], _Sm90Launcher(launch, workdir), [], ()) for launch in launches]
            started = time.perf_counter()
            compile_jobs(jobs, None, pool_size=size)
            rows.append({"workers": size, "seconds": round(time.perf_counter() - started, 2), "kernels": len(jobs)})
            sys.path.remove(workdir)
    print(json.dumps(rows))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="transformer_step")
    parser.add_argument("--size", default="full")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--workers", default=f"1,{min(os.cpu_count() or 1, 32)}",
                        help="pool sizes to time, comma-separated (default: 1 and this machine's CPUs)")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    pools = [int(w) for w in args.workers.split(",")]
    print(f"recording {args.workload} ({args.size}, {args.dtype}) ...", file=sys.stderr)
    jobs = record(args.workload, args.size, args.dtype)
    print(f"compiling its {len(jobs)} kernels for sm_90 with {args.workers} threads ...", file=sys.stderr)
    rows = measure(jobs, pools)
    result = {"workload": args.workload, "size": args.size, "dtype": args.dtype, "target": "cuda sm_90 (GPUTarget)",
              "cpus": os.cpu_count(), "runs": rows}
    serial = next((r["seconds"] for r in rows if r["workers"] == 1), None)
    for row in rows:
        speedup = f", {serial / row['seconds']:.2f}x one thread" if serial and row["workers"] != 1 else ""
        print(f"{row['workers']:>3} threads: {row['kernels']} kernels in {row['seconds']:.2f} s{speedup}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3])
    else:
        main()
