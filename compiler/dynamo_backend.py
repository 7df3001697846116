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

``torch.compile(..., backend="symgrad", options={...})`` takes ``compiler.compile``'s keywords
(``memory``, ``dynamic``, ``skip_python``, ``fullgraph``, ``backend``...) as ``options``; each
applies to every graph Dynamo hands over. Two names differ from ``torch.compile``'s arguments
of the same name: ``options={"fullgraph": True}`` makes any op of a graph that would run eagerly
a ``CompileError`` (``torch.compile(fullgraph=True)`` forbids Dynamo's graph breaks), and
``options={"dynamic": ...}`` chooses which sizes our recordings specialize on
(``torch.compile(dynamic=...)`` is Dynamo's choice, made before we see a graph).

Two ways Dynamo finds the name: the ``torch_dynamo_backends`` entry point in pyproject.toml (any
environment where the package is installed), and ``register()``, which ``import compiler``
calls (a checkout on ``PYTHONPATH``). Importing ``torch._dynamo`` takes about a second, so
``register()`` does not: it registers at once when Dynamo is already imported, else when
Dynamo's backend registry is first imported.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.fx as fx

NAME = "symgrad"
_REGISTRY = "torch._dynamo.backends.registry"


def symgrad(gm: fx.GraphModule, example_inputs, options=None, mode=None, **kwargs):
    """The Dynamo backend: returns a callable running ``gm`` through ``compiler.compile``.

    ``torch.compile(..., backend="symgrad", options={...})`` calls it with ``options=`` the dict
    (``torch._TorchCompileWrapper``; ``mode=`` too when one is given, which this backend has
    none of). The options are ``compiler.compile``'s keywords; called directly (or through
    ``functools.partial``) it takes them as keywords as well.
    """
    settings = compile_options(options, mode, kwargs)
    from compiler.api import compile as compile_fn  # (compiler/__init__ imports it before Dynamo calls us)

    return _DynamoRun(compile_fn(gm.forward, **settings))


def accepted_options() -> tuple[str, ...]:
    """The option names the backend takes: ``compiler.compile``'s keyword-only parameters, read from
    its signature (so an option added there is accepted here)."""
    import inspect

    from compiler.api import compile as compile_fn

    return tuple(name for name, p in inspect.signature(compile_fn).parameters.items()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY)


def compile_options(options=None, mode=None, kwargs=None) -> dict:
    """``compiler.compile``'s keywords from what Dynamo passes: ``options`` (a dict, or None) merged with
    keywords given directly; a TypeError/ValueError that says what to change for anything else."""
    accepted = accepted_options()
    listed = ", ".join(repr(name) for name in accepted)
    if mode not in (None, "default"):
        raise ValueError(
            f"torch.compile(backend={NAME!r}, mode={mode!r}): this backend has no modes; leave mode out and pass "
            f"options={{...}} with any of compiler.compile's keywords: {listed}")
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        raise TypeError(f"torch.compile(backend={NAME!r}, options=...) takes a dict of compiler.compile's keywords "
                        f"({listed}), got {type(options).__name__}: {options!r}")
    settings = dict(options)
    for name, value in (kwargs or {}).items():
        if name in settings:
            raise TypeError(f"backend {NAME!r}: option {name!r} given twice (in options= and as a keyword); "
                            "give it once")
        settings[name] = value
    unknown = [name for name in settings if name not in accepted]
    if unknown:
        import difflib

        hints = "".join(f" ({name!r}: did you mean {close[0]!r}?)" for name in unknown
                        if (close := difflib.get_close_matches(str(name), accepted, n=1)))
        raise TypeError(
            f"torch.compile(backend={NAME!r}) got unknown option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(repr(name) for name in unknown)}{hints}. The options it takes are compiler.compile's "
            f"keywords: {listed} (help(compiler.compile) describes them); remove or rename the others.")
    return settings


class _DynamoRun:
    """What Dynamo calls for one graph it captured: the compiled function (``compiled``, for tests
    and debugging: stats, last_entry.report)."""

    def __init__(self, compiled):
        self.compiled = compiled

    def __call__(self, *args):
        # Dynamo calls with a flat list of tensors (and SymInt sizes once it marks a dimension
        # dynamic: those arrive as Python ints, part of the guard key like any number argument).
        return self.compiled(*args)


# --- registration under the name "symgrad" (``import compiler`` calls register()) -------------------------------


def register() -> None:
    """Make ``torch.compile(..., backend="symgrad")`` find this backend without the entry point (a
    checkout on ``PYTHONPATH``). Cheap: it does not import ``torch._dynamo``; if Dynamo's registry is not
    imported yet, a finder on ``sys.meta_path`` registers the backend right after it is."""
    registry = sys.modules.get(_REGISTRY)
    if registry is not None and hasattr(registry, "register_backend"):
        _register_with(registry)
    elif not any(getattr(finder, "_symgrad_registers", False) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenImported())


def _register_with(registry) -> None:
    """``registry.register_backend(symgrad, name="symgrad")`` unless Dynamo already has the name: loaded
    (it refuses a duplicate), or an entry point it will load when the name is asked for (registering
    now would make that load a duplicate: the load imports this package, so this runs inside it)."""
    if getattr(registry, "_BACKENDS", {}).get(NAME) is not None:  # an entry point (pip install) names it
        return
    if NAME in getattr(registry, "_COMPILER_FNS", {}):
        return
    try:
        registry.register_backend(compiler_fn=symgrad, name=NAME)
    except AssertionError:  # "duplicate name": registered meanwhile
        pass


class _RegisterWhenImported:
    """A ``sys.meta_path`` finder that only watches for Dynamo's backend registry: it finds the module
    with the other finders and returns a spec of its own whose loader runs the module's, then
    registers the backend in it; it removes itself on the way."""

    _symgrad_registers = True

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _REGISTRY:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # a loader we cannot run a step after: Dynamo imports as without us
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # (importlib stops at the spec this returns: safe while it iterates)
        import importlib.util

        loader = _ThenRegister(spec.loader)
        if spec.has_location:  # (``__file__`` and the cached bytecode's path, as the module has without us)
            return importlib.util.spec_from_file_location(fullname, spec.origin, loader=loader,
                                                          submodule_search_locations=spec.submodule_search_locations)
        return importlib.util.spec_from_loader(fullname, loader, origin=spec.origin,
                                               is_package=spec.submodule_search_locations is not None)


class _ThenRegister:
    """The registry module's own loader (everything else asked of it, source lookups included, goes to
    that loader), then ``_register_with`` on the module it ran."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            _register_with(module)
        except Exception as e:  # noqa: BLE001 — never break importing Dynamo; the entry point may still name it
            import warnings

            warnings.warn(f"compiler: registering backend {NAME!r} with torch._dynamo failed ({type(e).__name__}: "
                          f"{e}); pass backend=compiler.dynamo_backend.symgrad to torch.compile instead", stacklevel=2)
