"""The scalar symbols pointwise expressions are written in, and conjugation.

A pointwise node's expression refers to its i-th tensor argument as ``a{i}`` when that
argument is real, and as ``z{i}`` / ``zc{i}`` (the value and its conjugate) when it is
complex. Treating z and z̄ as independent symbols is Wirtinger calculus: SymPy's ``diff``
with respect to ``z{i}`` and ``zc{i}`` gives ∂s/∂z and ∂s/∂z̄ (``diff`` with respect to
``conjugate(z)`` itself raises in SymPy). Gradient and result symbols follow the same
pattern: ``g`` / ``gz, gzc`` and ``y`` / ``yz, yzc``.
"""

from __future__ import annotations

import functools

import sympy

_ROLES: dict = {}   # symbol -> (kind, index, conjugated); kind in {"arg", "grad", "result"}


def _make(name, role, real):
    s = sympy.Symbol(name, real=True) if real else sympy.Symbol(name, complex=True)
    _ROLES[s] = role
    return s


REAL_ARGS = tuple(_make(f"a{i}", ("arg", i, False), True) for i in range(64))
COMPLEX_ARGS = tuple(_make(f"z{i}", ("arg", i, False), False) for i in range(64))
CONJ_ARGS = tuple(_make(f"zc{i}", ("arg", i, True), False) for i in range(64))
GRAD, GRAD_Z, GRAD_ZC = _make("g", ("grad", 0, False), True), _make("gz", ("grad", 0, False), False), \
    _make("gzc", ("grad", 0, True), False)
RESULT, RESULT_Z, RESULT_ZC = _make("y", ("result", 0, False), True), _make("yz", ("result", 0, False), False), \
    _make("yzc", ("result", 0, True), False)

_CONJ = {**dict(zip(COMPLEX_ARGS, CONJ_ARGS)), **dict(zip(CONJ_ARGS, COMPLEX_ARGS)),
         GRAD_Z: GRAD_ZC, GRAD_ZC: GRAD_Z, RESULT_Z: RESULT_ZC, RESULT_ZC: RESULT_Z}


def operand(i: int, is_complex: bool) -> sympy.Symbol:
    return COMPLEX_ARGS[i] if is_complex else REAL_ARGS[i]


def role(symbol) -> tuple | None:
    return _ROLES.get(symbol)


def is_complex_symbol(e) -> bool:
    return isinstance(e, sympy.Symbol) and e in _CONJ


def conj(e):
    """The conjugate of an expression: z ↔ z̄ and i → -i.

    Every scalar function in the catalog is real-analytic (f(z̄) = conj(f(z))) or, like
    |z|, written symmetrically in z and z̄, so swapping the symbols conjugates the value.
    """
    return _conj(sympy.sympify(e))


@functools.lru_cache(maxsize=16384)
def _conj(e):
    return e.xreplace({**_CONJ, sympy.I: -sympy.I})


def has_complex(e) -> bool:
    return any(s in _CONJ for s in e.free_symbols) or e.has(sympy.I)
