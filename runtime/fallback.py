"""Telling the user, once, why something runs eagerly."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("compiler")
_said: set = set()
_lock = threading.Lock()


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
