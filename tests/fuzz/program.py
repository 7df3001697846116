"""Random programs: tensor inputs (shape, dtype, layout, requires_grad) and a few lines of
straight-line Python applying ops from ``ops.OPS`` to them.

A program is drawn step by step over concrete tensors (so each op sees real shapes and
dtypes and only valid-looking calls are made); its source is plain Python that a failing
case prints as its reproduction. Draws go through a chooser: ``HypothesisChooser`` (pytest,
with shrinking) or ``RandomChooser`` (the long run: a seed reproduces a program).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from tests.fuzz import ops as O

DTYPES = [torch.float32, torch.float64, torch.complex64, torch.int64, torch.bool]
DTYPE_WEIGHTS = [8, 6, 2, 1, 1]
# "lazy": a view PyTorch conjugates or negates lazily, its memory unchanged (complex: z.conj() of a
# conjugated copy; float: the imaginary part of a conjugate, a negative view; others: contiguous)
LAYOUTS = ["contiguous", "transposed", "strided", "offset", "expanded", "lazy"]
LAYOUT_WEIGHTS = [8, 2, 2, 1, 1, 1]


class RandomChooser:
    """Draws from a seeded ``random.Random``."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def int(self, lo, hi):
        return self.rng.randint(lo, hi)

    def bool(self, p=0.5):
        return self.rng.random() < p

    def pick(self, seq, weights=None):
        return self.rng.choices(list(seq), weights=weights)[0]


class HypothesisChooser:
    """Draws from hypothesis' ``data`` (so failures shrink: small ints, first choices, False)."""

    def __init__(self, data):
        from hypothesis import strategies as st
        self.data, self.st = data, st

    def int(self, lo, hi):
        return self.data.draw(self.st.integers(lo, hi))

    def bool(self, p=0.5):
        # shrinks to False: the rare branch (p small) goes away first
        return self.data.draw(self.st.integers(0, 99)) >= 100 - round(p * 100)

    def pick(self, seq, weights=None):
        seq = list(seq)
        if weights is None:
            return seq[self.int(0, len(seq) - 1)]
        point = self.int(0, sum(weights) - 1)
        for item, w in zip(seq, weights):
            if point < w:
                return item
            point -= w
        raise AssertionError("unreachable")


@dataclass
class Input:
    shape: tuple
    dtype: torch.dtype
    layout: str
    requires_grad: bool
    seed: int

    def make(self, dtype=None):
        """A fresh tensor (the same values every time), in ``dtype`` if given (the float64 reference)."""
        g = torch.Generator().manual_seed(self.seed)
        full = list(self.shape)
        if self.layout == "transposed" and len(full) >= 2:
            full[-1], full[-2] = full[-2], full[-1]
        elif self.layout == "strided" and full:
            full[-1] *= 2
        elif self.layout == "offset":
            full = [max(1, _numel(full)) + 1]
        elif self.layout == "expanded" and full:
            full[0] = 1
        if self.dtype.is_floating_point or self.dtype.is_complex:
            x = torch.randn(full, generator=g, dtype=torch.float64 if not self.dtype.is_complex else torch.complex128)
        elif self.dtype == torch.bool:
            x = torch.rand(full, generator=g) > 0.5
        else:
            x = torch.randint(-3, 4, full, generator=g)
            if self.seed % 5 == 0:  # now and then values that fp32 cannot hold exactly
                x = x * (2**33 + 1)
        x = x.to(dtype or self.dtype)
        if self.layout == "transposed" and len(full) >= 2:
            x = x.transpose(-1, -2)
        elif self.layout == "strided" and full:
            x = x[..., ::2]
        elif self.layout == "offset":
            x = x[1:1 + _numel(self.shape)].view(self.shape)
        elif self.layout == "expanded" and full:
            x = x.expand(self.shape)
        elif self.layout == "lazy" and x.is_complex():
            x = x.conj_physical().conj()
        elif self.layout == "lazy" and x.is_floating_point():
            x = torch.complex(torch.zeros_like(x), -x).conj().imag
        return x.detach().requires_grad_(self.requires_grad)

    def __repr__(self):
        grad = ", requires_grad" if self.requires_grad else ""
        return f"{self.dtype} {list(self.shape)} {self.layout}{grad} (seed {self.seed})"


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass
class Program:
    inputs: list
    lines: list = field(default_factory=list)   # Python statements, in order
    outputs: list = field(default_factory=list)  # names returned
    eager_error: str | None = None               # what eager raised while drawing it (the last line)

    @property
    def source(self) -> str:
        params = ", ".join(f"x{i}" for i in range(len(self.inputs)))
        body = [f"    {line}" for line in self.lines] or ["    pass"]
        ret = f"    return ({', '.join(self.outputs)},)" if self.outputs else "    return None"
        return "\n".join([f"def fn({params}):"] + body + [ret])

    def function(self):
        """The program as a Python function (a fresh one each time: compiled caches are per function)."""
        scope = {"torch": torch}
        exec(compile(self.source, "<fuzz program>", "exec"), scope)
        return scope["fn"]

    def make_inputs(self, reference=False):
        out = []
        for spec in self.inputs:
            dtype = None
            if reference and spec.dtype in (torch.float32, torch.float16):
                dtype = torch.float64
            elif reference and spec.dtype == torch.complex64:
                dtype = torch.complex128
            out.append(spec.make(dtype))
        return out

    def __str__(self):
        return "\n".join([f"# x{i}: {spec!r}" for i, spec in enumerate(self.inputs)] + [self.source])


