"""Special functions: the error function and its relatives."""

from __future__ import annotations

import sympy
import torch

from compiler.ops.primitives.base import FLOAT, Builtin


class Erf(Builtin):
    function, triton, torch_fn = sympy.erf, "tl.erf", torch.erf
    op, result, binds, in_place, math = "erf", FLOAT, ("erf",), True, True


class Erfc(Builtin):
    function, triton, torch_fn = sympy.erfc, "libdevice.erfc", torch.erfc
    op, result, binds, in_place, math = "erfc", FLOAT, ("erfc",), True, True
