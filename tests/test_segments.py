"""A region's backward handed out in segments, one autograd Node each (runtime/segments.py, issue 38).

Under DDP the compiler does it by itself (tests/test_distributed.py checks the buckets); here one
process turns it on for a compiled region by hand (``hand_out_in_segments``) and checks what the
engine sees: each segment's gradients accumulated while the backward's later kernels are still to
run, the values eager gives, and every backward path (retain_graph, anomaly mode, create_graph).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import compiler
from runtime.checkpoints import in_checkpoint
from runtime.program import steps_run_by
from tests.distributed_steps import _Launches
from tests.devices import KERNELS


def _mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(12, 12), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(12, 3)).double()


def _segmented(segment_bytes=1):
    """A compiled loss whose region hands its backward out in segments (1 byte: a segment for each
    point where parameter gradients become final); the model and its eager twin."""
    model, twin = _mlp(), _mlp()
    loss = compiler.compile(lambda x: model(x).pow(2).mean(), backend=KERNELS)
    x = torch.randn(5, 12, dtype=torch.float64)
    loss(x)   # (its recording)
    regions = [r.compiled for r in loss.last_entry.trace.regions if r.compiled is not None and r.compiled.backward]
    for region in regions:
        region.hand_out_in_segments(segment_bytes)
    return loss, model, twin, x


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _graph_nodes(out) -> list:
    """Every autograd Node reachable from ``out``'s grad_fn, each once."""
    seen, stack, found = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        found.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return found


def check_each_segments_gradients_are_accumulated_while_later_kernels_still_run():
    loss, model, twin, x = _segmented()
    launches, accumulated = _Launches(), []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: accumulated.append(launches.count))
    with steps_run_by(launches):
        out = loss(x)
        forward = launches.count
        out.backward()
    twin(x).pow(2).mean().backward()
    torch.testing.assert_close(_grads(model), _grads(twin))
    assert loss.last_backend == KERNELS and launches.count > forward
    assert len(accumulated) == 10
    # the last layer's gradients arrive before the backward's last launch; the first layer's at it
    region = next(r.compiled for r in loss.last_entry.trace.regions if r.compiled is not None and r.compiled.backward)
    state = (accumulated, launches.count, loss.stats, region.segment_bytes, region.first_call_facts, in_checkpoint(),
             torch.is_anomaly_enabled(), type(region).__name__, region.output_groups, region.mutated_inputs)
    assert accumulated[0] < launches.count and accumulated[-1] == launches.count, state
    assert len(set(accumulated)) >= 3, accumulated   # several segments, several hand-overs
    assert len(region.segment_plan(None).later) >= 2


def test_a_segmented_backward_runs_again_under_retain_graph():
    loss, model, twin, x = _segmented()
    out, want = loss(x), twin(x).pow(2).mean()
    for _ in range(2):
        out.backward(retain_graph=True)
        want.backward(retain_graph=True)
    torch.testing.assert_close(_grads(model), _grads(twin))


def test_anomaly_mode_computes_every_gradient_in_the_first_node_and_hands_them_out():
    loss, model, twin, x = _segmented()
    with torch.autograd.detect_anomaly():
        loss(x).backward()
    twin(x).pow(2).mean().backward()
    torch.testing.assert_close(_grads(model), _grads(twin))


def test_segments_as_large_as_the_model_leave_one_node():
    loss, model, twin, x = _segmented(segment_bytes=1 << 30)
    loss(x).backward()
    twin(x).pow(2).mean().backward()
    torch.testing.assert_close(_grads(model), _grads(twin))
    region = next(r.compiled for r in loss.last_entry.trace.regions if r.compiled is not None and r.compiled.backward)
    assert region.segment_plan(None) is None


def check_a_region_handed_out_in_other_segments_plans_them_again():
    # (the plan is kept per segment size: one made for a size that left one Node is not the next size's)
    loss, model, twin, x = _segmented(segment_bytes=1 << 30)
    loss(x).backward()
    region = next(r.compiled for r in loss.last_entry.trace.regions if r.compiled is not None and r.compiled.backward)
    assert region.segment_plan(None) is None
    region.hand_out_in_segments(1)
    for p in model.parameters():
        p.grad = None
    loss(x).backward()
    twin(x).pow(2).mean().backward()
    torch.testing.assert_close(_grads(model), _grads(twin))
    assert len(region.segment_plan(None).later) >= 2


def check_each_segments_gradients_become_grad_without_a_copy():
    # AccumulateGrad takes a gradient as .grad where nothing else holds it: the run made range by
    # range lets go of each segment's gradients as it returns them (a copy each was 6 ms of a 50 ms
    # DDP step at width 1024)
    loss, model, twin, x = _segmented()
    out = loss(x)
    handed = {}

    def note(node):
        def hook(grad_inputs, grad_outputs):
            for g in grad_inputs:
                if g is not None and g.dim() > 0:
                    handed[g.data_ptr()] = type(node).__name__
        node.register_hook(hook)

    for node in _graph_nodes(out):
        if "Segment" in type(node).__name__:
            note(node)
    out.backward()
    kinds = {handed.get(p.grad.data_ptr()) for p in model.parameters()}
    assert {"_FirstSegmentBackward", "_LaterSegmentBackward"} <= kinds and None not in kinds, kinds


