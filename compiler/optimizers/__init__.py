"""``optimizer.step()`` inside a compiled function, compiled to a few fused kernels.

While a function is recorded, ``StepRecorder`` notes each ``optimizer.step()`` (which
optimizer, where among the recorded calls). The step itself runs eagerly then: the
recording call is eager PyTorch, and an optimizer's first step creates its state
(``exp_avg``, ``momentum_buffer``, ``step``) as eager does. ``compile_optimizer_steps`` then
turns each step of an optimizer the compiler knows (``rules``: SGD, Adam, AdamW) into a
``runtime.optimizer_step.FusedOptimizerStep``: per parameter group and dtype, combo kernels
that update up to ``combo.MAX_PARAMETERS`` parameters each. Later calls run those kernels in
place of the optimizer's per-parameter loop. Any other optimizer (RMSprop, a subclass) keeps
running eagerly, with the reason in ``explain()``'s fallbacks.

``torch.nn.utils.clip_grad_norm_``, the bookkeeping between backward and the step, is noted
and compiled the same way (``clip``: a few combo kernels per call, ``CompiledRecording.fused_calls``).
"""

from __future__ import annotations

import threading
import weakref

import torch

from compiler.optimizers import clip
from compiler.codegen.cpp_kernel import PARALLEL_MIN
from compiler.optimizers.combo import BLOCK, MAX_PARAMETERS, NUM_WARPS, combo_source
from compiler.optimizers.cpp_combo import chunk_table, cpp_combo_source
from compiler.optimizers.rules import rule_for
from compiler.report.explain import KernelInfo
from runtime import ahead_of_time, backends, clip_grad, shards
from runtime.cpp_kernels import CppComboLaunch
from runtime.fallback import internal_error
from runtime.optimizer_step import ComboLaunch, FusedOptimizerStep, GroupStep

# parameter dtype -> the kernel's: complex parameters are updated as their real views, as
# eager's Adam does (view_as_real) and SGD's ops do element by element
_FUSED_DTYPES = {torch.float32: torch.float32, torch.float64: torch.float64,
                 torch.complex64: torch.float32, torch.complex128: torch.float64}
_INT32_LIMIT = 2 ** 31


class NotFused(Exception):
    """Why an optimizer step keeps running eagerly."""


class StepRecorder:
    """Optimizer-step hooks for a recording: each step's first call index and its optimizer;
    and each ``clip_grad_norm_`` call (``clip.ClipRecord``), through ``watch_clipping()``."""

    def __init__(self, mode):
        self.mode = mode
        self.thread = threading.get_ident()
        # (first call index, weak reference to the optimizer, whether step() was given arguments,
        # gradients). NOTE: nothing here may hold the optimizer (nor so its parameters) while
        # the recording decides which tensors outlive the call: an optimizer made inside the
        # function would keep its parameters alive, to be guarded by identity, and every call
        # would record again.
        self.found: list = []

    def begin(self, optimizer, args, kwargs):
        if threading.get_ident() == self.thread:
            # which parameters have a gradient, and what it is like, now: the function may
            # zero them (set them to None) after the step, before the step is compiled. (Not
            # seen by the recording's mode: these reads are the compiler's, not the function's.)
            with torch._C.DisableTorchFunction():
                grads = [[_gradient_facts(p) for p in group["params"]] for group in optimizer.param_groups]
            self.found.append((len(self.mode.calls), weakref.ref(optimizer), len(args) > 1 or bool(kwargs), grads))

    def watch_clipping(self):
        """Note this thread's ``clip_grad_norm_`` calls until the handle's ``remove()``."""
        return clip_grad.watch(self)

    def clip_begins(self, params, max_norm, norm_type, error_if_nonfinite, foreach):
        found = clip.record(len(self.mode.calls), params, max_norm, norm_type, error_if_nonfinite, foreach)
        self.found.append(found)
        return found

    def clip_ends(self, found, total_norm):
        entry = self.mode.ids.get(id(total_norm))
        found.ended(len(self.mode.calls), entry[1] if entry is not None and entry[0]() is total_norm else None)


def _gradient_facts(p):
    """None (no gradient), or whether it is a dense contiguous tensor of the parameter's dtype."""
    g = p.grad
    if g is None:
        return None
    return g.layout == torch.strided and g.dtype == p.dtype and g.is_contiguous() and g.shape == p.shape


