"""The README's commands are the ones CI runs, the examples run, every Python snippet of the README
runs as written (or, quoted from a source file, is still that file's code), and every op form its
"Known limits" names is still a limit: it falls back and ``explain`` says why (or, where the item
says a form compiles or runs as PyTorch's kernel between ours, it does not fall back)."""

import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import compiler
from runtime import backends

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def readme_commands():
    block = re.search(r"```bash\n(.*?)```", readme(), re.S).group(1)
    return [line.strip() for line in block.strip().splitlines()]


def test_readme_starts_with_two_commands_and_ci_runs_the_test_one():
    commands = readme_commands()
    assert len(commands) == 2
    assert "examples/train_mlp.py" in commands[0]
    assert "pytest" in commands[1]
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert commands[1] in ci.splitlines()


def test_example_trains_and_matches_eager():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)  # the example sets things up itself, as for a user
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_mlp.py"), "--steps", "8"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ran: interpret" in result.stdout
    assert "fallbacks: none" in result.stdout


def test_complex_filter_example_matches_eager():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "complex_filter.py"), "--steps", "6"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ran: interpret" in result.stdout and "fallbacks: none" in result.stdout


# -- the Python snippets ------------------------------------------------------------------------------
def python_snippets() -> list:
    """(line, code) of each ```python block of the README."""
    text = readme()
    return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


@dataclass
class Run:
    """Run as written, in this process (the suite's backend: Triton's interpreter on CPU), after
    ``prelude`` (what the README's text around it supplies), then ``check(namespace, printed)``: what
    its comments claim."""
    check: object
    prelude: str = ""


@dataclass
class Excerpt:
    """Code quoted from ``path``: each of its lines (comments and blank lines aside) is a line of the
    file, in order (the file may have more: docstrings)."""
    path: str


@dataclass
class Skip:
    """Not run here: one that needs a GPU or several processes. ``reason`` says which."""
    reason: str


def _check_first_example(ns, printed):
    f, x, y = ns["f"], ns["x"], ns["y"]
    assert "fallbacks: none" in printed and "kernels: 1 forward, 1 backward" in printed, printed
    launches = f.stats["kernel_launches"]
    loss = f(x, y)  # "later calls: one fused kernel"
    assert f.stats["kernel_launches"] == launches + 1
    loss.backward()  # "the backward: one fused kernel too"
    assert f.stats["kernel_launches"] == launches + 2
    assert f.last_backend == backends.auto_cpu_backend()  # (the suite's: SYMGRAD_CPU_BACKEND=interpret)


