"""Ops whose kernels are PyTorch's (matmuls, convolutions, a gather's scatter-add gradient)."""

from __future__ import annotations

import torch
import torch.fx as fx

from compiler.ir.graph import OpKind, meta_of
from compiler.ir.ops import structural, views
from compiler.ir.ops.base import OpDef
from compiler.ir.ops.pointwise import emit_pointwise


# ----------------------------------------------------------------------------- extern
class Extern(OpDef):
    """An op whose kernel is PyTorch's: a hand-written VJP here, and ``torch_fn``, the torch
    function that computes it (``torch_fn(*args, **node.kwargs)``), which the runtime calls
    (``runtime.program.ExternCall``) and the reference executor too. Its result is always a
    buffer; fusion works around it."""

    kind = OpKind.EXTERN

    def __init__(self, name, torch_fn=None):
        super().__init__(name)
        if torch_fn is not None:
            self.torch_fn = torch_fn

    def evaluate(self, node: fx.Node, args: list) -> torch.Tensor:
        """The op's value on real tensors (``compiler.ir.reference``)."""
        return self.torch_fn(*args, **node.kwargs)

    def function_for(self, backend: str):
        """What a program built for ``backend`` calls (an op with kernels of its own picks them)."""
        return self.torch_fn

    def kernels_launched(self, backend: str, nodes) -> int:
        """How many of our own kernels the call making ``nodes`` launches (PyTorch's: none)."""
        return 0


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
    """The scatter-add of a gather's gradient. Linear in the gradient: its own VJP gathers
    again, with the same index (double backward)."""

    @staticmethod
    def torch_fn(grad, index, *, mode, dim, shape, padding_idx=None, wrap=False):
        """The gradient of a gather: ``grad`` summed into zeros of the source's ``shape`` at the
        gathered positions (repeats add up). ``mode`` says how ``index`` picked them: gather
        (torch.gather), index_select (along ``dim``) or embedding (rows; ``padding_idx`` gets none)."""
        if mode == "embedding":
            return torch.ops.aten.embedding_dense_backward(
                grad, index, shape[0], -1 if padding_idx is None else padding_idx, False)
        if wrap:  # x[idx]: negative indices count from the end
            index = torch.where(index < 0, index + shape[dim], index)
        out = torch.zeros(shape, dtype=grad.dtype, device=grad.device)
        if mode == "gather":
            return out.scatter_add_(dim, index, grad)
        if index.dim() != 1:  # x[idx] with an n-d idx: its dims stand where ``dim`` was
            grad = grad.reshape(*shape[:dim], index.numel(), *shape[dim + 1:])
            index = index.reshape(-1)
        return out.index_add_(dim, index, grad)

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

    @staticmethod
    def torch_fn(x, weight, *, stride, padding, dilation, groups):
        """A convolution without bias (the bias is added by a fused kernel)."""
        return torch.convolution(x, weight, None, stride, padding, dilation, False, [0] * len(stride), groups)

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
    """One of a convolution's two gradients (``which``: "input" or "weight")."""

    @staticmethod
    def torch_fn(grad, x, weight, *, which, stride, padding, dilation, groups):
        mask = [which == "input", which == "weight", False]
        out = torch.ops.aten.convolution_backward(grad, x, weight, None, stride, padding, dilation, False,
                                                  [0] * len(stride), groups, mask)
        return out[0] if which == "input" else out[1]

    def joint_key(self, node):
        """Gradients of one convolution (same operands and parameters) are made by one call."""
        return tuple(node.args), tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                              for k, v in node.kwargs.items() if k != "which"))

    def joint_call(self, nodes, backend):
        """(fn, kwargs, nodes in fn's output order): both gradients from one ``convolution_backward``
        (eager's autograd makes them in one call too; on a GPU it is cuDNN's two kernels either way)."""
        which = {n.kwargs["which"]: n for n in nodes}
        if len(nodes) != 2 or set(which) != {"input", "weight"}:
            return None
        kwargs = {k: v for k, v in nodes[0].kwargs.items() if k != "which"}
        return _both_conv_grads, kwargs, [which["input"], which["weight"]]

    def vjp(self, b, node, grad_out):
        """Double backward. Each gradient is bilinear: the input's in (grad, weight), the
        weight's in (grad, input); so its VJP is a convolution or the other gradient with the
        incoming ``grad_out`` in one operand's place (x enters the input's gradient by shape only)."""
        grad, x, w = node.args
        which, params = node.kwargs["which"], {k: v for k, v in node.kwargs.items() if k != "which"}
        gg = gx = gw = None
        if meta_of(grad).requires_grad:  # the forward convolution again, of grad_out
            gg = emit_conv(b, grad_out, w, meta_of(grad).shape, **params) if which == "input" else \
                emit_conv(b, x, grad_out, meta_of(grad).shape, **params)
        other, source = ("weight", w) if which == "input" else ("input", x)
        if meta_of(source).requires_grad:
            operands = [grad, grad_out, w] if which == "input" else [grad, x, grad_out]
            found = b.call(EXTERNS["conv_backward"], operands, {"which": other, **params},
                           shape=meta_of(source).shape, dtype=meta_of(grad_out).dtype,
                           requires_grad=any(meta_of(o).requires_grad for o in operands))
            gw, gx = (found, None) if which == "input" else (None, found)
        return [gg, gx, gw]


def _both_conv_grads(grad, x, weight, *, stride, padding, dilation, groups):
    """A convolution's input and weight gradients, one call (``ConvolutionBackward.joint_call``)."""
    gx, gw, _ = torch.ops.aten.convolution_backward(grad, x, weight, None, stride, padding, dilation, False,
                                                    [0] * len(stride), groups, [True, True, False])
    return gx, gw


EXTERNS = {"mm": MatMul("mm", torch.mm), "bmm": MatMul("bmm", torch.bmm),
           "addmm": AddMM("addmm", torch.addmm),  # bias + a @ w: the bias added in cuBLAS's epilogue
           "index_backward": IndexBackward("index_backward"),
           "conv": Convolution("conv"), "conv_backward": ConvolutionBackward("conv_backward")}


def emit_conv(b, x, w, shape, stride, padding, dilation, groups) -> fx.Node:
    return b.call(EXTERNS["conv"], [x, w], {"stride": stride, "padding": padding, "dilation": dilation,
                                            "groups": groups},
                  shape=shape, dtype=meta_of(x).dtype,
                  requires_grad=meta_of(x).requires_grad or meta_of(w).requires_grad)


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
