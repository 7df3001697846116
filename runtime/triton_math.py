"""``libdevice`` for generated kernels: Triton's own on GPU, a NumPy stand-in in the interpreter.

Triton's interpreter does not implement ``libdevice`` (tanh, pow, ...: "cannot convert None
to tensor"). Generated kernels import ``libdevice`` from here, so the same kernel source runs
on a GPU and, for tests, on CPU tensors through the interpreter.
"""

from __future__ import annotations

import os

from triton.language.extra import libdevice as _triton_libdevice

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class _InterpreterLibdevice:
    """The few libdevice functions our kernels emit, evaluated with NumPy."""

    @staticmethod
    def _wrap(fn):
        import numpy as np
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle

        def apply(*args):
            tensors = [a for a in args if isinstance(a, tl.tensor)]
            data = [a.handle.data if isinstance(a, tl.tensor) else np.asarray(a) for a in args]
            with np.errstate(all="ignore"):  # masked-off lanes compute on padding
                out = np.asarray(fn(*np.broadcast_arrays(*data)))
            ref = max(tensors, key=lambda t: t.handle.data.size)
            out = out.astype(ref.handle.data.dtype, copy=False)
            return tl.tensor(TensorHandle(out, ref.handle.dtype.scalar), ref.type)

        return apply

    def __init__(self):
        import numpy as np

        import math

        self.tanh = self._wrap(np.tanh)
        self.pow = self._wrap(np.power)
        self.atan2 = self._wrap(np.arctan2)
        for name, fn in {"tan": np.tan, "asin": np.arcsin, "acos": np.arccos, "atan": np.arctan, "sinh": np.sinh,
                         "cosh": np.cosh, "asinh": np.arcsinh, "acosh": np.arccosh, "atanh": np.arctanh,
                         "log1p": np.log1p, "expm1": np.expm1, "floor": np.floor, "ceil": np.ceil, "rint": np.rint,
                         "trunc": np.trunc, "erfc": np.vectorize(math.erfc, otypes=[float])}.items():
            setattr(self, name, self._wrap(fn))


libdevice = _InterpreterLibdevice() if INTERPRETING else _triton_libdevice


def add_interpreter_stand_in(name: str, fn) -> None:
    """Give the interpreter's ``libdevice.<name>`` a NumPy function (arrays in, array out), for a
    libdevice function a compiler primitive prints and this stand-in lacks. No effect on a GPU
    (Triton's own libdevice) or where the stand-in already has ``name``."""
    if INTERPRETING and not hasattr(libdevice, name):
        setattr(libdevice, name, libdevice._wrap(fn))


def _round_bf16_to_nearest_even():
    """Make the interpreter round float32 -> bfloat16 to nearest even, as the GPU does.

    NOTE: Triton's interpreter (3.9) converts by truncating the mantissa, which doubles the
    rounding error of every bf16 value a kernel stores compared with the GPU (``cvt.rn``) and
    with eager PyTorch; precision tests would measure the interpreter, not our kernels.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    truncating = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return truncating(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(src.data)
        if nan.any():  # keep NaN a NaN (the carry could turn it into an infinity)
            rounded = np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)
        return interpreter.TensorHandle(rounded, dst_type.scalar)

    builder.cast_impl = cast_impl


def _bf16_products_as_floats():
    """Make the interpreter's ``tl.dot`` multiply bfloat16 operands as numbers.

    NOTE: Triton's interpreter (3.9) keeps bfloat16 values as their uint16 bit patterns and its
    ``create_dot`` hands those to ``np.matmul`` as integers (products of 1e10 for values near 1).
    Widened to float32 first, every product is exact, as in the GPU's bf16 MMA with float32
    accumulation (the flash-attention kernels multiply bf16 tiles).
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    integer_products = builder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = (np.ascontiguousarray(handle.data).astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return integer_products(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot


if INTERPRETING:
    _round_bf16_to_nearest_even()
    _bf16_products_as_floats()
