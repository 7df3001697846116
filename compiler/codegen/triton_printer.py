"""SymPy scalar expressions → Triton expressions.

Every C-vs-Python difference is decided here rather than left to a generic printer:
numbers print as float literals with 17 significant digits (so `2/3` never becomes integer
division), integer powers print as products, and each primitive prints as its declaration in
``compiler.ir.ops.primitives`` says, with PyTorch's semantics (NaN-propagating maximum,
relu(nan) = nan, sign(0) = 0).
"""

from __future__ import annotations

import struct

import torch

from compiler.codegen.expression_printer import ExpressionPrinter
from compiler.ir.ops import primitives
from compiler.ir.ops.primitives.base import NotPrintable  # noqa: F401  (re-exported: the kernel writer imports it here)


def literal(value) -> str:
    value = float(value)
    if value != value:
        return 'float("nan")'
    if value in (float("inf"), float("-inf")):
        return 'float("inf")' if value > 0 else '(-float("inf"))'
    return repr(value)


def _exact_in_fp32(value) -> bool:
    """Whether a float literal keeps its value as fp32 (NaN and infinities do)."""
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        return True
    if abs(value) > 3.4e38:
        return False
    return struct.unpack("f", struct.pack("f", value))[0] == value


class TritonPrinter(ExpressionPrinter):
    """Prints one expression; ``names`` maps each free symbol to a Triton variable.

    NOTE (GPU arithmetic): a quotient prints as ``/``, which Triton compiles to div.full.f32 in
    fp32 (2 ulp), as Inductor's kernels do; eager's own CUDA kernels are not IEEE either where
    they normalize (rsqrtf). The CUDA test mode's fp32 tolerance covers it (tests/devices.py).
    Where an error would compound (the optimizer's update), the division is correctly rounded
    (compiler/optimizers/combo.py)."""

    language = "Triton"

    def __init__(self, names: dict, dtype=None):
        super().__init__(names)
        # tl.sqrt_rn (IEEE-rounded, as eager) exists for fp32 only; fp64's tl.sqrt is IEEE.
        self.fp64 = str(dtype) == "torch.float64"
        # NOTE: in an integer kernel whole numbers print as integers: `2.0 * t0` would compute
        # an int64/int32 value in fp32 (rounding above 2**24, saturating instead of wrapping);
        # eager's integer arithmetic wraps around, and so does Triton's on int literals.
        self.integer = dtype is not None and isinstance(dtype, torch.dtype) and not (
            dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
        self.sqrt = "tl.sqrt" if self.fp64 else "tl.sqrt_rn"

    def render(self, primitive, e) -> str:
        return primitive.render(self, e)

    def whole(self, text: str) -> str:
        """A literal that is a whole value of its own (both branches of a tl.where): Triton
        types it fp32, so in an fp64 kernel it is made fp64 (sign(x) fed to cos in fp64)."""
        return f"tl.full([], {text}, tl.float64)" if self.fp64 and not text.startswith("tl.full") else text

    def literal(self, value) -> str:
        if self.integer and value.is_number and value.is_finite and float(value).is_integer():
            return str(int(value))
        if self.fp64 and not _exact_in_fp32(value):
            # NOTE: Triton types a float literal as fp32 where nothing promotes it first (both
            # branches of tl.where, a product with an fp32 value): keep all 53 bits.
            return f"tl.full([], {literal(value)}, tl.float64)"
        return literal(value)

    def _pow(self, base, exp) -> str:
        if base.is_number and not exp.is_number:  # 2.0 ** x: the literal base takes x's dtype (libdevice)
            e = self.p(exp)
            return f"libdevice.pow(tl.full([1], {literal(base)}, {e}.dtype), {e})"
        b = self.p(base)
        small = self.small_power(b, exp, "1.0", lambda x: f"{self.sqrt}({x})")
        if small is not None:
            return small
        if exp.is_number:
            # libdevice wants both operands in one dtype: broadcast the literal like the base.
            return f"libdevice.pow({b}, tl.full([1], {literal(exp)}, {b}.dtype))"
        e = self.p(exp)
        if base.is_number:
            # a literal base (2.0 ** x): libdevice wants it in the exponent's dtype, as above
            return f"libdevice.pow(tl.full([1], {literal(base)}, {e}.dtype), {e})"
        return f"libdevice.pow({b}, {e})"


def _install_interpreter_stand_ins():
    """Give the interpreter's NumPy ``libdevice`` the functions primitives declare for it.

    NOTE: Triton's interpreter has no libdevice; ``runtime.triton_math`` stands in with NumPy
    for the functions kernels print. A primitive printing a libdevice function that stand-in
    lacks declares ``interpreter`` (a NumPy-array function), so it stays one class.
    """
    from runtime.triton_math import add_interpreter_stand_in

    for primitive in primitives.HEADS.values():
        if primitive.interpreter is not None and (primitive.triton or "").startswith("libdevice."):
            add_interpreter_stand_in(primitive.triton.removeprefix("libdevice."), primitive.interpreter)


_install_interpreter_stand_ins()
