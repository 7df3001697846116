"""The OpInfo sweep: every op the README claims, over PyTorch's own sample inputs
(``torch.testing._internal.common_methods_invocations.op_db``), compiled vs eager.

Each sample runs as a function of its tensors: eagerly, then compiled with
``fullgraph=True`` (the recording, then a replay through the generated kernels in Triton's
interpreter). The outcome is one of

* ``pass``: the replay's values (and dtypes, shapes) and the gradients of every input that
  requires one equal eager's (bfloat16: or are as close to the float64 result as eager's are,
  ``_as_accurate_as_eager``);
* ``fallback``: the compiler declined part of the call by design (``CompileError``), with
  its reason; results would have been eager's;
* ``mismatch``: a value, dtype or gradient other than eager's, or a second call that did not
  replay the recording's kernels (it ran eagerly: nothing compiled was compared) (a bug);
* ``internal``: an internal compiler error (``InternalCompilerError`` under SYMGRAD_STRICT=1,
  a bug);
* ``skip``: eager itself raises on the sample (nothing to compare);
* ``known``: a mismatch listed in ``KNOWN`` (reported, not fixed yet).

``select_samples`` keeps a fixed subset of each op's samples by default (the CI run);
``SYMGRAD_OPINFO=full`` keeps them all.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

import compiler
from compiler import CompileError, InternalCompilerError

F32, F64, BF16, C64 = torch.float32, torch.float64, torch.bfloat16, torch.complex64

# The README's op list as OpInfo names, each in float32, float64 and bfloat16 (every op whose
# OpInfo takes bfloat16 on CPU: all but ``NO_BF16``), and complex64 where the README
# claims complex support and the OpInfo takes it: arithmetic, exp/log/sqrt/pow/sin/cos/tanh/
# sigmoid, complex parts, sum/mean, views, matmuls. ``dtypes_of`` checks each against the OpInfo.
BASE = (F32, F64, BF16)
COMPLEX = {
    "add", "sub", "mul", "div.no_rounding_mode", "true_divide", "rsub", "neg", "pow", "exp", "log", "sqrt", "sin",
    "cos", "tanh", "sigmoid", "abs", "real", "imag", "angle", "conj", "sum", "mean", "reshape", "view", "permute",
    "transpose", "expand", "squeeze", "unsqueeze", "flatten", "t", "matmul", "mm", "bmm", "addmm",
    "nn.functional.linear",
}
NAMES = [
    # elementwise
    "add", "sub", "mul", "div.no_rounding_mode", "true_divide", "rsub", "neg", "pow", "exp", "exp2", "expm1", "log",
    "log1p", "log2", "log10", "sqrt", "rsqrt", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh",
    "asinh", "acosh", "atanh", "erf", "erfc", "erfinv", "atan2", "hypot", "logaddexp", "xlogy", "lerp", "addcmul",
    "addcdiv", "sign", "round", "floor", "ceil", "trunc", "frac", "abs", "clamp", "clamp_min", "clamp_max", "where",
    "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor",
    "logical_not", "reciprocal", "square", "sigmoid", "real", "imag", "angle", "conj", "complex", "polar",
    # activations
    "nn.functional.relu", "nn.functional.relu6", "nn.functional.leaky_relu", "nn.functional.elu",
    "nn.functional.selu", "nn.functional.celu", "nn.functional.gelu", "nn.functional.silu", "nn.functional.mish",
    "nn.functional.logsigmoid", "nn.functional.softplus", "nn.functional.softsign", "nn.functional.hardtanh",
    "nn.functional.hardsigmoid", "nn.functional.hardswish",
    # reductions, statistics, normalizations
    "sum", "mean", "amax", "amin", "max.reduction_no_dim", "max.reduction_with_dim", "max.binary",
    "min.reduction_no_dim", "min.reduction_with_dim", "min.binary", "argmax", "argmin", "all", "any", "var", "std",
    "var_mean", "std_mean", "norm", "linalg.vector_norm", "nn.functional.normalize",
    "nn.functional.cosine_similarity", "softmax", "log_softmax", "logsumexp", "nn.functional.layer_norm",
    "nn.functional.rms_norm", "nn.functional.group_norm",
    # losses
    "nn.functional.mse_loss", "nn.functional.l1_loss", "nn.functional.smooth_l1_loss", "nn.functional.huber_loss",
    "nn.functional.cross_entropy", "nn.functional.nll_loss", "nn.functional.binary_cross_entropy_with_logits",
    "nn.functional.kl_div",
    # structure
    "reshape", "view", "permute", "transpose", "expand", "squeeze", "unsqueeze", "flatten", "t", "gather",
    "index_select", "split", "chunk", "cat", "stack", "repeat", "repeat_interleave", "unfold",
    "nn.functional.pad.constant", "nn.functional.interpolate.nearest", "tril", "triu", "masked_fill", "flip",
    "fliplr", "flipud", "clone", "contiguous", "new_ones", "new_zeros", "new_full", "new_empty", "zeros_like",
    "ones_like", "full_like",
    # layers
    "matmul", "mm", "bmm", "addmm", "nn.functional.linear", "nn.functional.conv1d", "nn.functional.conv2d",
    "nn.functional.conv3d", "nn.functional.max_pool1d", "nn.functional.max_pool2d", "nn.functional.max_pool3d",
    "nn.functional.avg_pool1d", "nn.functional.avg_pool2d", "nn.functional.avg_pool3d",
    "nn.functional.adaptive_avg_pool1d", "nn.functional.adaptive_avg_pool2d", "nn.functional.batch_norm",
    "nn.functional.embedding", "nn.functional.scaled_dot_product_attention",
]
# OpInfos whose CPU dtypes have no bfloat16 (imag: complex only; complex and polar: no complex32)
NO_BF16 = {"imag", "complex", "polar", "nn.functional.avg_pool3d"}
ONLY_COMPLEX = {"imag"}
OPS = {name: ((C64,) if name in ONLY_COMPLEX else
              tuple(d for d in BASE if not (d == BF16 and name in NO_BF16)) + ((C64,) if name in COMPLEX else ()))
       for name in NAMES}


def dtypes_of(info) -> set:
    """The dtypes of ``BASE`` and complex64 that an OpInfo's CPU samples take (the sweep's check
    that ``OPS`` leaves none out)."""
    return {d for d in (*BASE, C64) if d in info.supported_dtypes("cpu")}


# Ops whose values are unspecified (uninitialized memory): only shapes and dtypes compare.
SHAPE_ONLY = {"new_empty"}
# Ops that draw random numbers (eager's stream and ours differ): values compare only where
# the sample draws none (dropout_p = 0).
RANDOM = {"nn.functional.scaled_dot_product_attention"}

# Mismatches found by the sweep in code outside this sweep's owners' files, reported, not yet
# fixed, or a known property of an algorithm eager itself runs elsewhere: counted apart ("known")
# so that any other mismatch fails. (op, dtype, sample index): why.
_FLASH_DELTA = ("bf16, 3-D q/k/v: eager dispatches 3-D inputs to its math kernel; ours runs flash attention, "
                "whose dQ reads delta = rowsum(dO * O) from the bf16-rounded output as every flash kernel does "
                "(FlashAttention-2 on CUDA, eager's own CPU flash kernel): on these samples made 4-D, eager's "
                "dQ error equals ours bitwise")
KNOWN: dict = {("nn.functional.scaled_dot_product_attention", BF16, 4): _FLASH_DELTA,
                ("nn.functional.scaled_dot_product_attention", BF16, 5): _FLASH_DELTA}

TOLERANCE = {F32: dict(rtol=1e-4, atol=1e-5), F64: dict(rtol=1e-7, atol=1e-7), BF16: dict(rtol=2e-2, atol=2e-2),
             C64: dict(rtol=1e-4, atol=1e-5)}


def full_sweep() -> bool:
    return os.environ.get("SYMGRAD_OPINFO", "") == "full"


def opinfos() -> dict:
    """{sweep name: OpInfo} for the ops in ``OPS`` (importing op_db takes ~10-30 s)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    found = {}
    for info in op_db:
        name = info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")
        if name in OPS:
            found[name] = info
    return found


