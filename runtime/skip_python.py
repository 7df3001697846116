"""``compile(fn, skip_python=True)``: replaying the recorded torch calls without running ``fn``.

The default replay runs the user's Python again and checks every torch call it makes against the
recording (``runtime.replay``): whatever Python does, results are eager's. That check costs
microseconds per torch call, and the Python itself (module ``__call__``s, ``zero_grad``'s loop)
costs what it costs in eager. With ``skip_python=True`` the user promises that every call with
the same guard key makes the same torch calls with the same constants and that ``fn``'s Python
has no other effect (no prints, counters or Python state changed); later calls then make the
recorded calls directly, as torch.compile's graphs do: each region's fused kernels, each eager
call (``loss.backward()``, ``p.grad = None``) on the tensors it was recorded with, and each
``optimizer.step()`` as the optimizer's own Python (its learning rate, state and hooks are read
as eager reads them; a step the compiler fused runs its kernels, called directly where the step's
Python would do nothing else: no step hooks, no profiler, ``step`` not replaced).

A recording that ran a DistributedDataParallel module replays without its Python too: DDP's forward
Python prepares the reducer for the backward's all-reduce (and syncs buffers, notes a join), which no
torch call records, so the replay makes DDP's own ``_pre_forward()`` and ``_post_forward()`` where its
forward's profiler range was entered and exited (``ddp_forwards``). Where DDP's forward does more
than that (torch calls of its own in the recording: buffers synced, inputs moved or cast; or now
``find_unused_parameters``, ``static_graph``, mixed precision, a join: ``ddp_in_the_way``), and for
any other torch.distributed wrapper (FSDP, DataParallel), the function replays the default way.

What stays guarded on every call, as on the default replay: the guard key (arguments' shapes,
dtypes, devices, requires_grad, other arguments' values, grad mode, autocast), tensors reached
inside (identity and metadata), modules' train/eval mode; and here also that no module the
recording ran has forward or backward hooks (their Python would not run).

Where the promise cannot hold, the function replays the default way, and the reason is logged
once (``refusal``): the recording read a value into Python (``loss.item()``, ``if mask.any():``:
the next calls may depend on it), passed a Python function to a torch call (a hook), called
``optimizer.step()`` with arguments (a closure), returned a tensor no recorded call made, bound
a value at its first use, seeded the random generator (``torch.manual_seed`` is no torch call),
or has a recording beside it made because Python took another path with the same key. The log
is ``guards`` (``SYMGRAD_LOG=guards``: ``say_python_runs``), which also says where a replay left
its recording.
"""

from __future__ import annotations

import logging
import threading

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_unflatten

from runtime import guard_log
from runtime.fallback import say_once
from runtime.torch_functions import is_profiler_range
from runtime.trace import UNKEPT, CallKind, CompiledRecording, ValueId, sets_grad_to_none


def refusal(trace: CompiledRecording) -> str | None:
    """Why this recording cannot be replayed without its Python, or None (remembered per trace)."""
    memo = trace.__dict__.get("_skip_python_refusal", False)
    if memo is not False:
        return memo
    reason = _refusal(trace)
    trace.__dict__["_skip_python_refusal"] = reason
    return reason


def _refusal(trace: CompiledRecording) -> str | None:
    if trace.result is None:
        return "it returns a tensor that no recorded torch call made"
    wrapper = _distributed_wrapper(trace)
    if wrapper is not None:
        return f"it runs a {wrapper} module, whose forward's Python drives communication that no torch call records"
    forwards = ddp_forwards(trace)
    if type(forwards) is str:
        return forwards
    if trace.reseeded:
        return "it calls torch.manual_seed (not a torch call the recording sees)"
    if trace.transient:
        return "a tensor it uses appears without a torch call (bound at its first use on replay)"
    if trace.numbers:
        return ("its kernels take Python numbers that its Python computes each call (a float argument, a number "
                "seen to change)")
    for start, (_, given_arguments) in trace.step_calls.items():
        if given_arguments and start in trace.optimizer_steps:
            return "it calls optimizer.step() with arguments (a closure runs Python)"
    steps = set()  # (an optimizer step runs as its own Python: what it reads inside is its business)
    for start, end in trace.optimizer_steps.items():
        if start not in trace.step_calls:
            return "an optimizer step began where no optimizer.step() call was recorded"
        steps.update(range(start, end))
    if trace.graph_breaks or any(c.guarded for i, c in enumerate(trace.calls) if i not in steps):
        return "it reads a value into Python (the torch calls after it may depend on the value)"
    for i, call in enumerate(trace.calls):
        if i in steps or is_profiler_range(call.func):
            continue
        for leaf in call.constant_slots:
            value = leaf[1]
            if (type(value) is str and value == UNKEPT) or (callable(value) and not isinstance(value, type)):
                return f"it passes a Python function to {getattr(call.func, '__name__', call.func)} (a hook)"
    return None


