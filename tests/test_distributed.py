"""A compiled training step inside DistributedDataParallel and FSDP2 (fully_shard): 2 processes on gloo over loopback
(tests/distributed_steps.py), compared with the same step run eagerly under DDP."""

import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

from tests import distributed_steps

WORLD = 2
TIMEOUT_S = 240  # both ranks, all scenarios; a hang fails the test instead of blocking CI


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    context = mp.start_processes(distributed_steps.worker, args=(WORLD, str(out / "init"), str(out)),
                                 nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"DDP workers did not finish in {TIMEOUT_S} s")
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(WORLD)]


@pytest.mark.parametrize("scenario", ["plain", "no_sync", "unused", "static", "fsdp2"])
def test_compiled_step_matches_eager_under_ddp_and_fsdp2(results, scenario):
    for rank_results in results:
        ours, eager = rank_results[scenario]["compiled"], rank_results[scenario]["eager"]
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(eager["losses"]))
        for p, q in zip(ours["params"], eager["params"], strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        if scenario == "static":  # (static_graph rebuilds its buckets from the order gradients arrived in
            # at its first step: the segments' order, not eager's; the values above are the same)
            assert all(n > 0 for n in ours["buckets"])
        elif scenario != "fsdp2":  # DDP's reducer fired the same bucket all-reduces per step
            assert ours["buckets"] == eager["buckets"] and all(n > 0 for n in ours["buckets"])
        if scenario != "fsdp2":
            # ... and, the region's backward handed out in segments (runtime.segments), the first
            # bucket while kernels of that backward were still to run: one Node would hand every
            # bucket over after its last launch (the steps that replayed: launches ran)
            replayed = [at_buckets for *at_buckets, at_end in ours["fired"][2:] if at_end > 0]
            assert replayed and all(len(at) >= 2 and at[0] < at[-1] for at in replayed), (scenario, ours["fired"])
        for name, stats in ours["stats"].items():
            if stats["calls"] == 0:
                continue
            # FSDP2's sharded parameters are DTensors: their optimizer step runs eagerly, said once
            expected = ["tensor subclass"] if scenario == "fsdp2" else []
            assert [e for e in expected if not any(e in f for f in stats["fallbacks"])] == [], (scenario, stats)
            assert len(stats["fallbacks"]) == len(expected), (scenario, name, stats)
            assert stats["replays"] >= 1 and stats["kernel_launches"] > 0, (scenario, name, stats)
            if scenario == "plain":  # clip_grad_norm_ fused on DDP's all-reduced gradients
                assert stats.get("clip_launches", 0) > 0, stats
    # the ranks saw different data and still agree on the parameters: gradients were all-reduced
    for scenario in ("plain", "no_sync", "unused", "static", "fsdp2"):
        first, second = (r[scenario]["compiled"] for r in results)
        assert first["losses"] != second["losses"]
        for p, q in zip(first["params"], second["params"], strict=True):
            torch.testing.assert_close(p, q)


def test_ddp_example_runs_from_the_readme():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    env.pop("TRITON_INTERPRET", None)  # the example sets things up itself, as for a user
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               os.path.join(root, "examples", "train_ddp.py"), "--steps", "3", "--layers", "1"]
    # (one transformer block: the same features as the README's two, a quarter less compiling on 2 cores)
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=TIMEOUT_S, cwd=root)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = re.findall(r"rank (\d)/2 step +(\d+) +compiled ([\d.]+) +eager ([\d.]+)", result.stdout)
    assert len(steps) == 6
    for _, _, ours, eager in steps:
        assert abs(float(ours) - float(eager)) <= 1e-5 * abs(float(eager))
    assert result.stdout.count("fallbacks: none") == 2
