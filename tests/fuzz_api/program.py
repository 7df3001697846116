"""Random programs that use the autograd API around a few ops: drawn from a seed, printable.

A program is a function ``fn([m, opt,] x0, x1, ...)`` of small float tensors (and, in about
half of them, a tiny module ``m`` with an optimizer ``opt`` that persist across calls, as a
training step's do). Its body applies ops from ``OPS`` and, at random points, the API features
of the autograd API; then a backward phase (``loss.backward()``, twice with ``retain_graph``,
``torch.autograd.grad(..., inputs)``, ``backward(inputs=...)``, or none: the checker calls
backward on what it returns) and maybe an optimizer step. Hooks write what they see to
``log(name, *args)`` (a global of the program), which the checker compares with eager's.

The program is drawn step by step over concrete tensors (the first call's), so each statement
is one eager accepts or the last one (whose error the compiled call must raise too). Program k
of a run is ``draw_program(random.Random(seed + k))``; ``str(program)`` is its reproduction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tests.fuzz import program as fuzz_program

# -- what the program's hooks reach: globals of the program's function -------------------------


class Box:
    """An object holding a packed tensor (a pack hook may return any object)."""

    def __init__(self, t):
        self.t = t


class Log:
    """The hook calls of one program call: (name, arguments as snapshots), in order. Names that
    start with ``~`` (hooks of ``saved_tensors_hooks`` blocks: which tensors a compiled region
    saves is its own business) are only counted."""

    def __init__(self):
        self.entries, self.uncompared = [], 0
        self.store = {}  # int keys -> packed tensors (pack hooks that return a key)

    def __call__(self, name, *args):
        if name.startswith("~"):
            self.uncompared += 1
        else:
            self.entries.append((name, tuple(snapshot(a) for a in args)))
        return None

    def stash(self, t):
        key = len(self.store)
        self.store[key] = t
        return key


def snapshot(value):
    """What a hook argument showed when the hook ran (tensors copied: they may change later)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return tuple(snapshot(v) for v in value)
    if isinstance(value, Box):
        return ("Box", snapshot(value.t))
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, int):
        return "int key"  # (a dict key: its number is the checker's business, not the program's)
    return value if value is None else type(value).__name__


def program_globals(log: Log) -> dict:
    return {"torch": torch, "log": log, "Box": Box, "stash": log.stash, "store": log.store, "hookable": hookable}


def hookable(t: torch.Tensor) -> torch.Tensor:
    """``t``, its view history refreshed before a hook is registered on it, as PyTorch itself does
    from its fix of pytorch/pytorch#196459: in 2.13, ``register_hook`` on a view changed in place
    through an alias (``with torch.no_grad(): v.mul_(2)`` on a Linear's 3-d output) crashes the
    process (seed 28389, both worlds: eager's own crash). Read with torch functions off, so the
    recording does not see it, as it does not see PyTorch's own refresh."""
    with torch._C.DisableTorchFunction():
        t.grad_fn  # noqa: B018 (the read refreshes it)
    return t


# -- choosers -------------------------------------------------------------------------------------


class RandomChooser(fuzz_program.RandomChooser):
    """The op fuzzer's seeded chooser (``--seed S --count 1`` reproduces program S), which also
    says its seed."""

    def __init__(self, seed: int):
        super().__init__(seed)
        self.seed = seed


# -- inputs, module, optimizer ----------------------------------------------------------------


@dataclass
class Input:
    shape: tuple
    dtype: torch.dtype
    requires_grad: bool
    seed: int

    def make(self, call: int):
        """This input for call ``call`` (the same shape every call, other values)."""
        g = torch.Generator().manual_seed(self.seed + 7919 * call)
        x = torch.randn(self.shape, generator=g, dtype=torch.float64).to(self.dtype)
        return x.requires_grad_(self.requires_grad)

    def __repr__(self):
        return f"{self.dtype} {list(self.shape)}{', requires_grad' if self.requires_grad else ''} (seed {self.seed})"


