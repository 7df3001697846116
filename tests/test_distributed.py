"""A compiled training step inside DistributedDataParallel and FSDP2 (fully_shard): 2 processes on gloo over loopback
(tests/distributed_steps.py), compared with the same step run eagerly under DDP."""

import os
import re
import subprocess
import sys

import pytest
import torch

from tests import distributed_steps

WORLD = 2
TIMEOUT_S = 240  # both ranks, all scenarios; a hang fails the test instead of blocking CI


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ddp"))
    return distributed_steps.spawn_ranks(distributed_steps.worker, out, WORLD, TIMEOUT_S, "DDP")


SCENARIOS = ["plain", "no_sync", "unused", "static", "skip_python", "skip_python_no_sync", "skip_python_buffers",
             "skip_python_unused", "fsdp2", "fsdp2_bf16", "fsdp2_triton"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_compiled_step_matches_eager_under_ddp_and_fsdp2(results, scenario):
    # (bf16 mixed precision: the forward and backward round to bf16, where a fused kernel may keep
    # float32 between ops; AdamW's normalized update carries a gradient's last bits into the
    # parameters: 1e-4 at most was measured after 6 steps)
    loss_tolerance, param_tolerance = {"fsdp2_bf16": ((2e-3, 1e-5), (1.6e-2, 5e-4))}.get(
        scenario, ((1.3e-6, 1e-5), (1e-5, 1e-6)))
    for rank_results in results:
        ours, eager = rank_results[scenario]["compiled"], rank_results[scenario]["eager"]
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(eager["losses"]),
                                   rtol=loss_tolerance[0], atol=loss_tolerance[1])
        for p, q in zip(ours["params"], eager["params"], strict=True):
            torch.testing.assert_close(p, q, rtol=param_tolerance[0], atol=param_tolerance[1])
        for b, c in zip(ours["buffers"], eager["buffers"], strict=True):   # (DDP broadcasts them from rank 0)
            torch.testing.assert_close(b, c, rtol=param_tolerance[0], atol=param_tolerance[1])
        assert ours["versions"] == eager["versions"]  # (in-place ops of the fused steps bump as eager's)
        if scenario == "static":  # (static_graph rebuilds its buckets from the order gradients arrived in
            # at its first step: the segments' order, not eager's; the values above are the same)
            assert all(n > 0 for n in ours["buckets"])
        elif not scenario.startswith("fsdp2"):  # DDP's reducer fired the same bucket all-reduces per step
            assert ours["buckets"] == eager["buckets"] and all(n > 0 for n in ours["buckets"])
        # the first bucket (DDP: the region's backward handed out in segments, runtime.segments)
        # or reduce-scatter (FSDP2: a region per module) handed over while kernels of the backward
        # were still to run: one Node would hand every one over after its last launch (the steps
        # that replayed: launches ran)
        replayed = [(at_handovers, at_end) for *at_handovers, at_end in ours["fired"][2:] if at_end > 0]
        # (the BatchNorm's region writes its running statistics in place, inputs that need no gradient:
        # segmented all the same, ``CompiledRegion.segment_plan``)
        assert replayed and all(len(at) >= 2 and at[0] < end for at, end in replayed), (scenario, ours["fired"])
        for name, stats in ours["stats"].items():
            if stats["calls"] == 0:
                continue
            assert stats["fallbacks"] == [], (scenario, name, stats)
            assert stats["replays"] >= 1 and stats["kernel_launches"] > 0, (scenario, name, stats)
            if scenario == "plain" or scenario.startswith("fsdp2"):
                # clip_grad_norm_ fused on DDP's all-reduced gradients, on FSDP2's local shards
                assert stats.get("clip_launches", 0) > 0, stats
            if scenario.startswith("fsdp2"):  # AdamW fused on the DTensor parameters' local shards
                assert stats.get("optimizer_launches", 0) > 0, stats
            if scenario == "fsdp2_triton":
                assert stats["backend"].startswith("interpret"), stats
    if scenario.startswith("skip_python"):   # replays made DDP's reducer calls without the step's Python
        calls = sum(stats["calls"] for stats in results[0][scenario]["compiled"]["stats"].values())
        skipped = calls - results[0][scenario]["compiled"]["python_runs"]
        # (refused, the Python runs: DDP's forward passes the output through its own Function, or its
        # pre-forward made torch calls of its own, syncing the BatchNorm's buffers: runtime.skip_python)
        refused = scenario in ("skip_python_unused", "skip_python_buffers")
        assert skipped == 0 if refused else skipped >= calls - 3, (scenario, calls, skipped)
    if scenario == "fsdp2_triton":  # (the one-row layer's shard: rank 1's is empty, and was updated: no error)
        assert 0 in results[1][scenario]["compiled"]["shard_sizes"]
    # the ranks saw different data and still agree on the parameters: gradients were all-reduced
    for scenario in SCENARIOS:
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


def test_fsdp2_example_runs_from_the_readme():
    # (FSDP2: fully_shard per block and at the root, clip_grad_norm_ and AdamW fused on the local shards.
    # 5 steps: the first call's recording holds FSDP2's lazy initialization, calls 2 and 3 leave it and
    # run eagerly from there, the 4th records the steady path and the 5th replays it whole)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    env.pop("TRITON_INTERPRET", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               os.path.join(root, "examples", "train_ddp.py"), "--steps", "5", "--layers", "1", "--fsdp2"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=TIMEOUT_S, cwd=root)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = re.findall(r"rank (\d)/2 step +(\d+) +compiled ([\d.]+) +eager ([\d.]+)", result.stdout)
    assert len(steps) == 10
    for _, _, ours, eager in steps:  # (float32: the fused kernels' other summation order, 1e-6 measured)
        assert abs(float(ours) - float(eager)) <= 1e-5 * abs(float(eager))
    assert result.stdout.count("fallbacks: none") == 2
    ends = re.findall(r"max \|param difference\| ([\d.e+-]+);.*? replays (\d+)(?: \((\d+) left[^)]*\))?; fallbacks",
                      result.stdout)
    assert len(ends) == 2, result.stdout
    for diff, replays, left in ends:
        assert int(replays) - int(left or 0) >= 1  # a whole step replayed: the fused optimizer step ran
        # AdamW's normalized update makes rounding differences of tiny gradients up to ~lr (3e-3): 2e-5
        # measured; a skipped or doubled update moves parameters by about lr
        assert float(diff) < 1e-3
