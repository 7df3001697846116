"""A picture of what was compiled: one self-contained HTML page (no scripts, no links out).

``compiler.explain(fn, *args).save("report.html")`` draws one recording;
``compiler.report_html(compiled_fn, "report.html")`` draws every recording a compiled function
holds (one per guard key and path). Each region is a row of boxes, one box per kernel with the
user ops it fused, forward above backward; a region that runs eagerly is marked with its
reason; graphs and kernel sources open in place (``<details>``).
"""

from __future__ import annotations

import html
import os

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.25em; border-bottom: 1px solid #ccc; margin-top: 2em; }
h3 { font-size: 1.05em; margin-bottom: .3em; }
pre { background: #f6f8fa; padding: .6em; overflow-x: auto; font-size: 12px; }
table.summary td, table.summary th { padding: .2em .8em; text-align: left; border-bottom: 1px solid #eee; }
.row { display: flex; flex-wrap: wrap; gap: .5em; align-items: stretch; margin: .3em 0; }
.phase { width: 6em; font-weight: bold; align-self: center; }
.kernel { border: 1px solid #4a7; background: #eef8f0; border-radius: 4px; padding: .3em .6em; max-width: 24em; }
.kernel.backward { border-color: #47a; background: #eef3fb; }
.kernel.optimizer { border-color: #a74; background: #fbf3ee; }
.kernel .name { font-family: monospace; font-size: 12px; }
.ops { color: #555; font-size: 12px; }
.eager { border: 2px solid #c33; background: #fdeeee; border-radius: 4px; padding: .4em .6em; margin: .3em 0; }
.ok { color: #2a7d2a; } .bad { color: #c33; font-weight: bold; }
"""


def render(reports, title: str = "symgrad report", guards=None) -> str:
    """The page for ``reports`` (``compiler.report.explain.Report``, one per recording); ``guards``: per
    report, lines describing the guards it replays under (or None)."""
    reports = list(reports)
    guards = list(guards) if guards is not None else [None] * len(reports)
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_e(title)}</title>",
           f"<style>{_STYLE}</style></head><body>", f"<h1>{_e(title)}</h1>", _summary(reports)]
    for i, (report, lines) in enumerate(zip(reports, guards)):
        out.append(_recording(i, report, lines))
    out.append("</body></html>")
    return "\n".join(out)


def save(reports, path: str, title: str = "symgrad report", guards=None) -> str:
    """Write ``render(...)`` to ``path`` (whole, renamed into place); returns ``path``."""
    text = render(reports, title, guards)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def _summary(reports) -> str:
    rows = ["<table class='summary'><tr><th>recording</th><th>backend</th><th>regions</th><th>kernels "
            "(forward / backward / optimizer)</th><th>runs eagerly</th></tr>"]
    for i, r in enumerate(reports):
        phases = [sum(1 for k in r.kernels if k.phase == p) for p in ("forward", "backward", "optimizer")]
        eager = len(r.fallbacks) + len(r.internal_errors)
        status = f"<span class='bad'>{eager} fallback(s)</span>" if eager else "<span class='ok'>nothing</span>"
        rows.append(f"<tr><td><a href='#recording-{i}'>{i}</a></td><td>{_e(r.backend or '-')}</td>"
                    f"<td>{len(r.regions)}</td><td>{' / '.join(map(str, phases))}</td><td>{status}</td></tr>")
    rows.append("</table>")
    return "\n".join(rows)


def _recording(i: int, report, guard_lines) -> str:
    from compiler.ir.graph import format_graph

    out = [f"<h2 id='recording-{i}'>Recording {i}</h2>"]
    if report.backend:
        out.append(f"<p>backend: <b>{_e(report.backend)}</b> ({_e(report.backend_reason)})</p>")
    if guard_lines:
        out.append("<details><summary>guards (a call replays this recording when all hold)</summary><ul>"
                   + "".join(f"<li>{_e(line)}</li>" for line in guard_lines) + "</ul></details>")
    for index, region in enumerate(report.regions):
        out.append(f"<h3>Region {index}</h3>")
        if region.get("reason"):
            what = "internal error (a compiler bug: please report it)" if region.get("internal_error") \
                else "runs eagerly"
            out.append(f"<div class='eager'><b>{what}:</b> {_e(region['reason'])}</div>")
        for phase in ("forward", "backward"):
            kernels = [k for k in region.get("kernels", []) if k.phase == phase]
            if kernels:
                out.append(_kernel_row(phase, kernels))
        out.append(f"<details><summary>captured graph</summary><pre>{_e(format_graph(region['captured'], 'forward'))}"
                   "</pre></details>")
        if region.get("backward_graph") is not None:
            out.append("<details><summary>backward graph (SymPy autodiff)</summary><pre>"
                       f"{_e(format_graph(region['backward_graph'], 'backward'))}</pre></details>")
        for k in region.get("kernels", []):
            out.append(_kernel_source(k))
    optimizer = [k for k in report.kernels if k.phase == "optimizer"]
    if optimizer:
        out.append("<h3>Optimizer steps</h3>")
        out.append(_kernel_row("optimizer", optimizer))
        out.extend(_kernel_source(k) for k in optimizer)
    out.append("<h3>Fallbacks</h3>")
    if report.fallbacks:
        out.append("".join(f"<div class='eager'>{_e(reason)}</div>" for reason in report.fallbacks))
    else:
        out.append("<p class='ok'>none: everything captured runs as compiled kernels</p>")
    if report.graph_breaks:  # (values read into Python: the call splits there, nothing runs eagerly)
        out.append("<h3>Graph breaks</h3>" + "".join(f"<div>{_e(reason)}</div>" for reason in report.graph_breaks))
    if report.internal_errors:
        out.append("<h3>Internal errors</h3>" + "".join(f"<div class='eager'>{_e(m)}</div>"
                                                         for m in report.internal_errors))
    out.append("<p>eager calls (run as they are on each replay): "
               f"{_e(', '.join(report.eager_calls)) if report.eager_calls else 'none'}</p>")
    return "\n".join(out)


def _kernel_row(phase: str, kernels) -> str:
    boxes = "".join(
        f"<div class='kernel {phase}'><div class='name'>{_e(k.name)}</div>"
        f"<div class='ops'>fuses: {_e(', '.join(k.op_names) or '-')}</div>"
        f"<div class='ops'>{k.bytes_moved} bytes moved</div></div>" for k in kernels)
    return f"<div class='row'><div class='phase'>{phase}</div>{boxes}</div>"


def _kernel_source(k) -> str:
    lines = "".join(f"<li>{_e(op)}{' at ' + _e(src) if src else ''}</li>" for op, src in k.ops)
    return (f"<details><summary>{k.phase} kernel <code>{_e(k.name)}</code></summary>"
            f"<ul>{lines}</ul><pre>{_e(k.source)}</pre></details>")


def _e(text) -> str:
    return html.escape(str(text))


def report_html(fn, path: str, title: str | None = None) -> str:
    """Write the page for every recording ``fn`` (a ``compiler.compile``'d function, or the
    callable the ``torch.compile`` backend returned) holds now: its regions, kernels and the
    user ops each fused, fallbacks with their reasons, graphs, sources and guards. Returns ``path``.

    >>> import torch, compiler, tempfile, os
    >>> f = compiler.compile(lambda x: (x.sin() * 2).sum())
    >>> _ = f(torch.randn(4, requires_grad=True))
    >>> path = compiler.report_html(f, os.path.join(tempfile.mkdtemp(), "report.html"))
    """
    from runtime.dispatch import CompiledFunction
    from runtime.guard_log import describe_key, leaf_names

    compiled = getattr(fn, "compiled", fn)
    if not isinstance(compiled, CompiledFunction):
        raise TypeError(f"report_html takes a function made by compiler.compile, got {type(fn).__name__}; "
                        "for a plain function use compiler.explain(fn, *args).save(path)")
    reports, guards = [], []
    for key, variants in list(compiled.cache.items()):
        names = leaf_names(compiled.fn, key[0], len(key) - 3)
        for entry in variants:
            reports.append(entry.report)
            guards.append(describe_key(key, names))
    if not reports:
        raise ValueError(f"{compiled.__name__} has no recording yet: call it once first, "
                         "or use compiler.explain(fn, *args).save(path)")
    return save(reports, path, title or f"symgrad: {compiled.__name__}", guards)
