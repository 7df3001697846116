"""Telling the user, once, why something runs eagerly — and telling a deliberate fallback
(an op the catalog lacks, ``.item()``) from a bug in the compiler.

A bug (any other exception inside capture, autodiff, fusion, codegen or the build) still
falls back to eager — the user's program keeps running, with eager's results — but the log
line says it is a bug to report, with the traceback. Under ``SYMGRAD_STRICT=1`` (the test
suite and CI) it raises ``InternalCompilerError`` instead, chained to the original.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("compiler")
_said: set = set()
_lock = threading.Lock()

STRICT_ENV = "SYMGRAD_STRICT"


def say_once(fn_name: str, reason: str, level: int = logging.WARNING, runs_eagerly: str = "") -> None:
    """Log ``reason`` once per function; ``runs_eagerly`` says what of the call runs eagerly."""
    key = (fn_name, reason)
    with _lock:
        if key in _said:
            return
        _said.add(key)
    log.log(level, "compiler: %s: %s%s", fn_name, reason, f" ({runs_eagerly} runs eagerly)" if runs_eagerly else "")


class CompileError(RuntimeError):
    """Raised with ``fullgraph=True`` where the compiler would otherwise fall back to eager."""


class InternalCompilerError(RuntimeError):
    """A bug in the compiler, raised instead of the eager fallback under ``SYMGRAD_STRICT=1``.
    Its ``__cause__`` is the original exception, with the traceback that locates the bug."""


def strict() -> bool:
    """Whether ``SYMGRAD_STRICT`` asks for compiler bugs to raise (set in tests and CI)."""
    return os.environ.get(STRICT_ENV, "").strip().lower() not in ("", "0", "false", "no")


def internal_error(where: str, exc: BaseException) -> str:
    """A compiler bug caught at ``where`` (the user's function, and what failed there).

    Under ``SYMGRAD_STRICT=1`` raises ``InternalCompilerError`` from ``exc``. Otherwise logs,
    once, a line saying it is a bug to report, with the traceback, and returns that line
    (``explain`` lists it among the internal errors); the caller then falls back to eager.
    """
    message = (f"symgrad internal error in {where} ({type(exc).__name__}: {exc}) — this is a bug, "
               "please report it; running eagerly")
    if strict():
        raise InternalCompilerError(f"{message} [raised, not run eagerly: {STRICT_ENV}=1]") from exc
    with _lock:
        first = message not in _said
        _said.add(message)
    if first:
        log.error("%s", message, exc_info=(type(exc), exc, exc.__traceback__))
    return message
