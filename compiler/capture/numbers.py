"""Which Python numbers a recording's regions take at run time, not as constants (issue 39).

A float passed to the function as an argument is taken at run time from the first recording on
(``torch.compile`` likewise does not specialize float arguments): a temperature, a loss scale, a
learning rate passed to a step replay one recording with every value. Any other number (an
attribute ``self.temperature``, a global, ``param_groups[0]["lr"]``, ``1 / scale``) is a constant
until a replay sees it change; the replay says where (the call, by function and occurrence, and
the argument), and the next recording takes it at run time (``seen_changing``), as Dynamo's
automatic dynamic does for sizes. Only math takes numbers so: the elementwise and dropout bindings,
where a 0-dim input computes what the constant did; a binding that needs the constant (an
activation's slope) keeps it, and a change there still leaves the recording, as before.
"""

from __future__ import annotations

from compiler.capture.calls import FACTORIES
from runtime.torch_functions import function_name
from runtime.trace import occurrence_of

# bindings whose numbers are operands of their math (``x / t``, ``x.clamp(lo, hi)``, ``dropout(x, p)``)
LIFTABLE_MODULES = frozenset({"compiler.capture.bindings.elementwise", "compiler.capture.bindings.random"})


class NumbersTaken:
    def __init__(self, arguments=(), seen_changing=frozenset()):
        """``arguments``: the call's flattened leaves (``runtime.calls.flatten_call``)."""
        self._arguments = list(arguments)  # (kept alive: floats are matched by identity)
        self._ids = {id(x): i for i, x in enumerate(self._arguments) if type(x) is float}
        self.changing = frozenset(seen_changing)   # (function name, occurrence, leaf position)

    def __bool__(self) -> bool:
        return bool(self._ids or self.changing)

    def positions(self, capture, func, binding, leaves) -> list:
        """Leaf positions of the call ``func`` (about to be recorded by ``capture``) whose numbers its
        region takes at run time."""
        if not self or getattr(binding, "__module__", None) not in LIFTABLE_MODULES or func in FACTORIES:
            return []
        found, occurrence = [], None
        name = function_name(func)
        for i, x in enumerate(leaves):
            if type(x) not in (int, float):   # (bools are flags, not math)
                continue
            if type(x) is float and id(x) in self._ids:
                found.append(i)
            elif self.changing:
                if occurrence is None:
                    occurrence = occurrence_of(capture.calls, func, len(capture.calls))
                if (name, occurrence, i) in self.changing:
                    found.append(i)
        return found

    def argument_of(self, value) -> int | None:
        """The position among the call's leaves of the float argument ``value`` is (by identity), or None."""
        return self._ids.get(id(value)) if type(value) is float else None
