"""The "varying" workload: one transformer training step over batches whose shapes change.

``python -m benchmarks.varying [--tiny] [--out DIR]`` runs the transformer step's model over the
batches of ``workloads.varying_run`` (20 distinct sequence lengths drawn from 16..128, a smaller
last batch) three ways, each from a fresh model: eager, ours (``compiler.compile``, default
``dynamic=None``) and ``torch.compile(dynamic=None)``, and writes ``varying-<device>.md``:

* ours: recordings (eager runs that record) and instantiations (entries re-made from a template,
  no eager run), what each step was, kernel versions (distinct sources of each kernel across
  the run's entries: what a GPU would compile) and the sm_90 compile time of those sources
  (``benchmarks.sm90``, compiled without a GPU);
* cold compile of the whole run: ours = the recordings' time over eager's step time (capture,
  SymPy, codegen), the instantiations' build time, and the sm_90 compile of every distinct
  kernel source; torch.compile's = its wall time across the steps minus eager's;
* step times (ours: the replay, without the build of a step's instantiation) and every step's
  loss and the final parameters against eager's.

On a machine without a GPU our kernels run in Triton's interpreter: our step times are not a
speed measurement there, the compile figures are.
"""

import compiler  # noqa: F401  (first: before anything imports triton)

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from benchmarks import sm90  # noqa: E402
from benchmarks.workloads import VARYING, transformer_train_step, varying_run  # noqa: E402

# (as ``python -m benchmarks``: benchmarks/out/, git-ignored; --out benchmarks/results updates the committed file)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def _steps(step, model, batches, on_step=None):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses, times = [], []
    for i, (idx, targets) in enumerate(batches):
        start = time.perf_counter()
        loss = step(model, opt, idx, targets)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        if on_step:
            on_step(i)
    return losses, times, [p.detach().clone() for p in model.parameters()]


