"""Compile generated kernels for Hopper (sm_90) exactly as their real launches would — no GPU needed.

A ``Launch`` is what one kernel launch passes: the kernel's source, and per argument either a
pointer (its dtype and the byte offset of the tensor's first element from the start of its
allocation) or an integer (a stride). ``compile_launches`` compiles each one with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` in worker processes
started without ``TRITON_INTERPRET`` (an interpreted process cannot compile), and reports
registers, spills and how many global loads were vectorized. ``recorded_launches`` makes the
``Launch`` list from a compiled program: within it each of our kernel launches is recorded with
its real arguments instead of run.

NOTE: the specialization is Triton's own. The worker calls the binder that ``JITFunction.run``
uses (``create_function_from_signature``) and ``JITFunction._pack_args``, so the arguments get
the attributes a real launch gives them: an integer equal to 1 becomes a constant, an integer
divisible by 16 and a pointer whose address is divisible by 16 get ``tt.divisibility=16``.
Pointers are stand-ins whose address is a 256-byte-aligned base plus the tensor's offset:
CUDA's caching allocator hands out blocks aligned to 512 bytes, so a fresh tensor is aligned
and a view with an offset is aligned only if its offset is. Compiling with a bare signature
instead reports scalar loads and spills that the real launch would not have.

This file runs in two roles: imported (``compile_launches``, ``Launch``) it needs nothing but the
standard library (``recorded_launches`` imports torch and our runtime when entered); run as a
script it is the worker (``python benchmarks/sm90.py JOBS.json``),
which imports Triton non-interpreted and never imports ``compiler`` or ``benchmarks``.
Results are cached on disk per kernel source and specialization, so a rerun compiles nothing.

>>> launch = Launch("k", "...source...", [["ptr", "torch.float32", 0], ["int", 1]], {"XBLOCK": 128, "RBLOCK": 1})
>>> len(launch.key()) == 64
True
"""

from __future__ import annotations

import ast
import collections
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass

DEFAULT_NUM_WARPS = 4   # Triton's default; a kernel module may say otherwise (NUM_WARPS = ...)
_ALIGNED_BASE = 1 << 20  # a stand-in allocation address, aligned far beyond 16 bytes
_VECTOR_LOAD = re.compile(r"\bld\.global\S*\.v[248]\.")
_ANY_LOAD = re.compile(r"\bld\.global\b")
# fp32 arithmetic a GPU rounds otherwise than IEEE (and than Triton's interpreter): ``/`` compiles to
# div.full.f32 (2 ulp), tl.sqrt to sqrt.approx.f32, and libdevice's fast paths to the .approx forms
_APPROXIMATE_MATH = re.compile(r"\b(?:div\.full|div\.approx|sqrt\.approx|rsqrt\.approx|rcp\.approx)\.\S*f32\b")
_RESULT_VERSION = 3      # bumped when a result gains or changes a field: older cached results are not read


@dataclass
class Launch:
    """One kernel launch, as JSON-able data: what ``fn[grid](*args, **constexprs)`` passes."""

    name: str
    source: str               # the generated module (defines the @triton.jit function ``name``)
    args: list                # per argument: ["ptr", "torch.float32", byte offset], ["int", value] or ["float", value]
    constexprs: dict          # XBLOCK, RBLOCK
    num_warps: int = DEFAULT_NUM_WARPS
    grid: int = 0             # programs launched (reported, not part of the compilation)

    def key(self) -> str:
        """The cache key: what decides the compiled artifact (source, specialization, warps)."""
        text = json.dumps([self.source, self.args, self.constexprs, self.num_warps, _triton_version(),
                           _RESULT_VERSION])
        return hashlib.sha256(text.encode()).hexdigest()


def describe_args(args) -> list:
    """Real launch arguments (tensors and Python numbers) as ``Launch.args``: a shape-generic kernel's
    fp32 constants (``kf<k>``) are floats."""
    out = []
    for a in args:
        if hasattr(a, "data_ptr"):
            out.append(["ptr", str(a.dtype), a.storage_offset() * a.element_size()])
        elif isinstance(a, float):
            out.append(["float", a])
        elif isinstance(a, bool) or not isinstance(a, int):
            raise TypeError(f"a kernel argument of type {type(a).__name__}: only tensors and numbers are described")
        else:
            out.append(["int", int(a)])
    return out


