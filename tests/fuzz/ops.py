"""The fuzzer's op table: each op knows how many operands it takes, which operands it applies
to (dtype kind, rank, shapes) and how its call is written in Python.

An op's ``make(ch, xs)`` gets a chooser and the concrete operand tensors of the program so
far and returns the expression as a template (``{0}``, ``{1}`` name the operands) or None
when it does not apply. Ops are meant to be valid most of the time: an eager error is a
test case too (the compiled call must raise the same one), but a program stops at it. A few
ops are written to fail on purpose now and then (out-of-range indices, views of
non-contiguous tensors, in-place writes to leaves that require grad).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Op:
    name: str
    arity: int
    make: Callable  # (chooser, operand tensors) -> template (a statement `{0}[i] = v` too), or None


def is_real(x):
    return x.dtype.is_floating_point


def is_complex(x):
    return x.dtype.is_complex


def is_float(x):
    return x.dtype.is_floating_point or x.dtype.is_complex


def is_int(x):
    return not is_float(x) and x.dtype != torch.bool


def broadcastable(*xs):
    try:
        torch.broadcast_shapes(*(x.shape for x in xs))
        return True
    except RuntimeError:
        return False


def _dim(ch, x):
    """A dim of ``x`` (negative now and then), or None for a 0-dim tensor."""
    if x.dim() == 0:
        return None
    d = ch.int(0, x.dim() - 1)
    return d - x.dim() if ch.bool(0.3) else d


# -- elementwise -------------------------------------------------------------------------
REAL_UNARY = ["torch.sin({0})", "torch.cos({0})", "torch.exp({0})", "torch.tanh({0})", "torch.sigmoid({0})",
              "torch.relu({0})", "torch.abs({0})", "-{0}", "torch.erf({0})", "torch.nn.functional.gelu({0})",
              "torch.nn.functional.silu({0})", "torch.nn.functional.softplus({0})", "torch.atan({0})",
              "torch.log({0}.abs() + 0.5)", "torch.sqrt({0}.abs())", "torch.rsqrt({0}.abs() + 0.5)",
              "torch.log1p({0}.abs())", "{0}.clamp(-0.5, 0.5)", "torch.sign({0})", "{0}.floor()",
              "{0} ** 2", "{0} * 2.5", "1.5 - {0}", "{0} / 3", "{0}.abs() ** 1.5", "torch.expm1({0})",
              "torch.nn.functional.leaky_relu({0}, 0.1)", "torch.nn.functional.elu({0})",
              "torch.nn.functional.hardtanh({0})", "torch.asinh({0})", "torch.square({0})",
              "torch.reciprocal({0})", "{0}.to(torch.float64)", "{0}.float()", "torch.log({0})"]
COMPLEX_UNARY = ["torch.sin({0})", "torch.cos({0})", "torch.exp({0})", "torch.tanh({0})", "torch.sigmoid({0})",
                 "-{0}", "{0} * 2.5", "{0} ** 2", "{0}.abs()", "{0}.real", "{0}.imag", "torch.angle({0})",
                 "{0}.conj()", "torch.sqrt({0})", "torch.log({0})", "(1 + 2j) * {0}", "{0} / 3"]
INT_UNARY = ["{0} + 1", "{0} * 3", "-{0}", "{0}.float()", "{0}.double()", "{0} > 0", "torch.abs({0})",
             "{0} / 2", "{0} ** 2"]
BOOL_UNARY = ["~{0}", "{0}.float()", "torch.where({0}, 1.0, -1.0)", "{0}.logical_not()"]


def unary(ch, xs):
    (x,) = xs
    table = (REAL_UNARY if is_real(x) else COMPLEX_UNARY if is_complex(x)
             else BOOL_UNARY if x.dtype == torch.bool else INT_UNARY)
    return ch.pick(table)


REAL_BINARY = ["{0} + {1}", "{0} - {1}", "{0} * {1}", "{0} / {1}", "torch.maximum({0}, {1})",
               "torch.minimum({0}, {1})", "torch.atan2({0}, {1})", "torch.where({0} > 0, {0}, {1})",
               "torch.hypot({0}, {1})", "torch.logaddexp({0}, {1})", "({0} > {1})", "({0} <= {1}).float()",
               "torch.lerp({0}, {1}, 0.3)", "{0}.abs() ** {1}", "torch.complex({0}, {1})",
               "torch.polar({0}.abs(), {1})", "torch.addcmul({0}, {1}, {1}, value=0.5)"]
COMPLEX_BINARY = ["{0} + {1}", "{0} - {1}", "{0} * {1}", "{0} / {1}"]
INT_BINARY = ["{0} + {1}", "{0} * {1}", "{0} - {1}", "torch.maximum({0}, {1})", "({0} == {1})"]
BOOL_BINARY = ["{0} & {1}", "{0} | {1}", "{0} ^ {1}", "torch.where({0}, {1}, 2 * {1})"]


def binary(ch, xs):
    a, b = xs
    if not broadcastable(a, b) and not ch.bool(0.05):  # now and then: eager's broadcast error
        return None
    if is_real(a) and is_real(b):
        template = ch.pick(REAL_BINARY)
        if template.startswith(("torch.complex", "torch.polar")) and a.dtype != b.dtype:
            return None  # torch.complex wants one dtype: that error is not interesting every time
        return template
    if is_float(a) and is_float(b):
        return ch.pick(COMPLEX_BINARY)
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return ch.pick(BOOL_BINARY)
    if a.dtype == torch.bool and is_real(b):
        return "torch.where({0}, {1}, -{1})"
    if not is_float(a) and not is_float(b):
        return ch.pick(INT_BINARY)
    return ch.pick(["{0} + {1}", "{0} * {1}"])  # mixed kinds: type promotion


# -- views -------------------------------------------------------------------------------
def _factor_shape(ch, numel, rank):
    """A random shape of ``rank`` dims with ``numel`` elements (a -1 now and then), or None."""
    if rank == 0:
        return [] if numel == 1 else None
    if numel == 0:
        shape = [ch.int(0, 3) for _ in range(rank)]
        shape[ch.int(0, rank - 1)] = 0
        return shape
    shape, rest = [], numel
    for _ in range(rank - 1):
        shape.append(ch.pick([d for d in range(1, rest + 1) if rest % d == 0]))
        rest //= shape[-1]
    shape.append(rest)
    if ch.bool(0.2):
        shape[ch.int(0, rank - 1)] = -1
    return shape


def view(ch, xs):
    (x,) = xs
    kind = ch.pick(["reshape", "view", "permute", "transpose", "t", "mT", "unsqueeze", "squeeze",
                    "expand", "slice", "narrow", "select", "flatten", "contiguous", "clone", "split", "T"])
    if kind in ("reshape", "view"):
        shape = _factor_shape(ch, x.numel(), ch.int(0, 3))
        if shape is None:
            return None
        return f"{{0}}.{kind}({tuple(shape)})"
    if kind == "flatten":
        return "{0}.flatten()"
    if kind in ("contiguous", "clone"):
        return f"{{0}}.{kind}()"
    if x.dim() == 0:
        return "{0}.unsqueeze(0)" if kind == "unsqueeze" else None
    if kind == "permute":
        perm = list(range(x.dim()))
        for i in range(len(perm) - 1, 0, -1):
            j = ch.int(0, i)
            perm[i], perm[j] = perm[j], perm[i]
        return f"{{0}}.permute({tuple(perm)})"
    if kind == "transpose":
        return f"{{0}}.transpose({_dim(ch, x)}, {_dim(ch, x)})"
    if kind == "t":
        return "{0}.t()" if x.dim() <= 2 else None
    if kind in ("mT", "T"):
        return f"{{0}}.{kind}" if x.dim() >= 2 or kind == "T" and x.dim() <= 2 else None
    if kind == "unsqueeze":
        return f"{{0}}.unsqueeze({ch.int(-x.dim() - 1, x.dim())})"
    if kind == "squeeze":
        return "{0}.squeeze()" if ch.bool() else f"{{0}}.squeeze({_dim(ch, x)})"
    if kind == "expand":
        shape = [ch.int(0, 3) if s == 1 and ch.bool() else (-1 if ch.bool(0.3) else s) for s in x.shape]
        if ch.bool(0.3):
            shape.insert(0, ch.int(1, 3))
        return f"{{0}}.expand({tuple(shape)})"
    d = _dim(ch, x)
    size = x.shape[d]
    if kind == "slice":
        start, step = ch.int(0, max(size, 1)), ch.int(1, 3)
        stop = ch.pick([None, size, ch.int(-size, size)])
        index = ", ".join([":"] * (d % x.dim()) + [f"{start}:{'' if stop is None else stop}:{step}"])
        return f"{{0}}[{index}]"
    if kind == "narrow":
        start = ch.int(0, size)
        return f"{{0}}.narrow({d}, {start}, {ch.int(0, size - start)})"
    if kind == "select":
        if size == 0 and not ch.bool(0.2):
            return None
        return f"{{0}}.select({d}, {ch.int(-size, max(size - 1, 0))})"  # size 0: eager's IndexError
    if kind == "split":
        k = ch.int(1, max(size, 1))
        pieces = max(-(-size // k), 1)
        return f"{{0}}.split({k}, dim={d})[{ch.int(0, pieces - 1)}]" if size else None
    return None


# -- reductions --------------------------------------------------------------------------
def reduction(ch, xs):
    (x,) = xs
    if not is_float(x):
        return ch.pick(["{0}.sum()", "{0}.float().mean()"]) if x.dtype != torch.bool else "{0}.sum()"
    d = _dim(ch, x)
    keep = ch.bool(0.3)
    complex_ok = [f"{{0}}.sum(dim={d}, keepdim={keep})", f"{{0}}.mean(dim={d}, keepdim={keep})", "{0}.sum()",
                  "{0}.mean()"]
    real_only = [f"{{0}}.amax(dim={d}, keepdim={keep})", f"{{0}}.var(dim={d})", f"{{0}}.std(dim={d}, keepdim={keep})",
                 f"torch.softmax({{0}}, dim={d})", f"torch.log_softmax({{0}}, dim={d})",
                 f"torch.logsumexp({{0}}, dim={d})", "{0}.norm()", f"{{0}}.norm(dim={d})",
                 "torch.nn.functional.layer_norm({0}, {0}.shape[-1:])", f"{{0}}.max(dim={d}).values",
                 "{0}.amax()", "{0}.var()"]
    if d is None:
        complex_ok = complex_ok[2:]
        real_only = ["{0}.amax()", "{0}.norm()", "{0}.var()"]
    return ch.pick(complex_ok + (real_only if is_real(x) else []))


# -- indexing ----------------------------------------------------------------------------
def _index_list(ch, size, count, wrap):
    if size == 0:
        return [] if ch.bool(0.8) else [0]  # [0] into an empty dim: eager's IndexError
    lo = -size if wrap else 0
    hi = size - 1 if not ch.bool(0.03) else size  # now and then one out of range: eager's error
    return [ch.int(lo, hi) for _ in range(count)]


def indexing(ch, xs):
    (x,) = xs
    if x.dim() == 0:
        return None
    d = _dim(ch, x) % x.dim()
    size = x.shape[d]
    kind = ch.pick(["getitem", "index_select", "gather", "setitem", "masked_fill"])
    if kind == "getitem":
        idx = _index_list(ch, x.shape[0], ch.int(0, 4), wrap=True)
        return f"{{0}}[torch.tensor({idx}, dtype=torch.long)]"
    if kind == "index_select":
        idx = _index_list(ch, size, ch.int(0, 4), wrap=False)
        return f"{{0}}.index_select({d}, torch.tensor({idx}, dtype=torch.long))"
    if kind == "gather":
        shape = [ch.int(0, s) for s in x.shape]
        shape[d] = ch.int(0, 3)
        count = 1
        for s in shape:
            count *= s
        idx = _index_list(ch, size, count, wrap=False)
        return f"torch.gather({{0}}, {d}, torch.tensor({idx}, dtype=torch.long).reshape({tuple(shape)}))"
    if kind == "masked_fill":
        return "{0}.masked_fill({0} > 0, 0.25)" if is_real(x) else None
    if size == 0:
        return None
    value = "0.5" if is_float(x) else "True" if x.dtype == torch.bool else "3"
    index = ", ".join([":"] * d + [str(ch.int(0, size - 1)) if ch.bool() else f"{ch.int(0, size - 1)}:"])
    return f"{{0}}[{index}] = {value}"


# -- matmul, cat, stack ------------------------------------------------------------------
def matmul(ch, xs):
    a, b = xs
    if not (is_float(a) and is_float(b)) or a.dim() == 0 or b.dim() == 0:
        return None
    if a.dtype != b.dtype and not ch.bool(0.1):  # eager refuses mixed dtypes: now and then
        return None
    k_a = a.shape[-1]
    k_b = b.shape[-2] if b.dim() >= 2 else b.shape[0]
    if k_a != k_b and not ch.bool(0.05):
        return None
    return "{0} @ {1}"


def gram(ch, xs):
    (a,) = xs
    if not is_float(a) or a.dim() == 0:
        return None
    return ch.pick(["{0} @ {0}.mT", "{0}.mT @ {0}"]) if a.dim() >= 2 else "{0} @ {0}"


def join(ch, xs):
    a, b = xs
    if a.dim() == 0 or a.dim() != b.dim():
        return None
    if a.shape == b.shape and ch.bool():
        return f"torch.stack([{{0}}, {{1}}], dim={ch.int(-a.dim() - 1, a.dim())})"
    d = _dim(ch, a)
    same = all(a.shape[i] == b.shape[i] for i in range(a.dim()) if i != d % a.dim())
    return f"torch.cat([{{0}}, {{1}}], dim={d})" if same else None


# -- pooling -----------------------------------------------------------------------------
def pool(ch, xs):
    """A 1-d pool over the last dim or a 2-d pool over the last two ([C, L], [N, C, L], [C, H, W]):
    max (with indices now and then, dilation, ceil_mode), average (padding counted or not), adaptive
    average. Windows larger than the padded input, or padding over half a window: eager's error."""
    (x,) = xs
    if not is_real(x) or x.dim() < 2 or 0 in x.shape:
        return None
    dims = 2 if x.dim() == 3 and ch.bool() else 1
    F = "torch.nn.functional"
    kind = ch.pick(["max", "max", "indices", "avg", "adaptive"])
    if kind == "adaptive":
        size = tuple(ch.int(1, s) for s in x.shape[-dims:])
        return f"{F}.adaptive_avg_pool{dims}d({{0}}, {size if dims == 2 else size[0]})"
    kernel = tuple(ch.int(1, 4) for _ in range(dims))
    stride = tuple(ch.int(1, 3) for _ in range(dims))
    padding = tuple(ch.int(0, k // 2 + (1 if ch.bool(0.05) else 0)) for k in kernel)
    args = f"{kernel}, {stride}, {padding}"
    if kind == "avg":
        return f"{F}.avg_pool{dims}d({{0}}, {args}, count_include_pad={ch.bool()})"
    dilation, ceil = tuple(ch.int(1, 2) for _ in range(dims)), ch.bool(0.3)
    if not all(_windows_read_input(*a, ceil) for a in zip(x.shape[-dims:], kernel, stride, padding, dilation)):
        # NOTE: a dilated window of padding alone: eager's CPU max pool sends its gradient to an
        # element outside the window (past its row, or out of bounds), undefined; not asked
        dilation = (1,) * dims
    call = f"{F}.max_pool{dims}d({{0}}, {args}, dilation={dilation}, ceil_mode={ceil}"
    if kind == "indices":
        return ch.pick([f"{call}, return_indices=True)[0]", f"{call}, return_indices=True)[1].float()"])
    return call + ")"


def _windows_read_input(size, kernel, stride, padding, dilation, ceil) -> bool:
    """Whether every window of a pool over a dim of ``size`` (eager's output size) holds an input element."""
    span = size + 2 * padding - dilation * (kernel - 1) - 1
    out = (span + (stride - 1 if ceil else 0)) // stride + 1
    if ceil and (out - 1) * stride >= size + padding:
        out -= 1
    return all(any(0 <= o * stride - padding + j * dilation < size for j in range(kernel)) for o in range(out))


# -- in place ----------------------------------------------------------------------------
def in_place(ch, xs):
    """In place on any value, inputs included: eager raises for a leaf that requires grad,
    an expanded (overlapping) tensor, or a result dtype it cannot hold; the program stops
    there and the compiled call must raise the same."""
    a, b = xs
    if is_real(a):
        return ch.pick(["{0}.mul_(2)", "{0}.add_({1})", "{0}.relu_()", "{0}.sin_()", "{0}.copy_({1})",
                        "{0}.masked_fill_({0} < 0, 0.5)", "{0}.clamp_(-1, 1)", "{0}.sub_({1}, alpha=2)",
                        "{0}.fill_(1.5)"])
    if is_complex(a):
        return ch.pick(["{0}.mul_(2)", "{0}.add_({1})", "{0}.copy_({1})"])
    return ch.pick(["{0}.add_({1})", "{0}.mul_(3)"])


OPS = [
    Op("unary", 1, unary),
    Op("binary", 2, binary),
    Op("view", 1, view),
    Op("reduction", 1, reduction),
    Op("indexing", 1, indexing),
    Op("matmul", 2, matmul),
    Op("gram", 1, gram),
    Op("join", 2, join),
    Op("in_place", 2, in_place),
    Op("pool", 1, pool),
]
WEIGHTS = {"unary": 6, "binary": 5, "view": 4, "reduction": 3, "indexing": 2, "matmul": 1, "gram": 1,
           "join": 1, "in_place": 1, "pool": 1}
