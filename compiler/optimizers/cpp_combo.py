"""The fused optimizer step in C++ (``backend="cpp"``): one function per update rule and dtype.

The rule's statements (``rules.Rule.body``) are the ones the Triton combo kernel runs
(``combo.combo_source``), written as the body of a loop over one parameter's elements. The
function takes an array of pointers (per parameter: the parameter, its gradient, its state
tensors, in ``Rule.state_names`` order) and a table of chunks ``(parameter, begin, end)``, so
one compiled function serves every parameter list of that rule and dtype; the chunks spread
over threads by OpenMP where the step is large enough to pay for them. The loop has no
dependence between elements: ``-O3 -march=native`` vectorizes it (``vsqrtps`` and ``vdivps``
round as IEEE does, as eager's CPU kernels and the Triton kernel's ``sqrt_rn``/``div_rn`` do).
"""

from __future__ import annotations

import hashlib
import re

import torch

from compiler.codegen.cpp_printer import C_TYPE

# elements of one parameter a thread updates at once (a chunk of the table)
CHUNK = 16384

_PRELUDE = """#include <cmath>
#include <cstdint>

template <typename T> static inline T symgrad_where(bool c, T a, T b) { return c ? a : b; }
template <typename T> static inline T symgrad_div(T a, T b) { return a / b; }
"""

_ASSIGNMENT = re.compile(r"^(\w+) = (.+)$")


def cpp_combo_source(rule, key, dtype: torch.dtype) -> tuple:
    """(function name, C++ source, scalar names in argument order) of ``rule``'s update of
    ``dtype`` parameters with the settings ``key``. The function is
    ``int name(T* const* tensors, const int64_t* chunks, int64_t count, int64_t parallel, scalars...)``."""
    ctype = C_TYPE[dtype]
    tensors = ("p", "g") + rule.state_names(key)
    scalar_names = sorted(rule.scalar_names)
    body, declared = [], set(tensors)
    for line in rule.body(key):
        match = _ASSIGNMENT.match(line)
        if match is None:
            raise ValueError(f"update rule {rule.name!r}: {line!r} is not `name = expression`")
        target, expression = match.groups()
        expression = expression.replace("WHERE(", "symgrad_where(").replace("SQRT(", "std::sqrt(") \
            .replace("DIV(", "symgrad_div(")
        body.append(f"{target} = {expression};" if target in declared else f"{ctype} {target} = {expression};")
        declared.add(target)
    scalars = [f"int64_t {n}" if n in rule.integer_scalars else f"{ctype} {n}" for n in scalar_names]
    count = len(tensors)
    lines = [
        f'extern "C" int KERNEL({ctype}* const* tensors, const int64_t* chunks, int64_t count, int64_t parallel'
        + "".join(f", {s}" for s in scalars) + ") {",
        "    #pragma omp parallel for schedule(static) if(parallel)",
        "    for (int64_t k = 0; k < count; ++k) {",
        "        const int64_t m = chunks[3 * k], begin = chunks[3 * k + 1], end = chunks[3 * k + 2];",
        *[f"        {ctype}* __restrict__ {t}_ptr = tensors[m * {count} + {j}];" for j, t in enumerate(tensors)],
        "        for (int64_t i = begin; i < end; ++i) {",
        *[f"            {ctype} {t} = {t}_ptr[i];" for t in tensors],
        *[f"            {line}" for line in body],
        *[f"            {t}_ptr[i] = {t};" for t in rule.stores(key)],
        "        }", "    }", "    return 0;", "}", ""]
    source = _PRELUDE + "\n" + "\n".join(lines)
    name = f"optimizer_{rule.name}_cpp_{hashlib.sha256(source.encode()).hexdigest()[:16]}"
    return name, source.replace("KERNEL", name), scalar_names


def chunk_table(numels) -> list:
    """``(member, begin, end)`` for every ``CHUNK`` of each member's elements, flattened."""
    table = []
    for member, numel in enumerate(numels):
        for begin in range(0, numel, CHUNK):
            table += [member, begin, min(begin + CHUNK, numel)]
    return table