def _distributed_wrapper(trace: CompiledRecording) -> str | None:
    """The class name of a module the recording ran whose forward is torch.distributed's or
    torch.nn.parallel's (FullyShardedDataParallel, DataParallel), DistributedDataParallel's aside
    (``ddp_forwards``): their Python drives communication no torch call records."""
    for ref, _ in trace.module_modes:
        module = ref()
        if module is not None and type(module).__module__.startswith(_DISTRIBUTED_PACKAGES) \
                and not isinstance(module, DistributedDataParallel):
            return type(module).__name__
    return None


_DISTRIBUTED_PACKAGES = ("torch.nn.parallel", "torch.distributed")
_DDP_FORWARD_RANGE = "DistributedDataParallel.forward"   # the profiler range DDP's forward opens


def ddp_forwards(trace: CompiledRecording) -> dict | str:
    """Where each DistributedDataParallel forward's profiler range was entered -> (where it was exited,
    a weak reference to the module, whether a compiled region inside began before it), or why a replay
    cannot make them without DDP's Python. NOTE: with DDP's forward skipped whole, its reducer was never
    prepared for the backward, and each rank stepped on its own gradients (seen with 2 ranks);
    ``run_calls`` makes its ``_pre_forward`` and ``_post_forward`` there instead. The recording must
    show that DDP's forward made no torch call of its own: every call inside the range its module's
    compiled math (a buffer sync's or an input moved or cast would be one). Worked out once per
    recording."""
    memo = trace.__dict__.get("_ddp_forwards")
    if memo is None:
        memo = trace.__dict__["_ddp_forwards"] = _ddp_forwards(trace)
    return memo


def _ddp_forwards(trace: CompiledRecording) -> dict | str:
    modules = [ref for ref, _ in trace.module_modes if isinstance(ref(), DistributedDataParallel)]
    if not modules:
        return {}
    if len(modules) > 1:
        return "it runs several DistributedDataParallel modules (the recording does not say whose forward is which)"
    calls, forwards, first = trace.calls, {}, {}
    for i, rec in enumerate(calls):
        if rec.kind is CallKind.COMPUTE:
            first.setdefault(rec.region, i)
    for enter, (end, kind) in trace.unwatched_ranges().items():
        opened = calls[enter].leaves
        if kind != "watched" or not opened or opened[0] != _DDP_FORWARD_RANGE:
            continue
        inside = calls[enter + 1:end]
        if any(rec.kind is not CallKind.COMPUTE and not is_profiler_range(rec.func) for rec in inside):
            return ("its DistributedDataParallel forward made torch calls besides its module's compiled math "
                    "(DDP's own: buffers synced, inputs moved or cast)")
        # (a region runs whole at its first call: one begun before DDP's forward runs before its pre-forward,
        # which may broadcast the module's buffers into place: ``ddp_in_the_way``)
        early = any(rec.kind is CallKind.COMPUTE and first[rec.region] < enter for rec in inside)
        forwards[enter] = (end, modules[0], early)
    if not forwards:
        return "its DistributedDataParallel forward's profiler range was not recorded"
    return forwards


def ddp_in_the_way(trace: CompiledRecording) -> str | None:
    """What of a DDP module's settings, now, would make its forward do more than prepare the reducer
    (``ddp_forwards``): its Python runs then (checked per call: a join context, say, is per call)."""
    forwards = ddp_forwards(trace)
    if type(forwards) is str:
        return forwards
    for _, ref, early in forwards.values():
        ddp = ref()
        if ddp is None:
            continue
        if early and ddp.broadcast_buffers and ddp.modules_buffers:
            return ("a compiled region begins before its DistributedDataParallel forward, whose pre-forward "
                    "syncs the buffers that region may read")
        if ddp.find_unused_parameters or ddp.static_graph:
            return "its DistributedDataParallel module has find_unused_parameters or static_graph (its forward " \
                   "passes the output through DDP's own autograd Function)"
        if ddp.mixed_precision is not None or ddp._use_python_reducer or ddp._delay_all_reduce_all_params:
            return "its DistributedDataParallel module casts its inputs or all-reduces in Python"
        if ddp._join_config.enable:
            return "its DistributedDataParallel module runs inside a Join context"
        if ddp._check_sync_bufs_post_fwd():   # (the compiled math after its forward would read them before)
            return "its DistributedDataParallel module syncs its buffers after the forward (a buffer comm hook)"
    return None


