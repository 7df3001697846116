"""Complex expressions → pairs of real expressions, for kernels (Triton has no complex type).

Each complex operand ``z{i}`` becomes two real symbols, ``x{i}`` (real part) and ``w{i}``
(imaginary part); ``realify`` returns the real and imaginary parts of an expression as real
expressions over those, with our own rules per function (SymPy's ``as_real_imag`` leaves
quotients, non-integer powers, |z| and arg(z) unevaluated). Complex values are stored
interleaved (``torch.view_as_real``), so a fused complex chain is still one kernel.
"""

from __future__ import annotations

import functools

import sympy

from compiler.codegen.triton_printer import NotPrintable
from compiler.ops import scalar as S
from compiler.ops import symbols as Y

RE = tuple(sympy.Symbol(f"x{i}", real=True) for i in range(64))
IM = tuple(sympy.Symbol(f"w{i}", real=True) for i in range(64))
_ZERO = sympy.Integer(0)


@functools.lru_cache(maxsize=8192)
def realify(expr) -> tuple:
    """(re, im) of ``expr`` as real expressions over a{i}, x{i}, w{i}."""
    return _cx(sympy.sympify(expr))


def _mul(p, q):
    (a, b), (c, d) = p, q
    return (a * c - b * d, a * d + b * c)


def _recip(p):
    a, b = p
    if b == 0:
        return (1 / a, _ZERO)
    den = a * a + b * b
    return (a / den, -b / den)


def _hypot(a, b):
    return sympy.sqrt(a * a + b * b)


def _exp(p):
    a, b = p
    if b == 0:
        return (sympy.exp(a), _ZERO)
    e = sympy.exp(a)
    return (e * sympy.cos(b), e * sympy.sin(b))


def _log(p):
    a, b = p
    if b == 0:
        return (sympy.log(a), _ZERO)
    return (sympy.log(_hypot(a, b)), sympy.atan2(b, a))


def _cx(e):
    if e.is_Symbol:
        kind = Y.role(e)
        if kind is None or e.is_real:
            return (e, _ZERO)
        i = int(e.name.lstrip("zc"))
        return (RE[i], -IM[i]) if kind[2] else (RE[i], IM[i])
    if e.is_number:
        re, im = e.as_real_imag()
        return (re, im)
    if e.is_Add:
        parts = [_cx(a) for a in e.args]
        return (sympy.Add(*[p[0] for p in parts]), sympy.Add(*[p[1] for p in parts]))
    if e.is_Mul:
        result = (sympy.Integer(1), _ZERO)
        for factor in e.args:
            result = _mul(result, _cx(factor))
        return result
    if e.is_Pow:
        base, exp = _cx(e.base), e.exp
        if exp.is_Integer:
            n = int(exp)
            result = (sympy.Integer(1), _ZERO)
            for _ in range(abs(n)):
                result = _mul(result, base)
            return _recip(result) if n < 0 else result
        if base[1] == 0 and exp.is_real:
            return (base[0] ** exp, _ZERO)
        if exp.is_real:  # polar form: r^e (cos eθ, sin eθ)
            r, theta = _hypot(*base), sympy.atan2(base[1], base[0])
            return (r**exp * sympy.cos(exp * theta), r**exp * sympy.sin(exp * theta))
        return _exp(_mul(_cx(exp), _log(base)))
    f = e.func
    if f is sympy.exp:
        return _exp(_cx(e.args[0]))
    if f is sympy.log:
        return _log(_cx(e.args[0]))
    if f in (sympy.sin, sympy.cos):
        a, b = _cx(e.args[0])
        if b == 0:
            return (f(a), _ZERO)
        if f is sympy.sin:
            return (sympy.sin(a) * sympy.cosh(b), sympy.cos(a) * sympy.sinh(b))
        return (sympy.cos(a) * sympy.cosh(b), -sympy.sin(a) * sympy.sinh(b))
    if f is sympy.tanh:
        a, b = _cx(e.args[0])
        if b == 0:
            return (sympy.tanh(a), _ZERO)
        den = sympy.cosh(2 * a) + sympy.cos(2 * b)
        return (sympy.sinh(2 * a) / den, sympy.sin(2 * b) / den)
    if f is S.Sigmoid:
        a, b = _cx(e.args[0])
        if b == 0:
            return (S.Sigmoid(a), _ZERO)
        return _recip((1 + _exp((-a, -b))[0], _exp((-a, -b))[1]))
    if f is S.CAbs:
        return (_hypot(*_cx(e.args[0])), _ZERO)
    if f is S.CSgn:
        a, b = _cx(e.args[0])
        h = _hypot(a, b)
        is_zero = S.Compare(sympy.Integer(S.COMPARE_OPS.index("eq")), h, 0)
        return (S.Where(is_zero, 0, a / h), S.Where(is_zero, 0, b / h))
    if f is S.Where:  # a real condition choosing between complex values
        cond = _cx(e.args[0])
        if cond[1] != 0:
            raise NotPrintable("a complex condition")
        (ar, ai), (br, bi) = _cx(e.args[1]), _cx(e.args[2])
        return (S.Where(cond[0], ar, br), S.Where(cond[0], ai, bi) if (ai != 0 or bi != 0) else _ZERO)
    if f is S.CAngle:
        a, b = _cx(e.args[0])
        return (sympy.atan2(b, a), _ZERO)
    parts = [_cx(a) for a in e.args]
    if any(p[1] != 0 for p in parts):
        raise NotPrintable(f"{f.__name__} of a complex value is not supported")
    return (f(*[p[0] for p in parts]), _ZERO)