_TORCH_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64", "i8": "int8",
                "i16": "int16", "i32": "int32", "i64": "int64", "u8": "uint8", "i1": "bool"}


def generic_launch(name: str, source: str, stride: int = 17, kernel=None) -> Launch:
    """A launch of a generated kernel whose real arguments are not known: pointers aligned (as
    fresh allocations are), every stride ``stride`` (17: neither 1 nor a multiple of 16, so no
    integer is specialized; a shape-generic kernel's sizes are never specialized), fp32 arguments
    0.5, the kernel's own tiles and warps. ``kernel``: its ``KernelSource`` (signature, blocks,
    warps); without it (a kernel file from the cache), the values its module declares."""
    facts = kernel if kernel is not None else declared(source)
    args = []
    for kind in facts.signature.values():
        if kind.startswith("*"):
            args.append(["ptr", "torch." + _TORCH_DTYPE[kind[1:]], 0])
        elif kind == "fp32":
            args.append(["float", 0.5])
        elif kind != "constexpr":
            args.append(["int", stride])
    return Launch(name, source, args, {"XBLOCK": facts.xblock, "RBLOCK": facts.rblock}, facts.num_warps)


@dataclass(frozen=True)
class Declared:
    """What a generated kernel module declares for its launch (``SIGNATURE``, ``XBLOCK_DEFAULT``,
    ``RBLOCK_DEFAULT``, ``NUM_WARPS``: ``compiler.codegen.triton_kernel`` writes them for
    ahead-of-time builds), as a ``KernelSource`` holds them."""
    signature: dict
    xblock: int
    rblock: int
    num_warps: int = DEFAULT_NUM_WARPS


def declared(source: str) -> Declared:
    """The launch values a kernel module's top-level constants declare, read as Python reads the
    module (its syntax tree, each value a literal), for a kernel known only by its file."""
    values = {}
    for statement in ast.parse(source).body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1 \
                and isinstance(statement.targets[0], ast.Name):
            try:
                values[statement.targets[0].id] = ast.literal_eval(statement.value)
            except ValueError:
                continue
    for key in ("SIGNATURE", "XBLOCK_DEFAULT", "RBLOCK_DEFAULT"):
        if key not in values:
            raise ValueError(f"the kernel module defines no {key}")
    return Declared(values["SIGNATURE"], values["XBLOCK_DEFAULT"], values["RBLOCK_DEFAULT"],
                    values.get("NUM_WARPS", DEFAULT_NUM_WARPS))


@contextlib.contextmanager
def recorded_launches(on_launch=None, compute_extern_calls: bool = True, on_combo=None, on_flash=None,
                      on_extern=None):
    """Within the block, compiled programs record each of our kernel launches as a ``Launch``
    (appended to the yielded list) instead of running it. The runtime's own code still runs, so
    outputs are allocated and what a launch passes (offsets, strides, tiles, warps, the 64-bit
    twin when offsets need it) is exactly what a real launch passes; results are garbage.

    ``on_launch(step, launch)`` is called per launch with the runtime's ``KernelLaunch`` step.
    ``compute_extern_calls=False`` runs matmuls and other PyTorch calls on the meta device and
    allocates their outputs (fast; their values do not matter here). Index checks run as on a GPU
    (the range test and an asynchronous assert), never raising for a skipped kernel's garbage.
    ``on_combo(launch)`` is called per launch of a fused optimizer step's combo kernel
    (``runtime.optimizer_step.ComboLaunch``, not recorded as a ``Launch``: see ``_recorder``).
    Our flash-attention kernels, launched inside an extern call, are recorded as ``Launch``es too
    (their real arguments, tiles, warps and stages), and ``on_flash(launch, flops)`` is called
    per launch with what it computes (``runtime.extern_kernels.launches_recorded``'s ``cost``).
    ``on_extern(fn, args, kwargs)``, a context manager, is entered around each extern call (its
    function and resolved arguments): ``benchmarks.step_trace`` prices there an extern that declares
    its own cost (``roofline_cost``).
    """
    from runtime import program

    launches: list = []
    recorder = _recorder(program)(program.installed_runner(), launches, on_launch, compute_extern_calls, on_combo,
                                  on_flash, on_extern)
    with program.steps_run_by(recorder):
        yield launches


