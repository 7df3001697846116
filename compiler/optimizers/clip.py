"""``torch.nn.utils.clip_grad_norm_`` inside a compiled function, compiled to fused kernels.

Eager computes each gradient's norm (``torch._foreach_norm``), the norm of those norms, and
``clip_coef = min(max_norm / (total_norm + 1e-6), 1)``, then multiplies every gradient by it
(``torch._foreach_mul_``): a dozen small ops under no_grad, run eagerly op by op. Compiled, a
call is three kinds of launch (``runtime.clip_grad.FusedClipGradNorm``), each over up to
``combo.MAX_PARAMETERS`` gradients laid out as the optimizer's combo kernels are:

1. *partials*: each program reduces one block of one gradient (sum of squares for the 2-norm,
   sum of absolute values for the 1-norm, largest absolute value for inf) into a scratch slot;
2. *finalize* (one program): each gradient's norm from its slots, the total norm from those,
   as eager orders it (per-gradient norms first), then the clip coefficient op by op as eager
   rounds it (``reciprocal(total + 1e-6) * max_norm``, clamped to 1; ``Tensor.__rdiv__``);
3. *scale*: every gradient multiplied in place by the coefficient.

The recording notes each call (``Recorder``); ``compile_clip`` turns one into the runtime's
plan, or says why it keeps running eagerly (a norm type, a dtype, a tensor subclass...).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch

from compiler.optimizers.combo import BLOCK, MAX_PARAMETERS, NUM_WARPS, named, select_member
from compiler.codegen.cpp_kernel import PARALLEL_MIN
from compiler.optimizers.cpp_combo import chunk_table, cpp_clip_sources, first_chunks
from runtime import backends, shards
from runtime.clip_grad import FusedClipGradNorm
from runtime.cpp_kernels import CppClip, CppFunctionInfo
from runtime.optimizer_step import ComboLaunch
from runtime.trace import CallKind

_INT32_LIMIT = 2 ** 31
_DTYPES = {torch.float32: "fp32", torch.float64: "fp64"}
NORM_TYPES = (1.0, 2.0, math.inf)


class NotFused(Exception):
    """Why a clip_grad_norm_ call keeps running eagerly."""


@dataclass
class ClipRecord:
    """One recorded ``clip_grad_norm_`` call: where its calls are and what it was given."""
    start: int                 # index of its first recorded call
    params: list               # weak references to its parameters, in order
    grads: list                # per parameter: None (no gradient) or a reason it is not fusible ("" if it is)
    grad_meta: list            # per parameter with a gradient: (dtype, numel, device)
    max_norm: object
    norm_type: object
    error_if_nonfinite: object
    foreach: object
    end: int | None = None     # index after its last recorded call (None: it raised)
    output_id: object = None   # value id of the total norm it returned
    meshes: list = field(default_factory=list)  # the device mesh of each DTensor gradient

    def ended(self, end: int, output_id) -> None:
        """The call returned: its calls end before index ``end``, its total norm is value ``output_id``
        (None where the recording does not know the tensor)."""
        self.end, self.output_id = end, output_id


def record(start, params, max_norm, norm_type, error_if_nonfinite, foreach) -> ClipRecord:
    """A ``ClipRecord`` for a call about to run (the gradients as they are before it)."""
    grads, meta, meshes = [], [], []
    with torch._C.DisableTorchFunction():  # the compiler's reads, not the function's
        for p in params:
            g = p.grad
            if g is None:
                grads.append(None)
                continue
            reason = ""
            if type(p) not in (torch.Tensor, torch.nn.Parameter) or type(g) is not torch.Tensor:
                # NOTE: a sharded DTensor gradient (FSDP2's) is reduced on its local shard, the ranks'
                # norms then combined by one all-reduce (runtime.shards); any other subclass runs eagerly
                reason = shards.refuse_norm(p, g) or ""
                if not reason:
                    meshes.append(g.device_mesh)
                    g = shards.local(g)
            if not reason and (g.layout != torch.strided or not g.is_contiguous()):
                reason = "has a gradient that is not a contiguous dense tensor"
            grads.append(reason)
            meta.append((g.dtype, g.numel(), g.device))
    return ClipRecord(start, [weakref.ref(p) for p in params], grads, meta, max_norm, norm_type,
                      error_if_nonfinite, foreach, meshes=meshes)


def compile_clip(trace, clip: ClipRecord, stats) -> FusedClipGradNorm:
    """The fused kernels for one recorded call; raises NotFused with the reason it runs eagerly."""
    if type(clip.max_norm) not in (int, float):
        raise NotFused(f"max_norm is a {type(clip.max_norm).__name__}, not a Python number")
    try:
        norm_type = float(clip.norm_type)
    except (TypeError, ValueError):
        raise NotFused(f"norm_type {clip.norm_type!r} is not a number") from None
    if norm_type not in NORM_TYPES:
        raise NotFused(f"norm_type={norm_type} (fused for 1, 2 and inf)")
    if clip.output_id is None:
        raise NotFused("its total norm is not a tensor the recording tracked")
    calls = trace.calls[clip.start:clip.end]
    if not calls or any(c.kind is not CallKind.EAGER or c.reason is not None for c in calls):
        raise NotFused("its calls were not all eager bookkeeping (the function runs under no_grad?)")
    for start, end in trace.optimizer_steps.items():
        if start <= clip.start < end:
            raise NotFused("it runs inside an optimizer.step(), which runs as a whole")
    params = [ref() for ref in clip.params]
    if any(p is None for p in params):
        raise NotFused("a parameter was made inside the function (a new one each call)")
    with_grad = [i for i, g in enumerate(clip.grads) if g is not None]
    if not with_grad:
        raise NotFused("no parameter has a gradient")
    for i in with_grad:
        if clip.grads[i]:
            raise NotFused(f"parameter {i} {clip.grads[i]}")
    mesh = _mesh_of(clip.meshes, len(with_grad))
    dtypes = {dtype for dtype, _, _ in clip.grad_meta}
    devices = {device for _, _, device in clip.grad_meta}
    if len(dtypes) > 1 or len(devices) > 1:
        raise NotFused("its gradients have several dtypes or devices (eager promotes their norms)")
    (dtype,), (device,) = dtypes, devices
    if dtype not in _DTYPES:
        raise NotFused(f"its gradients are {dtype} (fused for float32 and float64: eager rounds each "
                       "gradient's norm to it, which the kernels do not reproduce yet)")
    if device.type not in ("cpu", "cuda"):
        raise NotFused(f"its gradients are on {device.type}")
    numels = [numel for _, numel, _ in clip.grad_meta]
    if any(n >= _INT32_LIMIT for n in numels):
        raise NotFused("a gradient has 2**31 elements or more")
    return build(clip, dtype, numels, with_grad, norm_type, stats, mesh)


def _mesh_of(meshes: list, gradients: int):
    """The one mesh all gradients are sharded on, None where none is a DTensor; raises NotFused for a mix."""
    if not meshes:
        return None
    if len(meshes) != gradients:
        raise NotFused("its gradients mix DTensors and plain tensors")
    if any(m != meshes[0] for m in meshes):
        raise NotFused("its DTensor gradients are on several device meshes")
    return meshes[0]


def build(clip: ClipRecord, dtype, numels, with_grad, norm_type, stats, mesh=None) -> FusedClipGradNorm:
    """The plan: for C++ (``backend="cpp"``, CPU gradients) a norm and a scale function; for Triton
    partial and scale launches per chunk of gradients, one finalize launch."""
    plan = dict(end=clip.end, output_id=clip.output_id, params=clip.params, with_grad=with_grad, dtype=dtype,
                numels=numels, norm_type=float(clip.norm_type), error_if_nonfinite=clip.error_if_nonfinite,
                foreach=clip.foreach, stats=stats, mesh=mesh)
    size = dtype.itemsize
    if backends.chosen() == "cpp" and clip.grad_meta[0][2].type == "cpu":
        (norm_name, norm_source), (scale_name, scale_source_) = cpp_clip_sources(norm_type, dtype)
        members = list(range(len(numels)))
        cpp = CppClip(CppFunctionInfo(norm_name, norm_source, sum(numels) * size, members),
                      CppFunctionInfo(scale_name, scale_source_, 2 * sum(numels) * size, members), dtype,
                      tuple(chunk_table(numels)), tuple(first_chunks(numels)), sum(numels) >= PARALLEL_MIN)
        return FusedClipGradNorm(**plan, partial_launches=[], finalize=None, scale_launches=[], bounds=[0], cpp=cpp)
    partials, scales, bounds = [], [], [0]
    for chunk in range(0, len(numels), MAX_PARAMETERS):
        part = list(range(chunk, min(chunk + MAX_PARAMETERS, len(numels))))
        sizes = [numels[m] for m in part]
        name, source, grid = partials_source(norm_type, dtype, sizes)
        partials.append(ComboLaunch(name, source, part, [], grid, BLOCK, NUM_WARPS, sum(sizes) * size + grid * size))
        for n in sizes:
            bounds.append(bounds[-1] + -(-n // BLOCK))
        name, source, grid = scale_source(dtype, sizes)
        scales.append(ComboLaunch(name, source, part, [], grid, BLOCK, NUM_WARPS, 2 * sum(sizes) * size))
    name, source = finalize_source(norm_type, dtype, len(numels))
    finalize = ComboLaunch(name, source, [], ["max_norm", "eps"], 1, BLOCK, NUM_WARPS, bounds[-1] * size)
    return FusedClipGradNorm(**plan, partial_launches=partials, finalize=finalize, scale_launches=scales,
                             bounds=bounds)


# -- the kernels ---------------------------------------------------------------------------

_HEADER = ["import triton", "import triton.language as tl", "", ""]


def _norm_kind(norm_type) -> str:
    return {1.0: "norm1", 2.0: "norm2", math.inf: "norminf"}[norm_type]


def _combine(norm_type, acc, x) -> str:
    """Triton expression folding ``x`` into ``acc`` as the norm does (inf: the larger, NaN wins)."""
    if norm_type == math.inf:
        return f"tl.where(({x} > {acc}) | ({x} != {x}), {x}, {acc})"
    return f"{acc} + {x}"


def partials_source(norm_type, dtype, numels) -> tuple:
    """(name, source, grid): program ``i`` writes block ``i``'s partial into ``out_ptr[i]``."""
    acc = f"tl.{'float32' if dtype == torch.float32 else 'float64'}"
    if norm_type == 2.0:
        reduce = ["    return tl.sum(g * g, axis=0)"]
    elif norm_type == 1.0:
        reduce = ["    return tl.sum(tl.abs(g), axis=0)"]
    else:  # the largest |g|; a NaN anywhere makes it NaN, as eager's max-norm does
        reduce = ["    a = tl.abs(g)",
                  "    return tl.max(a, axis=0) + tl.sum(tl.where(a != a, a, 0.0), axis=0)"]
    lines = _HEADER + ["@triton.jit",
                       "def _partial(g_ptr, offsets, mask, other):",
                       f"    g = tl.load(g_ptr + offsets, mask=mask, other=other).to({acc})"] + reduce
    grid = _kernel_head(lines, numels, "out_ptr")
    lines += _whole_blocks_then_tail(
        lambda mask, other: f"tl.store(out_ptr + pid, _partial(g_ptr, offsets, {mask}, {other}))")
    name, source = named(f"optimizer_clip_{_norm_kind(norm_type)}_partials", lines)
    return name, source, grid


