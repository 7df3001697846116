"""A recorded ``optimizer.step()`` run as fused kernels, in place of the optimizer's own loop.

The compiler hands over, per parameter group, combo kernels (``ComboLaunch``: many parameters
per launch) and the optimizer's update rule (what the runtime asks of it: ``key(group)`` and
``scalars(group, step, dtype)``). On a replay the optimizer-step pre-hook calls
``FusedOptimizerStep.run``: it checks that the step is the one compiled (the same optimizer,
parameters, settings that change the kernel, gradients present where they were, state
tensors of the right shape and dtype), runs the kernels, and returns the arguments for the
step call: ``optimizer.step`` then runs on a stand-in with no parameter groups, so it updates
nothing (Optimizer's step pre-hooks may replace the call's arguments). Any check that fails
returns None before anything changed: that step runs eagerly, as it was recorded.

Learning rates, betas and the step count are read from the optimizer on every step and passed
as kernel arguments: an LR scheduler changes arguments, never the kernel.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field

import torch
from torch.optim import optimizer as _optim

from runtime import backends, shards
from runtime.kernels import load_kernel
from runtime.launcher import make_launcher, specialization_key
from runtime.program import installed_runner, interpreter_lock, on_device
from runtime.unchanged import tensors_unchanged

_profiler_enabled = torch.autograd._profiler_enabled
_increment_version = torch._C._increment_version

# A float32 step counter counts exactly up to here; past it the count is read back each step.
_EXACT_STEPS = 2 ** 24


class _StepTaken:
    """What ``optimizer.step`` runs on after the fused kernels made the update: the step
    bodies of SGD, Adam and AdamW loop over ``param_groups`` (none here) and return None."""
    param_groups = ()
    defaults = {"differentiable": False}
    state: dict = {}

    def _accelerator_graph_capture_health_check(self):
        pass

    def _cuda_graph_capture_health_check(self):
        pass


_STEP_TAKEN = _StepTaken()


@dataclass
class ComboLaunch:
    """One kernel over several parameters: ``members`` index the group's updated parameters."""
    name: str
    source: str
    members: list
    scalar_names: list
    grid: int
    block: int
    num_warps: int
    bytes_moved: int
    _fn: object = None
    _launcher: object = None   # runtime.launcher's, made at the first launch
    # what a profile calls its launches (``name_in_profiles``; None: "symgrad kernel <name>")
    profile_name: str | None = field(default=None, init=False, repr=False, compare=False)

    def name_in_profiles(self, name: str) -> None:
        """Its launches appear as ``name`` in a profile (the compiler names them after the step)."""
        self.profile_name = name

    def launch(self, tensors: list, scalars: dict, device) -> None:
        """Launch on ``tensors`` (in ``members`` order, each parameter's tensors in turn) with the
        scalars it names; through the installed StepRunner, if a benchmark installed one
        (``runtime.program.steps_run_by``)."""
        runner = installed_runner()
        if runner is not None:
            runner.combo(self, tensors, scalars, device)
        else:
            self.launch_now(tensors, scalars, device)

    def launcher(self):
        """The kernel's launcher (``runtime.launcher``: compiled Triton's driver launcher called
        directly, not ``JITFunction.run``'s 10-20 µs of binding per launch), made once."""
        if self._launcher is None:
            if self._fn is None:
                self._fn = load_kernel(self.name, self.source)
            self._launcher = make_launcher(self._fn, self.grid, num_warps=self.num_warps,
                                           constexprs={"BLOCK": self.block})
        return self._launcher

    def launch_now(self, tensors: list, scalars: dict, device) -> None:
        if not self.grid:  # parameters with no elements
            return
        numbers = [scalars[n] for n in self.scalar_names]
        args = [*tensors, *numbers]
        key = specialization_key(tensors, numbers)
        launcher = self.launcher()
        if _profiler_enabled():  # named as the regions' kernels are (``name_in_profiles``)
            from torch.autograd.profiler import record_function

            with record_function(self.profile_name or f"symgrad kernel {self.name}"), \
                    on_device(device), interpreter_lock:
                launcher.launch(args, key, device)
            return
        with on_device(device), interpreter_lock:
            launcher.launch(args, key, device)