def compile_optimizer_steps(trace, recorded, stats=None) -> tuple:
    """Compile the recorded optimizer steps of ``trace`` (``StepRecorder.found``). Returns (the
    fused steps by the call index where each began, the fused clip_grad_norm_ calls likewise,
    KernelInfo list, reasons some steps run eagerly): a ``CompiledRecording``'s ``fused_steps``
    and ``fused_calls``."""
    kernels, reasons, fused, clips = [], [], {}, {}
    for entry in recorded:
        if isinstance(entry, clip.ClipRecord):
            if entry.end is None:
                continue  # it raised (eager's error for a non-finite norm): nothing to compile
            try:
                plan = clip.compile_clip(trace, entry, stats)
            except clip.NotFused as e:
                reasons.append(f"clip_grad_norm_ runs eagerly: {e}")
                continue
            try:
                ahead_of_time.compile_clip(plan)
            except ahead_of_time.KernelsDidNotCompile as e:   # a bug (strict: raises); the call runs eagerly
                reasons.append(internal_error("clip_grad_norm_ (compiling its functions)", e))
                continue
            clips[entry.start] = plan
            _name_for_profiler(plan.launches, "clip_grad_norm_")
            kernels.extend(_kernel_infos(plan.launches))
            continue
        start, optimizer_ref, given_arguments, grads = entry
        optimizer = optimizer_ref()
        if optimizer is None:
            reasons.append("optimizer.step() runs eagerly: its optimizer was made inside the function (a new one "
                           "each call)")
            continue
        name = type(optimizer).__name__
        try:
            step = _fuse(optimizer, given_arguments, grads, stats)
            if start not in trace.optimizer_steps:
                raise NotFused("its calls were not all eager updates (the replay could not skip them)")
            if start in fused:
                raise NotFused("another optimizer step began at the same call (a step calling another)")
        except NotFused as e:
            reasons.append(f"optimizer.step() of {name} runs eagerly: {e}")
            continue
        try:  # (compiled Triton: its kernels now, not inside the first replayed step)
            ahead_of_time.compile_optimizer_step(step, f"{name}.step", step.backend)
        except ahead_of_time.KernelsDidNotCompile as e:   # a bug (strict: raises); the step runs eagerly
            reasons.append(internal_error(f"{name}.step (compiling its kernels)", e))
            continue
        fused[start] = step
        _name_for_profiler(step.launches, f"{name}.step")
        kernels.extend(_kernel_infos(step.launches))
    return fused, clips, kernels, reasons


def optimizer_kernel_infos(fused_steps: dict, fused_calls: dict) -> list:
    """What ``explain`` lists of already fused optimizer steps and clip_grad_norm_ calls (shared by
    a recording instantiated from a template)."""
    return [info for plan in [*fused_calls.values(), *fused_steps.values()] for info in _kernel_infos(plan.launches)]


def _kernel_infos(launches) -> list:
    return [KernelInfo(launch.name, launch.source, "optimizer", -1, launch.bytes_moved) for launch in launches]


def _name_for_profiler(launches, what: str) -> None:
    """The names the combo kernels run under in a profile (as ``compiler.api.name_for_profiler``
    names the regions' kernels): the kernel, the call it does and how many parameters it updates."""
    for launch in launches:
        launch.name_in_profiles(f"symgrad kernel {launch.name} [{what}, {len(launch.members)} tensors]")


def fused_call_indices(trace) -> set:
    """The indices of the recorded calls that fused kernels replace (optimizer steps and
    clip_grad_norm_ calls compiled): not run eagerly on a replay that follows the recording."""
    spans = [(start, trace.optimizer_steps[start]) for start in trace.fused_steps]
    spans += [(start, plan.end) for start, plan in trace.fused_calls.items()]
    return {i for start, end in spans for i in range(start, end)}


def _fuse(optimizer, given_arguments, grads, stats) -> FusedOptimizerStep:
    rule = rule_for(optimizer)
    if rule is None:
        raise NotFused(f"{type(optimizer).__name__} is not an optimizer the compiler fuses "
                       "(it fuses torch.optim.SGD, Adam and AdamW themselves, not subclasses)")
    if given_arguments:
        raise NotFused("step() was given a closure")
    groups, backend = [], backends.chosen()
    if len(grads) != len(optimizer.param_groups):
        raise NotFused("its parameter groups changed during the step")
    for index, (group, group_grads) in enumerate(zip(optimizer.param_groups, grads)):
        refused = rule.refuse(optimizer, group)
        if refused:
            raise NotFused(f"parameter group {index}: {refused}")
        groups.append(_fuse_group(optimizer, rule, index, group, group_grads, backend))
    return FusedOptimizerStep(optimizer, groups, stats, backend)


