"""One program, eager vs compiled (backend="interpret", or ``SYMGRAD_FUZZ_BACKEND``'s): everything
eager shows must match.

The compiled function is called twice on fresh inputs: the first call records (it runs
eagerly), the second replays through the generated kernels. Each call is compared with
eager: the returned values (shape, dtype, requires_grad, values with NaN where eager has
NaN), the inputs afterwards (in-place writes), the gradients of the inputs that require grad
(``.grad``, None where eager leaves None), second derivatives where the first are
differentiable, and the exception where eager raises one (same type, same message).
The replay must have run kernels when the recording made some, and nothing may have fallen
back to eager because the compiler failed ("failed to compile" is always a bug).
"""

from __future__ import annotations

import os

import torch

import compiler

# Tolerance per dtype of the compared values; on top of it a float32 result may differ from
# eager by a few times eager's own error against a float64 run of the same program (a fused
# kernel rounds differently; where eager itself is ill-conditioned, so may we be).
TOLERANCE = {torch.float64: (1e-7, 1e-9), torch.complex128: (1e-7, 1e-9),
             torch.float32: (1e-4, 1e-5), torch.complex64: (1e-4, 1e-5),
             torch.float16: (1e-2, 1e-3), torch.bfloat16: (2e-2, 1e-2)}
SLACK = 8.0

# Fallbacks the compiler is allowed: substrings of reasons, each with why it is no bug.
ALLOWED_FALLBACKS = {
    "max with a dim": "Tensor.max(dim) returns indices too; README: use amax",
    "in-place op changed through other memory": "a view read after an in-place write through other "
                                               "memory it shares: that region runs eagerly",
    "elements share memory (expanded)": "an in-place write into an expanded tensor: that region runs eagerly",
    "an in-place op on a view whose base is outside this region": "capture follows writes through views "
                                                                  "of its own values only: runs eagerly",
    "may have saved for backward": "an in-place op on a view of a value the region's ops may have saved: "
                                   "runs eagerly, so eager's version error fires",
    "cat of non-tensors": "torch.cat with eager's legacy empty 1-d tensors: runs eagerly with the reason",
}


class Mismatch(AssertionError):
    """Compiled differs from eager; the message says where."""


class KnownBug(Exception):
    """A difference already reported, with an xfail(strict=True) regression test in
    tests/test_fuzz.py; the fuzz runs count these instead of stopping at them."""


# (name, test on the message of a Mismatch): bugs found by the fuzzer and not fixed yet.
# SYMGRAD_FUZZ_SKIP_PYTHON=1: the replayed call makes the recorded calls without the program's
# Python (compile(..., skip_python=True); the programs keep its promise: pure torch code)
SKIP_PYTHON = os.environ.get("SYMGRAD_FUZZ_SKIP_PYTHON", "0") == "1"
# SYMGRAD_FUZZ_BACKEND=cpp: the programs' kernels as C++ (the CPU default), not the Triton kernels in
# Triton's interpreter (the default here: the GPU's kernels); torch: the torch path's
BACKEND = os.environ.get("SYMGRAD_FUZZ_BACKEND", "interpret")
# what the results files call each backend's kernels
BACKEND_LABELS = {"interpret": "Triton interpreter", "cpp": "C++ kernels", "torch": "the torch path"}
if BACKEND not in BACKEND_LABELS:
    raise ValueError(f"SYMGRAD_FUZZ_BACKEND={BACKEND!r}: give interpret, cpp or torch")

