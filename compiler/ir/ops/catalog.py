"""The op catalog: the one place that knows each op, by kind, one module per kind.

* ``pointwise`` — a scalar SymPy expression (``meta_of(node).expr``). Its shape rule is
  broadcasting, its derivative comes from SymPy (``pointwise_vjp``), its lowering is the
  Triton printer.
* ``reductions`` — sum, mean and amax over dims: shape rule, VJP (expand back), lowering as a
  fused reduction loop; ``sum_to_shape``, the one place broadcasting is undone.
* ``views`` — reshape, permute, expand, slice, unfold: shape rule, VJP, and an *index map*
  that says which element of the input each output element reads, so views fuse for free.
* ``structural`` — iota, random numbers, gathers and slice scatters, computed inline.
* ``routing`` — externs of indexing and expert routing (topk/sort indices, cumsum, histc,
  grouped matmuls, index_put, scatters, ``x[i, j]``), by PyTorch's kernels; hand-written VJPs.
* ``externs`` — matmuls, convolutions and a gather's scatter-add gradient, run by PyTorch
  (cuBLAS and cuDNN on GPU); hand-written VJPs.
* ``linear_cross_entropy`` — a linear layer's cross-entropy over many classes in row chunks (the
  logits never whole), its gradients made with the loss; a decomposed form where the logits
  are read by something else, and for double backward.
* ``attention`` — scaled dot-product attention by flash-attention kernels (ours in Triton,
  PyTorch's fused one on the CPU path), forward and gradients; a decomposed form for double
  backward.

Gradients flow as graph nodes built from these same ops, so backward graphs fuse exactly
like forward graphs (tinygrad's habit). This module gathers the names stages use as ``C.*``.
"""

from __future__ import annotations

import torch.fx as fx

from compiler.ir.graph import GraphBuilder, OpKind
from compiler.ir.ops.attention import (
    ATTENTION,
    ATTENTION_BACKWARD,
    Attention,
    AttentionBackward,
    decompose_for_double_backward,
    emit_attention,
    has_attention,
)
from compiler.ir.ops.base import OpDef
from compiler.ir.ops.externs import (
    EXTERNS,
    AddMM,
    Convolution,
    ConvolutionBackward,
    Extern,
    IndexBackward,
    MatMul,
    emit_addmm,
    emit_conv,
    emit_extern,
)
from compiler.ir.ops.linear_cross_entropy import (
    LINEAR_CROSS_ENTROPY,
    LINEAR_CROSS_ENTROPY_BACKWARD,
    chunked_loss_pass,
    emit_linear_cross_entropy,
    linear_source,
)
from compiler.ir.ops.pointwise import (
    BOOL_RESULT_OPS,
    DERIVED,
    FLOAT_RESULT_OPS,
    GRAD_SYMBOL,
    POINTWISE,
    RESULT_SYMBOL,
    SCALAR_FUNCTIONS,
    Pointwise,
    derived_pointwise,
    emit_fill,
    emit_pointwise,
    masked_product,
    partial_derivative,
    pointwise_vjp,
    scalar_expr,
    wirtinger_gradient,
)
from compiler.ir.ops.reductions import REDUCTIONS, Reduction, emit_reduction, sum_to_shape
from compiler.ir.ops.structural import (
    GATHER,
    IOTA,
    RAND,
    SLICE_SCATTER,
    Gather,
    Iota,
    Rand,
    SliceScatter,
    emit_gather,
    emit_iota,
    emit_rand,
    emit_slice_scatter,
)
from compiler.ir.ops.routing import ROUTING
from compiler.ir.ops.views import VIEWS, View, emit_slice, emit_view, slice_tensor

__all__ = [
    "ATTENTION", "ATTENTION_BACKWARD", "Attention", "AttentionBackward", "decompose_for_double_backward",
    "emit_attention", "has_attention", "OpDef", "EXTERNS", "AddMM", "Convolution", "ConvolutionBackward", "Extern",
    "IndexBackward", "MatMul", "LINEAR_CROSS_ENTROPY", "LINEAR_CROSS_ENTROPY_BACKWARD", "chunked_loss_pass",
    "emit_linear_cross_entropy", "linear_source",
    "emit_addmm", "emit_conv", "emit_extern", "BOOL_RESULT_OPS", "DERIVED", "FLOAT_RESULT_OPS", "GRAD_SYMBOL",
    "POINTWISE", "RESULT_SYMBOL", "SCALAR_FUNCTIONS", "Pointwise", "derived_pointwise", "emit_fill",
    "emit_pointwise", "masked_product", "partial_derivative", "pointwise_vjp", "scalar_expr", "wirtinger_gradient",
    "REDUCTIONS", "Reduction", "emit_reduction", "sum_to_shape", "GATHER", "IOTA", "RAND", "SLICE_SCATTER",
    "Gather", "Iota", "Rand", "SliceScatter", "emit_gather", "emit_iota", "emit_rand", "emit_slice_scatter",
    "ROUTING", "VIEWS", "View", "emit_slice", "emit_view", "slice_tensor", "vjp",
]


def vjp(b: GraphBuilder, node: fx.Node, grad_out: fx.Node):
    """Gradient contributions for each tensor argument of ``node`` (None: no gradient)."""
    if node.target.kind == OpKind.POINTWISE:
        return pointwise_vjp(b, node, grad_out)
    return node.target.vjp(b, node, grad_out)
