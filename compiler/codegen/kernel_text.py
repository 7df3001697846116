"""Small pieces of kernel text shared by the kernel writers: dtype names, masks, indices."""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class Index:
    """One dim's index in a kernel being written: its text, with what the writer knows of it as it
    makes it, so that nothing reads the text back. ``names``: the index variables (and temporaries,
    a gathered position) it varies with; ``sized``: it holds a size argument of a shape-generic kernel
    (``ks<k>``: fixed for the launch, no variable); ``constant``: its value where it holds neither;
    ``unwrapped``: its text without the parentheses around all of it, where it has them."""
    text: str
    names: frozenset = frozenset()
    sized: bool = False
    constant: int | None = None
    unwrapped: str | None = None
    # how ``compose`` made it: its template (with the parentheses around all of it) and its parts,
    # so another printer writes it in its own language (``c_text``); None: a leaf (a name, a number)
    form: str | None = None
    parts: tuple = ()
    # the function of its parts' values it computes (``compose``'s ``value``), kept so that a writer
    # can evaluate the index at given values of its variables (``evaluate``) without reading its text
    op: object = field(default=None, compare=False, repr=False)

    @property
    def element(self) -> str:
        """The element it names, as text: "((i0))" and "i0" name one element (values are shared by it)."""
        return self.unwrapped or self.text

    def __str__(self) -> str:
        return self.text

    @property
    def position(self) -> int | None:
        """The element it names where that is known as digits: a constant, not negative."""
        return self.constant if self.constant is not None and self.constant >= 0 else None

    @property
    def fixed(self) -> bool:
        """Whether it names one element for the whole block: digits, or (shape-generic) sizes."""
        return self.position is not None or (self.sized and not self.names)

    def folded(self) -> Index:
        """A constant's index written as its value ("(0) * 4 + (1)" -> "1"); any other unchanged."""
        if self.constant is None or self.text == str(self.constant):
            return self
        return constant_index(self.constant)


def constant_index(value: int) -> Index:
    return Index(str(value), constant=value)


def variable_index(name: str) -> Index:
    """A variable of the kernel (``i0``, a temporary) used as an index."""
    return Index(name, frozenset({name}))


ZERO = constant_index(0)


def compose(template: str, *parts: Index, value, wrap: bool = True) -> Index:
    """The index ``(template)`` (``template`` itself where not ``wrap``), a ``{}`` in ``template`` for
    each of ``parts``; where every part is a constant, so is it: ``value`` of theirs (its text keeps the
    parts': ``Index.folded`` writes the value). ``template`` is one operation on its parts, or "{}" /
    "({})" around one part: then it names the element that part names ("((i0))" is "i0")."""
    constants = [p.constant for p in parts]
    inner = template.format(*parts)
    text = f"({inner})" if wrap else inner
    bare = parts[0].element if template in ("{}", "({})") else inner
    return Index(text, frozenset().union(*(p.names for p in parts)), any(p.sized for p in parts),
                 value(*constants) if None not in constants else None, bare if bare != text else None,
                 f"({template})" if wrap else template, tuple(parts), value)


def evaluate(index: Index, values: dict):
    """The value of ``index`` where each variable it reads has its value in ``values`` (a variable
    not there, or a size argument: None). Indices are never negative, so floor division is C's."""
    if index.constant is not None:
        return index.constant
    if index.op is None:   # (a leaf: a variable)
        return values.get(index.text)
    parts = [evaluate(p, values) for p in index.parts]
    return None if None in parts else index.op(*parts)


def leaves(index: Index) -> set:
    """The variables (leaf texts) ``index`` is computed from."""
    if index.constant is not None:
        return set()
    if index.op is None:
        return {index.text}
    return set().union(*(leaves(p) for p in index.parts)) if index.parts else set()


def c_text(index: Index) -> str:
    """``index`` as C/C++ text: its templates' floor division ``//`` written ``/`` (indices are
    never negative, where C's division truncating toward zero is Python's floor)."""
    if index.form is None:
        return index.text
    return index.form.replace("//", "/").format(*(c_text(part) for part in index.parts))


def last_position(size: Index) -> Index:
    """The last position of a dim of ``size`` (``KernelWriter.size_index``): a literal's folded."""
    if size.constant is not None:
        return constant_index(size.constant - 1)
    return compose("{} - 1", size, value=lambda s: s - 1)


def broadcast_index(index: tuple, out_shape: tuple, arg_shape: tuple) -> tuple:
    """The index of a broadcast argument of shape ``arg_shape`` at ``index`` of ``out_shape``."""
    lead = len(out_shape) - len(arg_shape)
    return tuple(ZERO if size == 1 else index[lead + d] for d, size in enumerate(arg_shape))


def literal_size(value: int, key=None) -> str:
    """A size as kernel text in a static kernel: its literal (``KernelWriter.size`` in a shape-generic one)."""
    return str(value)


def literal_index(value: int, key=None) -> Index:
    """A size as an index term in a static kernel: its literal (``KernelWriter.size_index`` in a
    shape-generic one)."""
    return constant_index(value)


def contiguous_offset(index: tuple, shape: tuple, single: str, size=literal_size) -> str:
    """The offset of ``index`` in a contiguous tensor of ``shape``; ``single`` when it has one
    element (any lane's index works, the mask keeps one lane). ``size(value, key)``: a stride's text."""
    terms = [f"({i}) * {size(st, ('contiguous', d))}" if st != 1 else f"({i})"
             for d, (i, st, size_) in enumerate(zip(index, contiguous_strides(shape), shape))
             if size_ != 1 and i.constant != 0]
    return " + ".join(terms) or single


def arange(block: str, wide: bool) -> str:
    """The lanes of a block, in int64 when the kernel's index math is 64-bit."""
    return f"tl.arange(0, {block}).to(tl.int64)" if wide else f"tl.arange(0, {block})"