def run_ddp_forward(ref, entering: bool) -> None:
    """DDP's own Python around its module's forward, made where the recording entered (``entering``)
    or left it: the reducer prepared for the backward as eager's forward prepares it."""
    ddp = ref()
    if ddp is None:   # (gone: so are the parameters it reduced)
        return
    if entering:
        ddp._pre_forward()
    else:
        ddp._post_forward(None)   # (its output is only handed back, ``ddp_in_the_way`` made sure)
_said: set = set()   # (function name, reason) said on the guards log
_said_lock = threading.Lock()


def say_python_runs(fn_name: str, reason: str) -> None:
    """Say, once per function and reason, that a ``skip_python`` call runs the function's Python
    (each torch call checked) and why: on the ``guards`` log (``symgrad.guards``: ``SYMGRAD_LOG=guards``
    or ``compiler.set_logs("guards")``, beside the guard failures and divergences it already says;
    said once it is on), and, as before, on the ``compiler`` logger at INFO. Called by the dispatcher
    at each such call: off, it costs a cached level check."""
    message = f"skip_python: this call runs its Python (each torch call checked): {reason}"
    say_once(fn_name, message, logging.INFO)
    if guard_log.guards.isEnabledFor(logging.INFO):
        with _said_lock:
            if (fn_name, reason) in _said:
                return
            _said.add((fn_name, reason))
        guard_log.guards.info("%s: %s", fn_name, message)


def plan(trace: CompiledRecording) -> list:
    """What a skip_python replay does, in order (made once per recording): ``("region", i)`` at
    a compiled region's first call (its other calls are answered by it), ``("step", start)``
    for an optimizer step (its recorded calls are the optimizer's own Python's), ``("call",
    (TraceCall, its value slots, whether its arguments are all positional leaves))`` for every
    other call, ``("grads_none", value ids)`` for a run of ``p.grad = None``, ``("ddp", (weak reference,
    entering))`` where a DDP forward's range was entered or exited (``ddp_forwards``); profiler ranges and
    reads of a tensor's state whose result nothing uses left out."""
    memo = trace.__dict__.get("_skip_python_plan")
    if memo is not None:
        return memo
    calls = trace.calls
    unused_read = trace.unused_reads()  # (zero_grad's reads of gradients the step already read: left out)
    forwards = ddp_forwards(trace)   # (where DDP's own pre- and post-forward are made)
    ddp = {**{enter: (True, ref) for enter, (_, ref, _) in forwards.items()},
           **{end: (False, ref) for end, ref, _ in forwards.values()}}
    out, seen, i = [], set(), 0
    while i < len(calls):
        end = trace.optimizer_steps.get(i)
        if end is not None:
            out.append(("step", i))
            i = end
            continue
        if i in ddp:
            entering, ref = ddp[i]
            out.append(("ddp", (ref, entering)))
        rec = calls[i]
        i += 1
        if rec.kind is CallKind.COMPUTE:
            if rec.region not in seen:
                seen.add(rec.region)
                out.append(("region", rec.region))
            if trace.regions[rec.region].compiled is not None:
                continue
        elif is_profiler_range(rec.func) or unused_read[i - 1]:
            continue
        elif sets_grad_to_none(rec):  # zero_grad: p.grad = None, the parameters' run gathered in one step
            if out and out[-1][0] == "grads_none":
                out[-1][1].append(rec.leaves[0])
            else:
                out.append(("grads_none", [rec.leaves[0]]))
            continue
        spec = rec.spec
        positional = type(spec) is tuple and spec[0] != "tree" and not spec[1]
        out.append(("call", (rec, rec.value_slots, positional)))
    trace.__dict__["_skip_python_plan"] = out
    return out


_modules = torch.nn.modules.module  # (its global hook dicts: read per call)


def hooks_in_the_way(trace: CompiledRecording) -> str | None:
    """Module hooks whose Python skip_python would not run, now (checked per call: cheap)."""
    modules = _modules
    if (modules._global_forward_hooks or modules._global_forward_pre_hooks or modules._global_backward_hooks
            or modules._global_backward_pre_hooks):
        return "global module hooks are registered"
    for ref, _ in trace.module_modes:
        m = ref()
        if m is not None and (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                              or m._backward_pre_hooks):
            return f"a {type(m).__name__} it runs has hooks"
    return None


def result_of(trace: CompiledRecording, env: dict):
    """The function's result, rebuilt from the replay's values."""
    spec, leaves = trace.result
    if spec.is_leaf():  # (the usual case: a loss)
        return env[leaves[0]] if isinstance(leaves[0], ValueId) else leaves[0]
    return tree_unflatten([env[v] if isinstance(v, ValueId) else v for v in leaves], spec)
