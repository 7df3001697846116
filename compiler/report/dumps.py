"""``SYMGRAD_DUMP_DIR``: every recording's graphs and kernel sources, as files, with an index.

With the variable set, each recording (a first call, a call with new shapes, a recompile)
writes a folder of its own::

    $SYMGRAD_DUMP_DIR/
      index.md                      every recording: function, regions, kernels, fallbacks (links)
      index.json                    the same, for tools
      <pid>-<n>-<function>/
        entry.json                  this recording (what index.json lists)
        region0.forward.txt         the captured graph (``compiler.ir.graph.format_graph``)
        region0.backward.txt        the backward graph autodiff derived
        kernels/<kernel>.py         each generated Triton kernel, as launched

Processes may dump into one folder at once: each writes its own recording folders, and the
index is rebuilt from every ``entry.json`` there and renamed into place (a reader sees a
whole index, never a half-written one).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import threading
import time

ENV = "SYMGRAD_DUMP_DIR"

_counter = itertools.count(1)
_lock = threading.Lock()


def dump_dir() -> str | None:
    """The dump folder, or None when ``SYMGRAD_DUMP_DIR`` is not set."""
    return os.environ.get(ENV) or None


def dump(fn_name: str, report, root: str | None = None) -> str | None:
    """Write ``report``'s graphs and kernels (``compiler.report.explain.Report`` of one recording) under
    ``root`` (default: ``$SYMGRAD_DUMP_DIR``; nothing when unset) and update the index.
    Returns the recording's folder."""
    root = root or dump_dir()
    if root is None:
        return None
    from compiler.ir.graph import format_graph

    with _lock:
        folder_name = f"{os.getpid()}-{next(_counter):04d}-{_safe(fn_name)}"
    folder = os.path.join(root, folder_name)
    os.makedirs(os.path.join(folder, "kernels"), exist_ok=True)
    regions = []
    for i, region in enumerate(report.regions):
        entry = {"index": i, "forward": f"region{i}.forward.txt", "reason": region.get("reason")}
        _write(os.path.join(folder, entry["forward"]), format_graph(region["captured"], "forward"))
        if region.get("backward_graph") is not None:
            entry["backward"] = f"region{i}.backward.txt"
            _write(os.path.join(folder, entry["backward"]), format_graph(region["backward_graph"], "backward"))
        regions.append(entry)
    kernels = []
    for k in report.kernels:
        path = f"kernels/{k.name}.py"
        _write(os.path.join(folder, path), k.source)
        kernels.append({"name": k.name, "phase": k.phase, "region": k.region, "file": path,
                        "ops": k.op_names, "bytes_moved": k.bytes_moved})
    entry = {"function": fn_name, "folder": folder_name, "pid": os.getpid(), "time": time.time(),
             "regions": regions, "kernels": kernels, "fallbacks": list(report.fallbacks),
             "eager_calls": list(report.eager_calls), "internal_errors": list(report.internal_errors)}
    _write(os.path.join(folder, "entry.json"), json.dumps(entry, indent=1))
    _write_index(root)
    return folder


def _write_index(root: str) -> None:
    entries = []
    for name in sorted(os.listdir(root)):
        try:
            with open(os.path.join(root, name, "entry.json")) as f:
                entries.append(json.load(f))
        except (OSError, ValueError):  # not a recording folder, or one being written right now
            continue
    entries.sort(key=lambda e: e["time"])
    _write(os.path.join(root, "index.json"), json.dumps(entries, indent=1))
    _write(os.path.join(root, "index.md"), _markdown(entries))


def _markdown(entries) -> str:
    out = ["# symgrad dump", "", f"{len(entries)} recording(s), oldest first. Each folder holds the captured "
           "graphs (`regionN.forward.txt`), the derived backward graphs (`regionN.backward.txt`) and the "
           "kernel sources (`kernels/`).", ""]
    for e in entries:
        stamp = time.strftime("%H:%M:%S", time.localtime(e["time"]))
        out.append(f"## {e['function']} — `{e['folder']}` ({stamp}, pid {e['pid']})")
        out.append("")
        for r in e["regions"]:
            line = f"- region {r['index']}: [forward graph]({e['folder']}/{r['forward']})"
            if r.get("backward"):
                line += f", [backward graph]({e['folder']}/{r['backward']})"
            if r.get("reason"):
                line += f" — runs eagerly: {r['reason']}"
            out.append(line)
            for k in e["kernels"]:
                if k["region"] == r["index"]:
                    out.append(f"  - {k['phase']} kernel [{k['name']}]({e['folder']}/{k['file']}): "
                               f"{', '.join(k['ops']) or '-'} ({k['bytes_moved']} bytes moved)")
        for k in e["kernels"]:
            if k["region"] < 0:
                out.append(f"- {k['phase']} kernel [{k['name']}]({e['folder']}/{k['file']})")
        out.append("- fallbacks: " + ("none" if not e["fallbacks"] else ""))
        out.extend(f"  - {reason}" for reason in e["fallbacks"])
        if e.get("internal_errors"):
            out.append("- internal errors (compiler bugs, please report): " + "; ".join(e["internal_errors"]))
        out.append("")
    return "\n".join(out)


def _write(path: str, text: str) -> None:
    """Write whole or not at all: a private temporary name, renamed into place."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:60] or "fn"
