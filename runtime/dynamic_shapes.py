"""Which tensor dims are dynamic, and the templates that cover the sizes they take.

``compile(fn, dynamic=...)`` chooses: ``None`` (the default) makes a dim of a tensor argument
dynamic once it is seen with a second value (both >= 2), as torch.compile's automatic dynamic
shapes do; ``True`` makes every dim >= 2 dynamic from the first call; ``False`` always
specializes. ``mark_dynamic(t, dim)`` marks one dim up front (with ``None`` or ``True``).
Sizes 0 and 1 always stay specialized: they are written into the guard key as they are.

The cache stays keyed by concrete sizes (``runtime.dispatch._guard_key``). A miss whose
*dynamic key* (the key with each dynamic dim written as ``DYNAMIC``) has recordings is given an
entry made from a template of them (``compiler.reuse.dynamic``) instead of a new recording. With
automatic dynamic, the template needs two recordings of the same calls at different sizes (so
each int's expression is fitted to two points); with ``dynamic=True`` or ``mark_dynamic``, one.
"""

from __future__ import annotations

import logging

import torch

from runtime.calls import flatten_call
from runtime.fallback import say_once

_MARKS = "_symgrad_dynamic_dims"
TEMPLATES_TRIED = 3  # templates made from the newest recordings of a dynamic key, tried in turn


class _Dynamic:
    """A dynamic dim in a guard key: any size >= 2."""

    def __repr__(self):
        return "s"

    def __reduce__(self):
        return "DYNAMIC"


DYNAMIC = _Dynamic()


def mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Compile calls with ``t`` for any size (>= 2) of its dimension ``dim``, from the first call,
    as ``torch._dynamo.mark_dynamic`` does: one recording covers them."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"mark_dynamic takes a tensor, not {type(t).__name__}")
    if not -t.dim() <= dim < max(t.dim(), 1):
        raise IndexError(f"mark_dynamic: dim {dim} is out of range for a tensor of {t.dim()} dimensions")
    marks = set(getattr(t, _MARKS, ()))
    marks.add(dim % t.dim())
    setattr(t, _MARKS, frozenset(marks))


def _marked(t) -> frozenset:
    return getattr(t, _MARKS, frozenset())


def _marks_of(spec, leaves) -> dict:
    """(spec, leaf position) -> the dims ``mark_dynamic`` marked on that tensor argument."""
    return {(spec, i): set(_marked(x)) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and _marked(x)}