# (name, test on (the Mismatch's message, the program's source)): bugs found and not fixed yet
KNOWN_BUGS: list = [
    # eager's pool backward nodes take the pool's input too, with a zero derivative
    # (derivatives.yaml: ``self: zeros_like(self)``): a second-order gradient through a pool alone is
    # zeros there; ours has no path from the input into the pool's gradient, so it is None
    # (tests/test_fuzz.py::test_known_bugs; the pool fuzz's seeds 706, 1021, 1029)
    ("second-order-gradient-through-a-pool-is-none",
     lambda message, source: "second-order grad" in message and "got None" in message and "pool" in source),
    # a value written in place (sub_, copy_) after an op of its region saved it: ours raises eager's
    # version error at backward where eager's backward never reaches that op's node (the loss reads
    # another output only); found at 6d23d5c by seeds 5919 and 6978 (tests/test_fuzz.py::test_known_bugs)
    ("version-error-where-eager-backward-skips-the-node",
     lambda message, source: "backward raised 'RuntimeError: one of the variables needed for gradient "
                             "computation has been modified by an inplace operation" in message
                             and message.rstrip().endswith("eager None")),
]


def run_all(program, fn):
    """Everything one call shows: (error, outputs, inputs after the call, grads, second grads)."""
    inputs = program.make_inputs()
    # NOTE: gradients of the inputs that require grad when the call starts (what .grad shows);
    # an input written in place gains a history, and gradients w.r.t. it are KNOWN below.
    leaves = [x for x in inputs if x.requires_grad]
    try:
        outputs = fn(*inputs)
    except Exception as e:  # noqa: BLE001
        return {"error": _describe(e)}
    result = {"error": None, "outputs": outputs, "inputs": inputs}
    loss = _loss(outputs)
    if not leaves or loss is None:
        return result
    try:
        grads = torch.autograd.grad(loss, leaves, allow_unused=True, create_graph=True)
        result["grads"] = grads
        second = _loss([g for g in grads if g is not None], square=True)
        if second is not None:
            result["second"] = torch.autograd.grad(second, leaves, allow_unused=True)
    except Exception as e:  # noqa: BLE001
        result["backward_error"] = _describe(e)
    return result


def _describe(e):
    return f"{type(e).__name__}: {e}"


def _seed_like(x, k):
    g = torch.Generator().manual_seed(1000 + k)
    dtype = torch.complex128 if x.dtype.is_complex else torch.float64
    return torch.randn(x.shape, generator=g, dtype=dtype).to(x.dtype)


def _loss(values, square=False):
    """A real scalar of every differentiable value, weighted by fixed random seeds."""
    total = None
    for k, v in enumerate(values):
        if not isinstance(v, torch.Tensor) or not v.requires_grad:
            continue
        term = (v.abs() ** 2).sum() if square else (v * _seed_like(v, k)).sum()
        term = term.real if term.is_complex() else term
        total = term if total is None else total + term
    return total


def _close(what, got, want, reference, loose=False):
    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
        if (got is None) != (want is None):
            raise Mismatch(f"{what}: got {_brief(got)}, eager {_brief(want)}")
        return
    if got.shape != want.shape or got.dtype != want.dtype:
        raise Mismatch(f"{what}: got {got.dtype}{list(got.shape)}, eager {want.dtype}{list(want.shape)}")
    if got.requires_grad != want.requires_grad and what.startswith("output"):
        raise Mismatch(f"{what}: requires_grad {got.requires_grad}, eager {want.requires_grad}")
    got, want = got.detach().resolve_conj(), want.detach().resolve_conj()
    if not (want.dtype.is_floating_point or want.dtype.is_complex):
        if not torch.equal(got, want):
            raise Mismatch(f"{what}: got {got.tolist()}, eager {want.tolist()}")
        return
    rtol, atol = TOLERANCE.get(want.dtype, (1e-4, 1e-5))
    if loose and "second-order" in what:  # derivatives of derivatives: rounding cancels further
        rtol, atol = max(rtol, 1e-3), max(atol, 1e-4)
    if loose:  # the program rounds through float32 somewhere (eager's gradient of a cast does too)
        rtol, atol = max(rtol, TOLERANCE[torch.float32][0]), max(atol, TOLERANCE[torch.float32][1])
    g, w = _as_f64(got), _as_f64(want)
    bound = atol + rtol * w.abs()
    if loose and w.numel():
        # float32: also relative to the tensor's scale (a fused kernel's sums cancel differently;
        # an element near 0 among large ones carries their rounding error)
        bound = bound + rtol * w.abs().nan_to_num(0.0, 0.0, 0.0).amax()
    if reference is not None and isinstance(reference, torch.Tensor) and reference.shape == want.shape:
        bound = bound + SLACK * (w - _as_f64(reference.detach().resolve_conj())).abs().nan_to_num(0.0)
    check_within(what, g, w, bound)