def _recorder(program):
    """The StepRunner class of ``recorded_launches`` (made when first recording: imported, this file
    needs nothing but the standard library)."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    class Recorder(program.StepRunner):
        def __init__(self, inner, launches, on_launch, compute_extern_calls, on_combo, on_flash, on_extern):
            super().__init__(inner)
            self.launches, self.on_launch, self.on_combo, self.on_flash = launches, on_launch, on_combo, on_flash
            self.compute_extern_calls, self.on_extern = compute_extern_calls, on_extern

        def kernel(self, step, env, device, torch_path, fresh_loads):
            """What the launch passes, from its own arguments (outputs allocated), recorded: the
            64-bit twin where the offsets need it, the launch's tiles and warps."""
            args, _, wide = step.arguments(env, device)
            if not step.grid:  # an empty iteration space: nothing is launched
                return
            twin = wide and step.wide_source is not None
            name, source = (step.wide_name, step.wide_source) if twin else (step.name, step.source)
            recorded = Launch(name, source, describe_args(args), {"XBLOCK": step.xblock, "RBLOCK": step.rblock},
                              step.num_warps, step.grid)
            self.launches.append(recorded)
            if self.on_launch is not None:
                self.on_launch(step, recorded)

        def index_check(self, step, env, device):
            """The check as a GPU runs it (``IndexCheck.run``'s CUDA branch): the range test, then an
            asynchronous assert. NOTE: not the CPU branch: its error path (4 more operators finding
            the bad index) ran or not with the garbage a skipped kernel left in an index it computes
            (cross-entropy's target where ignore_index is not hit), so a trace counted 8 host operators
            in one run and 4 in another for the same program."""
            index = step.args[0].resolve(env)
            if index.numel() == 0:
                return
            low = -step.size if step.wrap else 0
            ok = ((index >= low) & (index < step.size)).all()
            with _disable_current_modes():
                ok.fill_(True)   # a skipped kernel's garbage is no error of the program (unrecorded)
            torch._assert_async(ok)

        def extern(self, step, env, device):
            if self.on_extern is None:
                return self._extern(step, env, device)
            with self.on_extern(step.fn, [a.resolve(env) for a in step.args], step.kwargs):
                return self._extern(step, env, device)

        def _extern(self, step, env, device):
            if step.kernels:   # our own kernels inside the call (flash attention, chunked loss): recorded, not run
                from runtime import extern_kernels

                with extern_kernels.launches_recorded(self.flash):
                    super().extern(step, env, device)
                return
            if self.compute_extern_calls:
                super().extern(step, env, device)
                return
            args = [a.resolve(env) for a in step.args]
            meta = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta") for a in args]
            outs = step.fn(*meta, **step.kwargs)
            for slot, out in zip((step.out, *step.also), outs if isinstance(outs, tuple) else (outs,)):
                env[slot] = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=device)

        def flash(self, kernel, grid, args, options, cost):
            """A flash-attention launch (``runtime.extern_kernels.launches_recorded``): its module's source,
            its real arguments; ``num_stages`` rides with the constexprs (the binder takes it)."""
            import inspect

            options = dict(options)
            warps = options.pop("num_warps")
            recorded = Launch(kernel.fn.__name__, inspect.getsource(inspect.getmodule(kernel.fn)),
                              describe_args(args), options, warps, list(grid))
            self.launches.append(recorded)
            if self.on_flash is not None:
                self.on_flash(recorded, cost)

        def combo(self, launch, tensors, scalars, device):
            # NOTE: the fused optimizer step's combo kernels (runtime.optimizer_step) are skipped, not
            # recorded: their float arguments (lr, betas) are not described yet, and running them in
            # the interpreter at full size takes minutes. Known gap: they are not compiled for sm_90;
            # ``on_combo`` sees each (its ``bytes_moved`` prices it).
            if self.on_combo is not None and launch.grid:
                self.on_combo(launch)

    return Recorder