def _draw_shape(ch):
    rank = ch.pick([0, 1, 2, 3], weights=[1, 3, 4, 2])
    return tuple(0 if ch.bool(0.08) else ch.int(1, 4) for _ in range(rank))


def _related_shape(ch, base):
    """A shape that broadcasts with ``base`` (leading dims dropped, dims set to 1), or a new one."""
    if ch.bool(0.15):
        return _draw_shape(ch)
    shape = list(base[ch.int(0, len(base)):] if ch.bool(0.3) else base)
    return tuple(1 if ch.bool(0.25) else s for s in shape)


def _draw_input(ch, shape):
    dtype = ch.pick(DTYPES, weights=DTYPE_WEIGHTS)
    layout = ch.pick(LAYOUTS, weights=LAYOUT_WEIGHTS)
    differentiable = dtype.is_floating_point or dtype.is_complex
    return Input(shape, dtype, layout, differentiable and ch.bool(0.7), ch.int(0, 2**31 - 1))


def draw_program(ch, max_steps=6) -> Program:
    """A random program: 1-3 inputs, up to ``max_steps`` op applications."""
    base = _draw_shape(ch)
    inputs = [_draw_input(ch, base)]
    for _ in range(ch.int(0, 2)):
        inputs.append(_draw_input(ch, _related_shape(ch, base)))
    program = Program(inputs)
    env = {f"x{i}": x for i, x in enumerate(program.make_inputs())}
    names = list(env)
    fresh = []                     # values the program made (returned at the end)
    weights = [O.WEIGHTS[op.name] for op in O.OPS]
    for _ in range(ch.int(1, max_steps)):
        op = ch.pick(O.OPS, weights=weights)
        operands = [ch.pick(names) for _ in range(op.arity)]
        template = op.make(ch, [env[n] for n in operands])
        if template is None:
            continue
        text = template.format(*operands)
        statement = "] = " in template
        target = None if statement else f"v{len(fresh)}"
        line = text if statement else f"{target} = {text}"
        program.lines.append(line)
        try:
            exec(line, {"torch": torch}, env)
        except Exception as e:  # noqa: BLE001 — eager's error is what the compiled call must raise
            program.eager_error = f"{type(e).__name__}: {e}"
            break
        if target is not None:
            names.append(target)
            fresh.append(target)
    returned = fresh[-1:] + [n for n in fresh[:-1] if ch.bool(0.25)]
    program.outputs = returned or [names[-1]]
    return program
