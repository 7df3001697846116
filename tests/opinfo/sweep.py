"""The OpInfo sweep: every op the README claims, over PyTorch's own sample inputs
(``torch.testing._internal.common_methods_invocations.op_db``), compiled vs eager.

Each sample runs as a function of its tensors: eagerly, then compiled with
``fullgraph=True`` (the recording, then a replay through the generated kernels in Triton's
interpreter). The outcome is one of

* ``pass``: the replay's values (and dtypes, shapes) and the gradients of every input that
  requires one equal eager's;
* ``fallback``: the compiler declined part of the call by design (``CompileError``), with
  its reason; results would have been eager's;
* ``mismatch``: a value, dtype or gradient other than eager's (a bug);
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

# The README's op list as OpInfo names. Dtypes: float32 and float64 for all; bfloat16 and
# complex64 where the README claims them (half-precision statistics; complex arithmetic,
# exp/log/sqrt/pow/sin/cos/tanh/sigmoid, reductions, matmuls and views).
REAL = (F32, F64)
WITH_BF16 = (F32, F64, BF16)
WITH_COMPLEX = (F32, F64, C64)
OPS = {
    # elementwise
    "add": WITH_COMPLEX, "sub": WITH_COMPLEX, "mul": WITH_COMPLEX, "div.no_rounding_mode": WITH_COMPLEX,
    "true_divide": REAL, "rsub": REAL, "neg": WITH_COMPLEX, "pow": WITH_COMPLEX, "exp": WITH_COMPLEX,
    "exp2": REAL, "expm1": REAL, "log": WITH_COMPLEX, "log1p": REAL, "log2": REAL, "log10": REAL,
    "sqrt": WITH_COMPLEX, "rsqrt": REAL, "sin": WITH_COMPLEX, "cos": WITH_COMPLEX, "tan": REAL, "asin": REAL,
    "acos": REAL, "atan": REAL, "sinh": REAL, "cosh": REAL, "tanh": WITH_COMPLEX, "asinh": REAL, "acosh": REAL,
    "atanh": REAL, "erf": REAL, "erfc": REAL, "erfinv": REAL, "atan2": REAL, "hypot": REAL, "logaddexp": REAL,
    "xlogy": REAL, "lerp": REAL, "addcmul": REAL, "addcdiv": REAL, "sign": REAL, "round": REAL, "floor": REAL,
    "ceil": REAL, "trunc": REAL, "frac": REAL, "abs": WITH_COMPLEX, "clamp": REAL, "clamp_min": REAL,
    "clamp_max": REAL, "where": REAL, "maximum": REAL, "minimum": REAL, "eq": REAL, "ne": REAL, "lt": REAL,
    "le": REAL, "gt": REAL, "ge": REAL, "logical_and": REAL, "logical_or": REAL, "logical_xor": REAL,
    "logical_not": REAL, "reciprocal": REAL, "square": REAL, "sigmoid": WITH_COMPLEX, "real": WITH_COMPLEX,
    "imag": (C64,), "angle": WITH_COMPLEX, "conj": WITH_COMPLEX, "complex": REAL, "polar": REAL,
    # activations
    "nn.functional.relu": REAL, "nn.functional.relu6": REAL, "nn.functional.leaky_relu": REAL,
    "nn.functional.elu": REAL, "nn.functional.selu": REAL, "nn.functional.celu": REAL,
    "nn.functional.gelu": WITH_BF16, "nn.functional.silu": WITH_BF16, "nn.functional.mish": REAL,
    "nn.functional.logsigmoid": REAL, "nn.functional.softplus": REAL, "nn.functional.softsign": REAL,
    "nn.functional.hardtanh": REAL, "nn.functional.hardsigmoid": REAL, "nn.functional.hardswish": REAL,
    # reductions, statistics, normalizations
    "sum": WITH_COMPLEX, "mean": WITH_COMPLEX, "amax": REAL, "amin": REAL, "max.reduction_no_dim": REAL,
    "max.reduction_with_dim": REAL, "max.binary": REAL, "min.reduction_no_dim": REAL,
    "min.reduction_with_dim": REAL, "min.binary": REAL, "argmax": REAL, "argmin": REAL, "all": REAL,
    "any": REAL, "var": REAL, "std": REAL, "var_mean": REAL, "std_mean": REAL, "norm": REAL,
    "linalg.vector_norm": REAL, "nn.functional.normalize": REAL, "nn.functional.cosine_similarity": REAL,
    "softmax": WITH_BF16, "log_softmax": WITH_BF16, "logsumexp": REAL, "nn.functional.layer_norm": WITH_BF16,
    "nn.functional.rms_norm": WITH_BF16, "nn.functional.group_norm": REAL,
    # losses
    "nn.functional.mse_loss": REAL, "nn.functional.l1_loss": REAL, "nn.functional.smooth_l1_loss": REAL,
    "nn.functional.huber_loss": REAL, "nn.functional.cross_entropy": REAL, "nn.functional.nll_loss": REAL,
    "nn.functional.binary_cross_entropy_with_logits": REAL, "nn.functional.kl_div": REAL,
    # structure
    "reshape": WITH_COMPLEX, "view": REAL, "permute": WITH_COMPLEX, "transpose": WITH_COMPLEX, "expand": REAL,
    "squeeze": REAL, "unsqueeze": REAL, "flatten": REAL, "t": REAL, "gather": REAL, "index_select": REAL,
    "split": REAL, "chunk": REAL, "cat": REAL, "stack": REAL, "repeat": REAL, "repeat_interleave": REAL,
    "unfold": REAL, "nn.functional.pad.constant": REAL, "nn.functional.interpolate.nearest": REAL,
    "tril": REAL, "triu": REAL, "masked_fill": REAL, "flip": REAL, "fliplr": REAL, "flipud": REAL,
    "clone": REAL, "contiguous": REAL, "new_ones": REAL, "new_zeros": REAL, "new_full": REAL,
    "new_empty": REAL, "zeros_like": REAL, "ones_like": REAL, "full_like": REAL,
    # layers
    "matmul": WITH_COMPLEX, "mm": WITH_COMPLEX, "bmm": REAL, "addmm": REAL, "nn.functional.linear": WITH_BF16,
    "nn.functional.conv1d": REAL, "nn.functional.conv2d": REAL, "nn.functional.conv3d": REAL,
    "nn.functional.max_pool1d": REAL, "nn.functional.max_pool2d": REAL, "nn.functional.max_pool3d": REAL,
    "nn.functional.avg_pool1d": REAL, "nn.functional.avg_pool2d": REAL, "nn.functional.avg_pool3d": REAL,
    "nn.functional.adaptive_avg_pool1d": REAL, "nn.functional.adaptive_avg_pool2d": REAL,
    "nn.functional.batch_norm": REAL, "nn.functional.embedding": REAL,
    "nn.functional.scaled_dot_product_attention": REAL,
}
# Ops whose values are unspecified (uninitialized memory): only shapes and dtypes compare.
SHAPE_ONLY = {"new_empty"}
# Ops that draw random numbers (eager's stream and ours differ): values compare only where
# the sample draws none (dropout_p = 0).
RANDOM = {"nn.functional.scaled_dot_product_attention"}

# Mismatches found by the sweep in code outside this sweep's owners' files, reported, not yet
# fixed: counted apart ("known") so that any other mismatch fails. (op, dtype, sample index): why.
KNOWN: dict = {}  # (none now: complex64 |z| near 1e30 is a true hypot since issue 16)

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
    """The default (CI) run: the first and the middle sample (``first``; the middle one only
    for the second and later dtypes of an op).
    The full run: every sample, except that an op with more than ``CAPPED_ABOVE`` (only max pooling:
    every combination of kernel, stride, padding, dilation, ceil_mode and return_indices, ~3 s
    each in the interpreter) keeps an even spread of ``FULL_CAP``."""
    if full:
        if len(samples) <= CAPPED_ABOVE:
            return list(enumerate(samples))
        step = len(samples) / FULL_CAP
        return [(int(k * step), samples[int(k * step)]) for k in range(FULL_CAP)]
    picks = sorted({0, len(samples) // 2} if first else {len(samples) // 2}) if samples else []
    return [(i, samples[i]) for i in picks]


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
    try:
        _compare(name, _outputs(out), _outputs(ref), dtype, "value")
        if ref_grads is not None:
            _compare(name, [g for g in grads], [g for g in ref_grads], dtype, "gradient")
    except AssertionError as e:
        return Outcome("mismatch", f"{e}"[:300])
    return Outcome("pass")


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
