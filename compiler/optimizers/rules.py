"""The update rules of the optimizers the compiler fuses: SGD, Adam and AdamW.

Each rule says, for one parameter group, whether it can be fused (else why not), which of
the group's settings change the kernel (its *key*: a change runs the step eagerly), which
state tensors each parameter has, the per-step scalars, computed on the host in double
precision exactly as eager's ``_single_tensor_*`` functions compute them, and the elementwise
update as statements over loaded values (``p``, ``g``, the state's names, and the
scalars by name). The scalars are kernel arguments, never constants: an LR scheduler
changing ``lr`` changes an argument, not the kernel.

The update follows eager's single-tensor code op by op, in its order, rounding where it
rounds (each in-place op stores in the parameter's dtype; a Python scalar is rounded to it
when an op reads it). ``foreach=`` and ``fused=`` compute the same values in another order
(within a few ulps), so every setting of the flags runs this one kernel.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

# Settings the kernels do not implement: their steps run eagerly, with the setting named.
_UNSUPPORTED_FLAGS = ("capturable", "differentiable")


class Rule:
    """One optimizer's update. Subclasses fill in the class attributes and methods."""
    name: str = ""
    optimizer_types: tuple = ()

    def refuse(self, optimizer, group) -> str | None:
        """Why this group's step cannot be fused (None: it can)."""
        for flag in _UNSUPPORTED_FLAGS:
            if group.get(flag):
                return f"{flag}=True"
        for name in self.scalar_settings:
            if type(_setting(group, name)) not in (float, int):
                return f"{name} is a {type(_setting(group, name)).__name__}, not a Python number"
        if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
            return "a gradient scaler's grad_scale/found_inf is set"
        return None

    scalar_settings: tuple = ()   # the group's settings read as scalars each step
    scalar_names: tuple = ()      # the kernel's scalar arguments (``scalars``' keys)
    integer_scalars: tuple = ()   # those that are integers (the others are in the parameters' dtype)

    def key(self, group) -> tuple:
        """The group's settings that change the kernel's statements."""
        raise NotImplementedError

    def state_names(self, key) -> tuple:
        """The state tensors each parameter has, in kernel argument order."""
        raise NotImplementedError

    def state_keys(self, key) -> tuple:
        """Their keys in ``optimizer.state[param]``."""
        return self.state_names(key)

    def has_step(self, key) -> bool:
        """Whether each parameter's state counts its steps in ``state["step"]``."""
        return False

    def in_place_writes(self, key) -> dict:
        """Stored name (``stores``) -> how many in-place ops eager's step makes on it: the
        version counter's bumps, made again after the kernels (which PyTorch cannot see), so a
        graph that saved a parameter before the step fails its version check as in eager."""
        raise NotImplementedError

    def scalars(self, group, step, dtype) -> dict:
        """name -> value of the kernel's scalar arguments for this step."""
        raise NotImplementedError

    def body(self, key) -> list:
        """Statements, ``(name, expression)`` pairs in order: each reads the loaded ``p``, ``g``,
        state values, the scalars and the names assigned before it, and assigns ``name``. Expressions use Python's operators (``|`` between
        comparisons) and three functions each backend writes its own way: ``WHERE(c, a, b)``,
        ``SQRT(x)`` and ``DIV(a, b)``, the last two correctly rounded in fp32 (``combo.combo_source``
        for Triton, ``cpp_combo.cpp_combo_source`` for C++)."""
        raise NotImplementedError

    def stores(self, key) -> tuple:
        """The loaded names written back (the parameter and its state)."""
        return ("p",) + self.state_names(key)


def _setting(group, name):
    if name in ("beta1", "beta2"):
        return group["betas"][0 if name == "beta1" else 1]
    return group[name]


def _foreach_step(group) -> bool:
    """Whether eager runs this group's step with its foreach implementation: ``foreach=True``,
    or unset with neither ``fused`` nor ``differentiable``, where torch's default picks it by the
    parameters' device (CUDA's). (Torch's ``_default_to_fused_or_foreach`` asks that of every
    parameter; a fused group's are plain tensors on one device, so the first one answers: this
    runs in every replayed step's key check.)"""
    if group.get("fused") or group.get("differentiable"):
        return False
    if group.get("foreach") is not None:
        return bool(group["foreach"])
    params = group["params"]
    return bool(params) and params[0].device.type in _foreach_devices()


def _foreach_devices():
    from torch.optim.optimizer import _get_foreach_kernels_supported_devices

    return _get_foreach_kernels_supported_devices()


_FLOAT32 = struct.Struct("=f")


def rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` as an op of ``dtype`` reads a Python scalar: rounded to fp32 for fp32 tensors
    (eager's CPU and CUDA kernels compute float ops in float), kept for fp64."""
    if dtype != torch.float32:
        return float(value)
    try:  # (struct, not np.float32: the same IEEE rounding at a third of the cost, for each scalar of each step)
        return _FLOAT32.unpack(_FLOAT32.pack(value))[0]
    except OverflowError:  # (beyond fp32's range: numpy's infinity)
        return float(np.float32(value))


class SGDRule(Rule):
    name = "sgd"
    optimizer_types = (torch.optim.SGD,)
    scalar_settings = ("lr", "momentum", "dampening", "weight_decay")
    scalar_names = ("weight_decay", "momentum", "one_minus_dampening", "neg_lr")

    def key(self, group):
        maximize, decay = bool(group["maximize"]), group["weight_decay"] != 0
        momentum, nesterov = group["momentum"] != 0, bool(group["nesterov"])
        # NOTE: eager's foreach SGD (the default for CUDA parameters) makes nesterov's step in the
        # user's gradients, ``torch._foreach_add_(grads, bufs, alpha=momentum)``, where no earlier op
        # made them a copy (maximize's negation, weight decay's add): p.grad after step() holds
        # g + momentum * buf. The single-tensor and fused steps leave p.grad as it was.
        grad_written = nesterov and momentum and not maximize and not decay and _foreach_step(group)
        return (maximize, decay, momentum, nesterov, grad_written)

    def state_names(self, key):
        return ("buf",) if key[2] else ()

    def state_keys(self, key):
        return ("momentum_buffer",) if key[2] else ()

    def stores(self, key):
        return super().stores(key) + (("g",) if key[4] else ())

    def in_place_writes(self, key):
        # eager (single-tensor and foreach alike): buf.mul_(momentum).add_(grad); param.add_(grad)
        # (and foreach's nesterov grads' add_, see ``key``)
        return {"p": 1, "buf": 2, "g": int(key[4])}

    def scalars(self, group, step, dtype):
        # eager: grad.add(param, alpha=wd); buf.mul_(momentum).add_(grad, alpha=1 - dampening);
        # grad.add(buf, alpha=momentum); param.add_(grad, alpha=-lr)
        return {"weight_decay": rounded(group["weight_decay"], dtype),
                "momentum": rounded(group["momentum"], dtype),
                "one_minus_dampening": rounded(1 - group["dampening"], dtype),
                "neg_lr": rounded(-group["lr"], dtype)}

    def body(self, key):
        maximize, decay, momentum, nesterov, _ = key
        lines = []
        if maximize:
            lines.append(("g", "-g"))
        if decay:
            lines.append(("g", "g + weight_decay * p"))
        if momentum:
            lines.append(("buf", "buf * momentum + one_minus_dampening * g"))
            lines.append(("g", "g + momentum * buf" if nesterov else "buf"))
        lines.append(("p", "p + neg_lr * g"))
        return lines


class AdamRule(Rule):
    """Adam and AdamW (AdamW is Adam with ``decoupled_weight_decay=True``)."""
    name = "adam"
    optimizer_types = (torch.optim.Adam, torch.optim.AdamW)
    scalar_settings = ("lr", "beta1", "beta2", "eps", "weight_decay")
    scalar_names = ("decay", "weight_decay", "lerp_low", "weight", "one_minus_weight", "beta2", "one_minus_beta2",
                    "bias_correction2_sqrt", "eps", "neg_step_size")
    integer_scalars = ("lerp_low",)

    def key(self, group):
        decoupled = bool(group.get("decoupled_weight_decay", False))
        return (bool(group["maximize"]), group["weight_decay"] != 0, decoupled, bool(group["amsgrad"]))

    def state_names(self, key):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if key[3] else ())

    def has_step(self, key):
        return True

    def in_place_writes(self, key):
        # eager (single-tensor and foreach alike): param.mul_ (AdamW's decay), exp_avg.lerp_,
        # exp_avg_sq.mul_().addcmul_(), max_exp_avg_sq's copy_/maximum_, param.addcdiv_
        _, decay, decoupled, _ = key
        return {"p": 1 + int(decay and decoupled), "exp_avg": 1, "exp_avg_sq": 2, "max_exp_avg_sq": 1}

    def scalars(self, group, step, dtype):
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        # eager (_single_tensor_adam, capturable=False): Python floats in double
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2 ** 0.5
        weight = rounded(1 - beta1, dtype)  # exp_avg.lerp_(grad, 1 - beta1): the weight in opmath
        if dtype == torch.float32:
            one_minus_weight = float(np.float32(1) - np.float32(weight))
        else:
            one_minus_weight = 1 - weight
        return {"decay": rounded(1 - lr * wd, dtype),           # param.mul_(1 - lr * wd)  (AdamW)
                "weight_decay": rounded(wd, dtype),             # grad.add(param, alpha=wd) (Adam)
                "lerp_low": int(abs(weight) < 0.5),
                "weight": weight, "one_minus_weight": one_minus_weight,
                "beta2": rounded(beta2, dtype), "one_minus_beta2": rounded(1 - beta2, dtype),
                "bias_correction2_sqrt": rounded(bias_correction2_sqrt, dtype),
                "eps": rounded(eps, dtype), "neg_step_size": rounded(-step_size, dtype)}

    def body(self, key):
        maximize, decay, decoupled, amsgrad = key
        lines = []
        if maximize:
            lines.append(("g", "-g"))
        if decay:
            lines.append(("p", "p * decay") if decoupled else ("g", "g + weight_decay * p"))
        # lerp as ATen computes it: from the nearer end, by the weight's size
        lines.append(("exp_avg", "WHERE(lerp_low != 0, exp_avg + weight * (g - exp_avg), "
                                 "g - (g - exp_avg) * one_minus_weight)"))
        lines.append(("exp_avg_sq", "exp_avg_sq * beta2 + one_minus_beta2 * g * g"))
        second = "exp_avg_sq"
        if amsgrad:  # torch.maximum: NaN wins
            lines.append(("max_exp_avg_sq", "WHERE((max_exp_avg_sq < exp_avg_sq) | (exp_avg_sq != exp_avg_sq), "
                                            "exp_avg_sq, max_exp_avg_sq)"))
            second = "max_exp_avg_sq"
        lines.append(("denom", f"DIV(SQRT({second}), bias_correction2_sqrt) + eps"))
        lines.append(("p", "p + neg_step_size * DIV(exp_avg, denom)"))
        return lines


RULES = (SGDRule(), AdamRule())


def rule_for(optimizer):
    """The rule for ``optimizer``'s exact class (a subclass may change the step: not fused)."""
    for rule in RULES:
        if type(optimizer) in rule.optimizer_types:
            return rule
    return None
