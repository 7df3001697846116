"""The benchmark harness: a tiny workload end to end (checked, timed, counted, cold and warm
compile in fresh processes, files written), and the pieces that decide what a result says."""

import csv
import os

import torch

import benchmarks
from benchmarks import fresh_process, measure, report
from benchmarks.__main__ import _checks_passed, _parser
from benchmarks.backends import INTERPRETER_CHECK
from benchmarks.harness import Result, default_size
from benchmarks.workloads import SIZES, WORKLOADS


def test_tiny_workload_runs_through_the_harness_and_writes_csv_table_and_plot(tmp_path, monkeypatch):
    # ours as a user gets it: backend="auto" (the test suite makes it the interpreter on CPU)
    monkeypatch.delenv("SYMGRAD_CPU_BACKEND", raising=False)
    out = benchmarks.run(size="tiny", only=["overhead_step"], backends=("eager", "ours"), device="cpu",
                         out_dir=str(tmp_path), progress=False)

    rows = {r.backend: r for r in out.results}
    assert list(rows) == ["eager", "ours", INTERPRETER_CHECK]
    assert all(r.status == "ok" for r in out.results), [(r.backend, r.detail) for r in out.results]
    eager, ours, checked = rows["eager"], rows["ours"], rows[INTERPRETER_CHECK]
    assert eager.step_ms > 0 and eager.kernels_per_step > 0 and eager.timing == "wall clock"
    assert eager.speedup_vs_eager == 1.0
    # ours on CPU: the default backend (a CPU path), timed as eager is and compared
    assert not ours.ran.startswith("interpret") and "eager" not in ours.ran, ours.ran
    assert ours.timing == "wall clock" and ours.step_ms > 0 and ours.speedup_vs_eager > 0
    assert ours.fused_kernels > 0 and ours.bytes_moved > 0 and ours.fallbacks == []
    assert ours.kernels_per_step > ours.fused_kernels  # plus matmuls and the eager optimizer update
    assert ours.stubbed_ms > 0
    assert ours.compile_cold_s is not None and ours.compile_warm_s is not None, ours.detail
    # our Triton kernels: checked in the interpreter, never timed
    assert checked.ran == "interpret" and checked.max_err < 1e-3 and checked.timing == report.CHECK_ONLY
    assert checked.step_ms is None and checked.speedup_vs_eager is None and checked.compile_cold_s is None

    assert sorted(os.listdir(tmp_path)) == ["cpu-tiny.csv", "cpu-tiny.md", "cpu-tiny.png"]
    text = (tmp_path / "cpu-tiny.csv").read_text()
    assert f"# torch: {torch.__version__}" in text
    table = list(csv.DictReader(line for line in text.splitlines() if not line.startswith("#")))
    assert [r["backend"] for r in table] == ["eager", "ours", INTERPRETER_CHECK]
    assert table[1]["status"] == "ok" and int(table[1]["fused_kernels"]) == ours.fused_kernels
    md = (tmp_path / "cpu-tiny.md").read_text()
    assert f"| torch | {torch.__version__} |" in md and "| `overhead_step` | eager | ok" in md
    assert f"|  | {INTERPRETER_CHECK} | ok (" in md and "1 of 1 passed" in md
    assert "†" not in md and "fixed per-call costs" in md  # a real time; at tiny size, overhead-bound
    assert (tmp_path / "cpu-tiny.png").read_bytes()[:4] == b"\x89PNG"


def test_every_workload_has_a_cpu_size_and_it_is_the_default_without_a_gpu():
    assert "cpu" in SIZES and all(set(w.sizes) == set(SIZES) for w in WORKLOADS.values())
    assert _parser().parse_args(["--cpu"]).size == "cpu" and _parser().parse_args([]).size is None
    assert default_size(torch.device("cpu")) == "cpu" and default_size(torch.device("cuda")) == "full"


def test_a_failed_interpreter_check_is_a_failed_run(capsys):
    passed = _result(INTERPRETER_CHECK, timing=report.CHECK_ONLY, ran="interpret", step_ms=None)
    failed = _result(INTERPRETER_CHECK, workload="gelu", status="mismatch", max_err=0.5, ran="interpret",
                     timing=report.CHECK_ONLY, step_ms=None, detail="max error 5.00e-01 > tolerance 0.001")
    assert _checks_passed([_result("ours"), passed]) == 0
    assert _checks_passed([passed, failed]) == 1
    assert "FAILED: gelu" in capsys.readouterr().err
    md = report.markdown([_result("eager"), _result("ours", ran="torch"), passed, failed], {}, "cpu-cpu", "cpu")
    assert "1 of 2 passed" in md and "**MISMATCH** (5e-01)" in md and "†" not in md