@dataclass
class ModelSpec:
    kind: str          # "linear" | "mlp"
    in_features: int
    out_features: int
    dtype: torch.dtype
    seed: int
    optimizer: str | None = None    # "SGD" | "Adam" | "AdamW"
    options: dict = field(default_factory=dict)

    def make(self):
        """A fresh module and optimizer (the same values every time)."""
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            if self.kind == "linear":
                m = torch.nn.Linear(self.in_features, self.out_features, dtype=self.dtype)
            else:
                m = torch.nn.Sequential(torch.nn.Linear(self.in_features, 3, dtype=self.dtype), torch.nn.Tanh(),
                                        torch.nn.Linear(3, self.out_features, dtype=self.dtype))
        opt = getattr(torch.optim, self.optimizer)(m.parameters(), **self.options) if self.optimizer else None
        return m, opt

    def __repr__(self):
        layers = (f"torch.nn.Linear({self.in_features}, {self.out_features})" if self.kind == "linear" else
                  f"torch.nn.Sequential(torch.nn.Linear({self.in_features}, 3), torch.nn.Tanh(), "
                  f"torch.nn.Linear(3, {self.out_features}))")
        opt = f"; opt = torch.optim.{self.optimizer}(m.parameters(), {self.options})" if self.optimizer else ""
        return f"m = {layers} ({self.dtype}, seed {self.seed}){opt}"


def _draw_optimizer(ch, dtype):
    name = ch.pick(["SGD", "Adam", "AdamW"])
    options = {"lr": ch.pick([0.1, 0.01])}
    if name != "SGD" and dtype == torch.float32:
        # NOTE: Adam divides by sqrt(v) + eps: a gradient that is rounding noise (the loss of a
        # softmax's sum is constant) becomes a step of size lr where eps (1e-8) is below the noise,
        # so float32's noise would decide the step. 1e-4 keeps the step a function of the gradient.
        options["eps"] = 1e-4
    if ch.bool(0.3):
        options["weight_decay"] = ch.pick([0.0, 0.1])
    if ch.bool(0.2):
        options["maximize"] = True
    if ch.bool(0.4):
        options["foreach"] = ch.bool()
    if name == "SGD":
        if ch.bool(0.6):
            options["momentum"] = 0.9
            if ch.bool(0.4):
                options["nesterov"] = True
    elif ch.bool(0.3):
        options["amsgrad"] = True
    return name, options


# -- the program ------------------------------------------------------------------------------


@dataclass
class Program:
    inputs: list
    model: ModelSpec | None = None
    lines: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    external_backward: bool = False  # the checker calls backward on the outputs after each call
    eager_error: str | None = None   # what eager raised at the last line while drawing
    features: list = field(default_factory=list)  # the API features used (for the run's counts)

    @property
    def params(self) -> list:
        return (["m", "opt"] if self.model is not None else []) + [f"x{i}" for i in range(len(self.inputs))]

    @property
    def source(self) -> str:
        body = [f"    {line}" for line in self.lines] or ["    pass"]
        ret = f"    return ({', '.join(self.outputs)},)" if self.outputs else "    return None"
        return "\n".join([f"def fn({', '.join(self.params)}):"] + body + [ret])

    def function(self, log: Log):
        """The program as a fresh Python function whose hooks log to ``log``."""
        scope = program_globals(log)
        exec(compile(self.source, "<fuzz_api program>", "exec"), scope)
        return scope["fn"]

    def arguments(self, world, call: int) -> list:
        """The arguments of call ``call``: the world's module and optimizer, fresh inputs."""
        return list(world) + [spec.make(call) for spec in self.inputs]

    def __str__(self):
        head = [f"# x{i}: {spec!r}" for i, spec in enumerate(self.inputs)]
        if self.model is not None:
            head.append(f"# {self.model!r}")
        if self.external_backward:
            head.append("# after each call: backward of the sum of its differentiable outputs (seeded weights)")
        return "\n".join(head + [self.source])


# -- the menu -------------------------------------------------------------------------------------
# An op: (name, weight, arity, applies(operands) -> bool, template)

def _float(*ts):
    return all(isinstance(t, torch.Tensor) and t.dtype.is_floating_point for t in ts)


def _dims(t, lo):
    return _float(t) and t.dim() >= lo


