"""Saying which guard failed and why a function is recorded again (the ``guards`` and
``recompiles`` logs, ``compiler.report.logs``), as torch.compile's recompile reasons do.

The dispatcher calls these only where a call does not replay (a cache miss, a recording left),
and only after ``on()`` says a log wants them: a replay that matches pays nothing here.
"""

from __future__ import annotations

import inspect
import logging

import torch

guards = logging.getLogger("symgrad.guards")
recompiles = logging.getLogger("symgrad.recompiles")


def on() -> bool:
    """Whether either log is on (a cached level check each)."""
    return guards.isEnabledFor(logging.INFO) or recompiles.isEnabledFor(logging.INFO)


def leaf_names(fn, spec, count: int) -> list:
    """A readable name per leaf of a call's flattened arguments: the parameter's name for
    flat calls (``x``, ``args[2]``, ``lr=``), the leaf's position otherwise."""
    if spec[0] == "tree":
        return [f"argument leaf {i}" for i in range(count)]
    n, keys = spec
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [params[i].name if i < len(params) else f"args[{i}]" for i in range(n)]
    return names + [f"{k}=" for k in keys]


def _describe_leaf(part) -> str:
    if isinstance(part, tuple) and len(part) == 4 and isinstance(part[1], torch.dtype):
        shape, dtype, device, requires_grad = part
        text = f"{str(dtype).removeprefix('torch.')}{list(shape)} on {device}"
        return text + (", requires grad" if requires_grad else "")
    if isinstance(part, type):
        return f"any {part.__name__} (not specialized)"
    kind, value = part
    return f"{kind.__name__} object id {value}" if kind not in (int, float, bool, str, type(None)) \
        and type(value) is int else repr(value)


def describe_key(key, names) -> list:
    """The guards of a guard key (``runtime.dispatch._guard_key``), one line each."""
    spec, grad, autocast, *parts = key
    lines = [f"grad mode {'on' if grad else 'off'}",
             "autocast " + (", ".join(f"{d}: {str(t).removeprefix('torch.')}" for d, t in zip(("cpu", "cuda"), autocast)
                                      if t is not None) or "off")]
    lines += [f"{name}: {_describe_leaf(part)}" for name, part in zip(names, parts)]
    return lines


def key_difference(new, old, names) -> str:
    """The first guard of ``old`` (a recorded key) that a call with key ``new`` fails."""
    if new[0] != old[0]:
        return "the arguments are structured differently (another number of arguments, keywords or containers)"
    if new[1] != old[1]:
        return f"grad mode is {'on' if new[1] else 'off'}; recorded with it {'on' if old[1] else 'off'}"
    if new[2] != old[2]:
        return f"autocast is {new[2]}; recorded with {old[2]} (cpu, cuda)"
    for name, now, then in zip(names, new[3:], old[3:]):
        if now == then:
            continue
        tensor_now = isinstance(now, tuple) and len(now) == 4 and isinstance(now[1], torch.dtype)
        tensor_then = isinstance(then, tuple) and len(then) == 4 and isinstance(then[1], torch.dtype)
        if tensor_now and tensor_then:
            for what, a, b in zip(("shape", "dtype", "device", "requires_grad"), now, then):
                if a != b:
                    shown = (list(a), list(b)) if what == "shape" else (a, b)
                    return f"{name}: {what} is {shown[0]}, recorded {shown[1]}"
        return f"{name}: is {_describe_leaf(now)}, recorded {_describe_leaf(then)}"
    return "the guard key differs"


def describe_miss(fn_name: str, key, cache: dict, names) -> str:
    """Why a call with ``key`` has no recording: the first call, or each recorded key's failed guard."""
    if not cache:
        return "first call"
    failed = [key_difference(key, old, names) for old in list(cache)[:4]]
    more = f" (and {len(cache) - 4} more recordings)" if len(cache) > 4 else ""
    return "no recording's guards match: " + "; ".join(
        f"recording {i}: {reason}" for i, reason in enumerate(failed)) + more


def describe_modes(traces) -> str:
    """Why no recording of a key matches: a module ran in another train/eval mode."""
    for trace in traces:
        for ref, training in trace.module_modes:
            module = ref()
            if module is not None and module.training != training:
                return (f"{type(module).__name__} is in {'train' if module.training else 'eval'} mode; "
                        f"recorded in {'train' if training else 'eval'} mode")
    return "the modules' train/eval modes differ from every recording"


def describe_externals(trace) -> str:
    """Which tensor the function reaches (a parameter, a closed-over tensor) changed."""
    for vid, (ref, meta) in trace.externals.items():
        t = ref()
        if t is None:
            return (f"a tensor the function reached inside (value {vid}, {str(meta.dtype).removeprefix('torch.')}"
                    f"{list(meta.shape)}) was freed: a parameter or closed-over tensor was replaced")
        if not meta.matches(t):
            return (f"a tensor the function reached inside (value {vid}) changed: now "
                    f"{_describe_leaf((tuple(t.shape), t.dtype, t.device, t.requires_grad))}, recorded "
                    f"{_describe_leaf((meta.shape, meta.dtype, meta.device, meta.requires_grad))}")
    return "a tensor the function reached inside changed"


def log_miss(fn_name: str, reason: str) -> None:
    """A call that does not replay: the failed guard (``guards``) and the new recording (``recompiles``)."""
    if reason != "first call":
        guards.info("%s: guard failed: %s", fn_name, reason)
    recompiles.info("%s: recording (%s)", fn_name, reason)


def log_recorded(fn_name: str, key, names, trace) -> None:
    """The guards a new recording is replayed under."""
    if not guards.isEnabledFor(logging.INFO):
        return
    lines = describe_key(key, names)
    if trace is not None:
        lines.append(f"{len(trace.externals)} tensor(s) reached inside (parameters, closed-over tensors): "
                     "same object, shape, dtype, device, requires_grad")
        if trace.module_modes:
            lines.append(f"{len(trace.module_modes)} module(s) in the same train/eval mode")
        lines.append(f"each of its {len(trace.calls)} torch calls: same function, tensors and constants (per call)")
    guards.info("%s: guards of its new recording:\n%s", fn_name, "\n".join(f"  - {line}" for line in lines))
