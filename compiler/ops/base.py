"""The base of every catalog op: a named, callable-looking fx target that the compiler lowers."""

from __future__ import annotations


class OpDef:
    kind = "op"

    def __init__(self, name: str):
        self.name = name
        self.__name__ = name

    def __repr__(self):
        return self.name

    def __call__(self, *args, **kwargs):  # fx wants callable targets; we never call them
        raise RuntimeError(f"catalog op {self.name} is lowered by the compiler, not called")
