"""``python -m benchmarks``: workloads × backends, results under ``benchmarks/out/`` (git-ignored); the
committed ``benchmarks/results/`` is written only with ``--out benchmarks/results``. See ``benchmarks/README.md``."""

import compiler  # noqa: F401  (first: before anything imports triton, e.g. torch.optim)

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from benchmarks import backends  # noqa: E402
from benchmarks.harness import OUT, run  # noqa: E402
from benchmarks.workloads import WORKLOADS  # noqa: E402


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)

    if args.list:
        for w in WORKLOADS.values():
            print(f"{w.name:18s} {w.group}  {w.description}")
        return 0
    chosen = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in chosen if b not in backends.ALL]
    if unknown:
        parser.error(f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(backends.ALL)}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.all_modes:
        if device == "cuda":
            chosen += [m for m in backends.GPU_MODES if m not in chosen]
        else:
            print("benchmarks: --all-modes adds GPU-only modes; skipped on CPU", file=sys.stderr)
    if args.size is None and device == "cpu":
        print("benchmarks: no GPU, so --cpu sizes: ours runs compiler.compile's default CPU backend, timed; "
              "its Triton kernels are checked in Triton's interpreter at tiny sizes, not timed", file=sys.stderr)
    only = [w.strip() for w in args.only.split(",")] if args.only else None

    start = time.perf_counter()
    result = run(size=args.size, only=only, backends=chosen, device=device, out_dir=args.out, cold=args.cold,
                 rounds=args.rounds)
    print(f"benchmarks: {len(result.results)} results in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    for path in result.files:
        print(path)
    return _checks_passed(result.results)


def _parser():
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=(
        "Our compiler vs eager PyTorch vs torch.compile: workloads x backends; CSV, markdown table "
        "and plots under benchmarks/out/ (git-ignored; --out benchmarks/results updates the committed results). "
        "See benchmarks/README.md."))
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--cpu", dest="size", action="store_const", const="cpu",
                       help="CPU sizes, where eager's step takes 5-50 ms on 2 cores (the default without a GPU)")
    sizes.add_argument("--small", dest="size", action="store_const", const="small",
                       help="small sizes: on CPU, fixed per-call costs dominate every backend's time")
    sizes.add_argument("--tiny", dest="size", action="store_const", const="tiny", help="tiny sizes, for tests")
    sizes.add_argument("--full", dest="size", action="store_const", const="full",
                       help="the full GPU sizes (the default with a GPU)")
    parser.add_argument("--only", help=f"comma-separated workloads: {', '.join(WORKLOADS)}")
    parser.add_argument("--backends", default=",".join(backends.DEFAULT),
                        help=f"comma-separated, from {', '.join(backends.ALL)} (default: %(default)s); on CPU, "
                             "ours also adds an interpreter check of our Triton kernels per workload (not timed)")
    parser.add_argument("--all-modes", action="store_true",
                        help="add torch.compile's max-autotune-no-cudagraphs and reduce-overhead modes (GPU)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--no-cold", dest="cold", action="store_false",
                        help="skip cold/warm compile times (two fresh processes per compiled backend)")
    parser.add_argument("--rounds", type=int, help="interleaved timing rounds (default 10 on GPU, 5 on CPU)")
    parser.add_argument("--out", default=OUT, help=(
        "output directory (default: benchmarks/out/, git-ignored; --out benchmarks/results replaces the committed "
        "results of the same device and size)"))
    parser.add_argument("--list", action="store_true", help="list the workloads and exit")
    return parser


def _checks_passed(results) -> int:
    """The exit status: 1 where our Triton kernels failed their interpreter check (a wrong kernel
    that no timed row ran on this machine would otherwise pass unseen in a table)."""
    failed = [r for r in results if r.backend == backends.INTERPRETER_CHECK and r.status != "ok"]
    for r in failed:
        print(f"benchmarks: FAILED: {r.workload}: our Triton kernels in the interpreter: {r.status}; {r.detail}",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
