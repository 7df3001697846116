"""The device check: everything the first GPU session should learn, in one command, in ~8 minutes.

    python -m benchmarks.gpu_check [--out DIR] [--budget SECONDS] [--dry-run]

Run from the source tree on a fresh GPU machine (empty Triton cache, no network; README "On a
GPU" gives the offline install line, though nothing here needs the package installed). The steps
run in order, each in its own process with its own time box, and the markdown summary
(``DIR/gpu-check.md``, with ``gpu-check.json`` and each step's log under ``DIR/logs/``) is
rewritten after every step, so a session cut short still leaves what was learned:

1. ``environment``: torch, Triton, the GPU, the CPUs, whether compute-sanitizer is present;
2. ``smoke``: ``benchmarks.gpu_smoke`` — the README function; transposed and misaligned inputs;
   a side stream; a no-input region; dropout and ``manual_seed``; bf16 autocast; Adam and SGD
   against eager; clip;
3. ``pytest``: ``pytest -m gpu -x -q`` on a fast subset of the CUDA test mode (tests/devices.py);
4. ``examples``: ``examples/train_mlp.py`` and ``examples/train_gpt2.py`` (short);
5. ``launch``: real host time per launch: ours, ``JITFunction.run``, a combo kernel, an eager op
   (``benchmarks.real_launch``);
6. ``benchmarks``: ``python -m benchmarks`` on cuda for the training workloads, eager,
   torch.compile and ours side by side;
7. ``attention``: the attention workload, the same way;
8. ``cold_compile``: the transformer step's kernels compiled in one thread against the pool
   (``benchmarks.ahead_of_time``);
9. ``sanitizer``: ``compute-sanitizer --tool memcheck`` on the smoke test, if present.

``--dry-run`` runs the same steps on the CPU through Triton's interpreter at tiny sizes (the CUDA
test mode rehearsed, ``SYMGRAD_TEST_DEVICE=cpu``; steps that need a GPU say so and pass): a few
minutes, and CI runs it (tests/test_gpu_check.py), so the command is known to work before a GPU
is ever lent. Exit status: 1 if a step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "gpu-check")
TRAINING_WORKLOADS = "mlp_step,transformer_step,overhead_step,cnn_step"
SANITIZED = "readme_function,transposed_and_misaligned_inputs,adam_against_eager"   # (memcheck is slow)
PYTEST_SUBSET = ["tests/test_training_step.py", "tests/test_optimizer_step.py", "tests/test_clip_grad.py",
                 "tests/test_hooks.py", "tests/test_saved_tensor_hooks.py", "tests/test_elementwise.py",
                 "tests/test_random.py"]


@dataclass
class Step:
    name: str
    seconds_max: int          # its time box on a GPU
    status: str = "not run"   # passed, FAILED, TIMEOUT, skipped (why)
    seconds: float = 0.0
    detail: str = ""          # one line for the table
    log: str = ""             # the log file, relative to the output folder
    data: dict = field(default_factory=dict)


def _python(*args) -> list:
    return [sys.executable, *args]


def _environment(dry: bool) -> dict:
    """Versions and the machine, from a child process (this one imports no torch)."""
    code = ("import json, os, torch, triton; print(json.dumps({'torch': torch.__version__, "
            "'triton': triton.__version__, 'cuda': torch.version.cuda, 'gpu': torch.cuda.get_device_name() "
            "if torch.cuda.is_available() else None, 'capability': torch.cuda.get_device_capability() "
            "if torch.cuda.is_available() else None, 'cpus': os.cpu_count()}))")
    done = subprocess.run(_python("-c", code), capture_output=True, text=True, timeout=120, env=_env(dry), cwd=ROOT)
    info = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {"error": done.stderr[-500:]}
    info.update(python=platform.python_version(), sanitizer=shutil.which("compute-sanitizer"), dry_run=dry)
    try:
        from importlib.metadata import version
        info["transformers"] = version("transformers")
    except Exception:  # noqa: BLE001 — only reported
        info["transformers"] = None
    return info


def _env(dry: bool, **extra) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
    if dry:   # the interpreter on the CPU, the kernels run by "auto" as the tests run them
        env.update(SYMGRAD_CPU_BACKEND="interpret", SYMGRAD_TEST_DEVICE="cpu")
    else:
        env.pop("TRITON_INTERPRET", None)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # Triton's default, said (silences 3.9's warning)
    return env


def _commands(dry: bool, out: str) -> dict:
    """Each step's command lines (a step runs them in turn), per mode."""
    device = "cpu" if dry else "cuda"
    size = "--tiny" if dry else "--small"
    bench_out = os.path.join(out, "benchmarks")
    pytest = _python("-m", "pytest", "-m", "gpu", "-x", "-q", "-p", "no:cacheprovider", *PYTEST_SUBSET)
    return {
        "smoke": [_python("-m", "benchmarks.gpu_smoke", "--device", device)],
        "pytest": [pytest],
        "examples": [_python("examples/train_mlp.py"),
                     _python("examples/train_gpt2.py", "--steps", "3", "--width", "32", "--layers", "1")],
        "launch": [] if dry else [_python("-m", "benchmarks.real_launch", "--json", os.path.join(out, "launch.json"))],
        "benchmarks": [_python("-m", "benchmarks", size, "--device", device, "--only",
                               "overhead_step" if dry else TRAINING_WORKLOADS, "--no-cold", "--rounds",
                               "1" if dry else "5", "--out", bench_out)],
        "attention": [] if dry else [_python("-m", "benchmarks", "--full", "--device", device, "--only",
                                             "attention_d64_t1024,transformer_step", "--no-cold", "--rounds", "5",
                                             "--out", os.path.join(out, "attention"))],
        "cold_compile": [_python("-m", "benchmarks.ahead_of_time", "--workload",
                                 "overhead_step" if dry else "transformer_step", "--size",
                                 "tiny" if dry else "full", "--workers", "1,2" if dry else f"1,{os.cpu_count() or 1}",
                                 "--json", os.path.join(out, "cold-compile.json"))],
        "sanitizer": [] if dry or not shutil.which("compute-sanitizer") else
        [["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3", *_python(
            "-m", "benchmarks.gpu_smoke", "--device", "cuda", "--only", SANITIZED)]],
    }