FULL_CAP = 48     # per op and dtype in the full run, for ops with more than CAPPED_ABOVE samples
CAPPED_ABOVE = 400  # (only max pooling: up to 1,440 samples per dtype)


def select_samples(samples: list, full: bool, first: bool = True) -> list:
    """The default (CI) run: the first sample in an op's first dtype (``first``), the middle one in
    each of its other dtypes (so each op sees both, and every dtype one, in three or four runs).
    The full run: every sample, except that an op with more than ``CAPPED_ABOVE`` (only max pooling:
    every combination of kernel, stride, padding, dilation, ceil_mode and return_indices, ~3 s
    each in the interpreter) keeps an even spread of ``FULL_CAP``."""
    if full:
        if len(samples) <= CAPPED_ABOVE:
            return list(enumerate(samples))
        step = len(samples) / FULL_CAP
        return [(int(k * step), samples[int(k * step)]) for k in range(FULL_CAP)]
    if not samples:
        return []
    pick = 0 if first else len(samples) // 2
    return [(pick, samples[pick])]


@dataclasses.dataclass
class Outcome:
    kind: str          # pass, fallback, mismatch, internal, skip
    detail: str = ""


def _clone_leaves(leaves):
    return [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in leaves]


def _outputs(out) -> list:
    leaves, _ = tree_flatten(out)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _seeded_loss(outs):
    """sum(out * seed) over every output that needs a gradient (the seeds fixed, not ones:
    a gradient that only sums would hide a permuted one)."""
    g = torch.Generator().manual_seed(0)
    total = None
    for o in outs:
        if isinstance(o, torch.Tensor) and o.requires_grad:
            seed = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)
            term = (o * seed).sum().real if o.dtype.is_complex else (o * seed).sum()
            total = term if total is None else total + term
    return total