def _broadcasts(a, b):
    try:
        torch.broadcast_shapes(a.shape, b.shape)
        return a.dtype == b.dtype
    except RuntimeError:
        return False


OPS = [
    ("sin", 3, 1, lambda a: _float(a), "torch.sin({0})"),
    ("exp", 2, 1, lambda a: _float(a), "torch.exp({0})"),
    ("tanh", 3, 1, lambda a: _float(a), "torch.tanh({0})"),
    ("sigmoid", 2, 1, lambda a: _float(a), "torch.sigmoid({0})"),
    ("relu", 2, 1, lambda a: _float(a), "torch.relu({0})"),
    ("pow", 3, 1, lambda a: _float(a), "{0}.pow(2)"),
    ("square", 2, 1, lambda a: _float(a), "{0} * {0}"),
    ("affine", 2, 1, lambda a: _float(a), "{0} * 0.5 + 1"),
    ("log1pabs", 1, 1, lambda a: _float(a), "torch.log({0}.abs() + 1)"),
    ("softmax", 2, 1, lambda a: _dims(a, 1), "torch.softmax({0}, dim=-1)"),
    ("sum-last", 2, 1, lambda a: _dims(a, 1), "{0}.sum(-1)"),
    ("mean", 1, 1, lambda a: _float(a), "{0}.mean()"),
    ("transpose", 1, 1, lambda a: _dims(a, 2), "{0}.t()"),
    ("clone", 1, 1, lambda a: _float(a), "{0}.clone()"),
    ("mul", 4, 2, lambda a, b: _float(a, b) and _broadcasts(a, b), "{0} * {1}"),
    ("add", 3, 2, lambda a, b: _float(a, b) and _broadcasts(a, b), "{0} + {1}"),
    ("sub", 2, 2, lambda a, b: _float(a, b) and _broadcasts(a, b), "{0} - {1}"),
    ("div", 1, 2, lambda a, b: _float(a, b) and _broadcasts(a, b), "{0} / ({1}.abs() + 1)"),
    ("maximum", 1, 2, lambda a, b: _float(a, b) and _broadcasts(a, b), "torch.maximum({0}, {1})"),
    ("matmul", 3, 2, lambda a, b: _float(a, b) and a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]
     and a.dtype == b.dtype, "{0} @ {1}"),
    ("in-place mul", 1, 1, lambda a: _float(a) and a.grad_fn is not None, "{0}.mul_(2)"),
]

SAVED_HOOK_FORMS = {
    # name: (pack, unpack) templates ({n}: the log name's number); each logs what it gets
    "identity": ("lambda t: log('pack{n}', t) or t", "lambda t: log('unpack{n}', t) or t"),
    "copy": ("lambda t: log('pack{n}', t) or t.clone()", "lambda t: log('unpack{n}', t) or t"),
    "times-one": ("lambda t: t * 1", "lambda t: t"),
    "other dtype": ("lambda t: log('pack{n}', t) or (t.to(torch.float64), t.dtype)",
                    "lambda p: log('unpack{n}', p) or p[0].to(p[1])"),
    "tuple": ("lambda t: log('pack{n}', t) or (t,)", "lambda p: log('unpack{n}', p) or p[0]"),
    "object": ("lambda t: log('pack{n}', t) or Box(t)", "lambda b: log('unpack{n}', b) or b.t"),
    "int key": ("lambda t: log('pack{n}', t) or stash(t)", "lambda k: log('unpack{n}', k) or store[k]"),
}
# only where the saved tensor is known (a Node's own SavedTensor): unpack returns another dtype
RAW_ONLY_FORMS = {"returns float64": ("lambda t: log('pack{n}', t) or t.double()", "lambda t: t")}

GRAD_MODES = ["torch.no_grad()", "torch.enable_grad()", "torch.set_grad_enabled(False)",
              "torch.set_grad_enabled(True)", "torch.inference_mode()"]
GRAD_MODE_WEIGHTS = [4, 1, 2, 1, 1]

def _shape_like(ch, base):
    if ch.bool(0.2):
        return tuple(ch.int(1, 4) for _ in range(ch.int(0, 2)))
    return tuple(1 if ch.bool(0.2) else s for s in base[ch.int(0, len(base)) if ch.bool(0.2) else 0:])


