"""benchmarks/cpu_steps.py: the CPU step comparison (eager, ours with the default backend,
torch.compile) runs, times every backend, and says what ours ran."""

import json

import compiler  # noqa: F401  (first)
from benchmarks import cpu_steps


def test_cpu_steps_times_every_backend_and_reports_what_ours_ran(tmp_path, monkeypatch):
    monkeypatch.delenv("SYMGRAD_CPU_BACKEND", raising=False)   # (ours as users run it: backend="auto")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))   # (main sets its own otherwise)
    rows = cpu_steps.main(["--only", "readme_mlp", "--rounds", "1", "--out", str(tmp_path)])
    (row,) = rows
    assert row["workload"] == "readme_mlp" and row["ours_backend"] in ("cpp", "torch")
    assert row["ours_divergences"] == 0 and row["ours_fallbacks"] == []
    for backend in ("eager", "ours", "torch.compile"):
        assert row[backend]["ms"] > 0 and row[backend]["first_call_s"] >= 0
    # (the compiled backends' first calls record or compile: far longer than a step)
    assert min(row["ours"]["first_call_s"], row["torch.compile"]["first_call_s"]) * 1e3 > row["eager"]["ms"]
    assert row["eager"]["x_eager"] == 1.0
    assert json.loads((tmp_path / "cpu-steps.json").read_text()) == rows
    assert "| readme_mlp |" in (tmp_path / "cpu-steps.md").read_text()
