"""A compiled training step of tensor-parallel layers (``parallelize_module`` with ColwiseParallel and
RowwiseParallel, 2 processes on gloo over loopback: tests/tensor_parallel_steps.py), compared with
the same step run eagerly: the layers' math on the local shards compiles (runtime.tensor_parallel)."""

import pytest
import torch

from tests import distributed_steps, tensor_parallel_steps

WORLD = 2
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tp"))
    return distributed_steps.spawn_ranks(tensor_parallel_steps.worker, out, WORLD, TIMEOUT_S, "tensor-parallel")


@pytest.mark.parametrize("scenario", ["mlp", "block", "block_triton"])
def test_tensor_parallel_step_compiles_and_matches_eager(results, scenario):
    linears, biases = (2, 2) if scenario == "mlp" else (6, 5)
    for rank_results in results:
        ours, eager = rank_results[scenario]["compiled"], rank_results[scenario]["eager"]
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(eager["losses"]))
        for p, q in zip(ours["params"], eager["params"], strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        # the linears' gradients are DTensors placed as eager's (a row-parallel bias's all-reduced: Replicate)
        assert ours["grads"] == eager["grads"]
        assert sum(kind == "DTensor" for kind, _ in ours["grads"]) == linears + biases, ours["grads"]
        assert ours["versions"] == eager["versions"]
        # nothing ran eagerly: the local shards' products are in the compiled regions, forward and
        # backward kernels ran on each replay, AdamW fused on the DTensors' local shards
        assert ours["fallbacks"] == [], ours["fallbacks"]
        stats = ours["stats"]
        assert stats["replays"] == tensor_parallel_steps.STEPS - 1 and stats["divergences"] == 0, stats
        assert stats["kernel_launches"] > 0 and stats.get("optimizer_launches", 0) > 0, stats
        assert ours["matmuls"] >= linears, ours["matmuls"]
        if scenario.endswith("_triton"):
            assert ours["backend"].startswith("interpret"), ours["backend"]