class _Drawer:
    """Draws one program over live tensors (the first call's)."""

    def __init__(self, ch):
        self.ch = ch
        self.log = Log()
        self.scope = program_globals(self.log)
        self.env: dict = {}
        self.names: list = []       # tensors the program may use
        self.fresh: list = []       # values it made
        self.hooks = 0
        self.retained: list = []
        self.removals: list = []    # lines removing parameter hooks at the end
        self.error = None

    # one statement (or block) at a time, executed as drawn
    def emit(self, program, text, new=None):
        program.lines.extend(text.split("\n"))
        try:
            exec(text, self.scope, self.env)
        except Exception as e:  # noqa: BLE001 — eager's error is what the compiled calls must raise
            self.error = f"{type(e).__name__}: {e}"
            return False
        if new is not None:
            self.names.append(new)
            self.fresh.append(new)
        return True

    def tensors(self, pred=lambda t: True):
        return [n for n in self.names if isinstance(self.env.get(n), torch.Tensor) and pred(self.env[n])]

    def op_line(self, target):
        """``target = <op>(...)`` over tensors of env, or None where nothing applies."""
        ch = self.ch
        for _ in range(8):
            name, _, arity, applies, template = ch.pick(OPS, weights=[op[1] for op in OPS])
            operands = [ch.pick(self.names) for _ in range(arity)]
            if arity == 2 and ch.bool(0.5):
                operands[1] = ch.pick(self.names[-3:])
            if applies(*[self.env[n] for n in operands]):
                if name == "in-place mul":
                    return f"{template.format(*operands)}\n{target} = {operands[0]}"
                return f"{target} = {template.format(*operands)}"
        return None


