"""Shrink a failing program: drop statements and outputs while it still fails alike.

``python -m tests.fuzz_api --minimize SEED`` prints the smallest program found. "Alike": the
mismatch's first line, with numbers and hook numbers taken out, is the same (so a shrink that
fails for another reason, a name no longer defined, is not taken).
"""

from __future__ import annotations

import copy
import re

from tests.fuzz_api.check import KnownBug, Mismatch, check_program


def _kind(message: str) -> str:
    first = message.split("\n")[0]
    first = re.sub(r"call \d", "call", first)
    first = re.sub(r"at \[.*", "", first)
    return re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "N", first)


def _failure(program):
    try:
        check_program(program)
    except (Mismatch, KnownBug) as e:
        return str(e).split(": ", 1)[1] if isinstance(e, KnownBug) else str(e)
    except Exception as e:  # noqa: BLE001
        return f"crash {type(e).__name__}: {e}"
    return None


def _statements(lines):
    """Statements as (start, end) line ranges: a ``with`` block is one, its body lines others."""
    out = []
    for i, line in enumerate(lines):
        end = i + 1
        indent = len(line) - len(line.lstrip())
        if line.rstrip().endswith(":"):
            while end < len(lines) and len(lines[end]) - len(lines[end].lstrip()) > indent:
                end += 1
        out.append((i, end))
    return out


def minimize(program, budget: int = 300):
    """The smallest program found that fails like ``program`` (and its failure)."""
    message = _failure(program)
    if message is None:
        return program, None
    kind = _kind(message)
    tries = 0
    changed = True
    while changed and tries < budget:
        changed = False
        for start, end in reversed(_statements(program.lines)):
            if tries >= budget:
                break
            candidate = copy.copy(program)
            candidate.lines = program.lines[:start] + program.lines[end:]
            candidate.outputs = list(program.outputs)
            if _try(candidate, kind) is not None:
                program, changed = candidate, True
                break
            tries += 1
            # the same without one of the outputs
        for i in range(len(program.outputs)):
            if len(program.outputs) == 1 or tries >= budget:
                break
            candidate = copy.copy(program)
            candidate.outputs = program.outputs[:i] + program.outputs[i + 1:]
            tries += 1
            if _try(candidate, kind) is not None:
                program, changed = candidate, True
                break
        if program.external_backward and not changed:
            candidate = copy.copy(program)
            candidate.external_backward = False
            tries += 1
            if _try(candidate, kind) is not None:
                program, changed = candidate, True
    return program, _failure(program)


def _try(candidate, kind):
    message = _failure(candidate)
    return message if message is not None and _kind(message) == kind else None
