"""The HTML report: regions, graphs, kernels with the user ops they fused and their sources,
fallbacks with their reasons — in one self-contained page."""

from html.parser import HTMLParser

import pytest
import torch

import compiler


class _Page(HTMLParser):
    """The page's text (entities decoded) and its tags, checked for balance."""

    VOID = {"meta", "br", "hr", "img", "input", "link"}

    def __init__(self, markup):
        super().__init__()
        self.text, self.stack, self.tags = [], [], []
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack.pop() == tag, f"unbalanced </{tag}>"

    def handle_data(self, data):
        self.text.append(data)


def _step():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)

    def step(x):
        y = torch.nn.functional.gelu(lin(x)).softmax(-1)
        if y.sum() > 0:  # Python reads a tensor's value: the call is split there (a graph break)
            y = y * 2
        return torch.cumprod(y, -1).sum()  # not compiled: a fallback with its reason
    return compiler.compile(step, backend="interpret")


@pytest.mark.allows_eager("the report lists a fallback: what it tests")
def test_report_of_a_compiled_function_shows_regions_kernels_fallbacks_and_sources(tmp_path):
    step = _step()
    step(torch.randn(4, 8, requires_grad=True))
    step(torch.randn(6, 8, requires_grad=True))  # a second recording
    path = compiler.report_html(step, str(tmp_path / "report.html"))
    page = _Page((tmp_path / "report.html").read_text())
    assert page.stack == [] and not [t for t, attrs in page.tags if t in ("script", "link") or "src" in attrs]
    text = "".join(page.text)
    assert path.endswith("report.html") and "Recording 0" in text and "Recording 1" in text
    reports = [entry.report for variants in step.cache.values() for entry in variants]
    assert len(reports) == 2
    for report in reports:
        assert report.fallbacks and report.graph_breaks  # cumprod, the value read
        for reason in report.fallbacks + report.graph_breaks:
            assert reason in text
        for kernel in report.kernels:
            assert kernel.name in text and kernel.source in text  # the source, unescaped by the parser
            assert f"fuses: {', '.join(kernel.op_names)}" in text
    assert "def forward(" in text and "def backward(" in text
    assert "x: float32[6, 8] on cpu, requires grad" in text  # the guards of a recording


def test_explain_save_and_clear_errors(tmp_path):
    report = compiler.explain(lambda x: (x.sin() * 2).sum(), torch.randn(4, requires_grad=True))
    report.save(str(tmp_path / "one.html"))
    text = "".join(_Page((tmp_path / "one.html").read_text()).text)
    assert all(k.source in text for k in report.kernels) and "none: everything captured runs" in text
    with pytest.raises(ValueError, match="no recording yet"):
        compiler.report_html(compiler.compile(lambda x: x + 1), str(tmp_path / "none.html"))
    with pytest.raises(TypeError, match="explain"):
        compiler.report_html(lambda x: x, str(tmp_path / "plain.html"))