def check_within(what, g, w, bound, error=None):
    """Raise ``error`` (``Mismatch``) naming the first element of float64 ``g`` farther than
    ``bound`` from eager's ``w``: NaN where eager has NaN, an infinity where eager's equals it."""
    same_nan = torch.isnan(g) == torch.isnan(w)
    both_inf = torch.isinf(w) & (g == w)
    ok = same_nan & (torch.isnan(w) | both_inf | ((g - w).abs() <= bound))
    if not bool(ok.all()):
        bad = (~ok).nonzero()[0].tolist()
        raise (error or Mismatch)(f"{what}: at {bad} got {g[tuple(bad)].item()}, eager {w[tuple(bad)].item()}\n"
                                  f"  got   {_head(g)}\n  eager {_head(w)}")


def _head(x):
    try:
        return x.flatten()[:8].tolist()
    except RuntimeError:  # eager's second derivatives can come without storage
        return repr(x)


def _as_f64(x):
    return x.to(torch.complex128 if x.is_complex() else torch.float64)


def _brief(x):
    return f"{x.dtype}{list(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)


def _compare(call, got, want, reference, loose=False):
    if want["error"] is not None or got["error"] is not None:
        if got["error"] != want["error"]:
            raise Mismatch(f"{call}: raised {got['error']!r}, eager {want['error']!r}")
        return
    ref = reference or {}
    for i, (g, w) in enumerate(zip(got["outputs"], want["outputs"])):
        _close(f"{call}: output {i}", g, w, _at(ref, "outputs", i), loose)
    for i, (g, w) in enumerate(zip(got["inputs"], want["inputs"])):
        _close(f"{call}: input x{i} after the call", g, w, _at(ref, "inputs", i), loose)
    if got.get("backward_error") != want.get("backward_error"):
        raise Mismatch(f"{call}: backward raised {got.get('backward_error')!r}, eager {want.get('backward_error')!r}")
    for key, label in (("grads", "grad"), ("second", "second-order grad")):
        # NOTE: a compiled backward's result requires grad whenever its inputs do, where
        # eager's may not (maximum's gradient is a mask times grad_out, constant in x): where
        # eager has no second derivative, ours must be the derivative of a constant (zeros,
        # or NaN where the first derivative already was).
        if key == "second" and key in got and key not in want:
            want = dict(want, second=[None] * len(got[key]))
        if key == "second" and key in want and key not in got and all(
                w is None or not bool((w.detach().nan_to_num(0.0) != 0).any()) for w in want[key]):
            continue  # the other way round: eager's first derivative "requires grad" but is constant
        if (key in got) != (key in want):
            raise Mismatch(f"{call}: {label}s {'computed' if key in got else 'missing'}, unlike eager")
        for i, (g, w) in enumerate(zip(got.get(key, ()), want.get(key, ()))):
            if key == "second" and w is None and g is not None:
                if bool((g.detach().nan_to_num(0.0) != 0).any()):
                    raise Mismatch(f"{call}: nonzero {label} of input {i} where eager has none")
                continue
            _close(f"{call}: {label} of input {i}", g, w, _at(ref, key, i), loose)


def _at(ref, key, i):
    values = ref.get(key)
    return values[i] if values is not None and i < len(values) else None


def check_program(program) -> dict:
    """Run ``program`` eagerly and compiled (twice); raise ``Mismatch`` on any difference
    (``KnownBug`` for one listed in KNOWN_BUGS). Returns the compiled function's stats (and
    fallback reasons) for bookkeeping."""
    try:
        return _check(program)
    except Mismatch as e:
        known = next((name for name, matches in KNOWN_BUGS if matches(str(e), program.source)), None)
        if known is not None:
            raise KnownBug(f"{known}: {e}") from e
        raise


