"""Running workloads × backends: ``run`` is the Python API behind ``python -m benchmarks``.

For each workload, in this order: a float64 eager reference; for each backend a fresh
wrapper, its warm-up steps, the check against the reference, kernels per step and peak
memory; our compiler's report (fused kernels, bytes moved, fallbacks) and our step with
Triton launches skipped; all backends timed in interleaved rounds; each compiled backend's
cold and warm compile time in fresh processes; last, without a GPU, our Triton kernels
checked in Triton's interpreter at ``tiny`` size (a row of its own, not timed:
``benchmarks.interpreter_check``). A backend that fails is a result (status ``error``, with
the reason), never a crash of the run.

>>> import tempfile
>>> out = run(size="tiny", only=["gelu"], backends=("eager",), cold=False, progress=False,
...           out_dir=tempfile.mkdtemp())
>>> [(r.workload, r.backend, r.status) for r in out.results]
[('gelu', 'eager', 'ok')]
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import traceback
from dataclasses import dataclass, field

import compiler
import torch

from benchmarks import compile_time, interpreter_check, measure, report
from benchmarks.backends import (DEFAULT, EAGER, GPU_PROGRAM_BACKEND, INTERPRETER_CHECK, OURS, TORCH_COMPILE, prepare,
                                 ran_eagerly, reset, what_ran)
from benchmarks.environment import describe, device_kind
from benchmarks.progress import Progress
from benchmarks.report import CHECK_ONLY, INTERPRETER
from benchmarks.workloads import WORKLOADS

# The committed results (written only when asked: ``--out benchmarks/results``), and where a run writes by
# default: ``benchmarks/out/``, git-ignored, so that a run does not overwrite the committed tables.
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
# Relative to each tensor's scale (see measure.max_error); float32 sits near 1e-7..1e-5 here.
TOLERANCE = 1e-3


@dataclass
class Result:
    """One workload on one backend: a row of the CSV. ``None`` is "not measured" (n/a)."""
    workload: str
    group: int
    shape: str
    backend: str
    device: str
    status: str = "not run"          # ok | mismatch | error
    detail: str = ""                 # the error, or why a number is missing
    ran: str = ""                    # what the checked call ran (ours: interpret, triton, eager, ...)
    max_err: float | None = None     # vs the float64 reference, relative to each tensor's scale
    step_ms: float | None = None     # median
    step_p20_ms: float | None = None
    step_p80_ms: float | None = None
    wall_ms: float | None = None     # per step over a synchronized round
    iterations: int | None = None
    timing: str = ""                 # cuda events | wall clock | interpreter, not a speed measurement | CHECK_ONLY
    speedup_vs_eager: float | None = None
    speedup_vs_torch_compile: float | None = None
    compile_cold_s: float | None = None
    compile_warm_s: float | None = None
    kernels_per_step: int | None = None
    fused_kernels: int | None = None     # ours: len(explain(...).kernels)
    regions: int | None = None           # ours: compiled regions (graph pieces between eager ops)
    bytes_moved: int | None = None       # ours: sum of bytes_moved over our kernels, per step
    gbps: float | None = None            # ours on GPU: bytes_moved / step time
    copy_bw_fraction: float | None = None
    tflops: float | None = None          # matmul-bound workloads
    peak_mem_mb: float | None = None     # peak allocated during a step, above what was before it (measure.step_memory)
    mem_ratio_vs_eager: float | None = None   # eager's peak / this backend's
    saved_mb: float | None = None        # allocated when backward starts, above the step's start: kept for backward
    saved_ratio_vs_eager: float | None = None  # eager's saved / this backend's
    stubbed_ms: float | None = None      # ours: step with Triton launches skipped (host overhead + rest)
    launch_us: float | None = None       # ours: host µs per launch up to the driver call (benchmarks/launch.py)
    fallbacks: list = field(default_factory=list)  # ours: explain(...).fallbacks


@dataclass
class Run:
    results: list
    environment: dict
    files: list = field(default_factory=list)


def run(size=None, only=None, backends=DEFAULT, device=None, out_dir=OUT, cold=True,
        progress=True, rounds=None, tag=None) -> Run:
    """Benchmark workloads × backends and write ``<tag>.csv``, ``.md`` and ``.png`` to ``out_dir``.

    ``size``: "full" (the default on a GPU), "cpu" (the default on CPU), "small" or "tiny";
    ``only``: workload names (default all); ``cold``: measure cold and warm compile times in
    fresh processes; ``rounds``: timing rounds per backend. On CPU, with ``ours`` among the
    backends, each workload also gets an ``ours (interpreter check)`` row. Returns the results
    and file paths.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size = size or default_size(device)
    names = list(only or WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    chosen = list(dict.fromkeys(backends))
    if EAGER not in chosen:  # speedups are ratios to eager
        chosen.insert(0, EAGER)

    environment = describe(device)
    compiled = [b for b in chosen if b != EAGER]
    checked = OURS in chosen and device.type == "cpu"  # our Triton kernels, in the interpreter
    per_workload = 2 + len(chosen) + (OURS in chosen) + checked + (2 * len(compiled) if cold else 0)
    bar = Progress(len(names) * per_workload + 1, enabled=progress)
    bar.start("copy bandwidth" if device.type == "cuda" else "starting")
    copy_bw = measure.copy_bandwidth(device)
    if copy_bw:
        environment["copy bandwidth"] = f"{copy_bw:.0f} GB/s (device-to-device copy, read + write)"
    bar.done()

    # Our fallbacks are reported in the results; the compiler's log lines would only break the bar.
    log = logging.getLogger("compiler")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        results = []
        for name in names:
            bench = _Workload(WORKLOADS[name], size, device, chosen, bar, per_workload)
            results.extend(bench.run(cold, rounds, copy_bw))
            if checked:
                results.append(_interpreter_check(WORKLOADS[name], device, bar))
    finally:
        log.setLevel(level)
    bar.start("writing results")
    files = report.write(results, environment, out_dir, tag or f"{device_kind(device)}-{size}", size)
    bar.close()
    return Run(results, environment, files)


def default_size(device: torch.device) -> str:
    """The sizes a run on ``device`` gets unless told: the GPU sizes, or the CPU's."""
    return "full" if device.type == "cuda" else "cpu"


class _Workload:
    """One workload on every backend: the phases of ``run``, each filling in its rows."""

    def __init__(self, workload, size, device, names, bar, bar_steps):
        self.workload, self.size, self.device, self.bar, self.bar_steps = workload, size, device, bar, bar_steps
        self.name = workload.name
        self.rows = {n: Result(self.name, workload.group, "", n, device.type) for n in names}
        self.steps = {}   # backend -> its warm, checked zero-argument step
        self.runs = {}    # backend -> the wrapper those steps call (what it ran is asked after timing)

    def run(self, cold, rounds, copy_bw):
        reset()
        self.bar.start(f"{self.name} · build, float64 reference")
        try:
            self.case = self.workload.build(self.size, self.device)
            reference = self._reference()
        except Exception as e:  # noqa: BLE001 — the workload itself is broken: every row says so
            for row in self.rows.values():
                _fail(row, e, self.bar, "reference")
            self.bar.done(self.bar_steps)  # nothing more runs for this workload
            return list(self.rows.values())
        for row in self.rows.values():
            row.shape = self.case.shape
        self.bar.done()

        for n, row in self.rows.items():
            self.bar.start(f"{self.name} · {n} · warm-up and check")
            try:
                self.steps[n] = self._check(n, row, reference)
            except Exception as e:  # noqa: BLE001 — a backend failing is a result, not a crash
                _fail(row, e, self.bar, "warm-up")
            self.bar.done()
        del reference

        if OURS in self.rows:
            self.bar.start(f"{self.name} · ours · explain, host overhead")
            if OURS in self.steps:
                self._ours_extras(self.rows[OURS])
            self.bar.done()

        self.bar.start(f"{self.name} · timing {', '.join(self.steps)}")
        self._time(rounds)
        self.bar.done()
        _derive(self.case, self.rows, self.device, copy_bw)

        self.steps.clear()  # free the workload's tensors before the compile-time processes
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        for n, row in self.rows.items():
            if n != EAGER and cold:
                self._compile_times(n, row)
        return list(self.rows.values())

    def _reference(self):
        case = self.case
        args = case.make_args(torch.float64)
        result = None
        for _ in range(compile_time.WARMUP):  # as many steps as the backends' checked step
            result = case.step(case.fn, args)
        return _clone(case.observe(args, result))

    def _check(self, name, row, reference):
        """Warm up a fresh wrapper, check its result, count its kernels and peak memory; return
        the zero-argument step that the timing rounds call."""
        case, device = self.case, self.device
        run = self.runs[name] = prepare(name, case.fn)
        args = case.make_args(torch.float32)
        _, ran, result = compile_time.warm_up(case, name, run, args, device)
        row.ran = ran[-1]
        row.max_err = measure.max_error(_clone(case.observe(args, result)), reference)
        _judge(row)

        def step():
            return case.step(run, args)
        if not (name == OURS and device.type == "cpu"):  # ours on CPU: its GPU program's, in _ours_extras
            with _noted(row, "kernel count"):
                row.kernels_per_step = measure.count_kernels(step, device, python_calls=name.startswith(TORCH_COMPILE))
        with _noted(row, "memory"):
            memory = measure.step_memory(step, device)
            row.peak_mem_mb = memory.peak / 2**20
            row.saved_mb = memory.saved / 2**20
        return step

    def _ours_extras(self, row):
        """What our compiler reports for its GPU program (fused kernels, bytes moved, regions,
        fallbacks), and that program's step with Triton launches skipped: its time, and on CPU its
        kernels per step (the launches plus the operators between them, as a GPU would run them)."""
        case, device = self.case, self.device
        with _noted(row, "explain"):
            # (built for the GPU program, on CPU in the interpreter: a plain explain would build for the
            # CPU path, whose programs save pointwise values as eager does and launch no Triton kernels)
            explained = compiler.explain(compiler.compile(case.fn, backend=GPU_PROGRAM_BACKEND),
                                         *case.fn_args(case.make_args(torch.float32)))
            row.fused_kernels = len(explained.kernels)
            row.bytes_moved = sum(k.bytes_moved for k in explained.kernels)
            row.regions = len(explained.regions)
            row.fallbacks = list(explained.fallbacks)
        from benchmarks import launch  # (here: ``python -m benchmarks.launch`` imports this package first)

        launches = []
        with _noted(row, "launches skipped"):
            # A separate wrapper on throwaway arguments: stubbed steps compute garbage.
            run = compiler.compile(case.fn, backend=GPU_PROGRAM_BACKEND)
            args = case.make_args(torch.float32)
            case.step(run, args)  # the recording call runs eagerly, for real
            with measure.kernels_stubbed():

                def step():
                    return case.step(run, args)
                with launch.recorded() as launches:
                    step()
                row.stubbed_ms = measure.interleaved({"stub": step}, device, rounds=3)["stub"].median_ms
                if device.type == "cpu" and row.fused_kernels is not None:
                    row.kernels_per_step = measure.count_kernels(step, device) + row.fused_kernels
        with _noted(row, "launch path"):
            if launches:  # timed on the compiled-Triton path, without a GPU (benchmarks/launch.py)
                row.launch_us = launch.mean_us(launch.measure_launches(launches))

    def _time(self, rounds):
        fast = {n: s for n, s in self.steps.items() if not _interpreted(self.rows[n])}
        while fast:
            try:
                timings = measure.interleaved({n: _named(n, s) for n, s in fast.items()}, self.device,
                                              rounds=rounds or (10 if self.device.type == "cuda" else 5))
            except _StepFailed as e:  # drop the backend that failed, time the others again
                _fail(self.rows[e.backend], e.__cause__, self.bar, "timing")
                del fast[e.backend]
                continue
            for n, t in timings.items():
                _store_timing(self.rows[n], t)
                _note_eager_run(self.rows[n], what_ran(n, self.runs[n]))
            break
        for n, s in self.steps.items():
            if _interpreted(self.rows[n]):  # a few steps only: the interpreter is slow
                with _noted(self.rows[n], "timing"):
                    _store_timing(self.rows[n], measure.few(s, self.device, 2, INTERPRETER))

    def _compile_times(self, name, row):
        if row.status == "error":
            self.bar.done(2)
            return
        started = []

        def on_start(which):
            if started:  # the cold process has finished
                self.bar.done()
            started.append(which)
            self.bar.start(f"{self.name} · {name} · {which} compile (fresh process)")
        try:
            row.compile_cold_s, row.compile_warm_s = compile_time.cold_and_warm(
                self.name, name, self.size, self.device, on_start)
        except compile_time.ProbeError as e:
            _note(row, f"compile time: {e}", self.bar)
        self.bar.done(2 - max(0, len(started) - 1))  # two steps per backend, however far it got


def _interpreter_check(workload, device, bar) -> Result:
    """Our Triton kernels in Triton's interpreter at ``tiny`` size against float64 eager: a row
    that says whether they passed and their error, never a time (``benchmarks.interpreter_check``)."""
    row = Result(workload.name, workload.group, "", INTERPRETER_CHECK, device.type, timing=CHECK_ONLY)
    bar.start(f"{workload.name} · {INTERPRETER_CHECK} at {interpreter_check.SIZE} size")
    try:
        checked = interpreter_check.check(workload, device)
    except Exception as e:  # noqa: BLE001 — a failed check is a result, not a crash
        _fail(row, e, bar, "interpreter check")
    else:
        row.shape, row.ran, row.max_err = checked.shape, checked.ran, checked.max_err
        _judge(row)
        if row.status != "ok":
            bar.note(f"{row.workload} · {INTERPRETER_CHECK} FAILED: {row.detail}")
        if not row.ran.startswith("interpret"):
            _note(row, f"the checked call ran {row.ran}: no kernel of ours was checked", bar)
    bar.done()
    return row


def _judge(row):
    """A checked row's status from its error against the float64 reference."""
    row.status = "ok" if row.max_err <= TOLERANCE else "mismatch"
    if row.status == "mismatch":
        row.detail = f"max error {row.max_err:.2e} > tolerance {TOLERANCE:g} (relative to scale)"


def _note_eager_run(row, what):
    # The "ran" column says what the checked call ran; a timed call that ran eagerly (its replay left
    # the recording) would make the time partly eager's: said next to the number.
    if ran_eagerly(row.backend, what):
        _note(row, f"the last timed call ran {what}: the step time is partly eager's")


class _StepFailed(Exception):
    def __init__(self, backend):
        super().__init__(backend)
        self.backend = backend


def _named(backend, step):
    def named():
        try:
            return step()
        except Exception as e:
            raise _StepFailed(backend) from e
    return named


def _store_timing(row, t):
    row.step_ms, row.step_p20_ms, row.step_p80_ms = t.median_ms, t.p20_ms, t.p80_ms
    row.wall_ms, row.iterations, row.timing = t.wall_ms, t.iterations, t.method


def _derive(case, rows, device, copy_bw):
    """Ratios and rates from the measured numbers; only between correct, real timings."""
    def speed(n):
        r = rows.get(n)
        return r.step_ms if r and r.status == "ok" and r.step_ms and r.timing != INTERPRETER else None
    eager_ms, compile_ms = speed(EAGER), speed(TORCH_COMPILE)
    eager_peak = rows[EAGER].peak_mem_mb if EAGER in rows else None
    eager_saved = rows[EAGER].saved_mb if EAGER in rows else None
    for n, row in rows.items():
        ms = speed(n)
        if ms:
            row.speedup_vs_eager = eager_ms / ms if eager_ms else None
            row.speedup_vs_torch_compile = compile_ms / ms if compile_ms else None
            if case.flops:
                row.tflops = case.flops / (ms * 1e-3) / 1e12
            if row.bytes_moved and device.type == "cuda":
                row.gbps = row.bytes_moved / (ms * 1e-3) / 1e9
                row.copy_bw_fraction = row.gbps / copy_bw if copy_bw else None
        if eager_peak and row.peak_mem_mb:
            row.mem_ratio_vs_eager = eager_peak / row.peak_mem_mb
        if eager_saved and row.saved_mb:
            row.saved_ratio_vs_eager = eager_saved / row.saved_mb


def _in_interpreter(row) -> bool:
    return row.backend == OURS and row.ran.startswith("interpret")


def _interpreted(row) -> bool:
    """Ours with kernels in Triton's interpreter: not a speed measurement. (Where everything
    fell back to eager no kernel runs there, and the step is timed as usual.)"""
    return _in_interpreter(row) and row.fused_kernels != 0


def _clone(tensors):
    return [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in tensors]


def _fail(row, error, bar, when):
    row.status = "error"
    row.detail = f"{when}: {type(error).__name__}: {_first_line(error)}"[:400]
    tb = traceback.format_exception(type(error), error, error.__traceback__)
    bar.note(f"{row.workload} · {row.backend} failed ({when}):\n" + "".join(tb[-6:]).rstrip())


def _note(row, text, bar=None):
    row.detail = "; ".join(filter(None, [row.detail, text]))
    if bar is not None:
        bar.note(f"{row.workload} · {row.backend}: {text}")


@contextlib.contextmanager
def _noted(row, what):
    """A measurement that may fail without failing the row: its number stays n/a, and why."""
    try:
        yield
    except Exception as e:  # noqa: BLE001
        _note(row, f"{what} failed: {type(e).__name__}: {_first_line(e)}"[:300])


def _first_line(error):
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