def draw_program(ch, max_ops=6) -> Program:
    """A random program (see the module's docstring)."""
    d = _Drawer(ch)
    float_dtype = torch.float64 if ch.bool(0.6) else torch.float32
    rank = ch.pick([1, 2, 2, 3])
    base = tuple(ch.int(1, 4) for _ in range(rank))
    inputs = [Input(base, float_dtype, ch.bool(0.8), ch.int(0, 2**31 - 1))]
    for _ in range(ch.int(0, 2)):
        inputs.append(Input(_shape_like(ch, base), float_dtype, ch.bool(0.6), ch.int(0, 2**31 - 1)))
    model = None
    if ch.bool(0.55):
        model = ModelSpec(ch.pick(["linear", "linear", "mlp"]), base[-1], ch.int(1, 3), float_dtype,
                          ch.int(0, 2**31 - 1))
        if ch.bool(0.8):
            model.optimizer, model.options = _draw_optimizer(ch, float_dtype)
    program = Program(inputs, model)
    world = model.make() if model is not None else ()
    d.env.update(zip(program.params, program.arguments(world, 0)))
    d.names = [f"x{i}" for i in range(len(inputs))]
    m, opt = (world + (None, None))[:2]

    steps = ch.int(2, max_ops)
    if opt is not None and ch.bool(0.6):
        zero = ch.pick(["opt.zero_grad()", "opt.zero_grad(set_to_none=False)"])
        if not d.emit(program, zero):
            return _finish(d, program)
    if m is not None and ch.bool(0.5):  # a hook on a parameter, removed at the end (it outlives the call)
        p = ch.pick([n for n, _ in m.named_parameters()])
        k = _next_hook(d)
        d.emit(program, f"h{k} = m.get_parameter('{p}').register_hook(lambda g: log('param{k}@{p}', g))")
        d.removals.append(f"h{k}.remove()")
        program.features.append("parameter hook")
    if m is not None and ch.bool(0.2):
        p = ch.pick([n for n, _ in m.named_parameters()])
        k = _next_hook(d)
        d.emit(program, f"h{k} = m.get_parameter('{p}').register_post_accumulate_grad_hook("
                        f"lambda p: log('accumulated{k}@{p}', p.grad))")
        d.removals.append(f"h{k}.remove()")
        program.features.append("post-accumulate hook")
    used_model = False
    for _ in range(steps):
        if d.error:
            break
        target = f"v{len(d.fresh)}"
        # the module, once, where its input fits
        fits = [n for n in d.tensors(lambda t: _float(t) and t.dim() >= 1) if m is not None
                and d.env[n].shape[-1] == model.in_features]
        if fits and not used_model and ch.bool(0.6):
            line = f"{target} = m({ch.pick(fits)})"
            used_model = True
        else:
            line = d.op_line(target)
        if line is None:
            continue
        block = ch.pick([None, "saved", "grad mode"], weights=[8, 2, 2])
        if block == "saved":
            form = ch.pick(["saved_tensors_hooks"] * 3 + ["save_on_cpu"])
            if form == "save_on_cpu":
                head = "with torch.autograd.graph.save_on_cpu():"
                program.features.append("save_on_cpu block")
            else:
                pack, unpack = SAVED_HOOK_FORMS[ch.pick(list(SAVED_HOOK_FORMS))]
                k = _next_hook(d)
                # (the log names start with ~: which tensors a compiled region saves is its own)
                head = (f"with torch.autograd.graph.saved_tensors_hooks({pack.format(n=k)}, "
                        f"{unpack.format(n=k)}):").replace("log('", "log('~")
                program.features.append("saved_tensors_hooks block")
            line = head + "\n" + "\n".join("    " + ln for ln in line.split("\n"))
        elif block == "grad mode":
            mode = ch.pick(GRAD_MODES, weights=GRAD_MODE_WEIGHTS)
            if mode == "torch.inference_mode()" and ".mul_(" in line:
                # NOTE: eager PyTorch's register_hook segfaults on a tensor that requires grad and
                # was written in place under inference_mode (torch 2.13; fuzz seed 8170): no
                # program may make eager undefined (no RNG drawn: other seeds' programs stay)
                mode = "torch.no_grad()"
            inner = "\n".join("    " + ln for ln in line.split("\n"))
            if mode in ("torch.no_grad()", "torch.set_grad_enabled(False)") and ch.bool(0.3):
                inner = "    with torch.enable_grad():\n" + "\n".join("    " + ln for ln in inner.split("\n"))
                program.features.append("nested grad mode")
            line = f"with {mode}:\n{inner}"
            program.features.append("grad mode block")
        if not d.emit(program, line, new=target):
            break
        for _ in range(ch.int(0, 2)):
            if not _feature(d, program, target):
                break
    if not d.error:
        _backward_phase(d, program, m, opt)
    return _finish(d, program)


def _next_hook(d):
    d.hooks += 1
    return d.hooks


def _feature(d, program, latest) -> bool:
    """One API feature on a tensor of the program (mostly the latest value); False on an error."""
    ch = d.ch
    target = latest if ch.bool(0.6) else ch.pick(d.names)
    t = d.env.get(target)
    if not isinstance(t, torch.Tensor) or not t.requires_grad:
        return True
    k = _next_hook(d)
    leaf = t.grad_fn is None
    choices = ["tensor hook", "tensor hook (replaces grad)", "tensor hook (removed)"]
    if leaf:
        choices += ["post-accumulate hook"] * 2
    else:
        choices += ["node post hook", "node post hook (replaces grad)", "node pre hook",
                    "node pre hook (replaces grad)", "retain_grad", "raw saved hooks", "raw saved hooks"]
    feature = ch.pick(choices)
    at = f"@{target}" if leaf else ""  # (hooks of leaves: see check.leaf_order)
    if feature == "tensor hook":
        line = f"hookable({target}).register_hook(lambda g: log('hook{k}{at}', g))"
    elif feature == "tensor hook (replaces grad)":
        line = (f"hookable({target}).register_hook(lambda g: log('hook{k}{at}', g) or "
                f"g * {ch.pick(['2', '0.5', '-1'])})")
    elif feature == "tensor hook (removed)":
        line = f"h{k} = hookable({target}).register_hook(lambda g: log('hook{k}{at}', g))\nh{k}.remove()"
    elif feature == "post-accumulate hook":
        line = f"{target}.register_post_accumulate_grad_hook(lambda p: log('accumulated{k}{at}', p.grad))"
    elif feature == "node post hook":
        line = f"{target}.grad_fn.register_hook(lambda grad_in, grad_out: log('node{k}', grad_in, grad_out))"
    elif feature == "node post hook (replaces grad)":
        line = (f"{target}.grad_fn.register_hook(lambda grad_in, grad_out: log('node{k}', grad_in, grad_out) or "
                f"tuple(None if g is None else g * 2 for g in grad_in))")
    elif feature == "node pre hook":
        line = f"{target}.grad_fn.register_prehook(lambda grad_out: log('prehook{k}', grad_out))"
    elif feature == "node pre hook (replaces grad)":
        line = (f"{target}.grad_fn.register_prehook(lambda grad_out: log('prehook{k}', grad_out) or "
                f"tuple(None if g is None else g * 0.5 for g in grad_out))")
    elif feature == "retain_grad":
        line = f"{target}.retain_grad()"
        d.retained.append(target)
    else:  # raw saved hooks on one of the Node's saved tensors
        saved = [a for a in dir(t.grad_fn) if a.startswith("_raw_saved_")
                 and type(getattr(t.grad_fn, a)).__name__ == "SavedTensor"]
        if not saved:
            return True
        forms = dict(SAVED_HOOK_FORMS, **RAW_ONLY_FORMS)
        pack, unpack = forms[ch.pick(list(forms))]
        line = f"{target}.grad_fn.{ch.pick(saved)}.register_hooks({pack.format(n=k)}, {unpack.format(n=k)})"
    program.features.append(feature)
    return d.emit(program, line)


