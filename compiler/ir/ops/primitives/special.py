"""Special functions: the error function and its relatives."""

from __future__ import annotations

import sympy
import torch

from compiler.ir.ops.primitives.base import FLOAT, Builtin


class Erf(Builtin):
    function, triton, torch_fn = sympy.erf, "tl.erf", torch.erf
    op, result, binds, in_place, math = "erf", FLOAT, ("erf",), True, True


class Erfc(Builtin):
    function, triton, torch_fn = sympy.erfc, "libdevice.erfc", torch.erfc
    op, result, binds, in_place, math = "erfc", FLOAT, ("erfc",), True, True


class Erfinv(Builtin):
    """The inverse error function; d/dx erfinv(x) = √π/2 · exp(erfinv(x)²) (SymPy's own fdiff,
    which reuses the result y). Triton's interpreter has no libdevice: torch stands in there."""

    function, triton, torch_fn = sympy.erfinv, "libdevice.erfinv", torch.erfinv
    op, result, binds, in_place, math = "erfinv", FLOAT, ("erfinv",), True, True
    interpreter = staticmethod(lambda x: torch.special.erfinv(torch.from_numpy(x.copy())).numpy())
