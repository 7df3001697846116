"""What the compiler does, stage by stage, as it happens: ``SYMGRAD_LOG`` or ``set_logs``.

Like ``TORCH_LOGS``: each stage is a logger of its own under ``symgrad`` (Python's ``logging``),
off unless asked for::

    SYMGRAD_LOG=graphs,backward,kernels,fallbacks,guards,recompiles python train.py
    SYMGRAD_LOG=all python train.py

or, from Python, ``compiler.set_logs("guards", "recompiles")``. The stages:

- ``graphs``: each region's captured forward graph, when the recording ends; which losses run in chunks;
- ``backward``: each region's backward graph, as SymPy's autodiff derives it;
- ``kernels``: each generated kernel (name, the user ops it fused, bytes moved, source);
- ``fallbacks``: what runs eagerly and why, for each recording;
- ``guards``: the guards of each new recording, and each guard that fails on a call (which
  argument, what changed);
- ``recompiles``: why a function is recorded again (the guard that failed, a module switched
  to eval, a closed-over tensor replaced, a path Python took twice that no recording has).

Records go to stderr through one handler on the ``symgrad`` logger (and not on to the root
logger, as ``TORCH_LOGS`` does); attach handlers of your own to ``logging.getLogger("symgrad")``
or a stage's logger (``symgrad.guards``) to collect them elsewhere.
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = "symgrad"
STAGES = ("graphs", "backward", "kernels", "fallbacks", "guards", "recompiles")
ENV = "SYMGRAD_LOG"


def logger(stage: str) -> logging.Logger:
    """The logger of one stage (``symgrad.<stage>``)."""
    return logging.getLogger(f"{ROOT}.{stage}")


class _StderrHandler(logging.StreamHandler):
    """Writes to the ``sys.stderr`` of the moment (a test's capture, a notebook's redirect)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # (StreamHandler assigns it in __init__)
        pass


_handler: logging.Handler | None = None


def set_logs(*stages: str, **flags: bool) -> None:
    """Turn stage logs on: ``set_logs("graphs", "guards")``, ``set_logs(kernels=True)``,
    ``set_logs("all")``; ``set_logs()`` turns them all off. A comma-separated string works too
    (the ``SYMGRAD_LOG`` form).

    >>> import compiler
    >>> compiler.set_logs("recompiles", guards=True)
    >>> compiler.set_logs()  # all off again
    """
    names = set()
    for item in stages:
        names.update(s.strip() for s in item.split(",") if s.strip())
    names.update(name for name, on in flags.items() if on)
    unknown = set(flags) - set(STAGES) | names - set(STAGES) - {"all"}
    if unknown:
        raise ValueError(f"unknown symgrad log stage(s) {sorted(unknown)}; choose from {', '.join(STAGES)} or 'all'")
    if "all" in names:
        names = set(STAGES)
    global _handler
    root = logging.getLogger(ROOT)
    if names and _handler is None:
        _handler = _StderrHandler()
        _handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        root.addHandler(_handler)
        root.propagate = False
    elif not names and _handler is not None:
        # all off: the records (warnings of symgrad.cache, fallbacks) reach the application's
        # handlers through the root logger again, as before the logs were turned on
        root.removeHandler(_handler)
        _handler = None
        root.propagate = True
    for stage in STAGES:
        # off: WARNING, so the stage's INFO records cost one cached level check
        logger(stage).setLevel(logging.INFO if stage in names else logging.WARNING)
    if names:
        root.setLevel(logging.INFO)


def enabled(stage: str) -> bool:
    """Whether ``stage`` is logged now (cheap: the logging module caches it)."""
    return logger(stage).isEnabledFor(logging.INFO)


def configure_from_environment() -> None:
    """Apply ``SYMGRAD_LOG`` (at ``import compiler``)."""
    value = os.environ.get(ENV, "").strip()
    if value:
        set_logs(value)


# -- the records of each stage (called by ``compiler.api`` as the stage ends) --------------------
def graph(fn_name: str, region: int, captured) -> None:
    """``graphs``: a region's captured forward graph."""
    if enabled("graphs"):
        from compiler.ir.graph import format_graph
        logger("graphs").info("%s: region %d captured:\n%s", fn_name, region, format_graph(captured, "forward"))


def backward(fn_name: str, region: int, derived) -> None:
    """``backward``: a region's backward graph, as autodiff derived it."""
    if derived is not None and enabled("backward"):
        from compiler.ir.graph import format_graph
        logger("backward").info("%s: region %d backward:\n%s", fn_name, region, format_graph(derived, "backward"))


def kernels(fn_name: str, infos) -> None:
    """``kernels``: each generated kernel, the user ops it fused, and its source."""
    if enabled("kernels"):
        for k in infos:
            logger("kernels").info("%s: region %d %s kernel %s fuses [%s], %d bytes moved:\n%s", fn_name, k.region,
                                   k.phase, k.name, ", ".join(k.op_names), k.bytes_moved, k.source)


def fallback(fn_name: str, reason: str) -> None:
    """``fallbacks``: something runs eagerly, and why."""
    logger("fallbacks").info("%s: runs eagerly: %s", fn_name, reason)
