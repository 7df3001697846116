"""How many kernel sources a transformer step needs over changing sequence lengths, shape-generic
(``build_region(..., shape_generic=True)``) vs size-specialized kernels, and what the generic ones
cost on sm_90 (registers, spills, compile time) next to the static ones.

    PYTHONPATH=$PWD python -m benchmarks.generic_kernels [--lengths 16-128] [--sm90]

Every (length, batch) records and builds its own region here (the guard key is per shape; dynamic
recordings are compiler.reuse.dynamic's): what is counted is the kernels those builds write. A kernel is
one position of a build's schedule (forward, then backward), named by its ops; its versions are
the distinct sources at that position over all builds. No kernel runs: the first call of a shape
records eagerly and builds.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import time

import torch

import compiler
import compiler.api as api
from benchmarks.workloads import TinyTransformer
from compiler.build import build_region

DIMS = dict(vocab=65, dim=64, heads=4, seq=128)   # a character-level nanoGPT block, small enough for the CPU


def built(shape_generic: bool, into: list | None = None):
    """``build_region`` with its kernels shape-generic or not, whatever the caller asks; each
    build's details appended to ``into``."""
    def build(graph, *args, **options):
        region, details = build_region(graph, *args, **{**options, "shape_generic": shape_generic})
        if into is not None:
            into.append(details)
        return region, details
    return build


@contextlib.contextmanager
def regions_built_by(build):
    """Regions compiled by ``build`` (a stand-in for ``build_region``) while it lasts, and never
    loaded from the compile cache (a stored region would skip the stand-in)."""
    original, api.build_region = api.build_region, build
    saved = os.environ.get("SYMGRAD_REGION_CACHE")
    os.environ["SYMGRAD_REGION_CACHE"] = "0"
    try:
        yield
    finally:
        api.build_region = original
        if saved is None:
            os.environ.pop("SYMGRAD_REGION_CACHE", None)
        else:
            os.environ["SYMGRAD_REGION_CACHE"] = saved


def kernel_versions(lengths, batches=(8, 5), shape_generic=True) -> dict:
    """position ("forward 3: fused_sub_exp_sum_amax") -> {kernel name: source} over the builds."""
    versions = collections.defaultdict(dict)
    builds = []
    with regions_built_by(built(shape_generic, builds)):
        torch.manual_seed(0)
        model = TinyTransformer(**DIMS)
        step = compiler.compile(lambda m, idx, targets: m(idx, targets).backward())
        for t in lengths:
            for b in batches:
                idx = torch.randint(0, DIMS["vocab"], (b, t))
                builds.clear()
                step(model, idx, idx)
                for details in builds:
                    for part in ("forward", "backward"):
                        for i, k in enumerate(details[f"{part}_kernels"]):
                            versions[f"{part} {i}: {k.name.rsplit('_', 1)[0]}"][k.name] = k.source
    return versions


def sm90_costs(lengths=(20, 100)) -> dict:
    """{generic: [(kernel, registers, spill bytes, compile seconds)]} for a step's recorded launches."""
    from benchmarks.sm90 import compile_launches, recorded_launches
    from runtime.kernels import cache_dir

    out = {}
    for generic in (True, False):
        with regions_built_by(built(generic)):
            model = TinyTransformer(**DIMS)
            step = compiler.compile(lambda m, idx, targets: m(idx, targets).backward())
            launches = {}
            for t in lengths:
                idx = torch.randint(0, DIMS["vocab"], (8, t))
                step(model, idx, idx)
                with recorded_launches(compute_extern_calls=False) as recorded:
                    step(model, idx, idx)
                for launch in recorded:
                    launches.setdefault(launch.name, launch)
        start = time.perf_counter()
        results = compile_launches(list(launches.values()), processes=1, cache_dir=cache_dir())
        elapsed = time.perf_counter() - start
        out[generic] = ([(launch.name, r["registers"], r["spill_bytes"], r["error"])
                         for launch, r in zip(launches.values(), results)], elapsed)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="16-128", help="first-last sequence length (every one)")
    parser.add_argument("--sm90", action="store_true", help="also compile for sm_90 (generic vs static)")
    options = parser.parse_args()
    first, last = map(int, options.lengths.split("-"))
    lengths = range(first, last + 1)
    for generic in (True, False):
        versions = kernel_versions(lengths, shape_generic=generic)
        counts = sorted(len(v) for v in versions.values())
        total = len({name for v in versions.values() for name in v})
        print(f"{'shape-generic' if generic else 'static'}: lengths {first}..{last}, batches 8 and 5: "
              f"{len(versions)} kernel positions, {total} distinct sources, versions per kernel: "
              f"max {counts[-1]}, {collections.Counter(counts)}")
        if generic:
            for position, v in sorted(versions.items(), key=lambda kv: -len(kv[1])):
                if len(v) > 1:
                    print(f"  {len(v)} versions: {position}")
    if options.sm90:
        costs = sm90_costs()
        for generic in (True, False):
            rows, elapsed = costs[generic]
            registers = [r for _, r, _, e in rows if r]
            print(f"sm_90 {'generic' if generic else 'static'}: {len(rows)} kernels, registers mean "
                  f"{sum(registers) / max(1, len(registers)):.1f} max {max(registers, default=0)}, "
                  f"spilling {sum(1 for _, _, s, _ in rows if s)}, errors {sum(1 for *_, e in rows if e)}, "
                  f"compile {elapsed:.1f} s (one process, cached results are free)")


if __name__ == "__main__":
    main()
