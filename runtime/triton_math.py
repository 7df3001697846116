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