class _Timed:
    """Wraps a callable, adding its wall time per call to ``seconds``."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, []

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - start)


def kernel_versions(entries) -> dict:
    """Distinct sources of each kernel (a kernel: its phase, region and place in the region's
    program) across ``entries``."""
    versions: dict = {}
    for entry in entries:
        if entry.trace is None:
            continue
        place: dict = {}
        for k in entry.report.kernels:
            n = place.setdefault((k.phase, k.region), 0)
            place[(k.phase, k.region)] = n + 1
            versions.setdefault((k.phase, k.region, n), {})[k.source] = k.name
    return versions


def run(size="small", device="cpu", sm90_compile=True, with_torch_compile=True):
    make_model, batches = varying_run(torch.device(device), size)
    result = {"size": size, "device": device, "config": VARYING[size],
              "lengths": [tuple(idx.shape) for idx, _ in batches]}

    eager_losses, eager_times, eager_params = _steps(transformer_train_step, make_model(), batches)
    result["eager"] = {"losses": eager_losses, "times": eager_times}

    # ours
    step = compiler.compile(transformer_train_step)
    step.builder = build = _Timed(step.builder)
    step.shapes.provider.instantiate = inst = _Timed(step.shapes.provider.instantiate)
    kinds, marks = [], {"captures": 0, "instantiations": 0, "inst_s": 0.0}

    launched = {}  # id -> entry: the entries whose kernels ran (a recording's run eagerly: on a GPU,
    # Triton compiles a kernel at its first launch, so a recording never replayed compiles nothing)

    def note(i):
        if not step.last_backend.startswith("eager"):
            launched[id(step.last_entry)] = step.last_entry
        kind = "replay"
        if step.stats["captures"] > marks["captures"]:
            kind = "recording"
        elif step.stats["instantiations"] > marks["instantiations"]:
            kind = "instantiation"
        spent = sum(inst.seconds) - marks["inst_s"]  # (tried and failed too: part of the step's compile)
        kinds.append((kind, spent))
        marks.update(captures=step.stats["captures"], instantiations=step.stats["instantiations"],
                     inst_s=sum(inst.seconds))
    losses, times, params = _steps(step, make_model(), batches, note)
    built = kernel_versions([e for entries in step.cache.values() for e in entries])
    versions = kernel_versions(launched.values())
    sources = {src: name for v in versions.values() for src, name in v.items()}
    recordings_s = sum(max(0.0, b - e) for b, e in zip(build.seconds, [eager_times[i] for i, (k, _) in
                                                                       enumerate(kinds) if k == "recording"]))
    ours = {"losses": losses, "times": times, "kinds": kinds, "stats": dict(step.stats),
            "kernels": len(versions), "max_versions": max((len(v) for v in versions.values()), default=0),
            "distinct_sources": len(sources), "built_sources": len({s for v in built.values() for s in v}),
            "record_build_s": recordings_s, "instantiate_s": sum(inst.seconds),
            "loss_diff": max(abs(a - b) for a, b in zip(losses, eager_losses)),
            "param_diff": max(float((p - q).abs().max()) for p, q in zip(params, eager_params))}
    ours["replay_times"] = [t - spent if kind == "instantiation" else t
                            for t, (kind, spent) in zip(times, kinds) if kind != "recording"]
    if sm90_compile:
        # (region kernels; the optimizer's fused step, one version whatever the shapes, is left out)
        launches = [sm90.generic_launch(name, src) for src, name in sources.items() if "\nSIGNATURE = " in src]
        ours["sm90_kernels"] = len(launches)
        with tempfile.TemporaryDirectory(prefix="symgrad-varying-sm90-") as cache:
            start = time.perf_counter()
            compiled = sm90.compile_launches(launches, processes=2, cache_dir=cache)
            ours["sm90_s"] = time.perf_counter() - start
        ours["sm90_errors"] = sum(1 for c in compiled if c.get("error"))
    result["ours"] = ours

    if not with_torch_compile:
        result["torch.compile"] = {"losses": [], "times": [], "cold_s": 0.0, "loss_diff": float("nan"),
                                   "param_diff": float("nan")}
        return result
    # torch.compile(dynamic=None), cold: a fresh inductor cache
    torch._dynamo.reset()
    with tempfile.TemporaryDirectory(prefix="symgrad-varying-inductor-") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        tc = torch.compile(transformer_train_step, dynamic=None)
        tc_losses, tc_times, tc_params = _steps(tc, make_model(), batches)
    result["torch.compile"] = {
        "losses": tc_losses, "times": tc_times, "cold_s": max(0.0, sum(tc_times) - sum(eager_times)),
        "loss_diff": max(abs(a - b) for a, b in zip(tc_losses, eager_losses)),
        "param_diff": max(float((p - q).abs().max()) for p, q in zip(tc_params, eager_params))}
    return result


def markdown(r) -> str:
    o, tc, e = r["ours"], r["torch.compile"], r["eager"]
    c = r["config"]
    ms = lambda ts: f"{1e3 * statistics.median(ts):.1f}" if ts else "–"  # noqa: E731
    ours_cold = o["record_build_s"] + o["instantiate_s"] + o.get("sm90_s", 0.0)
    lines = [
        f"# varying: transformer training step over {len(r['lengths'])} batches of changing shape ({r['device']})",
        "",
        f"Model: the transformer_step workload's (dim {c['dim']}, {c['heads']} heads, vocab {c['vocab']}), SGD; "
        f"batches of {c['batch']} x distinct lengths drawn from {c['min_len']}..{c['max_len']} (seed 0), "
        f"the last batch {c['last_batch']}. Shapes in order: "
        + ", ".join(f"{b}x{t}" for b, t in r["lengths"]) + ".",
        "",
        "| figure | ours | torch.compile(dynamic=None) | target (issue 15) |",
        "|---|---|---|---|",
        f"| recordings (eager runs that record / compiles) | {o['stats']['captures']} | – | ≤ 2 |",
        f"| instantiations (no eager run) | {o['stats']['instantiations']} | – | |",
        f"| kernels; most versions of one kernel (launched) | {o['kernels']}; {o['max_versions']} | – "
        "| ≤ 2 versions |",
        f"| distinct kernel sources launched (GPU compiles); built | {o['distinct_sources']}; {o['built_sources']} "
        "| – | |",
        f"| sm_90 compile of those sources ({o.get('sm90_kernels', 0)} region kernels, 2 processes) "
        f"| {o.get('sm90_s', float('nan')):.1f} s"
        f"{' (' + str(o['sm90_errors']) + ' failed)' if o.get('sm90_errors') else ''} | – | |",
        f"| recordings' capture + build (over eager's step) | {o['record_build_s']:.1f} s | – | |",
        f"| instantiations' build | {o['instantiate_s']:.1f} s | – | |",
        f"| cold compile of the whole run | {ours_cold:.1f} s | {tc['cold_s']:.1f} s (CPU) "
        f"| ours ≤ 1/3 of torch.compile's: {ours_cold / tc['cold_s']:.2f}x |" if tc["cold_s"] else None,
        f"| step time, median ms (eager {ms(e['times'])}) | {ms(o['replay_times'])} (interpreter, not a speed "
        f"measurement) | {ms(tc['times'][3:])} (steps 4 on) | |",
        f"| largest loss difference vs eager, any step | {o['loss_diff']:.2e} | {tc['loss_diff']:.2e} | equal |",
        f"| largest final parameter difference vs eager | {o['param_diff']:.2e} | {tc['param_diff']:.2e} | equal |",
        "",
        "Per step (ours): " + ", ".join(f"{i + 1} {k}" for i, (k, _) in enumerate(o["kinds"])) + ".",
        "",
        "Kernel versions count the entries whose kernels ran: on a GPU Triton compiles a kernel at its first "
        "launch, and a recording's own call runs eagerly, so a recording that no later call replays compiles "
        "nothing (every length here is new: the recordings' kernels are built, never launched).",
        "",
        "Cold compile, ours: the recordings' wall time over eager's step time, the instantiations' build "
        "(SymPy, fusion, codegen), and the sm_90 compile of every distinct kernel source "
        "(`benchmarks/sm90.py`, Triton for Hopper without a GPU, a fresh cache). torch.compile's: its wall time "
        "across the 20 steps minus eager's, on CPU (a fresh inductor cache).",
    ]
    return "\n".join(line for line in lines if line is not None) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.varying", description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", dest="size", action="store_const", const="tiny", default="small")
    parser.add_argument("--no-sm90", dest="sm90", action="store_false", help="skip the sm_90 compile")
    parser.add_argument("--no-torch-compile", dest="torch_compile", action="store_false",
                        help="skip torch.compile's run")
    parser.add_argument("--out", default=OUT, help="output folder (default: benchmarks/out/, git-ignored; "
                                                   "--out benchmarks/results updates the committed result)")
    parser.add_argument("--tag", default="", help="a suffix of the result file's name")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = run(args.size, device, args.sm90, args.torch_compile)
    text = markdown(result)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"varying-{device}{args.tag}.md")
    with open(path, "w") as f:
        f.write(text)
    print(text)
    print(path, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
