"""Combo kernels: one Triton kernel that updates many parameters of one dtype.

Each parameter gets its own contiguous range of programs (``cdiv(numel, BLOCK)`` of them,
fixed at build time: parameter shapes are guarded), and a chain of ``if pid < end`` picks
the parameter's pointers; the update itself is one ``@triton.jit`` helper called with them.
This is horizontal fusion as Inductor's combo/foreach kernels do it (their code is not
copied): a whole optimizer step is one launch per (parameter group, dtype) and chunk of
``MAX_PARAMETERS`` parameters, instead of one launch per parameter and op.
"""

from __future__ import annotations

import hashlib

import torch

BLOCK = 1024
NUM_WARPS = 4
# Parameters per kernel: each adds 2-5 pointer arguments and a branch. Inductor caps its
# foreach kernels' arguments similarly, to keep compile time and argument size bounded.
MAX_PARAMETERS = 32

_TRITON_DTYPE = {torch.float32: "fp32", torch.float64: "fp64"}


def combo_source(rule, key, dtype, numels) -> tuple:
    """(kernel name, Triton source, its scalar arguments in order, its grid) updating
    ``len(numels)`` contiguous parameters of ``dtype`` with ``rule``."""
    tensors = ("p", "g") + rule.state_names(key)
    stores = rule.stores(key)
    scalar_names = sorted(rule.scalar_names)
    body = [line.replace("SQRT(", "tl.sqrt_rn(" if dtype == torch.float32 else "tl.sqrt(")
            for line in rule.body(key)]
    scalar_type = _TRITON_DTYPE[dtype]

    def scalar_param(name):
        return f"{name}: 'i32'" if name == "lerp_low" else f"{name}: '{scalar_type}'"

    lines = ["import triton", "import triton.language as tl", "", "",
             "@triton.jit",
             f"def _update({', '.join(t + '_ptr' for t in tensors)}, offsets, mask, {', '.join(scalar_names)}):"]
    lines += [f"    {t} = tl.load({t}_ptr + offsets, mask=mask)" for t in tensors]
    lines += [f"    {line}" for line in body]
    lines += [f"    tl.store({t}_ptr + offsets, {t}, mask=mask)" for t in stores]
    pointer_args = [f"{t}{i}" for i in range(len(numels)) for t in tensors]
    lines += ["", "", "@triton.jit",
              f"def KERNEL({', '.join(pointer_args)}, {', '.join(scalar_param(s) for s in scalar_names)}, "
              "BLOCK: tl.constexpr):",
              "    pid = tl.program_id(0)"]
    start = 0
    for i, numel in enumerate(numels):
        # whole blocks unmasked, the last partial one masked: a mask bound that is not a
        # multiple of the vector width would make every load of the parameter scalar
        full, tail = divmod(numel, BLOCK)
        args = ", ".join(f"{t}{i}" for t in tensors)
        first = start
        for programs, mask in ((full, "None"), (int(tail > 0), f"offsets < {numel}")):
            if programs == 0:
                continue
            end = start + programs
            lines.append(f"    {'elif' if start else 'if'} pid < {end}:")
            lines.append(f"        offsets = (pid - {first}) * BLOCK + tl.arange(0, BLOCK)")
            lines.append(f"        _update({args}, offsets, {mask}, {', '.join(scalar_names)})")
            start = end
    source = "\n".join(lines) + "\n"
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    name = f"optimizer_{rule.name}_{digest}"
    return name, source.replace("KERNEL", name), scalar_names, start

