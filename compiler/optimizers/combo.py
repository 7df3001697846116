"""Combo kernels: one Triton kernel that updates many parameters of one dtype.

Each parameter gets its own contiguous range of programs (``cdiv(numel, BLOCK)`` of them,
fixed at build time: parameter shapes are guarded). A program picks its parameter's pointers,
first program and size with a chain of selects on its program id, then runs the update once:
whole blocks unmasked (vectorized loads), a parameter's last partial block masked. This is
horizontal fusion as Inductor's combo/foreach kernels do it (their code is not copied): a
whole optimizer step is one launch per (parameter group, dtype) and chunk of
``MAX_PARAMETERS`` parameters, instead of one launch per parameter and op.

NOTE: selects, not an ``if pid < end`` branch per parameter: branches inline one copy of the
update per parameter, and ptxas took 5x longer on 32 of them (66 s against 13 s for an Adam
kernel here); selects keep the pointers' 16-byte alignment facts, so loads stay vectorized.
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
    # NOTE: on a GPU, Triton's fp32 ``/`` compiles to div.full.f32 (2 ulp) and ``tl.sqrt`` to an
    # approximate root; eager's foreach kernels round both as IEEE does (``_foreach_sqrt``,
    # ``addcdiv_``). An update's error lands in the parameters and compounds over every step, so
    # the rules' SQRT and DIV are the correctly rounded forms (fp64 is always exact).
    exact = dtype == torch.float32
    functions = {"SQRT(": "tl.sqrt_rn(" if exact else "tl.sqrt(", "DIV(": "tl.div_rn(" if exact else "_div(",
                 "WHERE(": "tl.where("}
    body = [f"{target} = {spelled(expression, functions)}" for target, expression in rule.body(key)]
    scalar_type = _TRITON_DTYPE[dtype]

    def scalar_param(name):
        return f"{name}: 'i32'" if name in rule.integer_scalars else f"{name}: '{scalar_type}'"

    lines = ["import triton", "import triton.language as tl", "", "",
             "@triton.jit", "def _div(a, b):", "    return a / b", "", "",
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
    selection, grid = select_member(tensors, numels)
    lines += selection
    lines.append("    offsets = (pid - first) * BLOCK + tl.arange(0, BLOCK)")
    args = ", ".join(f"{t}_ptr" for t in tensors)
    # whole blocks unmasked, the last partial one masked: a mask would make every load scalar
    lines.append("    if (pid - first + 1) * BLOCK <= numel:")
    lines.append(f"        _update({args}, offsets, None, {', '.join(scalar_names)})")
    lines.append("    else:")
    lines.append(f"        _update({args}, offsets, offsets < numel, {', '.join(scalar_names)})")
    name, source = named(f"optimizer_{rule.name}", lines)
    return name, source, scalar_names, grid


def spelled(expression: str, functions: dict) -> str:
    """A rule's expression with its functions (``SQRT(``, ``DIV(``, ``WHERE(``) as a backend spells them."""
    for name, spelling in functions.items():
        expression = expression.replace(name, spelling)
    return expression


def select_member(tensors, numels) -> tuple:
    """(Triton lines, grid): each member gets ``cdiv(numel, BLOCK)`` programs in order; the
    lines set, for the running program, ``<t>_ptr`` for each name in ``tensors`` (from the
    arguments ``<t>0``, ``<t>1``...), its member's ``first`` program and ``numel``."""
    # NOTE: selects, one copy of the body whatever the count (see the module's note)
    ends, starts, start = [], [], 0
    for numel in numels:
        starts.append(start)
        start += -(-numel // BLOCK)
        ends.append(start)
    last = len(numels) - 1

    def select(values):
        text = values[last]
        for i in range(last - 1, -1, -1):
            text = f"tl.where(pid < {ends[i]}, {values[i]}, {text})"
        return text
    lines = [f"    {t}_ptr = {select([f'{t}{i}' for i in range(len(numels))])}" for t in tensors]
    lines.append(f"    first = {select([str(s) for s in starts])}")
    lines.append(f"    numel = {select([str(n) for n in numels])}")
    return lines, start


def named(prefix: str, lines: list) -> tuple:
    """(name, source) of a kernel written as ``KERNEL``: named by its prefix and a digest of
    its source, so identical kernels share a name (and a cache file)."""
    source = "\n".join(lines) + "\n"
    name = f"{prefix}_{hashlib.sha256(source.encode()).hexdigest()[:16]}"
    return name, source.replace("KERNEL", name)

