"""The device check (``python -m benchmarks.gpu_check``), in its dry run on the CPU: the whole dry run
is CI's (``.ci/run``); here one step, and what the summary says of a step that fails or runs long."""

import json
import os
import sys

import compiler  # noqa: F401  (first: Triton's interpreter)

from benchmarks import gpu_check


def test_the_smoke_step_of_the_dry_run_passes_and_is_summarized(tmp_path):
    assert gpu_check.main(["--dry-run", "--steps", "smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    step, = result["steps"]
    assert step["status"] == "passed" and result["dry_run"] is True
    checks = step["data"]["checks"]
    assert {c["check"] for c in checks} >= {"readme_function", "no_input_region", "adam_against_eager",
                                             "clip_grad_norm", "bf16_autocast", "dropout_and_manual_seed"}
    assert all(c["ok"] for c in checks), checks
    summary = (tmp_path / "gpu-check.md").read_text()
    assert "| smoke | passed |" in summary and "| readme_function | yes |" in summary


def test_a_failing_or_overlong_step_is_reported_and_the_next_still_runs(tmp_path):
    out = str(tmp_path)
    steps = [gpu_check.Step("examples", 60), gpu_check.Step("pytest", 60), gpu_check.Step("launch", 60)]
    gpu_check.run_step(steps[0], [[sys.executable, "-c", "import sys; print('final loss 1.0'); sys.exit(3)"]], out,
                       True, 100)
    gpu_check.run_step(steps[1], [[sys.executable, "-c", "import time; time.sleep(30)"]], out, True, 11)
    gpu_check.run_step(steps[2], [], out, True, 100)
    assert steps[0].status == "FAILED" and "exited 3" in steps[0].detail and "final loss 1.0" in steps[0].detail
    assert steps[1].status == "TIMEOUT" and 10 <= steps[1].seconds < 20
    assert steps[2].status == "skipped" and "GPU" in steps[2].detail
    gpu_check.write_summary(out, {"gpu": None}, steps, 0.0, True)
    assert os.path.exists(os.path.join(out, "gpu-check.md"))


def test_without_a_gpu_the_real_check_refuses_and_points_at_the_dry_run(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "--dry-run" in capsys.readouterr().err
