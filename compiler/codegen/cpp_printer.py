"""SymPy scalar expressions → C++ expressions, for the C++ CPU kernels (``cpp_kernel``).

The C++ twin of ``triton_printer``: the same expressions, the same decisions about numbers and
powers, each primitive printed as its declaration says. A primitive whose Triton lowering is a
call of the C math library (``tl.exp``, ``libdevice.log1p``: libdevice is CUDA's C math library,
function for function) prints as that ``<cmath>`` function; one with a lowering of its own
declares ``render_cpp`` (``compiler.ir.ops.primitives``), with PyTorch's semantics (NaN-propagating
maximum, relu(nan) = nan, sign(0) = 0). Anything else raises ``NotPrintable``: that kernel runs on
the torch path.

Float literals carry their kernel's type (``0.1f`` in an fp32 kernel: a Triton literal is rounded
to the tensor's fp32 too; a bare ``0.1`` would compute in double). Divisions and roots are IEEE
(no ``-ffast-math``), as eager's CPU kernels are.
"""

from __future__ import annotations

import math

import torch

from compiler.codegen.expression_printer import ExpressionPrinter
from compiler.ir.ops.primitives.base import NotPrintable

# Triton's names for C math functions, as <cmath> spells them (libdevice mirrors the C library)
_CMATH = {"tl.exp": "std::exp", "tl.log": "std::log", "tl.sin": "std::sin", "tl.cos": "std::cos",
          "tl.sqrt": "std::sqrt", "tl.sqrt_rn": "std::sqrt", "tl.abs": "std::abs", "tl.erf": "std::erf"}
_LIBDEVICE_IN_CMATH = {"floor", "ceil", "rint", "trunc", "tanh", "tan", "asin", "acos", "atan", "sinh", "cosh",
                       "asinh", "acosh", "atanh", "atan2", "log1p", "expm1", "erfc"}

C_TYPE = {torch.float32: "float", torch.float64: "double", torch.int64: "int64_t", torch.int32: "int32_t",
          torch.int16: "int16_t", torch.int8: "int8_t", torch.uint8: "uint8_t", torch.bool: "bool"}


def cmath_function(triton_name: str | None) -> str | None:
    """The <cmath> function a primitive's Triton call is, or None."""
    if triton_name in _CMATH:
        return _CMATH[triton_name]
    if triton_name and triton_name.startswith("libdevice.") and triton_name[10:] in _LIBDEVICE_IN_CMATH:
        return "std::" + triton_name[10:]
    return None


class CppPrinter(ExpressionPrinter):
    """Prints one expression; ``names`` maps each free symbol to a C++ variable; ``dtype``: the
    type the expression computes in."""

    language = "C++"

    def __init__(self, names: dict, dtype: torch.dtype):
        super().__init__(names)
        self.dtype = dtype
        self.ctype = C_TYPE.get(dtype)
        if self.ctype is None:
            raise NotPrintable(f"no C++ type for {dtype}")
        self.fp32 = dtype == torch.float32
        self.integer = not (dtype.is_floating_point or dtype == torch.bool)

    def render(self, primitive, e) -> str:
        return primitive.render_cpp(self, e)

    # -- what renders use ------------------------------------------------------------------
    def literal(self, value) -> str:
        """A number in the kernel's type: ``0.5f`` (fp32), ``0.5`` (fp64), ``2`` (integers)."""
        if self.integer and value.is_number and float(value).is_integer():
            return str(int(value))
        v = float(value)
        if v != v:
            text = "NAN"
        elif math.isinf(v):
            text = "INFINITY" if v > 0 else "(-INFINITY)"
        else:
            text = repr(v)
            if "e" not in text and "." not in text:
                text += ".0"
            if self.fp32:
                text += "f"
        return f"({self.ctype})({text})" if text in ("NAN", "INFINITY", "(-INFINITY)") else text

    def where(self, condition: str, a: str, b: str) -> str:
        return f"(({condition}) ? ({a}) : ({b}))"

    def call(self, function: str, *args: str) -> str:
        return f"{function}({', '.join(args)})"

    def extremum(self, a: str, b: str, op: str) -> str:
        """The larger (``op`` ">") or smaller of two values, NaN where either is (torch.maximum's rule)."""
        return self.where(f"{a} != {a}", a, self.where(f"{b} != {b}", b, self.where(f"{a} {op} {b}", a, b)))

    def neg(self, x: str) -> str:
        return f"(-{x})"

    # -- powers, as the Triton printer writes them --------------------------------------------
    def _pow(self, base, exp) -> str:
        b = self.p(base)
        small = self.small_power(b, exp, self.one(), lambda x: f"std::sqrt({x})")
        if small is not None:
            return small
        if self.integer:
            raise NotPrintable("a non-integer power in an integer kernel")
        return f"std::pow({b}, {self.p(exp)})"


# <cmath> functions as at::vec::Vectorized methods (ATen's, as eager's CPU kernels compute them: Sleef
# or ATen's own vector code); a function missing here keeps its kernel scalar
_VECTOR_METHODS = {"std::exp": "exp", "std::log": "log", "std::sin": "sin", "std::cos": "cos", "std::sqrt": "sqrt",
                   "std::abs": "abs", "std::erf": "erf", "std::erfc": "erfc", "std::tanh": "tanh", "std::tan": "tan",
                   "std::asin": "asin", "std::acos": "acos", "std::atan": "atan", "std::sinh": "sinh",
                   "std::cosh": "cosh", "std::log1p": "log1p", "std::expm1": "expm1", "std::floor": "floor",
                   "std::ceil": "ceil", "std::trunc": "trunc", "std::rint": "round", "std::atan2": "atan2",
                   "std::pow": "pow", "std::hypot": "hypot"}


class VectorPrinter(CppPrinter):
    """Prints an expression over ``at::vec::Vectorized`` values (``V``): one SIMD register's worth of
    elements per operation. Comparisons give masks, ``where`` blends, maximum and minimum are
    at::vec's (NaN-propagating, as torch's), functions are Vectorized's methods."""

    def literal(self, value) -> str:
        return f"V({super().literal(value)})"

    def where(self, condition: str, a: str, b: str) -> str:
        return f"V::blendv({b}, {a}, {condition})"

    def call(self, function: str, *args: str) -> str:
        if function == "std::tanh":   # (``cpp_kernel.VECTOR_HELPERS``: Sleef's 1-ulp tanh costs 8x as much)
            return f"symgrad_tanh({args[0]})"
        method = _VECTOR_METHODS.get(function)
        if method is None:
            raise NotPrintable(f"no vectorized {function}")
        return f"({args[0]}).{method}({', '.join(args[1:])})"

    def extremum(self, a: str, b: str, op: str) -> str:
        return f"at::vec::{'maximum' if op == '>' else 'minimum'}({a}, {b})"

    def neg(self, x: str) -> str:
        return f"({x}).neg()"

    def _pow(self, base, exp) -> str:
        b = self.p(base)
        small = self.small_power(b, exp, self.one(), lambda x: f"({x}).sqrt()")
        return small if small is not None else f"({b}).pow({self.p(exp)})"
