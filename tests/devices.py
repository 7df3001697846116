"""Which device the test run is for: the CPU suite, or the CUDA test mode (issue 35).

``pytest -m gpu`` on a machine with a GPU runs the tests marked ``gpu`` (``GPU_FILES``: parity,
training steps, optimizers, clipping, Hugging Face models, hooks, saved tensors, dynamic shapes,
attention, memory) on CUDA tensors with compiled Triton kernels, against eager CUDA. The mode is
decided once per run, before Triton is imported, and read from ``SYMGRAD_TEST_DEVICE``:

- unset: the CPU suite (Triton's interpreter); ``-m gpu`` picks ``cuda`` where a GPU is present and
  skips the gpu tests where none is;
- ``cuda``: the CUDA test mode: tensors made without a device are CUDA tensors
  (``torch.set_default_device``), the tests' kernel backend is ``triton``, fp32 tolerances are the
  GPU's (``GPU_FP32``), and tests not marked ``gpu`` are skipped;
- ``cpu``: a rehearsal of the CUDA test mode on the CPU (default device set, the interpreter's
  kernels): what ``python -m benchmarks.gpu_check --dry-run`` runs, so the mode's own machinery is
  tested in CI.

Tests name the kernel backend as ``KERNELS`` (``interpret`` on the CPU, ``triton`` on CUDA), and
the backends they compare as ``BACKENDS``.
"""

from __future__ import annotations

import os
import re
import sys

ENV = "SYMGRAD_TEST_DEVICE"

# The files whose tests run in the CUDA test mode (the list), all their tests.
GPU_FILES = {
    "test_ops_parity.py", "test_elementwise.py", "test_reduction_layouts.py", "test_views.py", "test_complex.py",
    "test_training_step.py", "test_training_loop.py", "test_optimizer_step.py", "test_clip_grad.py",
    "test_models_hf.py", "test_hooks.py", "test_step_hooks.py", "test_saved_tensor_hooks.py",
    "test_dynamic_shapes.py", "test_dynamic_kernels.py", "test_attention.py", "test_memory.py", "test_random.py",
    "test_precision.py",
}

# fp32 tolerances on a GPU, where assert_close's default (rtol 1.3e-6, atol 1e-5) is calibrated on
# the interpreter's exact NumPy arithmetic. Compiled Triton differs from eager CUDA, both ways, by:
# fp32 ``/`` as div.full.f32 and exp/log through ex2/lg2.approx (2 ulp each, ~2.4e-7 relative),
# FMA contraction (each fused multiply-add rounds once where eager's may round twice, and eager's
# own kernels contract differently), and reductions summed in another order (tiles vs eager's
# block reductions: relative error grows ~sqrt(n)*eps, 4e-6 at the tests' largest rows of 4096).
# A fused kernel chains up to ~20 such operations before its one rounding to the output; rtol 1e-4
# is ten times that chain's worst case and still catches a wrong formula (which moves values by
# 1e-2 or more). bf16/fp16/fp64 keep assert_close's own (bf16's 1.6e-2 dwarfs these; fp64 has none
# of the approximations).
GPU_FP32 = {"rtol": 1e-4, "atol": 1e-5}


def _requested_by_marker(argv) -> bool:
    """Whether pytest's command line selects the gpu marker (``-m gpu``, ``-m "gpu and ..."``)."""
    expressions = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-m"]
    expressions += [a[2:] for a in argv if a.startswith("-m") and len(a) > 2 and not a.startswith("--")]
    return any(re.search(r"(?<!not )\bgpu\b", e) for e in expressions)


def decide() -> str:
    """The run's device ("cpu" suite, "cuda" mode, "cpu-rehearsal", or "skip": gpu tests asked for
    with no GPU), written to the environment so pytest-xdist's workers agree."""
    mode = os.environ.get(ENV, "").strip()
    if mode in ("cuda", "cpu"):
        return "cuda" if mode == "cuda" else "cpu-rehearsal"
    if mode:
        raise ValueError(f"{ENV}={mode!r}: choose cuda (the CUDA test mode) or cpu (its rehearsal on the CPU)")
    if not _requested_by_marker(sys.argv):
        return "cpu"
    import torch

    if torch.cuda.is_available():
        os.environ[ENV] = "cuda"
        return "cuda"
    return "skip"


MODE = decide()
CUDA = MODE == "cuda"
DEVICE = "cuda" if CUDA else "cpu"
def _compiler_found() -> bool:
    """Whether the C++ backend can build here (``runtime.cpp_build``; CI's machine has g++)."""
    from runtime import cpp_build

    return cpp_build.available()[0]


KERNELS = "triton" if CUDA else "interpret"   # the backend that runs the real generated kernels
# the backends a test runs each of on the CPU (the kernels in the interpreter, the torch path, C++ kernels
# where a compiler is found); on CUDA, Triton's
BACKENDS = ["triton"] if CUDA else ["interpret", "torch"] + (["cpp"] if _compiler_found() else [])


def tolerances(dtype) -> dict:
    """Keyword arguments for ``torch.testing.assert_close`` at ``dtype`` on this run's device
    ({} where assert_close's defaults hold)."""
    import torch

    return dict(GPU_FP32) if CUDA and dtype in (torch.float32, torch.complex64) else {}
