"""Ops whose kernels are PyTorch's (matmuls, convolutions, a gather's scatter-add gradient)."""

from __future__ import annotations

import torch
import torch.fx as fx

from compiler.ir import meta_of
from compiler.ops import structural, views
from compiler.ops.base import OpDef
from compiler.ops.pointwise import emit_pointwise
from runtime.program import EXTERN_KERNELS


# ----------------------------------------------------------------------------- extern
class Extern(OpDef):
    """An op whose kernel is PyTorch's (``runtime.program.EXTERN_KERNELS``): a hand-written
    VJP here, a call at run time. Its result is always a buffer; fusion works around it."""

    kind = "extern"

    def __init__(self, name):
        super().__init__(name)
        self.torch_fn = EXTERN_KERNELS[name]


class MatMul(Extern):
    """mm and bmm (cuBLAS on GPU)."""

    def vjp(self, b, node, grad_out):
        return _matmul_grads(b, self.name, *node.args, grad_out)


def _matmul_grads(b, name, a, w, grad_out):
    """grad_a = g @ w^H, grad_w = a^H @ g (the conjugate transpose; a plain one if real)."""
    t = (1, 0) if name == "mm" else (0, 2, 1)

    def adjoint(x):
        x = views.emit_view(b, "permute", x, dims=t)
        if meta_of(x).dtype.is_complex:
            x = emit_pointwise(b, "conj", [x], dtype=meta_of(x).dtype, requires_grad=False)
        return x
    ga = gw = None
    if meta_of(a).requires_grad:
        ga = emit_extern(b, name, grad_out, adjoint(w))
    if meta_of(w).requires_grad:
        gw = emit_extern(b, name, adjoint(a), grad_out)
    return [ga, gw]


class AddMM(Extern):
    """bias + a @ w in one call: a linear's bias added in the matmul's epilogue (cuBLAS)
    rather than by a pass of its own over the product. Gradients: mm's for a and w; the
    bias's is grad_out, summed over the rows it was broadcast to (``sum_to_shape``)."""

    def vjp(self, b, node, grad_out):
        bias, a, w = node.args
        return [grad_out] + _matmul_grads(b, "mm", a, w, grad_out)


class IndexBackward(Extern):
    """The scatter-add of a gather's gradient (``runtime.program._index_backward``). Linear in
    the gradient: its own VJP gathers again, with the same index (double backward)."""

    def vjp(self, b, node, grad_out):
        grad, index = node.args
        if not meta_of(grad).requires_grad:
            return [None, None]
        p = node.kwargs
        return [structural.emit_gather(b, grad_out, index, p["mode"], p["dim"], p.get("padding_idx"), zero_padding=True,
                            wrap=p.get("wrap", False)), None]


class Convolution(Extern):
    """conv1d/2d/3d without bias (cuDNN on GPU); gradients through PyTorch's
    convolution_backward, one extern per gradient that is needed."""

    def vjp(self, b, node, grad_out):
        x, w = node.args
        grads = []
        for which, source in (("input", x), ("weight", w)):
            if not meta_of(source).requires_grad:
                grads.append(None)
                continue
            grads.append(b.call(EXTERNS["conv_backward"], [grad_out, x, w], {"which": which, **node.kwargs},
                                shape=meta_of(source).shape, dtype=meta_of(grad_out).dtype,
                                requires_grad=meta_of(grad_out).requires_grad))
        return grads


class ConvolutionBackward(Extern):
    def vjp(self, b, node, grad_out):
        raise NotImplementedError("double backward through a convolution is not supported yet "
                                  "(create_graph=True through conv1d/conv2d/conv3d)")


EXTERNS = {"mm": MatMul("mm"), "bmm": MatMul("bmm"), "addmm": AddMM("addmm"),
           "index_backward": IndexBackward("index_backward"),
           "conv": Convolution("conv"), "conv_backward": ConvolutionBackward("conv_backward")}


def emit_conv(b, x, w, shape, stride, padding, dilation, groups) -> fx.Node:
    return b.call(EXTERNS["conv"], [x, w], {"stride": stride, "padding": padding, "dilation": dilation,
                                            "groups": groups},
                  shape=shape, dtype=meta_of(x).dtype, requires_grad=meta_of(x).requires_grad or meta_of(w).requires_grad)


def emit_extern(b, name, a, w) -> fx.Node:
    sa, sw = meta_of(a).shape, meta_of(w).shape
    shape = (sa[0], sw[1]) if name == "mm" else (sa[0], sa[1], sw[2])
    dtype = torch.promote_types(meta_of(a).dtype, meta_of(w).dtype)
    return b.call(EXTERNS[name], [a, w], shape=shape, dtype=dtype,
                  requires_grad=meta_of(a).requires_grad or meta_of(w).requires_grad)


def emit_addmm(b, bias, a, w) -> fx.Node:
    """bias + a @ w for 2-D ``a`` and ``w`` and a bias that broadcasts to the product."""
    return b.call(EXTERNS["addmm"], [bias, a, w], shape=(meta_of(a).shape[0], meta_of(w).shape[1]),
                  dtype=torch.promote_types(meta_of(a).dtype, meta_of(w).dtype),
                  requires_grad=any(meta_of(x).requires_grad for x in (bias, a, w)))
