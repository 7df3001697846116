"""Small pieces of kernel text shared by the kernel writers: dtype names, masks, indices."""

from __future__ import annotations

import torch

from compiler.ir.graph import contiguous_strides

TL_DTYPE = {
    torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
    torch.float64: "tl.float64", torch.int8: "tl.int8", torch.int16: "tl.int16",
    torch.int32: "tl.int32", torch.int64: "tl.int64", torch.uint8: "tl.uint8", torch.bool: "tl.int1",
}


def masked(line: str, mask: str) -> str:
    """A body line with its placeholders filled: XMASK (a value per row, [XBLOCK, 1]), RMASK
    (a value per row position, [1, RBLOCK]), MASK (a value per element: ``mask``)."""
    return line.replace("XMASK", "xmask").replace("RMASK", "rmask").replace("MASK", mask)


def broadcast_index(index: tuple, out_shape: tuple, arg_shape: tuple) -> tuple:
    """The index of a broadcast argument of shape ``arg_shape`` at ``index`` of ``out_shape``."""
    lead = len(out_shape) - len(arg_shape)
    return tuple("0" if size == 1 else index[lead + d] for d, size in enumerate(arg_shape))


def literal_size(value: int, key=None) -> str:
    """A size as kernel text in a static kernel: its literal (``KernelWriter.size`` in a shape-generic one)."""
    return str(value)


def contiguous_offset(index: tuple, shape: tuple, single: str, size=literal_size) -> str:
    """The offset of ``index`` in a contiguous tensor of ``shape``; ``single`` when it has one
    element (any lane's index works, the mask keeps one lane). ``size(value, key)``: a stride's text."""
    terms = [f"({i}) * {size(st, ('contiguous', d))}" if st != 1 else f"({i})"
             for d, (i, st, size_) in enumerate(zip(index, contiguous_strides(shape), shape))
             if size_ != 1 and i != "0"]
    return " + ".join(terms) or single


def arange(block: str, wide: bool) -> str:
    """The lanes of a block, in int64 when the kernel's index math is 64-bit."""
    return f"tl.arange(0, {block}).to(tl.int64)" if wide else f"tl.arange(0, {block})"


def unwrapped(index: str) -> str:
    """``index`` without parentheses around all of it: "(((i0) * 8 + (i1)))" -> "(i0) * 8 + (i1)"."""
    while index.startswith("(") and index.endswith(")"):
        depth = 0
        for k, ch in enumerate(index):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0 and k < len(index) - 1:
                return index     # the first parenthesis closes before the end: "(a) * (b)"
        index = index[1:-1]
    return index