def _check(program) -> dict:
    want = run_all(program, program.function())
    reference = None
    if want["error"] is None and any(x.dtype in (torch.float32, torch.complex64) for x in program.inputs):
        reference = run_all(_Reference(program), program.function())
        if reference["error"] is not None:
            reference = None
    compiled = compiler.compile(program.function(), backend=BACKEND, skip_python=SKIP_PYTHON)
    first = run_all(program, compiled)
    loose = "float()" in program.source or "float32" in program.source or any(
        x.dtype in (torch.float32, torch.complex64, torch.float16) for x in program.inputs)
    _compare("first (recording) call", first, want, reference, loose)
    launches = compiled.stats["kernel_launches"]
    second = run_all(program, compiled)
    try:
        _compare("second (replayed) call", second, want, reference, loose)
    except Mismatch as e:
        if not _second_order_rounding(program, second, want, reference, e):
            raise
    stats = dict(compiled.stats)
    entry = compiled.last_entry
    fallbacks = list(entry.report.fallbacks) if entry is not None and want["error"] is None else []
    for reason in fallbacks:
        if "failed to compile" in reason or not any(s in reason for s in ALLOWED_FALLBACKS):
            raise Mismatch(f"fell back to eager: {reason}")
    if want["error"] is None:
        if stats["replays"] != 1 or stats["divergences"] != 0:
            raise Mismatch(f"second call did not replay its recording: {stats}")
        if entry.report.forward_kernels and stats["kernel_launches"] == launches:
            raise Mismatch("the replay ran no kernel although the recording compiled some")
    stats["fallbacks"] = fallbacks
    return stats


def _second_order_rounding(program, got, want, reference, mismatch) -> bool:
    """Whether a second derivative that differs from eager's in float32 is rounding, not math:
    our compiled kernels run on the float64 copies of the inputs agree with eager's float64
    reference to float64 precision (the same math), and the float32 difference is within 1% of
    the first derivatives' scale (the terms a second derivative sums cancel there: hypot(2x, x)
    near x = 0 gives 1.5e-4 where eager's order of operations gives 0; fuzz seed 2544). A wrong
    derivative differs in float64 too, and stays a Mismatch."""
    if reference is None or "second-order grad" not in str(mismatch) or "second" not in got \
            or "second" not in reference:
        return False
    compiled64 = compiler.compile(program.function(), backend=BACKEND)
    ours64 = None
    for _ in range(2):  # (the first call records eagerly: the second runs our kernels)
        ours64 = run_all(_Reference(program), compiled64)
    if ours64.get("error") is not None or ours64.get("second") is None or compiled64.stats["replays"] != 1:
        return False
    scale = max((float(g.detach().abs().nan_to_num(0.0, 0.0, 0.0).max()) for g in want.get("grads", ())
                 if isinstance(g, torch.Tensor) and g.numel()), default=0.0)
    for g32, w32, g64, r64 in zip(got["second"], want["second"], ours64["second"], reference["second"]):
        if not all(isinstance(t, torch.Tensor) for t in (g32, w32, g64, r64)):
            if any(isinstance(t, torch.Tensor) for t in (g32, w32)) and (g32 is None) != (w32 is None):
                return False
            continue
        g64, r64 = _as_f64(g64.detach()), _as_f64(r64.detach())
        if not bool(((g64 - r64).abs() <= 1e-9 * max(scale, 1.0) + 1e-7 * r64.abs()).all()):
            return False  # the float64 runs differ: math, not rounding
        g32, w32 = _as_f64(g32.detach()), _as_f64(w32.detach())
        if not bool(((g32 - w32).abs().nan_to_num(0.0) <= 1e-2 * scale).all()) \
                or not torch.equal(torch.isnan(g32), torch.isnan(w32)):
            return False
    return True


class _Reference:
    """The same program on float64 (complex128) copies of its inputs."""

    def __init__(self, program):
        self.program = program

    def make_inputs(self):
        return self.program.make_inputs(reference=True)