STEPS = [("smoke", 120), ("pytest", 150), ("examples", 90), ("launch", 45), ("benchmarks", 120),
         ("attention", 90), ("cold_compile", 60), ("sanitizer", 90)]


def _why_not_run(name: str, dry: bool) -> str:
    if name == "sanitizer":
        return "no GPU in a dry run" if dry else "compute-sanitizer is not on PATH"
    return "needs a GPU (a dry run checks the rest)"


def run_step(step: Step, commands: list, out: str, dry: bool, time_left: float) -> None:
    """Run ``commands`` in turn within ``step``'s time box (or what is left of the budget)."""
    if not commands:
        step.status, step.detail = "skipped", _why_not_run(step.name, dry)
        return
    box = min(step.seconds_max * (3 if dry else 1), time_left)
    if box < 10:
        step.status, step.detail = "skipped", "the budget is spent"
        return
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    step.log = os.path.join("logs", f"{step.name}.log")
    started = time.perf_counter()
    with open(os.path.join(out, step.log), "w") as log:
        for command in commands:
            remaining = box - (time.perf_counter() - started)
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            try:
                done = subprocess.run(command, cwd=ROOT, env=_env(dry), stdout=log, stderr=subprocess.STDOUT,
                                      timeout=max(1.0, remaining))
            except subprocess.TimeoutExpired:
                step.status, step.detail = "TIMEOUT", f"{' '.join(command[1:4])} passed its {box:.0f} s box"
                break
            except FileNotFoundError as e:
                step.status, step.detail = "FAILED", str(e)
                break
            if done.returncode != 0:
                step.status, step.detail = "FAILED", f"{' '.join(command[1:4])} exited {done.returncode}"
                break
        else:
            step.status = "passed"
    step.seconds = round(time.perf_counter() - started, 1)
    _summarize(step, out)


