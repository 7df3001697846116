"""The shape of the code, checked (issue 33): stages in folders, short functions, hand-offs that
no one changes from outside.

These read the source with ``ast`` (no import): a rule broken by a new commit fails here, with
the place that broke it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("compiler", "runtime")
MAX_FUNCTION_LINES = 80
MAX_TOP_LEVEL_MODULES = 6   # beside compiler/'s stage folders

# Attribute assignments on objects other than ``self``/``cls`` that are allowed: each is how a
# PyTorch, Triton or standard-library API is used, never one of our records changed from outside
# (our records are built whole, or changed through their own methods). (file, target) -> why.
_FX = "editing an fx graph: torch.fx's own API for it (a Node's args/kwargs/meta)"
_CTX = "an autograd ctx: torch.autograd.Function's API for what forward hands backward"
_THREAD = "thread-local state (threading.local)"
_PATCH = "installing our wrapper into torch/Triton/logging (third-party objects)"
_FUNCTION = "a function's own metadata (__qualname__, __doc__) or a module object made here"
_TORCH_STATE = "state torch itself defines and reads (a tensor's .grad, an optimizer's flags)"
ALLOWED = {
    ("compiler/autodiff/partition.py", "user.args"): _FX,
    ("compiler/build.py", "node.args"): _FX,
    ("compiler/build.py", "node.kwargs"): _FX,
    ("compiler/build.py", "output.args"): _FX,
    ("compiler/fusion/fuse.py", "total.kwargs"): _FX,
    ("compiler/fusion/fuse.py", "chain[i].args"): _FX,
    ("compiler/fusion/fuse.py", "output.args"): _FX,
    ("compiler/fusion/fuse.py", "node.args"): _FX,
    ("compiler/reuse/dynamic.py", "copy.args"): _FX,
    ("compiler/reuse/dynamic.py", "copy.kwargs"): _FX,
    ("compiler/reuse/persist.py", "node.meta"): _FX,
    ("compiler/elementwise.py", "ctx.op"): _CTX,
    ("compiler/elementwise.py", "ctx.kinds"): _CTX,
    ("compiler/elementwise.py", "ctx.scalars"): _CTX,
    ("runtime/tensor_parallel.py", "ctx.group"): _CTX,
    ("runtime/autograd_bridge.py", "ctx.saved_versions"): _CTX,
    ("runtime/autograd_bridge.py", "ctx.saved_outputs"): _CTX,
    ("runtime/autograd_bridge.py", "ctx.eager_saved"): _CTX,
    ("runtime/autograd_bridge.py", "ctx.hooked"): _CTX,
    ("runtime/autograd_bridge.py", "ctx.region"): _CTX,
    ("runtime/autograd_bridge.py", "ctx.double_backward_inputs"): _CTX,
    ("runtime/autograd_bridge.py", "ctx.shapes"): _CTX,
    ("runtime/autograd_bridge.py", "ctx.chain"): _CTX,
    ("runtime/autograd_bridge.py", "ctx.carrier_grad"): _CTX,
    ("runtime/segments.py", "ctx.source"): _CTX,
    ("runtime/segments.py", "ctx.has_carrier"): _CTX,
    ("runtime/segments.py", "ctx.j"): _CTX,
    ("compiler/capture/pack_hooks.py", "_recording.mode"): _THREAD,
    ("runtime/replay.py", "_active.replay"): _THREAD,
    ("runtime/backends.py", "_chosen.backend"): _THREAD,
    ("runtime/clip_grad.py", "_hooks.recorder"): _THREAD,
    ("runtime/extern_kernels.py", "_recording.on_launch"): _THREAD,
    ("compiler/capture/pack_hooks.py", "_register_hooks.of_torch"): _FUNCTION,
    ("compiler/capture/pack_hooks.py", "_register_hooks.__doc__"): _FUNCTION,
    ("compiler/capture/bindings/elementwise.py", "bind.__qualname__"): _FUNCTION,
    ("runtime/kernels.py", "module.__file__"): _FUNCTION,
    ("compiler/capture/pack_hooks.py", "_SavedTensor.register_hooks"): _PATCH,
    ("compiler/report/logs.py", "root.propagate"): _PATCH,
    ("runtime/clip_grad.py", "clip_grad_norm_.pytorch_function"): _FUNCTION,
    ("runtime/clip_grad.py", "torch.nn.utils.clip_grad_norm_"): _PATCH,
    ("runtime/clip_grad.py", "_clip_grad_module.clip_grad_norm_"): _PATCH,
    ("runtime/launcher.py", "interpreter_builder.options"): _PATCH,
    ("runtime/triton_math.py", "setattr(libdevice, ...)"): _PATCH,
    ("runtime/triton_math.py", "builder.cast_impl"): _PATCH,
    ("runtime/triton_math.py", "builder.create_dot"): _PATCH,
    ("runtime/replay.py", "entering.__class__"): "a torch record_function range the replay takes over (its "
                                                 "exit then runs unwatched): torch's object, our subclass",
    ("runtime/replay.py", "entering._symgrad_replay"): "the same range: which replay its exit belongs to",
    ("runtime/replay.py", "entering._symgrad_exit"): "the same range: where its exit is in the recording",
    ("runtime/replay.py", "env[vid].grad"): _TORCH_STATE,
    ("runtime/dynamic_shapes.py", "setattr(t, ...)"): "torch._dynamo's mark_dynamic attribute on a user tensor",
    ("runtime/optimizer_step.py", "optimizer._opt_called"): _TORCH_STATE,
    ("runtime/optimizer_step.py", "optimizer._symgrad_last_pre_hook"): _TORCH_STATE,
}


def _sources():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))


def _outside_writes(tree) -> list:
    """(line, target) of each attribute assignment whose object is not ``self``/``cls``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            flat = [t for target in targets for t in (target.elts if isinstance(target, (ast.Tuple, ast.List))
                                                       else [target])]
            found += [(node.lineno, ast.unparse(t)) for t in flat
                      if isinstance(t, ast.Attribute) and not _is_self(t.value)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and not _is_self(node.args[0]):
            found.append((node.lineno, f"setattr({ast.unparse(node.args[0])}, ...)"))
    return found


def _is_self(node) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def test_no_record_is_changed_from_outside_its_class():
    found = {(path, target): line for path, tree in _sources() for line, target in _outside_writes(tree)}
    unexpected = sorted(f"{path}:{line}: {target}" for (path, target), line in found.items()
                        if (path, target) not in ALLOWED)
    assert not unexpected, ("attributes set on another class's object (build the record whole, or give its "
                            "class a method):\n" + "\n".join(unexpected))
    stale = sorted(f"{path}: {target}" for path, target in ALLOWED if (path, target) not in found)
    assert not stale, "ALLOWED lists writes the code no longer makes (remove them):\n" + "\n".join(stale)


def test_functions_fit_on_a_screen():
    long = sorted(f"{path}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
                  for path, tree in _sources() for node in ast.walk(tree)
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES)
    assert not long, f"functions longer than {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_compiler_is_stage_folders_and_a_few_modules():
    modules = sorted(p.name for p in (ROOT / "compiler").glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, modules
    stages = {p.name for p in (ROOT / "compiler").iterdir() if (p / "__init__.py").exists()}
    assert {"capture", "ir", "autodiff", "fusion", "lower", "codegen", "reuse", "report"} <= stages, stages


def test_the_hand_off_records_are_frozen():
    """Capture's and compiling's records: changing one raises (each stage makes a new one)."""
    import dataclasses

    from runtime.trace import CompiledRecording, Recording, RegionPlan, TraceCall

    for record in (Recording, CompiledRecording, RegionPlan, TraceCall):
        assert record.__dataclass_params__.frozen, record
    with pytest.raises(dataclasses.FrozenInstanceError):
        RegionPlan([], [], [], {}, True).reason = "changed"


def test_no_stage_reads_generated_text_back():
    """Kernel text is printed from the kernel plan and never parsed: no regular expression and no
    ``eval`` in the compiler (dumps' file names are the one use of ``re``: user function names)."""
    found = []
    for path, tree in _sources():
        if not path.startswith("compiler/") or path == "compiler/report/dumps.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                found += [f"{path}:{node.lineno}: imports re" for name in names if name == "re"]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "eval":
                found.append(f"{path}:{node.lineno}: eval(...)")
    assert not found, "\n".join(found)
