"""What the runtime and the capture need to know about a torch callable, apart from its value:
whether it only reads metadata or autograd state (never recorded as computation), and the
name to show the user in messages."""

from __future__ import annotations

import torch

_METADATA_ATTRS = {
    "shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "layout", "is_cuda", "is_cpu",
    "is_sparse", "is_quantized", "is_meta", "is_nested", "names", "itemsize", "nbytes",
}
_METADATA_METHODS = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__len__,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.element_size,
    torch.Tensor.get_device, torch.Tensor.nelement, torch.Tensor.ndimension, torch.Tensor.__hash__,
    torch.is_floating_point, torch.is_complex, torch.numel,  # (FSDP2's mixed precision casts ask these)
    torch.device,  # torch.device("cuda", 0) goes through the mode too: it makes a device, no tensor
}


_METADATA_CACHE: dict = {}


def is_metadata(func) -> bool:
    """Calls that only read metadata (guarded anyway): run directly, never recorded.
    Remembered per function: it runs before every torch call."""
    try:
        return _METADATA_CACHE[func]
    except KeyError:
        answer = _METADATA_CACHE[func] = _reads_metadata(func)
        return answer
    except TypeError:  # unhashable callable
        return _reads_metadata(func)


def _reads_metadata(func) -> bool:
    if func in _METADATA_METHODS:
        return True
    if getattr(func, "__name__", None) == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None) in _METADATA_ATTRS
    return False


# A tensor's autograd state: reading it has no side effects, but its value is no metadata.
STATE_ATTRS = {"grad", "data", "grad_fn", "_base", "_version"}


def is_state_read(func) -> bool:
    """Reading a tensor's autograd state (``t.grad``)."""
    return getattr(func, "__name__", None) == "__get__" and \
        getattr(getattr(func, "__self__", None), "__name__", None) in STATE_ATTRS


GRAD_GET = torch._C.TensorBase.grad.__get__  # (a method-wrapper: made anew per access, compared with ==)
GRAD_SET = torch._C.TensorBase.grad.__set__


def is_grad_set(func) -> bool:
    """Setting a tensor's gradient (``p.grad = ...``, as ``zero_grad`` does)."""
    return func == GRAD_SET


def is_profiler_range(func) -> bool:
    """A ``record_function`` range's enter or exit (an optimizer's step and zero_grad make them):
    bookkeeping around calls, with a handle made per call."""
    name = getattr(func, "__name__", "") or ""
    return "profiler" in (getattr(func, "__module__", "") or "") or "record_function" in name


# comparison -> its reflection (what Python calls on the right operand: `a <= b` is b.ge(a),
# `a == b` is b.__eq__(a))
REFLECTED_COMPARISONS = {
    torch.Tensor.le: torch.Tensor.ge, torch.Tensor.ge: torch.Tensor.le,
    torch.Tensor.lt: torch.Tensor.gt, torch.Tensor.gt: torch.Tensor.lt,
    torch.Tensor.__le__: torch.Tensor.__ge__, torch.Tensor.__ge__: torch.Tensor.__le__,
    torch.Tensor.__lt__: torch.Tensor.__gt__, torch.Tensor.__gt__: torch.Tensor.__lt__,
    torch.Tensor.__eq__: torch.Tensor.__eq__, torch.Tensor.__ne__: torch.Tensor.__ne__}


def function_name(func) -> str:
    """The name a user knows ``func`` by, for messages: ``torch.add``, ``Tensor.grad``, ``max_pool2d``."""
    name = getattr(func, "__name__", None)
    if name in ("__get__", "__set__", "__delete__"):
        attr = getattr(getattr(func, "__self__", None), "__name__", "?")
        return f"Tensor.{attr}" + {"__get__": "", "__set__": " = ...", "__delete__": " (del)"}[name]
    qual = getattr(func, "__qualname__", None) or name or repr(func)
    if "boolean_dispatch" in qual:  # F.max_pool2d & co: name the function it dispatches to
        inner = [c.cell_contents for c in getattr(func, "__closure__", None) or ()
                 if callable(c.cell_contents) and hasattr(c.cell_contents, "__name__")]
        plain = [f for f in inner if "with_indices" not in f.__name__]
        if plain or inner:
            return (plain or inner)[0].__name__.lstrip("_")
    if "pybind11" in qual or "._" in qual and name:
        qual = name if "pybind11" in qual else qual
    return qual.replace("TensorBase.", "Tensor.").replace("_VariableFunctionsClass.", "torch.")
