"""``explain``'s report: every stage of one compiled call, printable."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from compiler.ir.graph import format_graph, meta_of


@dataclass
class KernelInfo:
    name: str
    source: str
    phase: str          # "forward" | "backward" | "optimizer" (a fused optimizer.step(), region -1)
    region: int
    bytes_moved: int
    ops: tuple = ()     # (user op, "file:line") of each user op it fused, in graph order (``fused_user_ops``)

    def __repr__(self):
        return f"KernelInfo({self.phase} {self.name}, {self.bytes_moved} bytes)"

    @property
    def op_names(self) -> list:
        """The user ops it fused, each once (``torch.nn.functional.gelu`` -> ``gelu``)."""
        return list(dict.fromkeys(op for op, _ in self.ops))


def fused_user_ops(kernel) -> tuple:
    """(user op, source line) of each graph node a generated kernel computes — the nodes between
    the buffers it loads and the values it stores — in graph order. Backward nodes name the
    forward op they differentiate."""
    loads = set(kernel.loads)
    inside, stack = set(), list(kernel.stores)
    while stack:
        node = stack.pop()
        if node in inside or node in loads or node.op != "call_function":
            continue
        inside.add(node)
        stack.extend(node.all_input_nodes)
    ops = []
    for node in kernel.stores[0].graph.nodes if kernel.stores else ():
        if node in inside:
            meta = meta_of(node)
            op, source = (meta.torch_op, meta.source) if meta.torch_op else (meta.origin or (None, None))
            if op and (op, source) not in ops:
                ops.append((op, source))
    if not ops:  # nodes autodiff added with no forward op behind them (a broadcast's gradient sum)
        ops = [(f"{getattr(n.target, 'name', n.target)} (autodiff)", None) for n in kernel.stores]
    return tuple(dict.fromkeys(ops))


@dataclass
class Report:
    graph: fx.Graph | None              # the captured forward computation (all regions)
    backward_graph: fx.Graph | None     # the derived backward (of the first differentiable region)
    kernels: list                       # KernelInfo, forward then backward, region by region
    fallbacks: list                     # why anything runs eagerly; empty when fully compiled
    eager_calls: list                   # calls run as they are (backward(), optimizer updates)
    regions: list = field(default_factory=list)   # per region: dict of graphs and kernels
    internal_errors: list = field(default_factory=list)  # compiler bugs (ran eagerly): please report them
    # values read into Python (``if mask.all():``, ``loss.item()``): the regions on both sides
    # compile, only the read runs eagerly; each with where and why
    graph_breaks: list = field(default_factory=list)
    backend: str = ""
    backend_reason: str = ""
    # why ``compile(..., skip_python=True)`` would still run this recording's Python (None: it
    # would not; runtime.skip_python.refusal)
    skip_python_refusal: str | None = None

    @property
    def forward_kernels(self):
        return [k for k in self.kernels if k.phase == "forward"]

    @property
    def backward_segments(self) -> int:
        """Regions with a backward: the backward runs as this many fused segments, with the
        user's hooks (on the values between them) running in between."""
        return sum(1 for r in self.regions if r.get("backward_graph") is not None)

    @property
    def backward_kernels(self):
        return [k for k in self.kernels if k.phase == "backward"]

    def save(self, path: str) -> str:
        """Write this report as a self-contained HTML page (``compiler.report_html``): regions,
        kernels with the user ops each fused, fallbacks, graphs and sources. Returns ``path``."""
        from compiler.report.html import save

        return save([self], path, "symgrad explain")

    def __str__(self):
        out = [f"backend: {self.backend} ({self.backend_reason})" if self.backend else "backend: -"]
        out.append(f"regions: {len(self.regions)} (backward segments: {self.backward_segments})   "
                   f"kernels: {len(self.forward_kernels)} forward, {len(self.backward_kernels)} backward")
        for i, region in enumerate(self.regions):
            out.append("")
            out.append(f"== region {i}: captured graph")
            out.append(format_graph(region["captured"], "forward"))
            if region.get("backward_graph") is not None:
                out.append(f"== region {i}: backward graph")
                out.append(format_graph(region["backward_graph"], "backward"))
            for k in region.get("kernels", []):
                out.append(f"   [{k.phase}] {k.name}  ({k.bytes_moved} bytes moved)")
            if region.get("internal_error"):
                out.append(f"   runs eagerly after an internal error: {region['reason']}")
            elif region.get("reason"):
                out.append(f"   runs eagerly: {region['reason']}")
        optimizer = [k for k in self.kernels if k.phase == "optimizer"]
        if optimizer:  # optimizer.step() fused (compiler.optimizers)
            out.append("")
            out.append(f"== optimizer steps: {len(optimizer)} fused kernel(s)")
            out.extend(f"   [optimizer] {k.name}  ({k.bytes_moved} bytes moved)" for k in optimizer)
        out.append("")
        out.append("eager calls: " + (", ".join(self.eager_calls) if self.eager_calls else "none"))
        out.append("fallbacks: " + ("none" if not self.fallbacks else ""))
        out.extend(f"  - {reason}" for reason in self.fallbacks)
        if self.graph_breaks:
            out.append("graph breaks:")
            out.extend(f"  - {reason}" for reason in self.graph_breaks)
        out.append("skip_python: " + ("its replays may make the recorded calls without the Python"
                                       if self.skip_python_refusal is None
                                       else f"its replays run the Python ({self.skip_python_refusal})"))
        if self.internal_errors:  # not fallbacks: bugs, run eagerly so the program goes on
            out.append("internal errors (compiler bugs: please report them):")
            out.extend(f"  - {message}" for message in self.internal_errors)
        return "\n".join(out)
