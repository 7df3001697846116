"""Evaluating a scalar expression on tensors with PyTorch — the eager path of
user-defined elementwise ops (outside compiled functions), and a reference for tests.

Each primitive declares its torch evaluation (``torch_fn`` or ``torch_eval`` in
``compiler.ir.ops.primitives``): the torch function with the same semantics, and for derivative
functions (Step, TieShare, CSgn...) what eager PyTorch's backward formulas do.
"""

from __future__ import annotations

import sympy
import torch

from compiler.ir.ops import primitives
from compiler.ir.ops import symbols as Y


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
        primitive = primitives.head(e.func)
        if primitive is None:
            raise NotImplementedError(f"no torch evaluation for {e.func.__name__}")
        return primitive.torch_eval(*[ev(a) for a in e.args])

    return ev(sympy.sympify(expr))

