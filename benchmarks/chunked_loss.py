"""``python -m benchmarks.chunked_loss``: peak memory of a language model head's cross-entropy,
forward and backward, ours (the chunked linear cross-entropy) against eager, measured on CPU.

    python -m benchmarks.chunked_loss                       # 50,257 classes, 2,048 rows, width 768
    python -m benchmarks.chunked_loss --width 256 --out benchmarks/results/chunked-loss-cpu.md

One step: ``F.cross_entropy(head(h), target, **form)`` then ``backward()``, with ``head`` a
``Linear(width, classes)`` and ``h`` requiring grad, for each form the binding takes. Peak: the
most bytes allocated at once during the step above what it started with, from
``torch.profiler``'s allocation records (``benchmarks.measure.step_memory``); eager holds the
logits, their log-softmax and their gradient (each rows x classes in float32), ours one chunk's.
Each backend is warmed up (ours: recorded, then replayed) before the measured step. Time: the
median of three steps, for reference only (this 2-core machine is noisy).
"""

from __future__ import annotations

import compiler  # noqa: F401  (first: before anything imports triton)

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.measure import step_memory  # noqa: E402

FORMS = {
    "mean": {},
    "sum": dict(reduction="sum"),
    "none": dict(reduction="none"),
    "ignore_index": dict(ignore_index=0),
    "label smoothing 0.1": dict(label_smoothing=0.1),
    "class weights": dict(weight=True),
}


def _case(rows: int, width: int, classes: int, form: dict):
    torch.manual_seed(0)
    head = torch.nn.Linear(width, classes)
    h = torch.randn(rows, width, requires_grad=True)
    target = torch.randint(0, classes, (rows,))
    target[: rows // 10] = form.get("ignore_index", -100)
    kwargs = dict(form)
    if kwargs.pop("weight", None):
        kwargs["weight"] = torch.rand(classes)

    def loss(h, target):
        return F.cross_entropy(head(h), target, **kwargs)

    def step(fn):
        head.zero_grad(set_to_none=True)
        h.grad = None
        out = fn(h, target)
        out.backward(torch.ones_like(out))
        return out.detach()
    return loss, step


def measure(rows: int, width: int, classes: int, forms=FORMS) -> list:
    """One row per form: eager's and ours' peak bytes and median step time, and whether ours chunked."""
    results = []
    for name, form in forms.items():
        loss, step = _case(rows, width, classes, FORMS[name] if isinstance(form, str) else form)
        compiled = compiler.compile(loss, backend="auto")
        row = {"form": name}
        for label, fn in (("eager", loss), ("ours", compiled)):
            step(fn), step(fn)   # (ours: records, then replays)
            row[f"{label}_peak"] = step_memory(lambda: step(fn), torch.device("cpu")).peak
            times = []
            for _ in range(3):
                start = time.perf_counter()
                step(fn)
                times.append(time.perf_counter() - start)
            row[f"{label}_ms"] = statistics.median(times) * 1e3
        row["eager_calls"] = compiled.stats["eager_calls"]
        row["ratio"] = row["ours_peak"] / row["eager_peak"]
        results.append(row)
        print(f"{name}: eager {row['eager_peak'] / 2**20:.0f} MiB, ours {row['ours_peak'] / 2**20:.0f} MiB "
              f"({row['ratio']:.2f}x); {row['eager_ms']:.0f} vs {row['ours_ms']:.0f} ms", flush=True)
    return results


def table(results: list, rows: int, width: int, classes: int) -> str:
    lines = [f"Cross-entropy of a linear head, forward and backward, on CPU: {classes:,} classes, {rows:,} rows, "
             f"width {width}, float32; torch {torch.__version__}, {torch.get_num_threads()} threads. Chunk budget: "
             "`SYMGRAD_LOSS_CHUNK_MB` (default 128).", "",
             "| form | eager peak MiB | ours peak MiB | ours / eager | eager ms | ours ms | ours ran eagerly |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['form']} | {r['eager_peak'] / 2**20:.0f} | {r['ours_peak'] / 2**20:.0f} | "
                     f"{r['ratio']:.2f} | {r['eager_ms']:.0f} | {r['ours_ms']:.0f} | {r['eager_calls']} calls |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--classes", type=int, default=50257)
    parser.add_argument("--forms", default=",".join(FORMS), help="comma-separated: " + ", ".join(FORMS))
    parser.add_argument("--out", help="write the markdown table here")
    args = parser.parse_args(argv)
    forms = {name: FORMS[name] for name in args.forms.split(",")}
    results = measure(args.rows, args.width, args.classes, forms)
    text = table(results, args.rows, args.width, args.classes)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return results


if __name__ == "__main__":
    main()