def check_create_graph_through_segments_says_what_to_do():
    loss, model, twin, x = _segmented()
    with pytest.raises(RuntimeError, match="SYMGRAD_DDP_SEGMENTS=0"):
        torch.autograd.grad(loss(x), list(model.parameters()), create_graph=True)


def _later_nodes(out) -> list:
    """The later segments' Nodes in ``out``'s graph."""
    return [node for node in _graph_nodes(out) if type(node).__name__ == "_LaterSegmentBackward"]


def check_later_nodes_are_made_once_and_shared_by_the_calls():
    # (two Function applies a call were 0.3 ms of the DDP benchmark's cold forward: made once instead)
    loss, model, twin, x = _segmented()
    nodes = None
    for step in range(3):
        out = loss(x)
        later = _later_nodes(out)
        assert len(later) >= 2, later
        if nodes is not None:
            assert set(later) == nodes   # the same Node objects in every call's graph
        nodes = set(later)
        out.backward()
        twin(x).pow(2).mean().backward()
        torch.testing.assert_close(_grads(model), _grads(twin))
    region = next(r.compiled for r in loss.last_entry.trace.regions if r.compiled is not None and r.compiled.backward)
    assert region._later_nodes is not None and not region._later_nodes.pending   # (the last Node forgot the run)


def check_one_backward_through_two_calls_graphs_sums_their_segments():
    loss, model, twin, x = _segmented()
    x2 = torch.randn_like(x)
    (loss(x) + 3 * loss(x2)).backward()
    (twin(x).pow(2).mean() + 3 * twin(x2).pow(2).mean()).backward()
    torch.testing.assert_close(_grads(model), _grads(twin))


def check_a_backward_that_raised_leaves_no_run_alive():
    import gc
    import weakref

    loss, model, twin, x = _segmented()
    first_layer = next(model.parameters())   # (its gradient comes last: a later segment's)
    last_layer = list(model.parameters())[-1]   # (the region's own Node's)

    def fail(p):
        raise ValueError("a hook failed")

    handle = last_layer.register_post_accumulate_grad_hook(fail)
    out = loss(x)
    kept = weakref.ref(out)
    with pytest.raises(ValueError, match="a hook failed"):
        out.backward()
    handle.remove()
    region = next(r.compiled for r in loss.last_entry.trace.regions if r.compiled is not None and r.compiled.backward)
    runs = [ref for refs in region._later_nodes.pending.values() for ref in refs]
    assert runs, "the failed backward's run was registered"
    del out
    gc.collect()
    assert kept() is None and all(ref() is None for ref in runs)   # (held weakly: gone with its graph)
    for p in model.parameters():
        p.grad = None
    loss(x).backward()   # the next backward runs as usual
    twin(x).pow(2).mean().backward()
    assert first_layer.grad is not None
    torch.testing.assert_close(_grads(model), _grads(twin))


def check_a_later_segment_given_a_non_leaf_makes_its_nodes_per_call():
    # (a tensor with a history differs per call: no Node made once could point at it)
    loss, model, twin, x = _segmented()
    loss(x.requires_grad_() * 2)   # (the recording of an input that needs a gradient)
    for region in loss.last_entry.trace.regions:
        if region.compiled is not None and region.compiled.backward:
            region.compiled.hand_out_in_segments(1)
    for p in model.parameters():
        p.grad = None
    for _ in range(2):
        base = torch.randn_like(x, requires_grad=True)   # (a new one each call)
        twin_base = base.detach().clone().requires_grad_(True)
        out = loss(base * 2)
        assert _later_nodes(out)
        out.backward()
        twin(twin_base * 2).pow(2).mean().backward()
        torch.testing.assert_close(_grads(model), _grads(twin))
        torch.testing.assert_close(base.grad, twin_base.grad)


# NOTE: these run in a fresh process: in the full suite (2 xdist workers sharing a kernel and
# region cache) the region's segment plan came out None in CI three times, where every standalone run
# and every run of this file after its neighbours plans segments; the cause is not found yet (a state
# another test leaves). The third time (2026-11-29) two checks made in the suite failed together: the
# plan None after ``hand_out_in_segments(1)`` and no segment Node at all, which together point at a
# region built with ``output_groups`` or ``mutated_inputs`` (``CompiledRegion.segment_plan`` plans none
# for those, and ``__call__`` then applies it by group). In a fresh process each checks the mechanism.
@pytest.mark.parametrize("check", ["check_each_segments_gradients_are_accumulated_while_later_kernels_still_run",
                                   "check_create_graph_through_segments_says_what_to_do",
                                   "check_a_region_handed_out_in_other_segments_plans_them_again",
                                   "check_each_segments_gradients_become_grad_without_a_copy",
                                   "check_later_nodes_are_made_once_and_shared_by_the_calls",
                                   "check_one_backward_through_two_calls_graphs_sums_their_segments",
                                   "check_a_backward_that_raised_leaves_no_run_alive",
                                   "check_a_later_segment_given_a_non_leaf_makes_its_nodes_per_call"])
def test_in_a_fresh_process(check, tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               SYMGRAD_CACHE_DIR=str(tmp_path))
    code = f"import tests.conftest, tests.test_segments as t; t.{check}(); print('ok')"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-4000:]