@dataclass
class GroupStep:
    """The fused step of one parameter group."""
    rule: object                 # the compiler's update rule (key, scalars, state names)
    key: tuple                   # the group's settings the kernels were built for
    param_ids: tuple             # id() of every parameter of the group, in order
    updated: list                # (index in the group, numel, dtype) of the parameters with a gradient
    state_names: tuple           # the state tensors per parameter, in kernel argument order
    state_keys: tuple            # their keys in ``optimizer.state[p]``
    has_step: bool               # a per-parameter ``state["step"]`` tensor counts steps
    launches: list               # ComboLaunch per dtype and chunk
    version_bumps: tuple = ()    # per tensor a parameter's launch takes: eager's in-place ops on it
    _known_steps: tuple | None = field(default=None, repr=False)  # (step tensors, versions, count)
    # (the check that its tensors are as at the last step bound in full, the device, the settings then):
    # ``_bind_unchanged``
    _unchanged: tuple | None = field(default=None, repr=False)
    _scalars: tuple | None = field(default=None, repr=False)   # (step count, dtype -> scalars): ``_scalars_for``

    def bind(self, optimizer, group):
        """The tensors each launch takes and the step count, or None where this step is not
        the one compiled (then nothing has changed)."""
        params = group["params"]
        if len(params) != len(self.param_ids) or tuple(map(id, params)) != self.param_ids:
            return None
        if len(self.updated) != len(params):  # (usually every parameter had a gradient)
            updated = {i for i, _, _ in self.updated}
            for i, p in enumerate(params):
                if i not in updated and p.grad is not None:
                    return None  # a parameter that had no gradient when recorded has one now
        state, state_keys = optimizer.state, self.state_keys
        keeps_state = bool(state_keys) or self.has_step
        settings = _settings(optimizer, group)
        if self._unchanged is not None and _same_objects(settings, self._unchanged[2]):
            bound = self._bind_unchanged(params, state, keeps_state)
            if bound is not None:
                return bound
        if self.rule.refuse(optimizer, group) is not None or self.rule.key(group) != self.key:
            return None
        self._unchanged = self._scalars = None
        per_param, bumped, steps = [], [], []
        dtensor = shards.dtensor_class()  # (None: no DTensor exists in this process)
        device = None
        for i, numel, dtype in self.updated:
            wrapper = params[i]
            wrappers = _wrappers(wrapper, state, state_keys, keeps_state)
            if wrappers is None:
                return None
            if device is None:
                device = wrapper.device if dtensor is None or not isinstance(wrapper, dtensor) \
                    else wrapper._local_tensor.device
            tensors = _updatable(wrappers, dtensor, device, numel, dtype)
            if tensors is None:
                return None
            bumped.append(wrappers)
            if self.has_step:
                step = _step_tensor(state[wrapper])
                if step is None:
                    return None
                steps.append(step)
            if dtype.is_complex:  # updated as its real view (the kernel's dtype is the real one)
                tensors = [torch.view_as_real(t) for t in tensors]
            per_param.append(tensors)
        count = self._step_count(steps) if self.has_step else 0
        if count is None:
            return None
        if not any(dtype.is_complex for _, _, dtype in self.updated) and _immutable(settings, params):
            # (a DTensor's tensors: never unchanged, ``tensors_unchanged``)
            self._unchanged = (tensors_unchanged([t for tensors in bumped for t in tensors]), device, settings)
        return per_param, bumped, steps, count, device

    def _bind_unchanged(self, params, state, keeps_state: bool):
        """``bind``'s result where the group's settings are the objects they were at the last step bound
        in full (so its checks of them hold) and the tensors it takes are as then (one C++ check,
        ``runtime.unchanged``), else None. NOTE (speed): checking each parameter's tensors and the
        settings in Python was about 0.15 ms of the DDP benchmark's 0.8 ms step on this CPU (each step
        begins out of the caches)."""
        unchanged, device, _ = self._unchanged
        bumped = [_wrappers(params[i], state, self.state_keys, keeps_state) for i, _, _ in self.updated]
        if any(w is None for w in bumped) or not unchanged(*[t for tensors in bumped for t in tensors]):
            return None
        steps = [_step_tensor(state[params[i]]) for i, _, _ in self.updated] if self.has_step else []
        if any(step is None for step in steps):
            return None
        count = self._step_count(steps) if self.has_step else 0
        if count is None:
            return None
        return bumped, bumped, steps, count, device

    def _step_count(self, steps):
        """The step count all parameters share (None: they differ; that step runs eagerly).
        Known without reading the tensors when they are the ones this plan last advanced and
        nothing wrote them since (their version counters say so)."""
        known = self._known_steps
        if known is not None and len(known[0]) == len(steps) and all(a is b for a, b in zip(known[0], steps)) \
                and all(t._version == v for t, v in zip(steps, known[1])):
            return known[2]
        counts = {t.item() for t in steps}
        return counts.pop() if len(counts) == 1 else None

    def apply(self, group, bound, stats) -> None:
        per_param, bumped, steps, count, device = bound
        if steps:
            torch._foreach_add_(steps, 1)  # eager: step_t += 1, each a 0-d tensor
            count = count + 1 if count + 1 < _EXACT_STEPS else steps[0].item()
            self._known_steps = (steps, [t._version for t in steps], count)
        for launch in self.launches:
            dtype = self.updated[launch.members[0]][2].to_real()
            scalars = self._scalars_for(group, count, dtype)
            tensors = [t for m in launch.members for t in per_param[m]]
            launch.launch(tensors, scalars, device)
        # what eager's in-place ops do to the version counters (the kernels write unseen); its
        # fused=True kernels bump none (checked on CPU with torch 2.13): neither do we then. A
        # DTensor's are its own, not its local shard's (eager's ops on it bump the wrapper's only)
        if not group.get("fused"):
            _increment_version([t for tensors in bumped for t, n in zip(tensors, self.version_bumps)
                                for _ in range(n)])
        if stats is not None:
            stats["kernel_launches"] = stats.get("kernel_launches", 0) + len(self.launches)
            stats["optimizer_launches"] = stats.get("optimizer_launches", 0) + len(self.launches)


    def _scalars_for(self, group, count: int, dtype) -> dict:
        """The rule's scalars for this step, kept while the settings are those last bound in full
        (``bind`` forgets them where they may not be) and the step count is the same (SGD's: 0)."""
        kept = self._scalars
        if kept is None or kept[0] != count:
            kept = self._scalars = (count, {})
        scalars = kept[1].get(dtype)
        if scalars is None:
            scalars = kept[1][dtype] = self.rule.scalars(group, count, dtype)
        return scalars


