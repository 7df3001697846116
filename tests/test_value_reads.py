"""Reading a tensor's value into Python (``if mask.all():``, ``loss.item()``) is a graph break:
the region before compiles and ends with the value, only the read runs eagerly, what follows
compiles again. A bool read steers Python's branch, so replay checks it: a call whose bool
differs from the recording's must not run the other branch's compiled regions."""

from __future__ import annotations

import pytest
import torch

import compiler


def branchy(x, mask, w):
    y = x * 2
    if mask.all():
        z = y + 1
        w.add_(z)  # (the branches share their first call: the region after the read starts alike)
    else:
        z = y + 1
        w.sub_(z)
    return z * 3


def masks():
    full = torch.ones(4, dtype=torch.bool)
    partial = full.clone()
    partial[1] = False
    return full, partial


def run_both(compiled, x, mask, w):
    w_eager, w_compiled = w.clone(), w.clone()
    expected = branchy(x, mask, w_eager)
    got = compiled(x, mask, w_compiled)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(w_compiled, w_eager)


def test_a_bool_read_is_a_graph_break_not_a_fallback():
    x, w = torch.randn(4), torch.zeros(4)
    report = compiler.explain(branchy, x, masks()[0], w)
    assert report.fallbacks == [] and report.eager_calls == []
    assert len(report.graph_breaks) == 1
    assert report.graph_breaks[0].startswith("Tensor.__bool__ reads a tensor's value into Python at ")
    assert "test_value_reads.py" in report.graph_breaks[0]  # where, in the user's code
    assert "graph breaks:" in str(report)
    assert len(report.regions) == 2 and all(r.get("kernels") for r in report.regions)  # both sides compiled


def test_fullgraph_refuses_a_graph_break():
    compiled = compiler.compile(branchy, backend="interpret", fullgraph=True)
    with pytest.raises(compiler.CompileError, match="__bool__"):
        compiled(torch.randn(4), masks()[0], torch.zeros(4))


@pytest.mark.allows_eager("a value read into Python steers another path: the replay leaves its recording, what it "
                          "tests")
def test_a_different_bool_never_runs_the_other_branch():
    """Recorded with an all-true mask; then a mask with a False: the region after the read
    begins with the same call on both branches, so only the bool tells them apart (without the
    guard the region of the recorded branch ran whole and wrote w += z, then the replay saw
    w.sub_ and went on eagerly: w ended wrong)."""
    full, partial = masks()
    x, w = torch.randn(4), torch.randn(4)
    compiled = compiler.compile(branchy, backend="interpret")
    run_both(compiled, x, full, w)  # records
    run_both(compiled, x, full, w)  # replays
    run_both(compiled, x, partial, w)  # the other branch: diverges at the read, eagerly from there
    assert compiled.stats["divergences"] == 1


@pytest.mark.allows_eager("a value read into Python steers another path: the replay leaves its recording, what it "
                          "tests")
def test_both_branches_recorded_then_replayed_by_the_bool():
    full, partial = masks()
    x, w = torch.randn(4), torch.randn(4)
    compiled = compiler.compile(branchy, backend="interpret")
    for mask in (full, partial, partial):  # record, diverge (a new branch), record it
        run_both(compiled, x, mask, w)
    assert compiled.stats["captures"] == 2
    divergences, launches = compiled.stats["divergences"], compiled.stats["kernel_launches"]
    for mask in (full, partial, full, partial, partial, full):
        run_both(compiled, x, mask, w)
    assert compiled.stats["captures"] == 2 and compiled.stats["divergences"] == divergences
    assert compiled.stats["kernel_launches"] > launches


@pytest.mark.parametrize("read", [lambda y: torch.equal(y, y.clamp(min=0)), lambda y: bool((y > 0).all()),
                                  lambda y: torch.allclose(y, y.abs()), lambda y: 0 in (y > 0).long()],
                         ids=["equal", "bool", "allclose", "contains"])
@pytest.mark.allows_eager("a value read into Python steers another path: the replay leaves its recording, what it "
                          "tests")
