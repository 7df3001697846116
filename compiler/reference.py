"""Running an IR graph op by op with PyTorch: a reference executor.

Used where each intermediate value matters more than speed: under
``torch.autograd.detect_anomaly()`` it finds the first op of a backward graph that turned
finite values into NaN, so the error can name the forward op responsible.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from compiler.ir import meta_of
from compiler.ops import symbols as Y
from compiler.ops.catalog import slice_tensor
from compiler.ops.evaluate import evaluate


def run_graph(graph: fx.Graph, inputs, on_value=None):
    """Evaluate ``graph`` on ``inputs``; ``on_value(node, value, args)`` sees every value."""
    env: dict = {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, inputs):
        env[node] = value
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        args = [env[a] if isinstance(a, fx.Node) else a for a in node.args]
        value = _evaluate_node(node, args)
        env[node] = value
        if on_value is not None and on_value(node, value, args):
            break
    output = next(n for n in graph.nodes if n.op == "output")
    return [env.get(o) if isinstance(o, fx.Node) else o for o in output.args[0]]


def _evaluate_node(node, args):
    op = node.target
    kind = op.kind
    dtype = meta_of(node).dtype
    if kind == "pointwise":
        binding = {}
        for i, (arg, value) in enumerate(zip(node.args, args)):
            binding[Y.operand(i, meta_of(arg).dtype.is_complex)] = value
        value = evaluate(meta_of(node).expr, binding)
        value = torch.as_tensor(value, device=args[0].device if args else None)
        if value.is_complex() and not dtype.is_complex:
            value = value.real
        return value.to(dtype).expand(meta_of(node).shape)
    if kind == "gather":
        source, index = args
        mode, dim = node.kwargs["mode"], node.kwargs["dim"]
        if node.kwargs.get("wrap"):
            index = torch.where(index < 0, index + source.shape[dim], index)
        if mode == "gather":
            return torch.gather(source, dim, index)
        if mode == "index_select":
            return source.index_select(dim, index.reshape(-1)).reshape(meta_of(node).shape)
        out = torch.nn.functional.embedding(index, source)
        if node.kwargs.get("zero_padding"):
            out = out.masked_fill((index == node.kwargs["padding_idx"]).unsqueeze(-1), 0)
        return out
    if kind == "rand":
        # NOTE: the reference executor only attributes NaNs (anomaly mode); these numbers come
        # from torch's generator seeded alike, not from the kernels' Philox stream.
        generator = torch.Generator(device=args[0].device).manual_seed(int(args[0]))
        return torch.rand(meta_of(node).shape, generator=generator, device=args[0].device)
    if kind == "iota":
        shape, dim = meta_of(node).shape, node.kwargs["dim"]
        view = [1] * len(shape)
        view[dim] = shape[dim]
        return torch.arange(shape[dim]).reshape(view).expand(shape)
    if kind == "reduction":
        x = args[0]
        dims, keepdim = node.kwargs["dims"], node.kwargs["keepdim"]
        fn = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax}[op.name]
        if node.kwargs.get("count"):  # the second stage of a split mean
            return (torch.sum(x, dim=dims, keepdim=keepdim) / node.kwargs["count"]).to(dtype)
        return (fn(x, dim=dims, keepdim=keepdim) if dims else x.clone()).to(dtype)
    if kind == "scatter":
        base, src = args
        out = base.clone()
        view = slice_tensor(out, **node.kwargs)
        view.copy_(src.expand(view.shape) if src.dim() else src)
        return out
    if kind == "view":
        x = args[0]
        if op.name == "slice":
            return slice_tensor(x, **node.kwargs)
        if op.name == "permute":
            return x.permute(node.kwargs["dims"])
        if op.name == "expand":
            return x.expand(node.kwargs["shape"])
        if op.name == "unfold":
            return x.unfold(node.kwargs["dim"], node.kwargs["size"], node.kwargs["step"])
        if op.name == "view_as_real":
            return torch.view_as_real(x.resolve_conj())
        if op.name == "view_as_complex":
            return torch.view_as_complex(x.contiguous())
        return x.reshape(node.kwargs["shape"])
    if kind == "extern":
        return op.torch_fn(*args, **node.kwargs)
    raise NotImplementedError(f"reference execution of {op}")


def first_nan(graph: fx.Graph, inputs):
    """The first node that produces NaN from NaN-free arguments, or None."""
    found = []

    def check(node, value, args):
        if _has_nan(value) and not any(_has_nan(a) for a in args if isinstance(a, torch.Tensor)):
            found.append(node)
            return True
        return False
    run_graph(graph, inputs, check)
    return found[0] if found else None


def _has_nan(t) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and bool(torch.isnan(t).any())