def _result(backend, **fields):
    defaults = dict(workload="layernorm", group=2, shape="x 8x64", backend=backend, device="cpu", status="ok",
                    max_err=1e-7, step_ms=1.0, step_p20_ms=0.9, step_p80_ms=1.1, timing="wall clock")
    return Result(**{**defaults, **fields})


def test_report_shows_fallbacks_failures_and_the_interpreter_label():
    results = [
        _result("eager", speedup_vs_eager=1.0),
        _result("torch.compile", status="error", detail="warm-up: RuntimeError: boom", step_ms=None),
        _result("ours", ran="interpret", timing=report.INTERPRETER, fused_kernels=0, regions=0,
                fallbacks=["layer_norm is not supported by the compiler yet"]),
        _result("eager", workload="gelu"),
        _result("ours", workload="gelu", status="mismatch", max_err=0.5, detail="max error 5.00e-01 > tolerance"),
    ]
    md = report.markdown(results, {"device": "cpu"}, "cpu-tiny", "tiny")
    assert "  - layer_norm is not supported by the compiler yet" in md
    assert "**ERROR**" in md and "warm-up: RuntimeError: boom" in md
    assert "**MISMATCH** (5e-01)" in md
    assert "1 (0.9–1.1) †" in md and report.INTERPRETER in md


def test_max_error_is_relative_to_scale_and_flags_nan_and_shape():
    ref = [torch.tensor([1000.0, -2000.0], dtype=torch.float64)]
    assert measure.max_error([torch.tensor([1000.0, -2000.1])], ref) < 1e-4
    assert measure.max_error([torch.tensor([1000.0, -1000.0])], ref) == 0.5
    assert measure.max_error([torch.tensor([float("nan"), -2000.0])], ref) == float("inf")
    assert measure.max_error([torch.tensor([1000.0])], ref) == float("inf")


def test_kernel_count_on_cpu_counts_compute_ops_not_views():
    x = torch.randn(8, 8)

    def step():
        return (x.t().reshape(64) * 2).sum()  # t and reshape of a copy: views; mul and sum: kernels
    assert measure.count_kernels(step, torch.device("cpu")) == 3  # reshape of a transposed x copies


def test_fresh_processes_see_their_own_environment_and_report_failures(tmp_path):
    log = str(tmp_path / "log")
    for fork in (False, True):  # a subprocess (GPU machines), a fork of a clean server (CPU)
        seen = fresh_process.call("os:getenv", "SYMGRAD_CACHE_DIR", {"SYMGRAD_CACHE_DIR": str(tmp_path)}, log,
                                  timeout=300, fork=fork)
        assert seen == str(tmp_path)
    request = {"workload": "gelu", "backend": "ours", "size": "tiny", "device": "cpu"}
    assert fresh_process.call("benchmarks.compile_time:probe", request, {}, log, timeout=300)["compile_s"] > 0
    failed = fresh_process.call("benchmarks.compile_time:probe", {**request, "workload": "nope"}, {}, log,
                                timeout=300, fork=True)
    assert failed["error"].startswith("KeyError")


def test_torch_compiles_triton_path_is_counted_without_a_gpu():
    """``benchmarks.inductor_triton``: Inductor's Triton scheduling on CPU tensors, kernels counted
    and not run (a process of its own). Layer norm forward and backward: one persistent reduction
    forward, the input's and the weights' gradients in two backward kernels, no other operator;
    cross entropy's loss seed (``ones_like``) is an operator of the step."""
    from benchmarks import inductor_triton

    norm, loss = inductor_triton.counts(["layernorm", "cross_entropy"], "tiny")
    assert "error" not in norm and "error" not in loss, (norm, loss)
    assert norm["kernels"] == norm["triton"] == 3 and norm["operators"] == {}
    assert loss["operators"] == {"aten::ones_like": 1} and loss["kernels"] == loss["triton"] + 1 >= 2


def test_views_are_not_counted_as_kernels():
    """A transpose written ``.mT`` (as our generated calls write a matmul operand's) is a view: the
    step below launches one kernel, the matmul, however its operand's transpose is spelled."""
    x = torch.randn(8, 8)
    for step in (lambda: x.mT @ x, lambda: x.t() @ x, lambda: x.permute(1, 0) @ x):
        assert measure.count_kernels(step, torch.device("cpu")) == 1


