"""Evaluating a scalar expression on tensors with PyTorch — the eager path of
user-defined elementwise ops (outside compiled functions), and a reference for tests.

Each catalog function maps to the torch function with the same semantics; derivative
expressions (Step, TieShare, CSgn...) map to what eager PyTorch's backward formulas do.
"""

from __future__ import annotations

import sympy
import torch

from compiler.ops import scalar as S
from compiler.ops import symbols as Y

_UNARY = {sympy.exp: torch.exp, sympy.log: torch.log, sympy.sin: torch.sin, sympy.cos: torch.cos,
          sympy.tanh: torch.tanh, sympy.erf: torch.erf, sympy.sinh: torch.sinh, sympy.cosh: torch.cosh,
          S.Sigmoid: torch.sigmoid, S.Relu: torch.relu, S.Abs: torch.abs, S.Sign: torch.sign,
          S.RealAngle: torch.angle, sympy.Abs: torch.abs, sympy.erfc: torch.erfc, sympy.tan: torch.tan,
          sympy.asin: torch.asin, sympy.acos: torch.acos, sympy.atan: torch.atan, sympy.asinh: torch.asinh,
          sympy.acosh: torch.acosh, sympy.atanh: torch.atanh, S.Log1p: torch.log1p, S.Expm1: torch.expm1,
          S.NormSqrt: torch.sqrt, S.Floor: torch.floor, S.Ceil: torch.ceil, S.Round: torch.round, S.Trunc: torch.trunc}
_COMPARE = {"lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne}


def evaluate(expr, env: dict):
    """The value of ``expr`` with each symbol bound by ``env`` (tensors or numbers);
    conjugate symbols (zc, gzc, yzc) are derived from their partners when not bound."""
    cache: dict = {}

    def ev(e):
        if e in cache:
            return cache[e]
        result = _ev(e)
        cache[e] = result
        return result

    def _ev(e):
        if e.is_Symbol:
            if e in env:
                return env[e]
            partner = Y.conj(e)
            if partner in env:
                return torch.conj(env[partner]) if isinstance(env[partner], torch.Tensor) else \
                    complex(env[partner]).conjugate()
            raise KeyError(f"unbound symbol {e}")
        if e.is_number:
            value = complex(e)
            return value.real if value.imag == 0 else value
        if e.is_Add:
            total = ev(e.args[0])
            for a in e.args[1:]:
                total = total + ev(a)
            return total
        if e.is_Mul:
            total = ev(e.args[0])
            for a in e.args[1:]:
                total = total * ev(a)
            return total
        if e.is_Pow:
            base, exp = ev(e.base), e.exp
            if exp == sympy.Rational(1, 2):
                return torch.sqrt(base) if isinstance(base, torch.Tensor) else base ** 0.5
            if exp == -1:
                return 1 / base
            return base ** ev(exp)
        f = e.func
        args = [ev(a) for a in e.args]
        if f in _UNARY:
            return _UNARY[f](_tensor(args[0]))
        if f is S.Step:
            x = _tensor(args[0])
            return torch.where(x <= 0, 0.0, 1.0).to(x.dtype)
        if f is S.Maximum:
            return torch.maximum(_tensor(args[0]), _tensor(args[1]))
        if f is S.Minimum:
            return torch.minimum(_tensor(args[0]), _tensor(args[1]))
        if f is S.TieShare:
            a, b = _tensor(args[0]), _tensor(args[1])
            return torch.where(a == b, 0.5, torch.where(a < b, 0.0, 1.0)).to(torch.result_type(a, b))
        if f is S.Where:
            return torch.where(_tensor(args[0]), args[1], args[2])
        if f is S.Compare:
            return _COMPARE[S.COMPARE_OPS[int(e.args[0])]](_tensor(args[1]), args[2])
        if f is S.CAbs:
            return torch.abs(_tensor(args[0]))
        if f is S.CSgn:
            return torch.sgn(_tensor(args[0]))
        if f is S.CAngle:
            return torch.angle(_tensor(args[0]))
        if f is sympy.atan2:
            return torch.atan2(_tensor(args[0]), _tensor(args[1]))
        raise NotImplementedError(f"no torch evaluation for {f.__name__}")

    return ev(sympy.sympify(expr))


def _tensor(x):
    return x if isinstance(x, torch.Tensor) else torch.tensor(x)