def _wrappers(param, state, state_keys: tuple, keeps_state: bool) -> list | None:
    """The tensors a parameter's launch takes, as Python holds them: the parameter, its gradient and
    its state tensors (``state_keys``); None where the optimizer keeps state and has none for it yet."""
    if not keeps_state:
        return [param, param.grad]
    s = state.get(param)
    if s is None:
        return None
    return [param, param.grad, *[s.get(name) for name in state_keys]]


def _step_tensor(s: dict):
    """A parameter's ``state["step"]`` where it is a one-element tensor, else None."""
    step = s.get("step")
    return step if isinstance(step, torch.Tensor) and step.numel() == 1 else None


def _settings(optimizer, group) -> list:
    """What the rule's checks and scalars read of a step's group and optimizer: the group's values (its
    hyperparameters, flags and parameter list) and a gradient scaler's attributes."""
    return [*group.values(), getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)]


def _same_objects(settings: list, known: list) -> bool:
    return len(settings) == len(known) and all(map(operator.is_, settings, known))


# settings whose object cannot change its value: the same object, the same setting
_IMMUTABLE = (float, int, bool, str, type(None), torch.dtype)


def _immutable(settings: list, params: list) -> bool:
    """Whether every setting but the parameter list (checked at each step by identity) is immutable:
    a tuple of numbers (``betas``), a number, a flag (a list or a tensor may change in place)."""
    return all(v is params or type(v) in _IMMUTABLE or (type(v) is tuple and all(type(x) in _IMMUTABLE for x in v))
               for v in settings)


