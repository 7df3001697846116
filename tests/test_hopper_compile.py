"""Every kernel the suite generated compiles for Hopper (sm_90) with Triton's real compiler.

The interpreter accepts code the GPU compiler may reject; this runs ``triton.compile`` with
``GPUTarget("cuda", 90, 32)`` — no GPU needed — on each kernel source written to this test
session's kernel cache. It runs in a subprocess without TRITON_INTERPRET (the interpreter
replaces jit functions and has no compiler). Ordered last by conftest.py.
"""

import os
import subprocess
import sys
import textwrap

import torch

import compiler
from runtime.kernels import cache_dir

SCRIPT = textwrap.dedent("""
    import glob, importlib.util, os, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    failures, count = [], 0
    for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.py"))):
        name = os.path.basename(path)[:-3]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        constexprs = {"XBLOCK": module.XBLOCK_DEFAULT, "RBLOCK": module.RBLOCK_DEFAULT}
        try:
            triton.compile(ASTSource(getattr(module, name), module.SIGNATURE, constexprs),
                           target=GPUTarget("cuda", 90, 32))
            count += 1
        except Exception as e:
            failures.append(f"{name}: {type(e).__name__}: {str(e)[:400]}")
    print(f"compiled {count} kernels for sm_90")
    for f in failures:
        print("FAILED", f)
    sys.exit(1 if failures or count == 0 else 0)
""")


def test_every_generated_kernel_compiles_for_hopper():
    # make sure there is something to compile even when this test runs alone
    f = compiler.compile(lambda x, y: (torch.tanh(x) * y ** 2.5).mean(0), backend="interpret")
    x, y = torch.randn(8, 16, requires_grad=True), torch.rand(8, 16, requires_grad=True)
    f(x, y), f(x, y).sum().backward()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-c", SCRIPT, cache_dir()], capture_output=True, text=True,
                            env=env, timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "compiled" in result.stdout