def _grads(fn, leaves, sample):
    """(outputs, gradients of the leaves that require grad) of one run on fresh copies."""
    args = _clone_leaves(leaves)
    out = fn(*[a for a in args if isinstance(a, torch.Tensor)])
    processed = sample.output_process_fn_grad(out) if sample.output_process_fn_grad else out
    loss = _seeded_loss(_outputs(processed))
    grads = None
    if loss is not None:
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return out, grads


def check_sample(name: str, info, sample, dtype) -> Outcome:
    """Compiled vs eager on one sample (see the module docstring for the outcomes)."""
    leaves, spec = tree_flatten((sample.input, sample.args, sample.kwargs))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if name in RANDOM and sample.kwargs.get("dropout_p", 0.0):
        return Outcome("skip", "draws random numbers")

    def fn(*tensors):
        values = list(leaves)
        for i, t in zip(positions, tensors):
            values[i] = t
        x, args, kwargs = tree_unflatten(values, spec)
        return info.op(x, *args, **kwargs)

    fn.__qualname__ = f"opinfo[{name}]"
    try:
        ref, ref_grads = _grads(fn, leaves, sample)
    except Exception as e:  # eager raises on this sample: nothing to compare
        return Outcome("skip", f"eager raises {type(e).__name__}")
    compiled = compiler.compile(fn, backend="interpret", fullgraph=True)
    try:
        _grads(compiled, leaves, sample)                    # the recording
        out, grads = _grads(compiled, leaves, sample)       # the replay
    except CompileError as e:
        return Outcome("fallback", _reason(str(e)))
    except InternalCompilerError as e:
        return Outcome("internal", f"{e}"[:300])
    except Exception as e:  # anything else the compiled call raised where eager did not
        return Outcome("mismatch", f"raises {type(e).__name__}: {e}"[:300])
    if compiled.stats["divergences"] or compiled.stats["replays"] != 1:
        # the second call ran eagerly (it left its recording, or recorded again): its values are
        # eager's own, so comparing them would pass with no compiled kernel run
        return Outcome("mismatch", f"the second call did not replay its recording: {compiled.last_backend}, "
                                   f"{compiled.stats}"[:300])
    try:
        _compare(name, _outputs(out), _outputs(ref), dtype, "value")
        if ref_grads is not None:
            _compare(name, list(grads or ()), list(ref_grads), dtype, "gradient")
    except AssertionError as e:
        if dtype != BF16 or not _as_accurate_as_eager(fn, leaves, sample, (out, grads), (ref, ref_grads)):
            return Outcome("mismatch", f"{e}"[:300])
    return Outcome("pass")


