"""The base of every catalog op: a named, callable-looking fx target that the compiler lowers."""

from __future__ import annotations
from compiler.ir.graph import OpKind


class OpDef:
    kind = OpKind.OP

    def __init__(self, name: str):
        self.name = name
        self.__name__ = name

    def __repr__(self):
        return self.name

    def __call__(self, *args, **kwargs):  # fx wants callable targets; we never call them
        raise RuntimeError(f"catalog op {self.name} is lowered by the compiler, not called")

    def __reduce_ex__(self, protocol):
        # A graph read back from disk (compiler.reuse.persist, compiler.reuse.recordings) must hold the
        # catalog's own op objects, not copies: stages compare targets by identity.
        if _catalog().get((type(self).__name__, self.name)) is self:
            return catalog_op, (type(self).__name__, self.name)
        return super().__reduce_ex__(protocol)


def catalog_op(kind: str, name: str) -> OpDef:
    """The catalog's op of class ``kind`` named ``name`` (how a pickled graph names its targets)."""
    return _catalog()[(kind, name)]


_ops_by_name: dict = {}


def _catalog() -> dict:
    if not _ops_by_name:
        from compiler.ir.ops import catalog as C

        ops = [*C.POINTWISE.values(), C.DERIVED, *C.REDUCTIONS.values(), *C.VIEWS.values(), *C.EXTERNS.values(),
               *C.ROUTING.values(), C.IOTA, C.RAND, C.GATHER, C.SLICE_SCATTER, C.ATTENTION,
               C.ATTENTION_BACKWARD]
        _ops_by_name.update(((type(op).__name__, op.name), op) for op in ops)
    return _ops_by_name