def compile_launches(launches: list, processes: int = 2, cache_dir: str | None = None, progress=None) -> list:
    """Compile each launch for sm_90; one result dict per launch, in order.

    A result has ``registers``, ``spill_bytes`` (ptxas's spill stores), ``spill_loads``,
    ``loads`` (``ld.global`` instructions in the PTX), ``vector_loads`` (of which vectorized,
    ``.v2``/``.v4``/``.v8``), ``broadcast_loads`` (of which scalar loads of an address loaded
    again: one value for many lanes, such as a row's mean), ``vector_share``, and ``error``
    (None, or why it did not compile).

    ``approximate_math``: fp32 divisions and roots the GPU rounds approximately (div.full,
    sqrt.approx...), where IEEE (and the interpreter) rounds exactly.

    ``vector_share`` is vectorized loads among the loads that stream data: broadcasts are left
    out, since they read one value and nothing could vectorize them; counting them would rate
    a LayerNorm backward that streams all its rows in vectors as half scalar. It is 1.0 when
    every load is a broadcast and None when the kernel loads nothing.
    ``progress(done, total, name)`` is called as results arrive.
    """
    cache = os.path.join(cache_dir or _default_cache(), "sm90")
    os.makedirs(cache, exist_ok=True)
    keys = [launch.key() for launch in launches]
    results: dict = {}
    todo: dict = {}
    for key, launch in zip(keys, launches):
        path = os.path.join(cache, key + ".json")
        cached = _read_cached(path)
        if cached is not None:
            results[key] = cached
        elif key not in todo:
            todo[key] = launch
    total = len(set(keys))
    if progress:
        progress(len(results), total, "cached")
    if todo:
        _run_workers(todo, processes, cache, results, total, progress)
    return [dict(results[key]) for key in keys]


def _run_workers(todo: dict, processes: int, cache: str, results: dict, total: int, progress) -> None:
    items = list(todo.items())
    shares = [items[i::processes] for i in range(max(1, min(processes, len(items))))]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_INTERPRET"] = "0"           # also keeps ``import compiler`` from turning it on
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's current default, said out loud
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")   # kernels import runtime.triton_math
    lock = threading.Lock()
    errors = []

    def work(share):
        with tempfile.TemporaryDirectory(prefix="sm90-") as tmp:
            jobs = os.path.join(tmp, "jobs.json")
            with open(jobs, "w") as f:
                json.dump([asdict(launch) | {"key": key} for key, launch in share], f)
            # a cache of Triton's own would skip ptxas, whose report gives registers and spills
            worker_env = dict(env, TRITON_CACHE_DIR=os.path.join(tmp, "triton-cache"))
            log_path = os.path.join(tmp, "stderr.log")   # a file: a full pipe would block the worker
            with open(log_path, "w") as log:
                proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), jobs, tmp],
                                        stdout=subprocess.PIPE, stderr=log, text=True, env=worker_env)
                for line in proc.stdout:
                    if not line.startswith("{"):
                        continue
                    result = json.loads(line)
                    key = result.pop("key")
                    if _complete(result):   # failures are not cached: they are retried next time
                        _write_cached(os.path.join(cache, key + ".json"), result)
                    with lock:
                        results[key] = result
                        if progress:
                            progress(len(results), total, result["name"])
                failed = proc.wait() != 0
            if failed:
                with open(log_path) as log:
                    errors.append(log.read()[-3000:])

    threads = [threading.Thread(target=work, args=(share,)) for share in shares]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    missing = [launch.name for key, launch in todo.items() if key not in results]
    if missing:
        raise RuntimeError(f"the sm_90 compile worker stopped before compiling {', '.join(missing[:5])}: "
                           + "\n".join(errors))


def _complete(result: dict) -> bool:
    return result["error"] is None and result["registers"] is not None


def _read_cached(path: str) -> dict | None:
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        return None
    return result if _complete(result) else None


def _write_cached(path: str, result: dict) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)   # whole, even with another run writing the same key


