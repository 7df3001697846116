"""SYMGRAD_LOG / compiler.set_logs: each stage logged as it happens, guard failures with the
guard that failed and why the function records again; SYMGRAD_DUMP_DIR: every graph and
kernel written out with an index."""

import json
import logging

import pytest
import torch

import compiler
from compiler.report import logs


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def messages(self, stage):
        return [r.getMessage() for r in self.records if r.name == f"symgrad.{stage}"]


@pytest.fixture
def collected():
    handler = _Collect()
    logging.getLogger("symgrad").addHandler(handler)
    try:
        yield handler
    finally:
        logging.getLogger("symgrad").removeHandler(handler)
        logs.set_logs()  # all off again


def _mlp_step():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)

    def step(x, scale):
        return (torch.nn.functional.gelu(lin(x)) * scale).softmax(-1).sum()
    return lin, compiler.compile(step, backend="interpret")


def test_each_stage_is_logged_with_what_it_made(collected):
    compiler.set_logs("graphs,backward", kernels=True, fallbacks=True)
    _, step = _mlp_step()
    x = torch.randn(4, 8, requires_grad=True)
    step(x, 2.0)
    report = step.last_entry.report
    assert len(collected.messages("graphs")) == 1 and "def forward(" in collected.messages("graphs")[0]
    assert "gelu" in collected.messages("graphs")[0]
    assert len(collected.messages("backward")) == 1 and "def backward(" in collected.messages("backward")[0]
    kernel_lines = collected.messages("kernels")
    assert len(kernel_lines) == len(report.kernels) >= 3
    for line, kernel in zip(kernel_lines, report.kernels):
        assert kernel.name in line and kernel.source in line
    assert any("gelu" in line and "softmax" in line for line in kernel_lines)  # the user ops it fused
    assert collected.messages("fallbacks") == []  # nothing ran eagerly
    assert collected.messages("guards") == []     # not asked for


@pytest.mark.allows_eager("a fallback's log line: what it tests")
def test_fallbacks_are_logged_with_their_reason(collected):
    compiler.set_logs("fallbacks")

    def f(x):
        return torch.cumprod(x.sin(), 0) * 2  # cumprod is not compiled: it runs eagerly
    compiler.compile(f, backend="interpret")(torch.randn(4))
    lines = collected.messages("fallbacks")
    assert lines and all("runs eagerly" in line for line in lines)


def test_a_failed_guard_says_which_and_why_it_records_again(collected):
    compiler.set_logs("guards", "recompiles")
    lin, step = _mlp_step()
    x = torch.randn(4, 8, requires_grad=True)
    step(x, 2.0), step(x, 2.0)
    recorded = collected.messages("guards")
    assert len(recorded) == 1 and "x: float32[4, 8] on cpu, requires grad" in recorded[0]
    assert "scale: any float (not specialized)" in recorded[0]   # (taken by the kernels at run time)
    assert collected.messages("recompiles") == ["step: recording (first call)"]

    step(torch.randn(6, 8, requires_grad=True), 2.0)
    assert "guard failed" in collected.messages("guards")[-2]
    assert "x: shape is [6, 8], recorded [4, 8]" in collected.messages("recompiles")[-1]

    step(x.detach(), 2.0)
    assert "x: requires_grad is False, recorded True" in collected.messages("recompiles")[-1]

    with torch.no_grad():
        step(x, 2.0)
    assert "grad mode is off; recorded with it on" in collected.messages("recompiles")[-1]

    lin.eval()
    step(x, 2.0)
    assert "Linear is in eval mode; recorded in train mode" in collected.messages("recompiles")[-1]
    lin.train()

    lin.weight = torch.nn.Parameter(torch.randn(8, 8))  # the recorded parameter is gone
    step(x, 2.0)
    assert "was freed: a parameter or closed-over tensor was replaced" in collected.messages("recompiles")[-1]
    assert step.stats["captures"] == len(collected.messages("recompiles")) == 6


@pytest.mark.allows_eager("a per-call guard failure's log line: what it tests")
def test_a_per_call_guard_failure_is_logged(collected):
    compiler.set_logs("guards")
    flag = {"double": True}

    def f(x):
        y = x.sin()
        return y * 2 if flag["double"] else y.cos()  # Python takes another path: the replay diverges
    compiled = compiler.compile(f, backend="interpret")
    x = torch.randn(4)
    compiled(x), compiled(x)
    flag["double"] = False
    torch.testing.assert_close(compiled(x), x.sin().cos())
    assert collected.messages("guards")[-1] == ("f: a per-call guard failed: called Tensor.cos where the recording "
                                                "has Tensor.mul; the rest of the call ran eagerly")
    compiled(x)  # twice in a row: the next call records the new path
    assert collected.messages("guards")[-1].endswith("(twice in a row: the next call records this path)")


def test_logs_are_off_unless_asked_for(collected):
    logs.set_logs()
    _, step = _mlp_step()
    x = torch.randn(4, 8)
    step(x, 2.0), step(torch.randn(5, 8), 2.0)
    assert collected.records == []


def test_unknown_stage_names_the_known_ones(monkeypatch):
    with pytest.raises(ValueError, match="graphs, backward, kernels, fallbacks, guards, recompiles"):
        compiler.set_logs("graph")
    monkeypatch.setenv("SYMGRAD_LOG", "all")
    try:
        logs.configure_from_environment()
        assert all(logs.enabled(stage) for stage in logs.STAGES)
    finally:
        logs.set_logs()
    assert not any(logs.enabled(stage) for stage in logs.STAGES)


def test_dump_dir_holds_every_graph_and_kernel_with_an_index(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMGRAD_DUMP_DIR", str(tmp_path))
    _, step = _mlp_step()
    step(torch.randn(4, 8, requires_grad=True), 2.0)
    step(torch.randn(6, 8, requires_grad=True), 2.0)  # new shapes: a second recording
    report = step.last_entry.report
    index = json.loads((tmp_path / "index.json").read_text())
    assert [e["function"].rsplit(".", 1)[-1] for e in index] == ["step", "step"]
    last = index[-1]
    folder = tmp_path / last["folder"]
    assert (folder / "region0.forward.txt").read_text().startswith("def forward(")
    assert "def backward(" in (folder / last["regions"][0]["backward"]).read_text()
    assert [k["name"] for k in last["kernels"]] == [k.name for k in report.kernels]
    for k in report.kernels:
        assert (folder / "kernels" / f"{k.name}.py").read_text() == k.source
    markdown = (tmp_path / "index.md").read_text()
    assert markdown.count("<locals>.step — ") == 2 and f"kernels/{report.kernels[0].name}.py" in markdown
    assert not list(tmp_path.rglob("*.tmp"))  # written whole, renamed into place


def test_turning_the_logs_off_gives_records_back_to_the_application():
    # (set_logs left the "symgrad" logger unpropagating after turning off: a later warning of
    # symgrad.cache reached no handler of the application's, nor pytest's caplog)
    root = logging.getLogger("symgrad")
    handlers = list(root.handlers)
    logs.set_logs("guards")
    assert root.propagate is False and len(root.handlers) == len(handlers) + 1
    logs.set_logs()
    assert root.propagate is True and root.handlers == handlers
