"""Bindings of tensor factories: `torch.arange`, `torch.zeros`/`ones`/`full`/`empty` and `torch.tensor`
of a Python number, made inside a compiled region instead of eagerly on every call (the positions
and masks of a model's forward: an index expression or a constant, computed inline by the kernels
that read them).

A factory's arguments are Python values: the replay compares them with the recorded ones (a
compiled call's constants are baked into its kernels), so a call with other values leaves the
recording safely. Forms these bindings do not take (a list's data, `requires_grad=True`: a new
leaf of the user's autograd graph, `out=`, pinned memory, another layout) stay eager calls, as
factories always were (``compiler.capture.calls.expected_eager``): no fallback is reported for them.
"""

from __future__ import annotations

import math

import torch

from compiler.capture.bindings.registry import Unsupported, binds
from compiler.ir.ops import catalog as C


def _check_plain(kwargs) -> torch.dtype | None:
    """The dtype asked for; Unsupported for the arguments a constant of the region cannot honour
    (``device`` needs no check: the capture puts the call in a region of its result's device)."""
    if kwargs.pop("requires_grad", False):
        raise Unsupported("a factory with requires_grad=True makes a leaf of the autograd graph")
    if kwargs.pop("pin_memory", False) or kwargs.pop("layout", None) not in (None, torch.strided):
        raise Unsupported("a factory with pin_memory or a layout other than strided")
    if kwargs.pop("out", None) is not None:
        raise Unsupported("out= arguments are not supported")
    kwargs.pop("device", None)
    kwargs.pop("memory_format", None)   # a new contiguous tensor either way
    dtype = kwargs.pop("dtype", None)
    if kwargs:
        raise Unsupported(f"factory arguments {sorted(kwargs)} are not supported yet")
    return dtype


def _size(size) -> tuple:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if any(type(s) is not int for s in size):
        raise Unsupported("a factory with a size that is not a tuple of Python ints")
    return tuple(size)


def _number_dtype(value) -> torch.dtype:
    """The dtype eager gives a tensor made from the Python number ``value``."""
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    if isinstance(value, float):
        return torch.get_default_dtype()
    raise Unsupported(f"a factory of a {type(value).__name__} value")


def _filled(value):
    def bind(b, *size, **kwargs):
        dtype = _check_plain(kwargs) or torch.get_default_dtype()
        return C.emit_fill(b, _size(size), dtype, value)
    return bind


binds(torch.zeros)(_filled(0))
binds(torch.ones)(_filled(1))
binds(torch.empty)(_filled(0))   # values unspecified in eager: zeros here


@binds(torch.full)
def _full(b, size, fill_value, **kwargs):
    dtype = _check_plain(kwargs)
    if type(fill_value) not in (bool, int, float):
        raise Unsupported("torch.full with a fill value that is not a Python number")
    dtype = dtype or _number_dtype(fill_value)
    if math.isnan(fill_value) and not dtype.is_floating_point:
        raise Unsupported("torch.full with NaN into an integer dtype")
    return C.emit_fill(b, _size((size,)), dtype, fill_value)


@binds(torch.tensor)
def _tensor(b, data, **kwargs):
    dtype = _check_plain(kwargs)
    if type(data) in (list, tuple) and len(data) == 0:   # an empty cache to grow (transformers' DynamicCache)
        return C.emit_fill(b, (0,), dtype or torch.get_default_dtype(), 0)
    if type(data) not in (bool, int, float):
        raise Unsupported("torch.tensor of data other than one Python number")   # a list's values: eager
    return C.emit_fill(b, (), dtype or _number_dtype(data), data)


@binds(torch.arange)
def _arange(b, *args, **kwargs):
    """start + step · position, over ceil((end - start) / step) positions, as eager counts them.
    Whole-number arguments only (Python ints, or floats like 4.0: eager computes each value in
    double and rounds once, which equals the kernel's integer positions cast while they are whole
    numbers a float32 holds exactly, below 2^24); other floats stay an eager call."""
    dtype = _check_plain(kwargs)
    start, end, step = kwargs.pop("start", 0), kwargs.pop("end", None), kwargs.pop("step", 1)
    if len(args) == 1:
        end = args[0]
    elif len(args) >= 2:
        start, end, *rest = args
        step = rest[0] if rest else step
    bounds = (start, end, step)
    if any(type(v) not in (int, float) for v in bounds):
        raise Unsupported("torch.arange with arguments other than Python numbers")
    floats = any(type(v) is float for v in bounds)
    if floats and not all(math.isfinite(v) and float(v).is_integer() for v in (start, step)):
        raise Unsupported("torch.arange with a fractional start or step (eager's rounding in double)")
    if step == 0 or not math.isfinite(end):
        raise Unsupported("torch.arange with step 0 or an infinite end (eager's error)")
    count = max(0, math.ceil((end - start) / step)) if floats else max(0, -(-(end - start) // step))
    start, step = int(start), int(step)
    dtype = dtype or (torch.get_default_dtype() if floats else torch.int64)
    if dtype == torch.bool or (not dtype.is_floating_point and floats):
        raise Unsupported(f"torch.arange of float bounds into {dtype}")
    if dtype.is_floating_point and abs(start) + abs(step) * count >= 2**24:
        raise Unsupported("torch.arange past 2^24 into a float dtype (rounding)")
    values = C.emit_iota(b, (count,), 0)
    if step != 1:
        values = C.emit_pointwise(b, "mul", [values, step], dtype=torch.int64, requires_grad=False)
    if start != 0:
        values = C.emit_pointwise(b, "add", [values, start], dtype=torch.int64, requires_grad=False)
    if dtype != torch.int64:
        values = C.emit_pointwise(b, "identity", [values], dtype=dtype, requires_grad=False)
    return values
