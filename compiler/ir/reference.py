"""Running an IR graph op by op with PyTorch: a reference executor.

Used where each intermediate value matters more than speed: under
``torch.autograd.detect_anomaly()`` it finds the first op of a backward graph that turned
finite values into NaN, so the error can name the forward op responsible.

A plain ``torch.fx.Interpreter``: each catalog op computes its own value on real tensors
(``op.evaluate(node, args)``: a view applies itself with PyTorch's view function, an extern
calls its torch function, ...). Pointwise ops are evaluated from their SymPy expression here.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from compiler.ir.graph import output_node


class _Stop(Exception):
    """``on_value`` asked to stop: the values seen so far are the answer."""


class ReferenceInterpreter(fx.Interpreter):
    """Evaluates a graph of catalog ops with PyTorch; ``on_value(node, value, args)`` sees
    every op's value and may return True to stop there."""

    def __init__(self, graph: fx.Graph, on_value=None):
        super().__init__(torch.nn.Module(), garbage_collect_values=False, graph=graph)
        self.extra_traceback = False  # (errors carry no fx node text: the caller names the op)
        self.on_value = on_value

    def run_node(self, node: fx.Node):
        if node.op != "call_function":
            return super().run_node(node)
        args = list(self.fetch_args_kwargs_from_env(node)[0])  # (kwargs: constants, read from the node)
        value = node.target.evaluate(node, args)
        if self.on_value is not None and self.on_value(node, value, args):
            raise _Stop
        return value


def run_graph(graph: fx.Graph, inputs, on_value=None):
    """Evaluate ``graph`` on ``inputs``; ``on_value(node, value, args)`` sees every value (and
    stops the run by returning True: outputs not computed yet are None)."""
    interpreter = ReferenceInterpreter(graph, on_value)
    try:
        return list(interpreter.run(*inputs, enable_io_processing=False))
    except _Stop:
        env = interpreter.env
        output = output_node(graph)
        return [env.get(o) if isinstance(o, fx.Node) else o for o in output.args[0]]


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
