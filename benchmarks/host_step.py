"""Our whole step's host work with Triton launches stubbed, against eager's whole step, on CPU.

On a machine without a GPU our kernels run only in Triton's interpreter, so our step is timed
with each launch replaced by the allocation of its outputs (``measure.kernels_stubbed``): what
is left is our host work (guards, replay, autograd bridge, launches up to the driver call)
plus the matmuls and eager ops, which eager's step runs too. Issue 13 asks for this to be at
most eager's whole step (``overhead_step``: 1.0x; ``transformer_step``: 0.9x).

Both are timed in the same process, in interleaved rounds, as *thread CPU time* with torch on
one thread (autograd's CPU backward runs on the calling thread): on a shared machine wall
time mostly measures the other processes. Each round runs several steps of each; the result
is the median over rounds of the per-step mean.

``python -m benchmarks.host_step --only overhead_step,transformer_step --rounds 9``

Two rows of ours per workload: the default replay (the step's Python runs again, each torch
call checked) and ``compile(..., skip_python=True)`` (the recorded calls made directly:
``runtime.skip_python``), timed in the same interleaved rounds.
"""

from __future__ import annotations

import statistics
import time

import torch

ROUND_S = 0.2   # about this much CPU time of each backend per round


def stubbed_vs_eager(workload, size: str = "small", rounds: int = 9) -> dict:
    """``{"stubbed_ms", "skip_python_ms", "eager_ms", "ratio", "skip_python_ratio", "rounds"}`` for one
    workload (CPU, float32)."""
    import compiler
    from benchmarks import measure

    device = torch.device("cpu")
    case = workload.build(size, device)
    # (the Triton path, launches stubbed: on CPU "auto" would run the kernels as PyTorch ops instead)
    ours, eager = compiler.compile(case.fn, backend="interpret"), case.fn
    skipping = compiler.compile(case.fn, backend="interpret", skip_python=True)
    our_args, skip_args, eager_args = (case.make_args(torch.float32) for _ in range(3))
    case.step(ours, our_args)  # the recordings (eager, for real)
    case.step(skipping, skip_args)
    case.step(eager, eager_args)
    with measure.kernels_stubbed():  # stubbed steps compute garbage: our_args are throwaway
        steps = {"stubbed": lambda: case.step(ours, our_args), "skip_python": lambda: case.step(skipping, skip_args),
                 "eager": lambda: case.step(eager, eager_args)}
        for step in steps.values():
            step()
        repeat = {name: max(1, int(ROUND_S / max(_cpu_s(step, 1), 1e-6))) for name, step in steps.items()}
        samples = {name: [] for name in steps}
        for _ in range(rounds):
            for name, step in steps.items():
                samples[name].append(_cpu_s(step, repeat[name]) * 1e3)
    stubbed, eager_ms = statistics.median(samples["stubbed"]), statistics.median(samples["eager"])
    skip = statistics.median(samples["skip_python"])
    return dict(stubbed_ms=stubbed, skip_python_ms=skip, eager_ms=eager_ms, ratio=stubbed / eager_ms,
                skip_python_ratio=skip / eager_ms, rounds=rounds, skip_python_refused=_refused(skipping))


def _refused(compiled) -> str | None:
    """Why ``compiled`` (skip_python=True) ran its Python after all, or None."""
    from runtime import skip_python

    entry = compiled.last_entry
    return skip_python.refusal(entry.trace) or skip_python.hooks_in_the_way(entry.trace)


def _cpu_s(step, repeat: int) -> float:
    """Thread CPU seconds per call of ``step``, over ``repeat`` calls."""
    start = time.thread_time()
    for _ in range(repeat):
        step()
    return (time.thread_time() - start) / repeat


TARGETS = {"overhead_step": 1.0, "transformer_step": 0.9}


def main(argv=None) -> None:
    """Print the table of ``benchmarks/results/host-cpu-small.md``."""
    import argparse

    from benchmarks.workloads import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="overhead_step,transformer_step", help="workloads, comma-separated")
    parser.add_argument("--size", default="small", choices=("full", "small", "tiny"))
    parser.add_argument("--rounds", type=int, default=9)
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| workload | ours, launches stubbed (ms) | ratio | ours, skip_python (ms) | ratio | eager (ms) | target |")
    print("|---|---|---|---|---|---|---|")
    for name in options.only.split(","):
        r = stubbed_vs_eager(WORKLOADS[name], options.size, options.rounds)
        target = TARGETS.get(name)
        print(f"| `{name}` | {r['stubbed_ms']:.3f} | {r['ratio']:.2f}x | {r['skip_python_ms']:.3f} | "
              f"{r['skip_python_ratio']:.2f}x | {r['eager_ms']:.3f} | {'≤ %.1fx' % target if target else '-'} |",
              flush=True)
        if r["skip_python_refused"]:
            print(f"|  | (skip_python refused: {r['skip_python_refused']}) | | | | | |", flush=True)


if __name__ == "__main__":
    main()