def _backward_phase(d, program, m, opt):
    ch = d.ch
    differentiable = d.tensors(lambda t: t.requires_grad and t.dtype.is_floating_point)
    made = [n for n in differentiable if n in d.fresh]
    if not made:
        program.outputs = [d.fresh[-1]] if d.fresh else [d.names[0]]
        return
    last = made[-1]
    phase = ch.pick(["backward", "backward twice", "grad", "backward inputs", "external"], weights=[4, 2, 2, 1, 2])
    summed = f"loss = ({last} * {last}).sum()" if ch.bool(0.5) else f"loss = {last}.sum()"
    if phase == "external":
        program.external_backward = True
        program.outputs = [last] + [n for n in made[:-1] if ch.bool(0.3)]
        _end(d, program)
        return
    if not d.emit(program, summed):
        return
    outputs = ["loss", last]
    if phase == "backward":
        ok = d.emit(program, "loss.backward()")
    elif phase == "backward twice":
        retain = ch.bool(0.85)
        ok = d.emit(program, f"loss.backward(retain_graph={retain})") and d.emit(program, "loss.backward()")
        program.features.append("retain_graph twice" if retain else "backward twice without retain_graph")
    elif phase == "grad":
        wrt = sorted({ch.pick(differentiable) for _ in range(ch.int(1, 3))}, key=differentiable.index)
        retain = ch.bool(0.3)
        ok = d.emit(program, f"grads = torch.autograd.grad(loss, inputs=[{', '.join(wrt)}], "
                             f"allow_unused=True{', retain_graph=True' if retain else ''})")
        if ok and retain and ch.bool(0.7):
            ok = d.emit(program, "loss.backward()")
        outputs.append("grads")
        program.features.append("autograd.grad inputs=")
    else:
        wrt = sorted({ch.pick(differentiable) for _ in range(ch.int(1, 2))}, key=differentiable.index)
        ok = d.emit(program, f"loss.backward(inputs=[{', '.join(wrt)}])")
        outputs += [f"{n}.grad" for n in wrt if n in d.fresh]
        program.features.append("backward inputs=")
    outputs += [f"{n}.grad" for n in d.retained]
    program.outputs = outputs
    if ok and opt is not None and ch.bool(0.85):
        ok = d.emit(program, "opt.step()")
        program.features.append(f"optimizer {type(opt).__name__}")
    if ok:
        _end(d, program)


def _end(d, program):
    for line in d.removals:
        if not d.emit(program, line):
            return


def _finish(d, program) -> Program:
    program.eager_error = d.error
    if not program.outputs:
        program.outputs = [d.fresh[-1]] if d.fresh else [d.names[0]]
    return program
