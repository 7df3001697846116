"""Worker side of tests/test_distributed.py: each rank trains the same scenarios twice, with a
compiled step and with eager's, on DDP over gloo, and writes what the test compares.

Scenarios (all on one process group, one spawn, so the test stays a few seconds):
- ``plain``: SGD with momentum and clip_grad_norm_, 5 steps;
- ``no_sync``: gradient accumulation over 2 micro-batches, the first under ``model.no_sync()``;
- ``unused``: ``find_unused_parameters=True`` with a branch the step never uses;
- ``static``: ``static_graph=True``;
- ``skip_python``, ``skip_python_no_sync``: ``compile(..., skip_python=True)``, SGD with momentum and
  ``no_sync`` accumulation: replays make DDP's own pre- and post-forward calls, not the step's Python
  (runtime.skip_python.ddp_forwards); where it refuses and the Python runs: ``skip_python_buffers``
  (a BatchNorm: DDP's pre-forward syncs its buffers, torch calls of its own in the recording) and
  ``skip_python_unused`` (``find_unused_parameters=True``);
- ``fsdp2``: ``fully_shard`` on each layer and the root, AdamW and clip_grad_norm_ (both fused
  on the local shards: runtime.shards), 6 steps (its first step initializes FSDP2's state lazily,
  so the compiled function records twice);
- ``fsdp2_bf16``: the same with bf16 mixed precision (``MixedPrecisionPolicy``: bf16 parameters in
  the forward and backward, float32 gradient reduction, float32 shards the optimizer updates);
- ``fsdp2_triton``: ``fsdp2`` with Triton kernels (in its interpreter) and a one-row layer more,
  whose shard on rank 1 is empty.
Each records the loss per step, the parameters after, their version counters, the compiled
function's stats and fallbacks, the bucket all-reduces DDP's communication hook saw per step (to
compare the reducer's behaviour, not only its result) and how many launches had run when each
bucket (DDP) or reduce-scatter (FSDP2) was handed over.
"""

from __future__ import annotations

import copy
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from runtime.program import StepRunner, steps_run_by

STEPS = 5
# DDP buckets of about 2 KB (the default is 25 MB): the model's 6 parameter tensors fill several, so
# a compiled region's backward is handed out in segments (runtime.segments) and buckets fire during it
BUCKET_MB = 0.0005


class TwoBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32))
        self.head = torch.nn.Linear(32, 4)
        self.unused = torch.nn.Linear(32, 4)  # never called: find_unused_parameters must cope

    def forward(self, x):
        return self.head(self.body(x))


class Normed(TwoBranch):
    """TwoBranch with a BatchNorm: buffers that DDP broadcasts from rank 0 at each forward."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.BatchNorm1d(32))


class Gated(TwoBranch):
    """TwoBranch with a one-row layer: on 2 ranks FSDP2 leaves rank 1 an empty shard of it."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.body(x)) * torch.sigmoid(self.gate(x))