def test_bool_reads_are_guarded(read):
    def f(x):
        y = x * 2
        if read(y):
            return y + 1
        return y - 1

    compiled = compiler.compile(f, backend="interpret")
    report = compiler.explain(f, torch.ones(3))
    assert report.fallbacks == [] and len(report.graph_breaks) == 1
    for x in (torch.ones(3), torch.ones(3), -torch.ones(3), -torch.ones(3), torch.ones(3), -torch.ones(3)):
        torch.testing.assert_close(compiled(x), f(x))
    assert compiled.stats["captures"] == 2


def test_a_number_read_that_steers_nothing_diverges_nowhere():
    """``loss.item()`` for a log line changes every call: a graph break, not a reason to leave
    the recording (the value is checked, but nothing after the read writes in place: what follows
    runs compiled)."""
    def step(x):
        y = (x * x).sum()
        value = y.item()
        return y * 2, value

    compiled = compiler.compile(step, backend="interpret")
    report = compiler.explain(step, torch.randn(5))
    assert report.fallbacks == [] and len(report.graph_breaks) == 1 and "Tensor.item" in report.graph_breaks[0]
    for i in range(4):
        x = torch.randn(5) + i
        got, value = compiled(x)
        expected, expected_value = step(x)
        torch.testing.assert_close(got, expected)
        assert value == pytest.approx(expected_value, rel=1e-6)
    assert compiled.stats["divergences"] == 0 and compiled.stats["captures"] == 1


# Number reads that steer Python's branch: each read kind, then the branch's in-place write. The
# branches start with the same call, so only the read value tells them apart (without the guard the
# recorded branch's region ran whole with its in-place write: -97 where eager gives -98).
NUMBER_READS = {
    "item": lambda t: t.sum().item() > 0,
    "float": lambda t: float(t.sum()) > 0,
    "int": lambda t: int(t.sum()) > 0,
    "tolist": lambda t: t.tolist()[0] > 0,
}


def _steered(read):
    def f(x, a):
        if read(x):
            b = a * 2
            b.add_(1)
        else:
            b = a * 2
            b.add_(-100)
        return b
    return f


@pytest.mark.parametrize("first", ["positive first", "negative first"])
@pytest.mark.parametrize("kind", sorted(NUMBER_READS))
@pytest.mark.allows_eager("a value read into Python steers another path: the replay leaves its recording, what it "
                          "tests")
def test_a_number_that_steers_a_branch_never_runs_the_other_branch(kind, first):
    f = _steered(NUMBER_READS[kind])
    compiled = compiler.compile(f, backend="interpret")
    a = torch.ones(3)
    signs = [1, 1, -1, -1, -1, 1, -1, 1, 1] if first == "positive first" else [-1, -1, 1, 1, 1, -1, 1, -1, -1]
    for sign in signs:
        x = sign * torch.ones(3)
        torch.testing.assert_close(compiled(x, a), f(x, a))
    assert compiled.stats["captures"] == 2  # one recording per branch, chosen by the read value afterwards


def test_a_number_read_then_an_in_place_write_that_does_not_depend_on_it():
    """A number read for a log line, then a region that writes in place: the value changes every
    call and steers nothing, so the calls after it match the recording (checked one by one, as
    the value could have steered them): no divergence, no new recording, eager's values."""
    def step(x, running):
        y = (x * x).sum()
        value = y.item()
        running.mul_(0.9).add_(y * 0.1)
        return y * 2, value

    compiled = compiler.compile(step, backend="interpret")
    running_c, running_e = torch.zeros(()), torch.zeros(())
    for i in range(5):
        x = torch.randn(5) + i
        got, value = compiled(x, running_c)
        expected, expected_value = step(x, running_e)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(running_c, running_e)
        assert value == pytest.approx(expected_value, rel=1e-6)
    assert compiled.stats["divergences"] == 0 and compiled.stats["captures"] == 1


@pytest.mark.allows_eager("a value read into Python steers another path: the replay leaves its recording, what it "
                          "tests")
def test_a_number_that_steers_a_constant_inside_a_writing_region():
    """The read value flows into an in-place op that is not the region's first call: the region
    must not run whole with the recorded constant."""
    def f(x, a):
        v = x.sum().item()
        b = a * 2
        b.add_(v)
        return b

    compiled = compiler.compile(f, backend="interpret")
    a = torch.ones(3)
    for x in (torch.ones(3), torch.ones(3), 2 * torch.ones(3), -torch.ones(3)):
        torch.testing.assert_close(compiled(x, a), f(x, a))
