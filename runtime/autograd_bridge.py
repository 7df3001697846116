"""One compiled region as one ``torch.autograd.Function``.

The forward program's results are the region's outputs plus what backward needs; the latter
go through ``ctx.save_for_backward``, so saved-tensor hooks, in-place version checks and
"backward through the graph a second time" errors are PyTorch's own. Outputs carry a
grad_fn; ``.grad`` accumulation and its hooks stay with PyTorch's engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.program import Program, apply_views


@dataclass
class CompiledRegion:
    forward: Program
    backward: Program | None
    num_outputs: int            # user-visible outputs (the forward may return more: saved values)
    saved: list                 # ("input", i) | ("output", j) per saved value, backward's first inputs
    grad_output_for: list       # which outputs receive a gradient in backward
    differentiable: list        # per output: whether it can carry a gradient
    stats: dict = field(default_factory=dict)
    input_views: list = field(default_factory=list)  # (position, input, views): outputs that view inputs
    build_double_backward: object = None  # requires_grad pattern -> CompiledRegion of the backward
    explain_nan: object = None  # backward inputs -> message naming the forward op that made NaN
    mutated_inputs: tuple = ()  # positions of inputs the region writes into (after its forward)

    def __call__(self, inputs):
        originals = inputs
        if self.backward is None or not torch.is_grad_enabled():
            outs = self.forward.run(inputs, self.stats)[: self.num_outputs]
        else:
            if self.mutated_inputs and self.build_double_backward is not None:
                # NOTE: the region's own in-place writes land in these inputs after it runs,
                # but a double backward recomputes from what the forward read: give the region
                # copies (with the inputs' autograd history, taken before the writes).
                inputs = [t.clone() if i in self.mutated_inputs and isinstance(t, torch.Tensor) else t
                          for i, t in enumerate(inputs)]
            outs = list(_RegionFunction.apply(self, *inputs))
        for position, index, views in self.input_views:  # views of inputs: made outside, by torch
            outs.insert(position, apply_views(originals[index], views))
        return outs


class _RegionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, region: CompiledRegion, *inputs):
        outs = region.forward.run(list(inputs), region.stats)
        saved = [inputs[i] if kind == "input" else outs[i] for kind, i in region.saved]
        ctx.save_for_backward(*saved)
        ctx.region = region
        # For create_graph=True the backward is recomputed from the inputs themselves, so
        # keep them (their versions too: eager's in-place check still applies).
        ctx.versions = [t._version if isinstance(t, torch.Tensor) else None for t in inputs]
        ctx.inputs = inputs
        user = outs[: region.num_outputs]
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in user]
        non_diff = [o for o, d in zip(user, region.differentiable) if not d]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return tuple(user)

    @staticmethod
    def backward(ctx, *grad_outputs):
        region: CompiledRegion = ctx.region
        saved = list(ctx.saved_tensors)
        grads = []
        for i in region.grad_output_for:
            g = grad_outputs[i]
            if g is None:
                shape, dtype, device = ctx.shapes[i]
                g = torch.zeros(shape, dtype=dtype, device=device)
            grads.append(g)
        if torch.is_grad_enabled() and region.build_double_backward is not None:
            return (None, *_differentiable_backward(ctx, region, grads))
        results = region.backward.run(saved + grads, region.stats)
        if torch.is_anomaly_enabled() and region.explain_nan is not None and _has_nan(results) \
                and not _has_nan(grads):
            raise RuntimeError(region.explain_nan(saved + grads))
        return (None, *results)


def _has_nan(tensors) -> bool:
    return any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
               and bool(torch.isnan(t).any()) for t in tensors)


def _differentiable_backward(ctx, region: CompiledRegion, grads):
    """create_graph=True: run the backward as a compiled region with its own backward."""
    inputs = list(ctx.inputs)
    for t, version in zip(inputs, ctx.versions):
        if isinstance(t, torch.Tensor) and t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version "
                f"{version} instead (compiled region, create_graph=True)")
    pattern = tuple(t.requires_grad for t in inputs + grads)
    backward_region = region.build_double_backward(pattern)
    backward_region.stats = region.stats
    results = backward_region(inputs + grads)
    return [r if needs else None for r, needs in zip(results, ctx.needs_input_grad[1:])]
