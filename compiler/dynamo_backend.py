"""``torch.compile(model, backend="symgrad")``: Dynamo's graphs through this compiler.

Dynamo traces the user's Python once (with guards) and hands each graph between graph breaks
to a backend as an ``fx.GraphModule`` of torch calls. Running that module is an ordinary
function of tensors whose Python has no side effects, so the decorator's machinery applies
unchanged: the first call records the module's torch calls, SymPy derives its backward, the
regions become fused Triton kernels, and later calls replay them. What each entry point gives:

- ``torch.compile(..., backend="symgrad")``: Dynamo re-runs none of the user's Python on
  later calls (its guards decide), and graph breaks (``loss.backward()``, prints, data-dependent
  branches) split the step into several compiled pieces with eager Python between them.
- ``@compiler.compile``: the whole step, ``backward()`` and ``optimizer.step()`` included, is
  one recording, and tensor/Node hooks, saved-tensor hooks and in-place checks inside it keep
  eager's semantics; the function's Python runs again on each call (checked replay).

Registered under the ``torch_dynamo_backends`` entry point in pyproject.toml, so any
environment where this package is installed can name it.
"""

from __future__ import annotations

import torch.fx as fx


def symgrad(gm: fx.GraphModule, example_inputs, **options):
    """The Dynamo backend: returns a callable running ``gm`` through ``compiler.compile``.

    ``options`` (``torch.compile(..., options={...})``) go to ``compiler.compile``:
    ``backend`` ("auto", "triton", "interpret", "eager") and ``fullgraph``.
    """
    from compiler.api import compile as compile_fn  # the package imports torch._dynamo lazily, not us

    unknown = set(options) - {"backend", "fullgraph"}
    if unknown:
        raise TypeError(f"backend 'symgrad' got unknown options {sorted(unknown)}; it takes 'backend' and 'fullgraph'")
    return _DynamoRun(compile_fn(gm.forward, **options))


class _DynamoRun:
    """What Dynamo calls for one graph it captured: the compiled function (``compiled``, for tests
    and debugging: stats, last_entry.report)."""

    def __init__(self, compiled):
        self.compiled = compiled

    def __call__(self, *args):
        # Dynamo calls with a flat list of tensors (and SymInt sizes once it marks a dimension
        # dynamic: those arrive as Python ints, part of the guard key like any number argument).
        return self.compiled(*args)
