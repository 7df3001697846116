"""Warm start: a fresh process, from its first call to its first replayed result, with the
compiled-region cache (``compiler.reuse.persist``) empty (cold) and filled by an earlier process (warm).

    PYTHONPATH=$PWD python -m benchmarks.warm_start --size small mlp_step transformer_step

Each workload runs in two fresh processes sharing one ``SYMGRAD_CACHE_DIR`` that starts empty
(``benchmarks.fresh_process``: forks of a server that has imported torch and the compiler).
In each: eager's step (its time, and PyTorch's lazy start-up out of the way), then the
compiled function's first call and its second. In the cold process the first call records
(capture, then SymPy autodiff, fusion and codegen for each region) and the second is the first
replay. In the warm process the first call loads the recording the cold process stored
(``compiler.reuse.recordings``) and its regions (``compiler.reuse.persist``) and replays at once: no eager
run. ``recorded`` says whether the first call recorded; ``regions built`` counts the regions
differentiated in that process; the first replayed result is the first call's where it did not
record, else the second's. ``--no-recordings`` runs both processes with
``SYMGRAD_STORED_RECORDINGS=0`` (the state before stored recordings: the warm process records
again, loading only the regions); ``--no-cache`` adds ``SYMGRAD_REGION_CACHE=0`` (no cache).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from benchmarks import fresh_process
from benchmarks.workloads import WORKLOADS


def probe(request: dict) -> dict:
    """In the fresh process: the first call's and first replay's seconds, regions built."""
    import compiler
    import compiler.build

    builds = []
    partition = compiler.build.partition

    def counting(*args, **kwargs):
        builds.append(1)
        return partition(*args, **kwargs)
    compiler.build.partition = counting
    case = WORKLOADS[request["workload"]].build(request["size"], torch.device("cpu"))
    eager_args = case.make_args(torch.float32)
    eager = min(_timed(lambda: case.step(case.fn, eager_args)) for _ in range(3))
    fn = compiler.compile(case.fn)
    args = case.make_args(torch.float32)
    first = _timed(lambda: case.step(fn, args))
    replay = _timed(lambda: case.step(fn, args))
    return {"eager_s": eager, "first_call_s": first, "first_replay_s": replay, "regions_built": len(builds),
            "replays": fn.stats["replays"], "recorded": fn.stats["captures"] > 0 and fn.stats["replays"] < 2}


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(workload: str, size: str, cache: bool = True, recordings: bool = True, timeout: float = 900) -> dict:
    """{"cold": probe result, "warm": probe result} for one workload."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="symgrad-warm-start-") as tmp:
        env = {"SYMGRAD_CACHE_DIR": os.path.join(tmp, "symgrad"), "SYMGRAD_REGION_CACHE": "1" if cache else "0",
               "SYMGRAD_STORED_RECORDINGS": "1" if cache and recordings else "0"}
        for which in ("cold", "warm"):
            out[which] = fresh_process.call("benchmarks.warm_start:probe", {"workload": workload, "size": size}, env,
                                            os.path.join(tmp, f"{which}.log"), timeout, fork=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="+")
    parser.add_argument("--size", default="small")
    parser.add_argument("--no-cache", action="store_true", help="SYMGRAD_REGION_CACHE=0 in both processes")
    parser.add_argument("--no-recordings", action="store_true", help="SYMGRAD_STORED_RECORDINGS=0 in both processes")
    options = parser.parse_args()
    print("| workload | process | first call s | recorded | second call s | first call to first replayed result s "
          "| regions built | eager step s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in options.workloads:
        result = measure(name, options.size, cache=not options.no_cache, recordings=not options.no_recordings)
        for which, r in result.items():
            total = r["first_call_s"] + (r["first_replay_s"] if r["recorded"] else 0.0)
            print(f"| `{name}` | {which} | {r['first_call_s']:.2f} | {'yes' if r['recorded'] else 'no'} | "
                  f"{r['first_replay_s']:.2f} | {total:.2f} | {r['regions_built']} | {r['eager_s'] * 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
