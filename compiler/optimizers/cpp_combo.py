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

import torch

from compiler.codegen.cpp_printer import C_TYPE
from compiler.optimizers.combo import spelled

# elements of one parameter a thread updates at once (a chunk of the table)
CHUNK = 16384

_PRELUDE = """#include <cmath>
#include <cstdint>

template <typename T> static inline T symgrad_where(bool c, T a, T b) { return c ? a : b; }
template <typename T> static inline T symgrad_div(T a, T b) { return a / b; }
"""

def cpp_combo_source(rule, key, dtype: torch.dtype) -> tuple:
    """(function name, C++ source, scalar names in argument order) of ``rule``'s update of
    ``dtype`` parameters with the settings ``key``. The function is
    ``int name(T* const* tensors, const int64_t* chunks, int64_t count, int64_t parallel, scalars...)``."""
    ctype = C_TYPE[dtype]
    tensors = ("p", "g") + rule.state_names(key)
    scalar_names = sorted(rule.scalar_names)
    body, declared = [], set(tensors)
    for target, expression in rule.body(key):
        expression = spelled(expression, {"WHERE(": "symgrad_where(", "SQRT(": "std::sqrt(", "DIV(": "symgrad_div("})
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


def first_chunks(numels) -> list:
    """Per member, the index of its first chunk in ``chunk_table(numels)``; then the count."""
    firsts = [0]
    for numel in numels:
        firsts.append(firsts[-1] + -(-numel // CHUNK))
    return firsts


def cpp_clip_sources(norm_type: float, dtype: torch.dtype) -> tuple:
    """((name, source) of the norm function, (name, source) of the scale function) of
    ``clip_grad_norm_`` over ``dtype`` gradients (``compiler.optimizers.clip``'s plan in C++).

    ``norm(grads, chunks, count, parallel, partials, firsts, members, total, coef, max_norm, eps)``:
    each chunk's partial (in double: the sum of squares, of absolute values, or the largest
    absolute value with NaN winning), over threads; then, in order, each gradient's norm rounded
    to its dtype as eager's ``_foreach_norm`` gives it, the norm of those norms, and the clip
    coefficient as eager rounds it (``max_norm * (1 / (total + eps))``, clamped to 1, NaN kept).
    ``scale(grads, chunks, count, parallel, coef)``: every gradient times ``*coef``, in place."""
    ctype = C_TYPE[dtype]
    if norm_type == 2.0:
        element, combine, per_grad, fold, total = "x * x", "+", "std::sqrt(s)", "t += double(n) * n;", "std::sqrt(t)"
    elif norm_type == 1.0:
        element, combine, per_grad, fold, total = "std::fabs(x)", "+", "s", "t += n;", "t"
    else:
        element, combine, per_grad, fold, total = "std::fabs(x)", "max", "s", \
            "t = (n > t || n != n) ? n : t;", "t"
    if combine == "+":
        chunk = ["double s = 0;", "#pragma omp simd reduction(+:s)",
                 "for (int64_t i = begin; i < end; ++i) { const double x = g[i]; s += " + element + "; }",
                 "partials[k] = s;"]
        merge = "s += partials[c];"
    else:   # (the largest; a NaN anywhere makes the chunk's partial NaN, as eager's max-norm)
        chunk = ["double s = 0; int nan = 0;", "#pragma omp simd reduction(max:s) reduction(|:nan)",
                 "for (int64_t i = begin; i < end; ++i) { const double x = g[i]; const double a = " + element + ";",
                 "    s = a > s ? a : s; nan |= (a != a); }",
                 "partials[k] = nan ? NAN : s;"]
        merge = "s = (partials[c] > s || partials[c] != partials[c]) ? partials[c] : s;"
    norm = "\n".join([
        "#include <cmath>", "#include <cstdint>", "",
        f'extern "C" int KERNEL(const {ctype}* const* grads, const int64_t* chunks, int64_t count, int64_t parallel, '
        f"double* partials, const int64_t* firsts, int64_t members, {ctype}* total_out, {ctype}* coef_out, "
        f"{ctype} max_norm, {ctype} eps) {{",
        "    #pragma omp parallel for schedule(static) if(parallel)",
        "    for (int64_t k = 0; k < count; ++k) {",
        f"        const {ctype}* __restrict__ g = grads[chunks[3 * k]];",
        "        const int64_t begin = chunks[3 * k + 1], end = chunks[3 * k + 2];",
        *[f"        {line}" for line in chunk], "    }",
        "    double t = 0;",
        "    for (int64_t m = 0; m < members; ++m) {",
        "        double s = 0;",
        f"        for (int64_t c = firsts[m]; c < firsts[m + 1]; ++c) {merge}",
        f"        const {ctype} n = static_cast<{ctype}>({per_grad});",
        f"        {fold}", "    }",
        f"    const {ctype} norm = static_cast<{ctype}>({total});",
        "    *total_out = norm;",
        f"    const {ctype} one = 1;",
        f"    const {ctype} coef = (one / (norm + eps)) * max_norm;",
        "    *coef_out = coef > one ? one : coef;",
        "    return 0;", "}", ""])
    scale = "\n".join([
        "#include <cstdint>", "",
        f'extern "C" int KERNEL({ctype}* const* grads, const int64_t* chunks, int64_t count, int64_t parallel, '
        f"const {ctype}* coef_in) {{",
        f"    const {ctype} coef = *coef_in;",
        "    #pragma omp parallel for schedule(static) if(parallel)",
        "    for (int64_t k = 0; k < count; ++k) {",
        f"        {ctype}* __restrict__ g = grads[chunks[3 * k]];",
        "        for (int64_t i = chunks[3 * k + 1]; i < chunks[3 * k + 2]; ++i) g[i] = g[i] * coef;",
        "    }", "    return 0;", "}", ""])
    kind = {1.0: "norm1", 2.0: "norm2"}.get(norm_type, "norminf")
    named = []
    for prefix, text in ((f"optimizer_clip_{kind}_cpp", norm), ("optimizer_clip_scale_cpp", scale)):
        name = f"{prefix}_{hashlib.sha256(text.encode()).hexdigest()[:16]}"
        named.append((name, text.replace("KERNEL", name)))
    return tuple(named)
