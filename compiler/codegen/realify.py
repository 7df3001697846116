"""Complex expressions → pairs of real expressions, for kernels (Triton has no complex type).

Each complex operand ``z{i}`` becomes two real symbols, ``x{i}`` (real part) and ``w{i}``
(imaginary part); ``realify`` returns the real and imaginary parts of an expression as real
expressions over those: arithmetic here, and each function by the ``re_im`` rule its primitive
declares (SymPy's ``as_real_imag`` leaves quotients, non-integer powers, |z| and arg(z)
unevaluated). Complex values are stored interleaved (``torch.view_as_real``), so a fused
complex chain is still one kernel.
"""

from __future__ import annotations

import functools

import sympy

from compiler.codegen.triton_printer import NotPrintable
from compiler.ir.ops import primitives
from compiler.ir.ops import symbols as Y
from compiler.ir.ops.primitives.base import ZERO as _ZERO
from compiler.ir.ops.primitives.base import complex_exp as _exp
from compiler.ir.ops.primitives.base import complex_log as _log
from compiler.ir.ops.primitives.base import complex_mul as _mul
from compiler.ir.ops.primitives.base import complex_recip as _recip
from compiler.ir.ops.primitives.base import hypot as _hypot

RE = tuple(sympy.Symbol(f"x{i}", real=True) for i in range(64))
IM = tuple(sympy.Symbol(f"w{i}", real=True) for i in range(64))


@functools.lru_cache(maxsize=8192)
def realify(expr) -> tuple:
    """(re, im) of ``expr`` as real expressions over a{i}, x{i}, w{i}."""
    return _cx(sympy.sympify(expr))


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
    primitive = primitives.head(f)
    if primitive is not None and primitive.re_im is not None:
        return primitive.re_im(_cx, *e.args)
    parts = [_cx(a) for a in e.args]
    if any(p[1] != 0 for p in parts):
        raise NotPrintable(f"{f.__name__} of a complex value is not supported")
    return (f(*[p[0] for p in parts]), _ZERO)