class _Launches(StepRunner):
    """Counts the compiled programs' launches (kernels and extern calls) as they run."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def kernel(self, step, env, device, torch_path, fresh_loads):
        self.count += 1
        super().kernel(step, env, device, torch_path, fresh_loads)

    def extern(self, step, env, device):
        self.count += 1
        super().extern(step, env, device)


def _counting_hook(counts, fired, launches):
    def hook(state, bucket):
        counts[-1] += 1
        fired[-1].append(launches.count)   # (how many launches had run when the bucket was handed over)
        return allreduce_hook(state, bucket)
    return hook


def _train(model, compiled: bool, scenario: str, rank: int, backend: str = "auto"):
    import compiler

    counts: list = []
    fired: list = []   # per step: the launch count at each bucket's hand-over, then at the step's end
    launches = _Launches()
    if scenario.startswith("fsdp2"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _count_reduce_scatters(fired, launches)
    else:
        model.register_comm_hook(dist.group.WORLD, _counting_hook(counts, fired, launches))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    python_runs = []   # (the step's Python, run at each call unless skip_python skipped it)

    def step(x, y):
        python_runs.append(1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if scenario == "plain":  # on the all-reduced gradients, as DDP training scripts clip
            torch.nn.utils.clip_grad_norm_(model.parameters(), 3.0)
        elif scenario.startswith("fsdp2"):  # on the sharded gradients: a DTensor norm, one all-reduce
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        return loss

    def micro(x, y):
        python_runs.append(1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    def apply():
        opt.step()
        opt.zero_grad()

    options = {"backend": backend, "skip_python": scenario.startswith("skip_python")}
    run_step = compiler.compile(step, **options) if compiled else step
    run_micro = compiler.compile(micro, **options) if compiled else micro
    generator = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS + scenario.startswith("fsdp2")):
        counts.append(0)
        fired.append([])
        x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
        with steps_run_by(launches):
            launches.count = 0
            if scenario.endswith("no_sync"):
                with model.no_sync():
                    first = run_micro(x[:4], y[:4])
                second = run_micro(x[4:], y[4:])
                apply()
                losses.append((first.item() + second.item()) / 2)
            else:
                losses.append(run_step(x, y).item())
            fired[-1].append(launches.count)
    stats = {}
    if compiled:
        for fn in (run_step, run_micro):
            entry = fn.last_entry
            stats[fn.fn.__name__] = {**fn.stats, "fallbacks": entry.report.fallbacks if entry else None,
                                     "backend": fn.last_backend}
    sharded = scenario.startswith("fsdp2")
    params = [(p.full_tensor() if sharded else p).detach().clone() for p in model.parameters()]
    # (what in-place ops did to the parameters and the optimizer's state: the fused step bumps as eager)
    versions = [(p._version, *(t._version for t in opt.state[p].values())) for p in model.parameters()]
    shard_sizes = [getattr(p, "_local_tensor", p).numel() for p in model.parameters()]
    return {"losses": losses, "params": params, "stats": stats, "buckets": counts, "fired": fired,
            "versions": versions, "shard_sizes": shard_sizes, "python_runs": len(python_runs),
            "buffers": [b.detach().clone() for b in model.buffers()]}   # (BatchNorm's running statistics)


def _count_reduce_scatters(fired, launches):
    """Note in ``fired`` how many launches had run as FSDP2 begins each reduce-scatter (its
    ``foreach_reduce``, once per FSDP module in the backward)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    reduce = getattr(_fsdp_param_group.foreach_reduce, "__wrapped__", _fsdp_param_group.foreach_reduce)

    def counted(*args, **kwargs):
        fired[-1].append(launches.count)
        return reduce(*args, **kwargs)
    counted.__wrapped__ = reduce
    _fsdp_param_group.foreach_reduce = counted


def _fully_sharded(bf16: bool, model_class=TwoBranch):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = model_class()
    del model.unused
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for layer in (*model.body, model.head, *([model.gate] if model_class is Gated else [])):
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def worker(rank: int, world: int, init_file: str, out_dir: str):
    """One rank: every scenario, compiled and eager, saved to ``out_dir/rank{rank}.pt``."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {}
        for scenario in ("plain", "no_sync", "unused", "static", "skip_python", "skip_python_no_sync",
                         "skip_python_buffers", "skip_python_unused"):
            torch.manual_seed(0)
            base = Normed() if scenario.endswith("buffers") else TwoBranch()
            unused = scenario.endswith("unused")
            options = {"find_unused_parameters": unused, "static_graph": scenario == "static"}
            if not unused:
                del base.unused  # DDP without find_unused_parameters refuses parameters that get no grad
            results[scenario] = {
                "compiled": _train(DDP(copy.deepcopy(base), bucket_cap_mb=BUCKET_MB, **options), True, scenario, rank),
                "eager": _train(DDP(copy.deepcopy(base), bucket_cap_mb=BUCKET_MB, **options), False, scenario, rank),
            }
        for scenario, bf16, backend, model_class in (("fsdp2", False, "auto", TwoBranch),
                                                     ("fsdp2_bf16", True, "auto", TwoBranch),
                                                     ("fsdp2_triton", False, "interpret", Gated)):
            results[scenario] = {
                "compiled": _train(_fully_sharded(bf16, model_class), True, scenario, rank, backend),
                "eager": _train(_fully_sharded(bf16, model_class), False, scenario, rank)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn_ranks(worker, out_dir: str, world: int, timeout_s: float, what: str) -> list:
    """Run ``worker(rank, world, init_file, out_dir)`` in ``world`` spawned processes and load what each
    saved (``out_dir/rank{r}.pt``); raises, the processes killed, where they outlast ``timeout_s`` (a
    hang fails the test instead of blocking CI)."""
    import torch.multiprocessing as mp

    context = mp.start_processes(worker, args=(world, os.path.join(out_dir, "init"), out_dir), nprocs=world,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{what} workers did not finish in {timeout_s} s")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