def finalize_source(norm_type, dtype, count) -> tuple:
    """(name, source): one program; gradient ``i``'s partials are ``partials[bounds[i]:bounds[i + 1]]``.
    Writes the total norm and the clip coefficient."""
    acc = "tl.float32" if dtype == torch.float32 else "tl.float64"
    sqrt = "tl.sqrt_rn" if dtype == torch.float32 else "tl.sqrt"
    # 1 / x as eager's reciprocal rounds it (Triton's fp32 ``/`` may be approximate on GPUs)
    reciprocal = "tl.div_rn(one, {})" if dtype == torch.float32 else "one / {}"
    scalar = _DTYPES[dtype]
    if norm_type == 2.0:
        per_gradient, fold = f"{sqrt}(tl.sum(part, axis=0))", "total + norm * norm"
        total = f"{sqrt}(total)"
    elif norm_type == 1.0:
        per_gradient, fold, total = "tl.sum(part, axis=0)", "total + norm", "total"
    else:
        per_gradient = "tl.max(part, axis=0) + tl.sum(tl.where(part != part, part, 0.0), axis=0)"
        fold, total = _combine(norm_type, "total", "norm"), "total"
    lines = _HEADER + [
        "@triton.jit",
        f"def KERNEL(partials_ptr, bounds_ptr, total_ptr, coef_ptr, max_norm: '{scalar}', eps: '{scalar}', "
        "BLOCK: tl.constexpr):",
        f"    total = tl.zeros((), {acc})",
        f"    one = tl.full((), 1.0, {acc})",
        f"    for i in range({count}):",
        "        lo = tl.load(bounds_ptr + i)",
        "        hi = tl.load(bounds_ptr + i + 1)",
        f"        part = tl.zeros((BLOCK,), {acc})",
        "        for start in range(lo, hi, BLOCK):",
        "            offsets = start + tl.arange(0, BLOCK)",
        "            x = tl.load(partials_ptr + offsets, mask=offsets < hi, other=0.0)",
        f"            part = {_combine(norm_type, 'part', 'x')}",
        f"        norm = {per_gradient}",
        f"        total = {fold}",
        f"    total = {total}",
        "    tl.store(total_ptr, total)",
        # eager: clip_coef = max_norm / (total_norm + 1e-6) (reciprocal, then times max_norm);
        # torch.clamp(clip_coef, max=1.0) keeps a NaN
        f"    coef = {reciprocal.format('(total + eps)')} * max_norm",
        "    coef = tl.where(coef > 1.0, one, coef)",
        "    tl.store(coef_ptr, coef)"]
    return named(f"optimizer_clip_{_norm_kind(norm_type)}_finalize", lines)