def _default_cache() -> str:
    return os.environ.get("SYMGRAD_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"symgrad-{os.getuid()}")


def _triton_version() -> str:
    try:
        from importlib.metadata import version
        return version("triton")
    except Exception:  # noqa: BLE001 — only a cache key
        return "?"


# -- the worker (a process without TRITON_INTERPRET) ---------------------------------------------
class _Pointer:
    """What Triton's binder needs of a tensor argument: its dtype and its address."""

    def __init__(self, dtype, address):
        self.dtype = dtype
        self._address = address

    def data_ptr(self):
        return self._address


def load_job(job: dict, workdir: str) -> tuple:
    """(the jit function, its launch arguments) of a ``Launch`` as a dict: its source written to
    ``workdir`` and imported, pointers as stand-ins at its offsets from an aligned base."""
    import importlib.util

    import torch

    path = os.path.join(workdir, job["name"] + ".py")
    with open(path, "w") as f:
        f.write(job["source"])
    spec = importlib.util.spec_from_file_location(job["name"], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = []
    for kind, *rest in job["args"]:
        if kind == "ptr":
            dtype, offset = rest
            args.append(_Pointer(getattr(torch, dtype.split(".")[-1]), _ALIGNED_BASE + offset))
        else:
            args.append(rest[0])
    return getattr(module, job["name"]), args


def compile_for_sm90(fn, args, job: dict):
    """``fn`` compiled for sm_90 as a launch with ``args`` and the job's constexprs and warps would
    compile it (Triton's own binder and specialization): (the CompiledKernel, its constexprs)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from runtime.program import asserts_indices

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    kwargs = dict(job["constexprs"], num_warps=job["num_warps"])
    if asserts_indices(job["source"]):  # index checks: compiled in, as the launch compiles them
        kwargs.update(debug=True, sanitize_overflow=False)   # (runtime.launcher.Launcher's ``debug``)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    return compiled, constexprs


_PTXAS_REPORTS: dict = {}   # compiled kernel hash -> ptxas -v's report, in this worker


def _compile_one(job: dict, workdir: str) -> dict:
    import io
    from contextlib import redirect_stdout

    import triton

    fn, args = load_job(job, workdir)
    log = io.StringIO()
    with redirect_stdout(log):
        triton.knobs.nvidia.dump_ptxas_log = True   # make_cubin prints ptxas -v's report
        compiled, constexprs = compile_for_sm90(fn, args, job)
    loads, vector, broadcast = load_counts(compiled.asm["ptx"])
    report = log.getvalue()
    # (a second launch with the same specialization, a chunk kernel's of another chunk, is a hit in
    # Triton's cache: no ptxas runs, and its report is the first one's)
    report = _PTXAS_REPORTS.setdefault(compiled.hash, report) if "registers" in report else \
        _PTXAS_REPORTS.get(compiled.hash, report)
    registers = re.search(r"Used (\d+) registers", report)
    stores = re.search(r"(\d+) bytes spill stores", report)
    spill_loads = re.search(r"(\d+) bytes spill loads", report)
    return {
        "name": job["name"],
        "registers": int(registers.group(1)) if registers else None,
        "spill_bytes": int(stores.group(1)) if stores else None,
        "spill_loads": int(spill_loads.group(1)) if spill_loads else None,
        "loads": loads,
        "vector_loads": vector,
        "broadcast_loads": broadcast,
        "vector_share": (vector / (loads - broadcast) if loads > broadcast else 1.0) if loads else None,
        "shared": compiled.metadata.shared,
        "num_warps": compiled.metadata.num_warps,
        "approximate_math": len(_APPROXIMATE_MATH.findall(compiled.asm["ptx"])),
        # integer arguments the launch turns into constants (strides equal to 1)
        "int_constants": [fn.arg_names[path[0]] for path in constexprs
                          if fn.arg_names[path[0]] not in job["constexprs"]],
        "error": None,
    }


def load_counts(ptx: str) -> tuple:
    """(global loads, vectorized ones, broadcasts) in PTX. A broadcast is a scalar load whose
    address operand (``[%rd5+0]``: Triton's PTX gives each computed address its own register)
    is loaded again: the same value for several of a thread's elements."""
    loads = [line.strip() for line in ptx.splitlines() if _ANY_LOAD.search(line)]
    vector = [line for line in loads if _VECTOR_LOAD.search(line)]
    address = collections.Counter(line[line.rindex("["):] for line in loads if "[" in line)
    broadcast = [line for line in loads if not _VECTOR_LOAD.search(line) and "[" in line
                 and address[line[line.rindex("["):]] > 1]
    return len(loads), len(vector), len(broadcast)


def _worker(jobs_path: str, workdir: str) -> None:
    with open(jobs_path) as f:
        jobs = json.load(f)
    sys.path.insert(0, workdir)
    for job in jobs:
        try:
            result = _compile_one(job, workdir)
        except Exception as e:  # noqa: BLE001 — reported per kernel, the others still compile
            result = {"name": job["name"], "registers": None, "spill_bytes": None, "spill_loads": None,
                      "loads": 0, "vector_loads": 0, "broadcast_loads": 0, "vector_share": None, "shared": None,
                      "num_warps": job["num_warps"], "int_constants": [], "approximate_math": None,
                      "error": f"{type(e).__name__}: {str(e)[:600]}"}
        result["key"] = job["key"]
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
