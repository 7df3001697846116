"""The loop around a compiled step, as training scripts write it: torch.autocast with a
GradScaler (including a step it skips on an inf), clip_grad_norm_, an LR scheduler, gradient
accumulation over micro-batches and zero_grad(set_to_none=False) — compared with the same
loop run eagerly, step by step."""


import pytest
import torch

import compiler

STEPS = 6
INF_STEP = 3  # an inf in the batch: the scaler skips this optimizer step and halves its scale


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, scaler, scheduler


def _step(autocast, accumulate):
    def step(model, opt, scaler, x, y):
        total = 0.0
        for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = torch.nn.functional.mse_loss(model(xs).float(), ys) / accumulate
            scaler.scale(loss).backward()
            total = total + loss.detach()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=False)
        return total
    return step


@pytest.mark.parametrize("autocast,accumulate", [(False, 1), (False, 2), (True, 1)])
@pytest.mark.allows_eager("the first steps create the scaler's and Adam's state: the next calls leave the recording "
                          "until that path is recorded")
def test_scaled_clipped_scheduled_steps_match_eager(autocast, accumulate):
    ours, eager = _setup(), _setup()
    step = _step(autocast, accumulate)
    compiled = compiler.compile(step)
    generator = torch.Generator().manual_seed(1)
    skipped = []
    for i in range(STEPS):
        x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
        if i == INF_STEP:
            x[0, 0] = float("inf")
        before = [p.detach().clone() for p in ours[0].parameters()]
        a = compiled(*ours[:3], x, y)
        b = step(*eager[:3], x, y)
        ours[3].step()
        eager[3].step()
        # bf16 autocast: our fused kernels round where eager's ops do, but sum in another order
        torch.testing.assert_close(a, b, equal_nan=True, rtol=1e-4 if autocast else 1e-5, atol=1e-6)
        assert ours[2].get_scale() == eager[2].get_scale()
        assert ours[1].param_groups[0]["lr"] == eager[1].param_groups[0]["lr"]
        skipped.append(all(torch.equal(p, q) for p, q in zip(before, ours[0].parameters())))
    assert skipped == [i == INF_STEP for i in range(STEPS)]  # the inf step only, as the scaler decides
    tolerance = {"rtol": 1e-3, "atol": 1e-4} if autocast else {"rtol": 1e-5, "atol": 1e-6}
    for p, q in zip(ours[0].parameters(), eager[0].parameters(), strict=True):
        torch.testing.assert_close(p, q, **tolerance)
        assert p.grad is not None and not p.grad.any()  # zero_grad(set_to_none=False)
    for state, expected in zip(ours[1].state.values(), eager[1].state.values()):
        torch.testing.assert_close(state["exp_avg_sq"], expected["exp_avg_sq"], **tolerance)
    # replayed, with kernels; the only part run eagerly is the scaler reading found_inf into
    # Python (GradScaler.step's `if not sum(v.item() ...)`: eager semantics need that value)
    assert compiled.stats["replays"] >= STEPS - 2 and compiled.stats["kernel_launches"] > 0
    assert compiled.stats.get("clip_launches", 0) > 0  # clip_grad_norm_ fused (tests/test_clip_grad.py)
    fallbacks = compiled.last_entry.report.fallbacks
    assert all(f.startswith("Tensor.item reads a tensor's value") for f in fallbacks), fallbacks