def _kernel_head(lines: list, numels, extra_arg: str):
    """Append the combo kernel's signature (one pointer per gradient, then ``extra_arg``) and the
    selection of this program's gradient (``g_ptr``, ``numel``, ``first``); return the grid."""
    args = ", ".join(f"g{i}" for i in range(len(numels)))
    lines += ["", "", "@triton.jit", f"def KERNEL({args}, {extra_arg}, BLOCK: tl.constexpr):",
              "    pid = tl.program_id(0)"]
    selection, grid = select_member(("g",), numels)
    lines += selection
    return grid


def _whole_blocks_then_tail(body) -> list:
    """This program's block of its gradient: whole blocks unmasked (vector loads), the last
    partial one masked; ``body(mask, other)`` is the line that loads (and stores) it."""
    return ["    offsets = (pid - first) * BLOCK + tl.arange(0, BLOCK)",
            "    if (pid - first + 1) * BLOCK <= numel:",
            "        " + body(None, None),
            "    else:",
            "        " + body("offsets < numel", "0.0")]


def scale_source(dtype, numels) -> tuple:
    """(name, source, grid): every gradient multiplied in place by ``coef_ptr[0]``."""
    lines = _HEADER + ["@triton.jit",
                       "def _scale(g_ptr, offsets, mask, coef):",
                       "    g = tl.load(g_ptr + offsets, mask=mask)",
                       "    tl.store(g_ptr + offsets, g * coef, mask=mask)"]
    grid = _kernel_head(lines, numels, "coef_ptr")
    lines += ["    coef = tl.load(coef_ptr)"]
    lines += _whole_blocks_then_tail(lambda mask, other: f"_scale(g_ptr, offsets, {mask}, coef)")
    name, source = named(f"optimizer_clip_scale_{_DTYPES[dtype]}", lines)
    return name, source, grid