def test_step_memory_counts_the_steps_own_blocks_whatever_ran_before():
    """A step's saved-for-backward and peak bytes are its own allocations': a block an earlier
    profiled step allocated and this one frees (the previous step's saved tensors) is not
    subtracted (it was, and the table showed a negative saved-for-backward figure)."""
    cpu = torch.device("cpu")
    kept = {}

    def step():
        kept.pop("last", None)  # frees what the previous (profiled) step kept
        x = torch.randn(64, 1024, requires_grad=True)  # 256 KiB
        y = x.exp()  # exp saves its result: 256 KiB more when backward starts
        kept["last"] = (x, y)
        y.sum().backward()

    first, second = measure.step_memory(step, cpu), measure.step_memory(step, cpu)
    for m in (first, second):
        assert m.saved >= 2 * 256 * 1024, m
        assert m.peak >= m.saved
    assert second.saved == first.saved


def test_attention_saved_bytes_counts_what_autograd_keeps():
    """``benchmarks.attention_saved`` (issue 34's measure): eager's causal SDPA on CPU saves q, k, v,
    the output and the row logsumexp, nothing T x T; nanoGPT's explicit path saves T x T tensors (the
    weights); a replay of ours is measured through the same hooks, on both CPU paths, and keeps no
    T x T tensor: the written-out pattern is flash attention too."""
    from benchmarks import attention_saved

    T = 16
    fn, args = attention_saved.forms(T)["sdpa causal (nanoGPT)"]
    eager = attention_saved.measure(fn, args, T, None)
    q_bytes = attention_saved.BATCH * 2 * T * attention_saved.HEAD_DIM * 4
    eager_sdpa_bytes = 4 * q_bytes + attention_saved.BATCH * 2 * T * 4
    assert eager == {"bytes": eager_sdpa_bytes, "square": 0, "replayed": False, "kernels": 0}
    fn, args = attention_saved.forms(T)["explicit (nanoGPT non-flash)"]
    assert attention_saved.measure(fn, args, T, None)["square"] >= 1
    for backend in ("interpret", "torch"):
        ours = attention_saved.measure(fn, args, T, backend)
        assert ours["replayed"] and ours["bytes"] == eager_sdpa_bytes and ours["square"] == 0, ours
        # the flash forward, dQ and dK/dV kernels (the CPU path: PyTorch's own kernel)
        assert ours["kernels"] == (3 if backend == "interpret" else 0)
    rows = attention_saved.run([T], backends=("torch",))
    assert len(rows) == len(attention_saved.forms(T)) and "sdpa boolean mask" in attention_saved.table(rows, ("torch",))


def test_the_ahead_of_time_benchmark_compiles_a_steps_kernels_for_hopper_with_each_pool(tmp_path):
    from benchmarks import ahead_of_time

    path = tmp_path / "aot.json"
    result = ahead_of_time.main(["--workload", "overhead_step", "--size", "tiny", "--workers", "1,2",
                                 "--json", str(path)])
    runs = result["runs"]
    assert [r["workers"] for r in runs] == [1, 2] and runs[0]["kernels"] == runs[1]["kernels"] >= 4
    assert all(r["seconds"] > 0 for r in runs) and path.exists()


def test_the_cpu_kernels_benchmark_times_each_backend_side_by_side(tmp_path, monkeypatch):
    from benchmarks import cpu_kernels
    from runtime import cpp_build

    if not cpp_build.available()[0]:
        import pytest
        pytest.skip("no C++ compiler")
    monkeypatch.setattr(cpu_kernels, "N", 64)
    monkeypatch.setattr(cpu_kernels, "D", 32)
    monkeypatch.setattr(cpu_kernels, "ROUNDS", 2)
    results = cpu_kernels.main(["--only", "rmsnorm,softmax", "--out", str(tmp_path)])
    assert set(results) == {"rmsnorm", "softmax"}
    assert all(set(row) == {"eager", "ours (cpp)", "ours (torch path)", "torch.compile"} and min(row.values()) > 0
               for row in results.values())
    table = (tmp_path / "cpu-kernels.md").read_text()
    assert "| rmsnorm | " in table and "(1.00×)" in table


def test_the_interpreter_check_runs_our_kernels_whatever_recordings_are_stored(monkeypatch):
    """transformer_step and the explicit one call one step function on models of one class (the
    ``explicit`` flag is no tensor): a recording stored by the first has the second's key, and its
    replays would leave it until the third call recorded again, eagerly, checking no kernel."""
    import compiler
    from benchmarks import interpreter_check
    from compiler.reuse.recordings import ENV

    monkeypatch.setenv(ENV, "1")
    cpu = torch.device("cpu")
    case = WORKLOADS["transformer_step"].build("tiny", cpu)
    run, args = compiler.compile(case.fn, backend="interpret"), case.make_args(torch.float32)
    for _ in range(2):  # records, and stores the recording
        case.step(run, args)
    checked = interpreter_check.check(WORKLOADS["transformer_explicit_step"], cpu)
    assert checked.ran == "interpret" and checked.max_err < 1e-3, checked