def _summarize(step: Step, out: str) -> None:
    """The step's result in a line, from its log (and its JSON, where it writes one)."""
    with open(os.path.join(out, step.log), errors="replace") as f:
        text = f.read()
    if step.name in ("smoke", "sanitizer"):
        checks = [json.loads(line) for line in text.splitlines() if line.startswith('{"check"')]
        step.data["checks"] = checks
        failed = [c["check"] for c in checks if not c["ok"]]
        step.detail = (f"{len(checks) - len(failed)}/{len(checks)} checks passed"
                       + (f"; failed: {', '.join(failed)}" if failed else "")
                       + (f"; {step.detail}" if step.detail else ""))
    elif step.name == "examples":
        step.detail = "; ".join(line.strip() for line in text.splitlines() if "final loss" in line) \
            + (f"; {step.detail}" if step.detail else "")
    elif step.name == "pytest":
        last = [line for line in text.splitlines() if " passed" in line or " failed" in line or " error" in line]
        step.detail = (last[-1].strip("= ") if last else "") + (f"; {step.detail}" if step.detail else "")
    for name in ("launch.json", "cold-compile.json"):
        path = os.path.join(out, name)
        if step.name == {"launch.json": "launch", "cold-compile.json": "cold_compile"}[name] and os.path.exists(path):
            with open(path) as f:
                step.data = json.load(f)
            if step.name == "launch":
                step.detail = ", ".join(f"{k} {v} µs" for k, v in step.data.items() if k.endswith("_us"))
            else:
                step.detail = ", ".join(f"{r['workers']} threads {r['seconds']} s" for r in step.data["runs"]) \
                    + f" ({step.data['runs'][0]['kernels']} kernels)"


def write_summary(out: str, environment: dict, steps: list, started: float, dry: bool) -> None:
    lines = [f"# GPU check{' (dry run on the CPU: Triton interpreter)' if dry else ''}", "",
             f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.perf_counter() - started:.0f} s so far. "
             "Command: `python -m benchmarks.gpu_check" + (" --dry-run" if dry else "") + "`.", "",
             "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in environment.items()]
    lines += ["", "| step | status | seconds | result |", "|---|---|---|---|"]
    lines += [f"| {s.name} | {s.status} | {s.seconds} | {s.detail.replace('|', '/')} |" for s in steps]
    for s in steps:
        checks = s.data.get("checks")
        if checks:
            lines += ["", f"## {s.name}", "", "| check | ok | seconds | detail |", "|---|---|---|---|"]
            lines += [f"| {c['check']} | {'yes' if c['ok'] else 'NO'} | {c['seconds']} | "
                      f"{c['detail'].splitlines()[0][:200].replace('|', '/')} |" for c in checks]
    lines += ["", "Logs: `logs/<step>.log`; the benchmark tables under `benchmarks/` and `attention/`."]
    with open(os.path.join(out, "gpu-check.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "gpu-check.json"), "w") as f:
        json.dump({"environment": environment, "steps": [asdict(s) for s in steps], "dry_run": dry}, f, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help=f"output folder (default: {os.path.relpath(DEFAULT_OUT, ROOT)}, or a new "
                                      "temporary folder for a dry run)")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for all steps (default 480)")
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the CPU, tiny sizes")
    parser.add_argument("--steps", help="comma-separated steps to run (default: all)")
    args = parser.parse_args(argv)
    out = args.out or (tempfile.mkdtemp(prefix="symgrad-gpu-check-") if args.dry_run else DEFAULT_OUT)
    os.makedirs(out, exist_ok=True)
    started = time.perf_counter()
    environment = _environment(args.dry_run)
    if not args.dry_run and not environment.get("gpu"):
        print("gpu_check: no CUDA device here; --dry-run runs the same steps on the CPU", file=sys.stderr)
        return 2
    wanted = set(args.steps.split(",")) if args.steps else None
    commands = _commands(args.dry_run, out)
    steps = [Step(name, seconds) for name, seconds in STEPS if wanted is None or name in wanted]
    write_summary(out, environment, steps, started, args.dry_run)
    for step in steps:
        print(f"gpu_check: {step.name} ...", file=sys.stderr, flush=True)
        budget_left = args.budget * (3 if args.dry_run else 1) - (time.perf_counter() - started)
        run_step(step, commands[step.name], out, args.dry_run, budget_left)
        print(f"gpu_check: {step.name}: {step.status} ({step.seconds} s) {step.detail}", file=sys.stderr, flush=True)
        write_summary(out, environment, steps, started, args.dry_run)
    print(f"gpu_check: summary in {os.path.join(out, 'gpu-check.md')}", file=sys.stderr)
    return 1 if any(s.status in ("FAILED", "TIMEOUT") for s in steps) else 0


if __name__ == "__main__":
    sys.exit(main())