def _updatable(wrappers: list, dtensor, device, numel: int, dtype):
    """The tensors a parameter's launch updates in place (parameter, gradient, state): the wrappers
    themselves, or a DTensor parameter's local shards where its gradient and state are placed alike;
    None where the kernels built for ``numel`` elements of ``dtype`` on ``device`` cannot take them:
    one not a tensor, or not strided, contiguous, of that dtype, size and device, or a conjugate or
    negative view (the kernels would read its memory as it is). One function, one pass: it runs per
    parameter per step (NOTE (speed): each step begins with these objects out of the caches)."""
    tensors = wrappers
    if dtensor is not None and isinstance(wrappers[0], dtensor):
        reference = wrappers[0]
        if not all(isinstance(t, torch.Tensor) and shards.placed_like(t, reference) for t in wrappers[1:]):
            return None   # (its kernels read the local shards, which must line up)
        tensors = [t._local_tensor for t in wrappers]
    for t in tensors:
        if (not isinstance(t, torch.Tensor) or t.device != device or t.dtype != dtype or t.numel() != numel
                or not t.is_contiguous() or t.layout != _STRIDED or t.is_neg() or (dtype.is_complex and t.is_conj())):
            return None
    return tensors


_STRIDED = torch.strided


class FusedOptimizerStep:
    """One recorded ``optimizer.step()`` compiled: its groups' fused steps."""

    def __init__(self, optimizer, groups: list, stats=None, backend: str | None = None):
        self.optimizer = weakref.ref(optimizer)
        self.groups = groups
        self.stats = stats
        # what it was built for (``runtime.backends``; default: what this thread builds for now):
        # "torch" leaves CPU parameters to the optimizer's own step (its foreach kernels); "cpp"
        # launches C++ functions (``runtime.cpp_kernels.CppComboLaunch``)
        self.backend = backend or backends.chosen()

    @property
    def launches(self) -> list:
        return [launch for g in self.groups for launch in g.launches]

    def ahead_of_time(self) -> tuple:
        """(``runtime.ahead_of_time`` jobs, device): each combo kernel's launch as a step of the
        optimizer's groups now would make it (its scalars at step 1: only an integer's being 1 or a
        multiple of 16 changes what is compiled), every tensor aligned. None to do where the
        optimizer is gone or its groups changed (the first launch compiles then, as before)."""
        from runtime.ahead_of_time import Job, stand_in

        optimizer = self.optimizer()
        if optimizer is None or len(optimizer.param_groups) != len(self.groups):
            return [], None
        jobs, device = [], None
        for plan, group in zip(self.groups, optimizer.param_groups):
            params = group["params"]
            for launch in plan.launches:
                if not launch.grid:
                    continue
                index, _, dtype = plan.updated[launch.members[0]]
                device = params[index].device
                real = dtype.to_real()
                tensors = [stand_in(real, device)] * (len(launch.members) * (2 + len(plan.state_names)))
                scalars = plan.rule.scalars(group, 1, real)
                numbers = [scalars[n] for n in launch.scalar_names]
                jobs.append(Job(launch.name, launch.launcher(), [*tensors, *numbers],
                                specialization_key(tensors, numbers)))
        return jobs, device

    def run(self, optimizer, args, kwargs):
        """Update the parameters and state with the fused kernels; the arguments the step call
        then runs with (its own update skipped), or None where it must run eagerly."""
        if optimizer is not self.optimizer() or len(args) > 1 or kwargs:
            return None  # another optimizer, or a closure to call: eager
        if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
            # NOTE: CUDA graph capture: the fused kernels take the learning rate and step count from
            # the host, which the graph would bake in. Eager's own step raises unless its groups are
            # capturable (then its scalars live on the device): it runs, and decides.
            return None
        if self.backend == "torch":
            on_cpu = self.__dict__.get("_on_cpu")
            if on_cpu is None:  # (the parameters' device: fixed while the replay's guards hold)
                on_cpu = self._on_cpu = _on_cpu(optimizer)
            if on_cpu:  # the CPU path: the optimizer's own step (its foreach kernels)
                return None
        param_groups = optimizer.param_groups
        if len(param_groups) != len(self.groups):
            return None
        bound = []
        for plan, group in zip(self.groups, param_groups):
            b = plan.bind(optimizer, group)
            if b is None:
                return None
            bound.append(b)
        for plan, group, b in zip(self.groups, param_groups, bound):
            plan.apply(group, b, self.stats)
        return (_STEP_TAKEN,), {}

    def run_after_pre_hooks(self, optimizer, args, kwargs, own_hook: int):
        """``run`` from the replay's global step pre-hook (``own_hook``: its id), as the last of
        the step's pre-hooks. Returns what that pre-hook hands back.

        NOTE: eager's ``step()`` runs every pre-hook, the global ones then the optimizer's own,
        before its update: a hook may change the gradients (unscale, clip, zero) or raise, and
        the update must see that. Where any hook follows ours, the update is left to a pre-hook
        of the optimizer's own, moved to the end of its hooks for this step (``_LastPreHook``),
        which the global pre-hooks have all run before."""
        hooks = optimizer._optimizer_step_pre_hooks
        if not hooks and next(reversed(_optim._global_optimizer_pre_hooks)) == own_hook:
            return self.run(optimizer, args, kwargs)  # (the usual case: no other pre-hook)
        last = _LastPreHook.of(optimizer)
        hooks.move_to_end(last.id)
        last.hand_over(self, args)
        return None

    def run_directly(self, optimizer, own_hooks) -> bool:
        """``skip_python``: this step made without ``optimizer.step()``'s Python where that
        Python would do nothing else: no profiler running (its range), no step hooks but the
        replay's own (``own_hooks``: their ids), and ``step`` the class's (or an LR scheduler's
        wrapper, whose one effect, ``_opt_called``, is made here). What the wrapper does with
        grad mode and ``_optimizer_step_code`` has no effect on fused kernels' update. False:
        nothing changed; call ``optimizer.step()``. (overhead_step: the step's 96 us of host work -> 42.)"""
        if _profiler_enabled() or optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
            return False
        pre, post = _optim._global_optimizer_pre_hooks, _optim._global_optimizer_post_hooks
        if len(pre) != 1 or len(post) != 1 or own_hooks[0] not in pre or own_hooks[1] not in post:
            return False
        patched = optimizer.__dict__.get("step")
        if patched is not None and not getattr(patched, "_wrapped_by_lr_sched", False):
            return False  # a step the user replaced: its Python runs
        if self.run(optimizer, (), {}) is None:
            return False
        if patched is not None:
            # (the LR scheduler's wrapper's own mark, which its next ``step()`` reads: torch's attribute)
            optimizer._opt_called = True
        return True


