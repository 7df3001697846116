"""``benchmarks.models``: whole training steps priced from shapes (meta tensors), at the tiny size.

One run of GPT-2 and the Llama-style model (ours and eager traced on meta, our kernels compiled for
sm_90, torch.compile's Inductor Triton path at the tiny size), shared by the tests below.
"""

import resource

import pytest
import torch

from benchmarks import models

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def doc():
    return models.run(["gpt2", "llama"], size="tiny", dtype="bfloat16", log=lambda _: None)


def test_rows_for_every_backend(doc):
    got = {(r["model"], r["backend"]) for r in doc["models"]}
    assert got == {(m, b) for m in ("gpt2", "llama") for b in ("ours", "eager", "torch.compile")}
    for r in doc["models"]:
        assert r["predicted_ms"] > 0 and r["peak_bytes"] > 0


def test_kernels_compiled_for_sm90(doc):
    for model in ("gpt2", "llama"):
        rows = [k for k in doc["kernels"] if k["model"] == model]
        assert rows, model
        assert all(k["error"] is None and k["registers"] > 0 for k in rows), [k for k in rows if k["error"]]
        assert all(k["spill_bytes"] is not None and k["predicted_us"] > 0 for k in rows)
    # identical launches are one row: two identical layers' kernels are compiled once
    gpt2 = [k for k in doc["kernels"] if k["model"] == "gpt2"]
    assert len({k["name"] for k in gpt2}) < sum(k["launches"] for k in gpt2)
    assert any(k["launches"] == 2 for k in gpt2)


def test_peak_holds_the_resident_state(doc):
    for r in doc["models"]:
        eager = next(e for e in doc["models"] if e["model"] == r["model"] and e["backend"] == "eager")
        resident = eager["params_bytes"] + eager["grads_bytes"] + eager["optimizer_bytes"]
        assert resident <= r["peak_bytes"], r
    for r in doc["models"]:
        if r["backend"] != "torch.compile":
            # AdamW: exp_avg and exp_avg_sq in fp32, and a 4-byte step count per parameter
            assert 0 <= r["optimizer_bytes"] - 2 * r["params_bytes"] < 1024
            assert 0 < r["saved_bytes"] < r["peak_bytes"]


def test_torch_compiles_peak_holds_what_its_forward_saves(doc):
    """torch.compile's peak (a lower bound) counts what its forward leaves for backward, measured at
    the probes and extrapolated: not the optimizer's temporaries alone."""
    for model in ("gpt2", "llama"):
        tc = next(r for r in doc["models"] if r["model"] == model and r["backend"] == "torch.compile")
        assert tc["saved_bytes"] > 0, tc
        assert tc["peak_bytes"] >= tc["params_bytes"] + tc["optimizer_bytes"] + tc["saved_bytes"]


def test_our_step_saves_less_than_eager(doc):
    for model in ("gpt2", "llama"):
        ours, eager = (next(r for r in doc["models"] if r["model"] == model and r["backend"] == b)
                       for b in ("ours", "eager"))
        assert ours["saved_bytes"] <= eager["saved_bytes"], model
        assert ours["fallbacks"] == []


def test_capture_allocates_nothing_at_real_size():
    """GPT-2 124M's step traced on meta: its parameters, gradients and AdamW state (~2 GB) are never
    allocated; the predicted peak counts them all the same."""
    from benchmarks.step_trace import trace_meta_step

    made = {}

    def make_args():
        made["args"] = models.make_meta_args("gpt2", "real", batch=1, length=128)
        return made["args"]

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trace = trace_meta_step("gpt2", make_args, models.meta_step("bfloat16"), "bf16",
                            models.meta_step("bfloat16", eager=True))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    params = [p for p in made["args"][0].parameters()]
    assert all(p.device.type == "meta" for p in params)
    assert trace.eager_memory.params == sum(p.numel() for p in params) * 4 > 480e6   # 124M fp32
    assert trace.ours_memory.peak > 4 * trace.ours_memory.params
    assert grown < trace.ours_memory.params / 2, f"the process grew by {grown / 1e6:.0f} MB"
    assert any(op.name in ("mm", "addmm") and op.flops > 0 for op in trace.our_ops)



def test_a_deep_backward_frees_each_layer_as_it_goes():
    """The backward is copied in the forward's reverse order, so each layer's output gradient and
    recomputed operands die with the layer, as in eager's backward: at its peak the step holds little
    beyond the parameters, optimizer state, saved values and the gradients it makes. (Copied
    depth-first from the input's gradient, every weight gradient came last and held them all: 1.8x
    the gradients' bytes above the rest here, 1.17x now.)"""
    from benchmarks.step_trace import trace_meta_step

    def make_args():
        with torch.device("meta"):
            net = models.GPT(models.GPTConfig(layers=6, dim=768, heads=12, vocab=8192, seq=1024))
            opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=True)
            return net, opt, torch.randint(0, 8192, (4, 1024)), torch.randint(0, 8192, (4, 1024))
    trace = trace_meta_step("gpt2", make_args, models.meta_step("bfloat16"), "bfloat16 (autocast)")
    ours = trace.ours_memory
    assert trace.fallbacks == []
    assert ours.peak - ours.params - ours.optimizer - ours.saved <= 1.25 * ours.grads, ours