def _as_accurate_as_eager(fn, leaves, sample, mine, eager) -> bool:
    """Whether a bfloat16 result that differs from eager's by more than the tolerance is as close
    to the exact result as eager's is: against the float64 run of the same (bf16-valued) inputs,
    each tensor's largest error relative to its elements' sizes (``_worst_error``) at most
    eager's plus the relative tolerance.

    NOTE: eager rounds each op's result to bf16 (a gradient through x ** y is three roundings),
    where a fused kernel rounds once; a sum in another order rounds other elements. The two
    differ by a few ulps (up to 0.4 at 2**7), elementwise unalike, while both are within bf16's
    precision of the exact value. A real bug (a wrong index, a missing term) is far from both."""
    wide = [x.detach().double().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) and x.dtype == BF16
            else x for x in leaves]
    try:
        truth = _grads(fn, wide, sample)
    except Exception:
        return False
    for m_all, r_all, t_all in ((_outputs(mine[0]), _outputs(eager[0]), _outputs(truth[0])),
                                (list(mine[1] or ()), list(eager[1] or ()), list(truth[1] or ()))):
        if not len(m_all) == len(r_all) == len(t_all):
            return False
        for m, r, t in zip(m_all, r_all, t_all):
            if m is None or r is None or t is None:
                if not (m is None and r is None):
                    return False
                continue
            if m.dtype != r.dtype or m.shape != r.shape or t.shape != r.shape:
                return False
            if not r.is_floating_point():
                if not torch.equal(m, r):
                    return False
                continue
            m, r, t = m.detach().double(), r.detach().double(), t.detach().double()
            same = (m == r) | (m.isnan() & r.isnan())
            if not bool((same | t.isfinite()).all()):  # where the exact result is inf or NaN: eager's
                return False
            if _worst_error(m, t, same) > _worst_error(r, t, same) + TOLERANCE[BF16]["rtol"]:
                return False
    return True


def _worst_error(x, exact, skip):
    """max |x - exact| / size over the elements not in ``skip``, a size being |exact| or, for
    smaller ones, 1/16 of the tensor's largest |exact| (a sum that cancels keeps the absolute
    error of its terms), plus atol / rtol (the tolerance's own floor)."""
    keep = ~skip & exact.isfinite()
    if not keep.any():
        return 0.0
    tol = TOLERANCE[BF16]
    size = exact.abs().clamp_min(float(exact[keep].abs().max()) / 16) + tol["atol"] / tol["rtol"]
    error = ((x - exact).abs() / size)[keep]
    return float("inf") if error.isnan().any() else float(error.max())


def _compare(name, mine, theirs, dtype, what):
    assert len(mine) == len(theirs), f"{what}: {len(mine)} results where eager has {len(theirs)}"
    for k, (m, t) in enumerate(zip(mine, theirs)):
        if t is None or m is None:
            assert (m is None) == (t is None), f"{what} {k}: None where eager has a tensor (or back)"
            continue
        assert m.dtype == t.dtype and m.shape == t.shape, \
            f"{what} {k}: {m.dtype}{list(m.shape)} where eager has {t.dtype}{list(t.shape)}"
        if name in SHAPE_ONLY and what == "value":
            continue
        tol = TOLERANCE.get(t.dtype, dict(rtol=0, atol=0)) if t.is_floating_point() or t.is_complex() \
            else dict(rtol=0, atol=0)
        if what == "gradient" and t.dtype in (F32, C64):
            # a float32 gradient sums rounded terms (a normalization's 1/std amplifies them): eager's
            # own kernels differ by as much between CPU and GPU
            tol = dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(m, t, equal_nan=True, msg=lambda s: f"{what} {k}: {s}", **tol)


def _reason(message: str) -> str:
    """The fallback's reason without the function's name (one line per distinct reason)."""
    return message.split("cannot be compiled whole: ", 1)[-1].split("; ")[0][:200]


def run(name: str, info, dtype, full: bool):
    """[(sample index, Outcome)] for ``name`` at ``dtype``."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        samples = list(info.sample_inputs("cpu", dtype, requires_grad=info.supports_autograd and
                                          (dtype.is_floating_point or dtype.is_complex)))
    first = dtype == OPS[name][0]
    outcomes = [(i, check_sample(name, info, s, dtype)) for i, s in select_samples(samples, full, first)]
    return [(i, Outcome("known", KNOWN[(name, dtype, i)]) if o.kind == "mismatch" and (name, dtype, i) in KNOWN else o)
            for i, o in outcomes]