class _LastPreHook:
    """A step pre-hook of one optimizer's own that makes a fused update handed to it
    (``pending``: the update and the step's arguments) after the optimizer's other pre-hooks
    (``run_after_pre_hooks``). Registered once per optimizer; it does nothing at steps with no
    fused update pending. NOTE: an update is made only in the ``step()`` call that handed it: its
    arguments are the same tuple there unless a hook replaced them (then the step runs eagerly),
    and a step whose earlier pre-hook raised leaves nothing that a later, eager step would make."""

    def __init__(self, optimizer=None, hook_id: int | None = None):
        self.pending = None
        self.id = optimizer.register_step_pre_hook(self).id if optimizer is not None else hook_id

    @classmethod
    def of(cls, optimizer) -> "_LastPreHook":
        last = optimizer.__dict__.get("_symgrad_last_pre_hook")
        if last is None or last.id not in optimizer._optimizer_step_pre_hooks:  # (or the user removed it)
            # NOTE: kept on the optimizer itself: it lives, is copied (``__deepcopy__``) and dies with it
            last = optimizer._symgrad_last_pre_hook = cls(optimizer)
        return last

    def hand_over(self, step: FusedOptimizerStep, args) -> None:
        """``step``'s update, to make when this hook runs in the ``step()`` call given ``args``."""
        self.pending = (step, args)

    def __call__(self, optimizer, args, kwargs):
        pending, self.pending = self.pending, None
        if pending is None or pending[1] is not args:
            return None
        return pending[0].run(optimizer, args, kwargs)

    def __deepcopy__(self, memo):  # (a copied optimizer's copy: nothing pending)
        return _LastPreHook(hook_id=self.id)


def _on_cpu(optimizer) -> bool:
    return any(p.device.type == "cpu" for group in optimizer.param_groups for p in group["params"][:1])