def _fuse_group(optimizer, rule, index, group, grads, backend: str) -> GroupStep:
    key = rule.key(group)
    state_keys = rule.state_keys(key)
    updated, device = [], None
    if len(grads) != len(group["params"]):
        raise NotFused(f"parameter group {index} changed during the step")
    for i, (p, grad_ok) in enumerate(zip(group["params"], grads)):
        if grad_ok is None:
            continue
        where = f"parameter group {index}, parameter {i}"
        state = optimizer.state.get(p, {})
        plain = (torch.Tensor, torch.nn.Parameter)
        if type(p) not in plain or (p.grad is not None and type(p.grad) is not torch.Tensor):
            # NOTE: a DTensor (FSDP2's sharded parameter) is updated on its local shard, with its
            # gradient's and state's placed alike (runtime.shards); any other subclass runs eagerly
            refused = shards.refuse_update(p, [p.grad, *(state.get(name) for name in state_keys)])
            if refused:
                raise NotFused(f"{where} {refused}")
        if p.dtype not in _FUSED_DTYPES:
            raise NotFused(f"{where} is {p.dtype} (fused for float32, float64 and complex; eager rounds each op "
                           "to its dtype, which the kernel does not reproduce for it yet)")
        if not grad_ok or not p.is_contiguous() or not shards.local(p).is_contiguous():
            raise NotFused(f"{where}: the parameter or its gradient is not a contiguous dense tensor of its dtype")
        if p.numel() >= _INT32_LIMIT:
            raise NotFused(f"{where} has 2**31 elements or more")
        if device is None:
            device = p.device
        if p.device != device:
            raise NotFused(f"parameter group {index} has parameters on several devices")
        # NOTE: no state yet is no refusal: a stored recording is compiled in a new process before
        # its optimizer's first step has made the state (the step it recorded made it). Each replay's
        # step checks the state it binds (``GroupStep.bind``): that first step runs eagerly.
        for name in state_keys if state else ():
            t = state.get(name)
            if not isinstance(t, torch.Tensor) or t.dtype != p.dtype or t.shape != p.shape or not t.is_contiguous():
                raise NotFused(f"{where}: its state {name!r} is not a contiguous tensor like the parameter")
        if state and rule.has_step(key) and not isinstance(state.get("step"), torch.Tensor):
            raise NotFused(f"{where}: its state 'step' is not a tensor")
        updated.append((i, shards.local(p).numel(), p.dtype))  # (a DTensor's: its shard's)
    launches = []
    for dtype in dict.fromkeys(d for _, _, d in updated):
        # (a shard may be empty on this rank: FSDP2 pads a parameter of fewer rows than ranks)
        members = [m for m, (_, n, d) in enumerate(updated) if d == dtype and n > 0]
        real = _FUSED_DTYPES[dtype]
        for chunk in range(0, len(members), MAX_PARAMETERS):
            part = members[chunk:chunk + MAX_PARAMETERS]
            numels = [updated[m][1] * (2 if dtype.is_complex else 1) for m in part]
            # reads: parameter, gradient, state; writes: parameter, state (and the gradient: nesterov's foreach)
            moved = sum(numels) * real.itemsize * (2 + len(state_keys) + len(rule.stores(key)))
            if backend == "cpp" and device is not None and device.type == "cpu":
                name, source, scalar_names = cpp_combo_source(rule, key, real)
                launches.append(CppComboLaunch(name, source, part, scalar_names, rule.integer_scalars, real,
                                               tuple(chunk_table(numels)), sum(numels) >= PARALLEL_MIN, moved))
                continue
            name, source, scalar_names, grid = combo_source(rule, key, real, numels)
            launches.append(ComboLaunch(name, source, part, scalar_names, grid, BLOCK, NUM_WARPS, moved))
    writes = rule.in_place_writes(key)  # (per parameter the kernels take: parameter, gradient, state)
    bumps = (writes["p"], writes.get("g", 0), *[writes[name] for name in rule.state_names(key)])
    return GroupStep(rule, key, tuple(id(p) for p in group["params"]), updated, rule.state_names(key), state_keys,
                     rule.has_step(key), launches, bumps)
