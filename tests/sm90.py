"""Compile generated kernels for Hopper (sm_90) exactly as their launches would, with no GPU.

Registers, spills and vectorized loads depend on how Triton's JIT specializes a launch's
arguments (pointers and integers divisible by 16 get ``tt.divisibility=16``, integers equal
to 1 become constants, an integer's type follows its value), so a bare signature reports
loads and spills a real launch would not have. This module records the real arguments of
each launch while the kernels themselves are skipped (``recorded_launches``), then compiles
every recorded kernel with ``triton.compile(..., target=GPUTarget("cuda", 90, 32))`` in a
subprocess without TRITON_INTERPRET and reads ptxas's resource report (``compile_for_sm90``).

>>> with recorded_launches() as launches:           # doctest: +SKIP
...     step(x)                                      # any compiled call; results are garbage
>>> for stats in compile_for_sm90(launches):        # doctest: +SKIP
...     print(stats.name, stats.registers, stats.spill_bytes, stats.vector_load_share)
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Launch:
    """One kernel launch as the JIT would see it."""
    name: str
    source: str
    grid: int
    num_warps: int
    constants: dict          # constexpr name -> value (XBLOCK, RBLOCK, arguments equal to 1)
    signature: dict          # argument name -> Triton type, "constexpr" for constants
    divisible: list          # argument names the JIT marks divisible by 16


@dataclass
class Sm90Stats:
    name: str
    grid: int
    num_warps: int
    constants: dict
    registers: int
    spill_bytes: int         # spill stores + spill loads, as ptxas reports them
    global_loads: int        # ld.global instructions in the PTX
    vector_loads: int        # of which vectorized (ld.global.v2 / .v4)
    broadcast_loads: int     # of which scalar loads of one address for many lanes (a row's mean)

    @property
    def vector_load_share(self) -> float:
        """Vectorized loads among the loads that stream data (broadcasts left out)."""
        streamed = self.global_loads - self.broadcast_loads
        return self.vector_loads / streamed if streamed else 1.0


def _specialize(value):
    """(type, divisible by 16) of one argument, by the rule Triton's JIT applies."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl
    kind, attr = native_specialize_impl(BaseBackend, value, False, True, True)
    return kind, attr


@contextlib.contextmanager
def recorded_launches():
    """Within the block, compiled programs allocate their kernels' outputs and record each
    launch's specialization instead of running it; matmuls and other PyTorch kernels run on
    the meta device and index checks are skipped (results are garbage, and come fast)."""
    from runtime import program

    launches: list[Launch] = []
    originals = (program.KernelLaunch.run, program.ExternCall.run, program.IndexCheck.run)

    def extern_shapes_only(self, env, device):
        args = [a.resolve(env) for a in self.args]
        meta = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta") for a in args]
        out = program.EXTERN_KERNELS[self.name](*meta, **self.kwargs)
        env[self.out] = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=device)

    def record(self, env, device):
        args, wide = self.arguments(env, device)
        if not self.grid:
            return
        name, source = (self.wide_name, self.wide_source) if wide and self.wide_source else (self.name, self.source)
        names = _parameter_names(source, name)
        constants = {"XBLOCK": self.xblock, "RBLOCK": self.rblock}
        signature, divisible = {}, []
        for param, value in zip(names, args):
            kind, attr = _specialize(value)
            if kind == "constexpr":
                constants[param] = attr
            elif attr == "D":
                divisible.append(param)
            signature[param] = kind
        signature["XBLOCK"] = signature["RBLOCK"] = "constexpr"
        launches.append(Launch(name, source, self.grid, self.num_warps, constants, signature, divisible))

    program.KernelLaunch.run = record
    program.ExternCall.run = extern_shapes_only
    program.IndexCheck.run = lambda self, env, device: None
    try:
        yield launches
    finally:
        program.KernelLaunch.run, program.ExternCall.run, program.IndexCheck.run = originals


def _parameter_names(source: str, name: str) -> list:
    line = next(line for line in source.splitlines() if line.startswith(f"def {name}("))
    params = line[len(f"def {name}("):line.rindex(")")].split(",")
    return [p.split(":")[0].strip() for p in params]


_SCRIPT = textwrap.dedent("""
    import collections, contextlib, importlib.util, io, json, os, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    triton.knobs.nvidia.dump_ptxas_log = True
    triton.knobs.compilation.always_compile = True
    results = []
    for job in json.load(open(sys.argv[1])):
        spec = importlib.util.spec_from_file_location(job["name"], job["path"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = getattr(module, job["name"])
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in job["divisible"]}
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(fn, job["signature"], job["constants"], attrs),
                                      target=GPUTarget("cuda", 90, 32), options={"num_warps": job["num_warps"]})
        text = log.getvalue()
        registers = int(re.search(r"Used (\\d+) registers", text).group(1))
        spills = sum(int(n) for n in re.findall(r"(\\d+) bytes spill (?:stores|loads)", text))
        loads = [line for line in compiled.asm["ptx"].splitlines() if "ld.global" in line]
        vector = [line for line in loads if re.search(r"ld\\.global(\\.\\w+)*\\.v[24]", line)]
        address = collections.Counter(line[line.rindex("["):] for line in loads)
        # a scalar load of an address loaded again is a broadcast (one value for many lanes)
        broadcast = [line for line in loads if line not in vector and address[line[line.rindex("["):]] > 1]
        results.append({"registers": registers, "spill_bytes": spills, "global_loads": len(loads),
                        "vector_loads": len(vector), "broadcast_loads": len(broadcast)})
    print(json.dumps(results))
""")


def compile_for_sm90(launches: list, timeout: float = 1800) -> list:
    """Compile each recorded launch for sm_90 (once per distinct kernel and specialization)
    and return its ``Sm90Stats``. Needs no GPU: ptxas ships with Triton."""
    unique = {}
    for launch in launches:
        key = (launch.name, launch.num_warps, json.dumps(launch.constants, sort_keys=True),
               json.dumps(launch.signature, sort_keys=True), tuple(launch.divisible))
        unique.setdefault(key, launch)
    launches = list(unique.values())
    with tempfile.TemporaryDirectory(prefix="symgrad-sm90-") as tmp:
        jobs = []
        for launch in launches:
            path = os.path.join(tmp, f"{launch.name}.py")
            with open(path, "w") as f:
                f.write(launch.source)
            jobs.append({"name": launch.name, "path": path, "num_warps": launch.num_warps,
                         "constants": launch.constants, "signature": launch.signature,
                         "divisible": launch.divisible})
        with open(os.path.join(tmp, "jobs.json"), "w") as f:
            json.dump(jobs, f)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        result = subprocess.run([sys.executable, "-c", _SCRIPT, os.path.join(tmp, "jobs.json")],
                                capture_output=True, text=True, env=env, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"compiling for sm_90 failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
        stats = json.loads(result.stdout.strip().splitlines()[-1])
    return [Sm90Stats(launch.name, launch.grid, launch.num_warps, launch.constants, **s)
            for launch, s in zip(launches, stats)]


def layer_norm_gelu_linear(rows: int, dim: int, dtype: torch.dtype):
    """The block the spill checks use: LayerNorm -> GELU -> Linear, summed (a step's loss)."""
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(dim).to(dtype)
    linear = torch.nn.Linear(dim, dim).to(dtype)

    def block(x):
        return linear(torch.nn.functional.gelu(norm(x))).float().sum()

    x = torch.randn(rows, dim, dtype=dtype, requires_grad=True)
    return block, x