class DynamicShapes:
    """The dynamic dims of one compiled function, and its templates by dynamic key."""

    def __init__(self, mode, provider):
        if mode not in (None, True, False):
            raise ValueError(f"dynamic={mode!r}: choose None (automatic), True (every dim) or False (specialize)")
        self.mode = mode
        self.provider = provider    # compiler.api's: make templates and instantiate them (None: never)
        self.dims: dict = {}        # (spec, leaf position) -> dims seen with a second value (automatic)
        self.first: dict = {}       # (spec, leaf position) -> the first shape seen there
        self.templates: dict = {}   # dynamic key -> (recordings it was made from, template or why none)

    @property
    def enabled(self) -> bool:
        return self.mode is not False and self.provider is not None

    def note_shapes(self, spec, leaves, name) -> None:
        """Automatic dynamic: a dim seen with a second value (both >= 2) becomes dynamic."""
        if self.mode is not None:
            return
        for i, x in enumerate(leaves):
            if not isinstance(x, torch.Tensor):
                continue
            shape = tuple(x.shape)
            first = self.first.setdefault((spec, i), shape)
            if len(first) != len(shape):
                continue
            changed = {d for d, (a, b) in enumerate(zip(first, shape)) if a != b and a >= 2 and b >= 2}
            seen = self.dims.get((spec, i), frozenset())
            new = changed - seen
            if new:
                # NOTE: a new set, not one changed in place: other threads read (iterate) the old
                # one without the lock (``_dynamic_dims``); a set changed under them raised
                # "Set changed size during iteration" (tests/test_stress.py, 8 threads, 4 shapes)
                self.dims[(spec, i)] = frozenset(seen | new)
                say_once(name, f"argument leaf {i}: dims {sorted(new)} changed size; calls no longer specialize "
                         "on them (dynamic shapes)", logging.INFO)

    def _dynamic_dims(self, key, marks) -> list:
        """(leaf position, dim) of each dynamic dim of a concrete guard key, in order."""
        spec, parts = key[0], key[3:]
        found = []
        for i, part in enumerate(parts):
            if not (isinstance(part, tuple) and len(part) == 4 and isinstance(part[1], torch.dtype)):
                continue
            shape = part[0]
            dims = set(range(len(shape))) if self.mode is True else set(self.dims.get((spec, i), ()))
            dims |= marks.get((spec, i), set())
            found += [(i, d) for d in sorted(dims) if d < len(shape) and shape[d] >= 2]
        return found

    def dynamic_key(self, key, dims) -> tuple:
        parts = list(key)
        for i, d in dims:
            shape, *rest = parts[3 + i]
            parts[3 + i] = (tuple(DYNAMIC if j == d else s for j, s in enumerate(shape)), *rest)
        return tuple(parts)

    @staticmethod
    def sizes(key, dims) -> tuple:
        return tuple(key[3 + i][0][d] for i, d in dims)

    def is_dynamic(self, key, args, kwargs) -> bool:
        """Whether a call with this guard key has dynamic dims."""
        leaves, spec = flatten_call(args, kwargs)
        return bool(self._dynamic_dims(key, _marks_of(spec, leaves)))

    def instantiate(self, key, spec, leaves, cache, fn, fullgraph, stats):
        """(an Entry for ``key`` made from a template, None) or (None, why not: None when no
        template applies)."""
        marks = _marks_of(spec, leaves)
        dims = self._dynamic_dims(key, marks)
        if not dims:
            return None, None
        dkey = self.dynamic_key(key, dims)
        # the recordings (not instantiations) whose sizes this dynamic key covers, newest last
        recorded = [(k, e) for k, entries in cache.items() for e in entries
                    if not e.instantiated and e.trace is not None and len(k) == len(key)
                    and self.dynamic_key(k, dims) == dkey and min(self.sizes(k, dims)) >= 2]
        if not recorded:
            return None, None
        if self.mode is None and not marks and len(recorded) < 2:
            # (a first call often differs from the next ones: an optimizer creates its state)
            return None, "automatic dynamic shapes instantiate from the second recording on"
        made = self.templates.get(dkey)
        if made is None or made[0] != len(recorded):
            # NOTE: a template from each of the newest recordings, tried in turn: one made at a
            # degenerate size (a sequence as long as the position table: its slice was no slice)
            # does not cover the others
            templates = []
            for base in range(len(recorded) - 1, max(-1, len(recorded) - 1 - TEMPLATES_TRIED), -1):
                others = [(e, self.sizes(k, dims)) for j, (k, e) in enumerate(recorded) if j != base]
                try:
                    templates.append(self.provider.make_template(recorded[base][1], self.sizes(recorded[base][0], dims),
                                                                 others))
                except Exception as e:  # noqa: BLE001 — NotInstantiable, or a bug: either way the call records
                    templates.append(f"no template: {e}")
            made = self.templates[dkey] = (len(recorded), templates)
        sizes = self.sizes(key, dims)
        arg_shapes = [tuple(x.shape) for x in leaves if isinstance(x, torch.Tensor)]
        first_reason = None
        for template in made[1]:
            if isinstance(template, str):
                entry, reason = None, template
            else:
                entry, reason = self.provider.instantiate(template, sizes, fn, fullgraph, stats, arg_shapes)
            if entry is not None:
                return entry, None
            first_reason = first_reason or reason
        return None, first_reason