def _check_squareplus(ns, printed):
    squareplus, f = ns["squareplus"], ns["f"]
    assert ns["y"].grad_fn is not None  # "eager: a torch.autograd.Function"
    x = torch.randn(64, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    f(x)  # (its recording)
    launches = f.stats["kernel_launches"]
    loss = f(x)
    loss.backward()
    assert f.stats["kernel_launches"] == launches + 2  # "compiled: one kernel each way"
    eager = squareplus(torch.sin(x_eager), 2.0).sum()
    eager.backward()
    torch.testing.assert_close(loss, eager)
    torch.testing.assert_close(x.grad, x_eager.grad)


# "any compiled call": the README's text gives the snippet a compiled function that has recorded
_SM90_PRELUDE = """
import torch, compiler
step = compiler.compile(lambda x: (torch.sin(x) * x).sum())
x = torch.randn(4096)
step(x)  # (its recording: later calls launch the kernels)
"""


def _check_sm90(ns, printed):
    launches = ns["launches"]
    assert launches, "no launch recorded"
    for launch in launches:
        line = next(line for line in printed.splitlines() if line.startswith(launch.name))
        assert int(line.split()[-3]) > 0, line  # registers, from ptxas


# the training step and batches the numbers snippet names: its loss scale and temperature change every call
_NUMBERS_PRELUDE = """
import torch, compiler
import torch.nn.functional as F
torch.manual_seed(0)
model = torch.nn.Linear(6, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def train_step(x, y, temperature, loss_scale):
    opt.zero_grad()
    loss = F.cross_entropy(model(x) / temperature, y) * loss_scale
    loss.backward()
    opt.step()
    return loss.detach()
batches = [(torch.randn(5, 6), torch.randint(0, 3, (5,))) for _ in range(6)]
def scale(i):
    return 2.0 ** (i % 3)
"""


def _check_numbers(ns, printed):
    step = ns["step"]
    assert step.stats["captures"] == 1 and step.stats["divergences"] == 0, step.stats  # "one recording"
    assert step.stats["replays"] == 5 and step.stats["kernel_launches"] > 0, step.stats


# How each Python snippet is checked, by a line it contains.
SNIPPETS = {
    "first_example": ("def f(x, y):", Run(_check_first_example)),
    "squareplus": ("def squareplus(x, b=4.0):", Run(_check_squareplus)),
    "sm90_launches": ("with recorded_launches() as launches:", Run(_check_sm90, _SM90_PRELUDE)),
    "numbers": ("step(x, y, temperature=1 + 0.01 * i", Run(_check_numbers, _NUMBERS_PRELUDE)),
    "erfinv": ("class Erfinv(Builtin):", Excerpt("compiler/ir/ops/primitives/special.py")),
    "layer_norm_binding": ("def _layer_norm(", Excerpt("compiler/capture/bindings/norms.py")),
}


def test_every_python_snippet_is_checked():
    for line, code in python_snippets():
        keys = [name for name, (marker, _) in SNIPPETS.items() if marker in code]
        assert len(keys) == 1, (f"README.md:{line}: a Python snippet that tests/test_readme.py does not check "
                                f"(add it to SNIPPETS: Run, Excerpt, or Skip with the reason):\n{code}")


def _code_lines(text: str) -> list:
    lines = (re.sub(r"\s+#\s.*$", "", line).rstrip() for line in text.splitlines())
    return [line.strip() for line in lines if line.strip()]


@pytest.mark.parametrize("name", list(SNIPPETS))
def test_python_snippet(name, capsys):
    marker, how = SNIPPETS[name]
    found = [(line, code) for line, code in python_snippets() if marker in code]
    assert found, f"the README has no snippet with {marker!r} any more: remove {name!r} from SNIPPETS"
    line, code = found[0]
    if isinstance(how, Skip):
        pytest.skip(how.reason)
    if isinstance(how, Excerpt):
        with open(os.path.join(ROOT, how.path)) as f:
            source = iter(_code_lines(f.read()))
        for text in _code_lines(code):
            assert any(text == s for s in source), (f"README.md:{line} quotes {how.path}, which no longer has "
                                                    f"(there, after the lines before it): {text!r}")
        return
    ns = {"__name__": f"readme_snippet_{name}"}
    if how.prelude:
        exec(compile(how.prelude, f"<prelude of README.md:{line}>", "exec"), ns)
    exec(compile(code, f"README.md:{line}", "exec"), ns)
    printed = capsys.readouterr().out
    how.check(ns, printed)


def test_first_example_comment_names_what_auto_runs_on_cpu(monkeypatch):
    """The first example's tensors are CPU tensors: ``auto`` runs them as C++ kernels where a C++
    compiler works, else as PyTorch ops (the suite itself sets SYMGRAD_CPU_BACKEND=interpret)."""
    code = next(code for _, code in python_snippets() if SNIPPETS["first_example"][0] in code)
    assert "C++" in code and "PyTorch ops" in code and "Triton" in code
    monkeypatch.delenv(backends.CPU_BACKEND_ENV, raising=False)
    assert backends.auto_cpu_backend() in ("cpp", "torch")


# -- Known limits -------------------------------------------------------------------------------------
def _known_limits_section() -> str:
    return readme().split("## Known limits (today)", 1)[1].split("\n## ", 1)[0]


def known_limits() -> str:
    """The README's Known limits, whitespace joined."""
    return " ".join(_known_limits_section().split())


def limit_item(start: str) -> str:
    """The Known limits item that starts with ``start`` (whitespace joined)."""
    items = [" ".join(item.split()) for item in re.split(r"\n- ", _known_limits_section())]
    found = [item for item in items if item.startswith(start)]
    assert len(found) == 1, f"no Known limits item starts with {start!r}"
    return found[0]


def _x():
    return (torch.randn(6, 8, requires_grad=True),)


def _x_ints():
    return torch.randn(6, 8, requires_grad=True), torch.randint(0, 6, (8,))


def _z():
    return (torch.randn(8, dtype=torch.complex64, requires_grad=True),)


def _set_at(y, where, value):
    y[where] = value
    return y


@dataclass
class Form:
    phrase: str      # the README's words for it, in its Known limits (whitespace aside)
    fn: object
    args: object     # () -> the arguments
    says: str = ""   # falls back, and explain's reason says this; "" = compiles (no fallback)


FORMS = {
    # "Ops outside the catalog run eagerly, listed in explain(...).fallbacks: ..."
    "bool_mask_read": Form("`x[mask]`", lambda x: x[x > 0].sum(), _x, "boolean mask"),
    "bool_mask_write": Form("writing through one compiles", lambda x: _set_at(x * 2, x > 0, 0.0).sum(), _x),
    "bincount": Form("`bincount`", lambda x, i: x.sum() + torch.bincount(i).sum(), _x_ints, "torch.bincount"),
    "nonzero": Form("`nonzero`", lambda x: x.sum() + torch.nonzero(x > 0).sum(), _x, "torch.nonzero"),
    "int_and": Form("integer bit operations", lambda x, i: x.sum() + (i & 3).sum(), _x_ints, "bitwise and"),
    "int_shift": Form("integer bit operations", lambda x, i: x.sum() + (i << 1).sum(), _x_ints, "__lshift__"),
    "int_not": Form("integer bit operations", lambda x, i: x.sum() + (~i).sum(), _x_ints, "bitwise not"),
    "bernoulli": Form("`bernoulli`", lambda x: (torch.bernoulli(torch.sigmoid(x)) * x).sum(), _x,
                      "torch.bernoulli"),
    "multinomial": Form("`multinomial`", lambda x: x.sum() + torch.multinomial(x.detach().exp(), 2).sum(), _x,
                        "torch.multinomial"),
    "channel_dropout": Form("channel and alpha dropout", lambda x: F.dropout2d(x[None, :, :, None], 0.5).sum(), _x,
                            "channel and alpha dropout"),
    "alpha_dropout": Form("channel and alpha dropout", lambda x: F.alpha_dropout(x, 0.5, training=True).sum(), _x,
                          "channel and alpha dropout"),
    "random_factories": Form("`rand`/`randn` are made eagerly, as other factories, with no fallback",
                             lambda x: (x * torch.rand(6, 8) + torch.randn(6, 8)).sum(), _x),
    "repeat_interleave": Form("`repeat_interleave` with tensor repeats",
                              lambda x, i: torch.repeat_interleave(x, i[:6].clamp(0, 3), dim=0).sum(), _x_ints,
                              "repeat_interleave with tensor repeats"),
    "histc_no_range": Form("`histc` without a range", lambda x: x.sum() + torch.histc(x.detach(), 4).sum(), _x,
                           "histc with min == max"),
    "cumprod": Form("cumulative ops other than `cumsum`", lambda x: torch.cumprod(x, 1).sum(), _x, "torch.cumprod"),
    "cummax": Form("cumulative ops other than `cumsum`", lambda x: torch.cummax(x, 1).values.sum(), _x,
                   "torch.cummax"),
    "logcumsumexp": Form("cumulative ops other than `cumsum`", lambda x: torch.logcumsumexp(x, 1).sum(), _x,
                         "torch.logcumsumexp"),
    # "Ordering and routing ops ... run as PyTorch's kernels between ours": compiled, no fallback
    "topk": Form("`topk`", lambda x: x.topk(3, 1).values.sum(), _x),
    "sort": Form("`sort`/`argsort`", lambda x: x.sort(1).values.sum(), _x),
    "argsort": Form("`sort`/`argsort`", lambda x: (x * x.argsort(1)).sum(), _x),
    "cumsum": Form("`cumsum`", lambda x: torch.cumsum(x, 1).sum(), _x),
    "histc_range": Form("`histc` with a range", lambda x: x.sum() + torch.histc(x.detach(), 4, min=-3, max=3).sum(),
                        _x),
    "grouped_mm": Form("`torch._grouped_mm`", lambda a, b, offs: torch._grouped_mm(a, b, offs=offs).float().sum(),
                       lambda: (torch.randn(16, 8, dtype=torch.bfloat16, requires_grad=True),
                                torch.randn(2, 8, 8, dtype=torch.bfloat16, requires_grad=True),
                                torch.tensor([8, 16], dtype=torch.int32))),
    "index_write": Form("`x[idx] = v`", lambda x, i: _set_at(x * 2, i[:3], 1.0).sum(), _x_ints),
    "index_put": Form("`index_put`", lambda x, i: x.index_put((i[:3],), torch.ones(3, 8)).sum(), _x_ints),
    "scatter": Form("`scatter`", lambda x, i: x.scatter(0, i[None], 0.0).sum(), _x_ints),
    "scatter_add": Form("`scatter_add`", lambda x, i: torch.zeros(6, 8).scatter_add(0, i[None], x[:1]).sum(),
                        _x_ints),
    "index_add": Form("`index_add`", lambda x, i: torch.zeros(6, 8).index_add(0, i[:6], x).sum(), _x_ints),
    "several_index_tensors": Form("`x[i, j]`", lambda x, i: x[i, i].sum(), _x_ints),
    "int_floordiv_mod": Form("integer `//` and `%`", lambda x, i: x.sum() + (i // 3).sum() + (i % 4).sum(), _x_ints),
    "one_hot": Form("`one_hot`", lambda x, i: (x[:, :6] * F.one_hot(i[:6], 6)).sum(), _x_ints),
    # "The ops added for real tensors (inverse trigonometric, activations, losses, ...) run eagerly on complex
    # tensors, with the reason." (Most losses and activations have no complex kernel in eager itself.)
    "complex_asin": Form("(inverse trigonometric, activations, losses, ...) run eagerly on complex tensors",
                         lambda z: torch.asin(z).abs().sum(), _z, "asin of a complex tensor"),
    "complex_softsign": Form("(inverse trigonometric, activations, losses, ...) run eagerly on complex tensors",
                             lambda z: F.softsign(z).abs().sum(), _z, "softsign of a torch.complex64 tensor"),
}

# the code spans of the items FORMS covers that name no op form
NOT_OP_FORMS = {"explain(...).fallbacks", "compiler/ir/ops/routing.py", "min == max", "rand", "randn"}


def test_known_limits_forms_are_all_checked():
    """Every op the two op-naming items name (a code span) has a FORMS entry: one added to the
    README is checked too."""
    phrases = " ".join(form.phrase for form in FORMS.values())
    for start in ("Ops outside the catalog", "Ordering and routing ops"):
        item = limit_item(start)
        spans = set(re.findall(r"`([^`]+)`", item)) - NOT_OP_FORMS
        unchecked = sorted(s for s in spans if f"`{s}`" not in phrases)
        assert not unchecked, f"Known limits item {start!r} names {unchecked}: add them to FORMS (tests/test_readme.py)"


@pytest.mark.allows_eager("the Known limits forms that fall back: what it checks")
@pytest.mark.parametrize("name", list(FORMS))
def test_known_limits_form(name):
    form = FORMS[name]
    assert form.phrase in known_limits(), f"{form.phrase!r} is no longer in the README's Known limits: remove {name!r}"
    report = compiler.explain(form.fn, *form.args())
    assert not report.internal_errors, report.internal_errors
    if form.says:
        assert report.fallbacks, (f"{name} compiles now: take {form.phrase!r} out of the README's Known limits "
                                  "(and this entry out of FORMS)")
        assert any(form.says in reason for reason in report.fallbacks), report.fallbacks
    else:
        assert not report.fallbacks, f"{name}: the README says it compiles, but: {report.fallbacks}"


def test_pooling_with_ceil_mode_and_dilation_compiles():
    """The op list's pooling forms (max pooling with dilation and ceil_mode; average pooling whose
    ceil_mode adds a window) compile whole, so the Known limits do not list them."""
    assert "pool" not in known_limits()
    x = torch.randn(2, 3, 9, 9, requires_grad=True)
    for fn in (lambda x: F.max_pool2d(x, 3, stride=2, dilation=2, ceil_mode=True).sum(),
               lambda x: F.avg_pool2d(x, 2, stride=2, ceil_mode=True).sum()):   # 9 wide: 5 windows, not 4
        compiled = compiler.compile(fn, fullgraph=True)
        compiled(x)
        torch.testing.assert_close(compiled(x), fn(x))
        assert compiled.stats["replays"] == 1 and compiled.stats["kernel_launches"] >= 1
