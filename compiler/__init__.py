"""A compiler for PyTorch training code: capture → SymPy autodiff → fused Triton kernels.

    import compiler

    @compiler.compile
    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step(); opt.zero_grad()
        return loss

See ``compile`` and ``explain``; ``set_logs`` (or ``SYMGRAD_LOG``) and ``SYMGRAD_DUMP_DIR`` show each stage.
"""

from runtime.backends import prepare_process as _prepare_process

_prepare_process()  # before anything imports triton: interpreter mode on CPU-only machines

from compiler import scalar_math as math  # noqa: E402
from compiler.api import compile, explain  # noqa: E402
from compiler.dynamo_backend import register as _register_dynamo_backend  # noqa: E402
from compiler.elementwise import elementwise  # noqa: E402
from compiler.report.logs import configure_from_environment as _configure_logs, set_logs  # noqa: E402
from compiler.reuse.persist import clear_cache  # noqa: E402
from compiler.report.html import report_html  # noqa: E402
from runtime.dynamic_shapes import mark_dynamic  # noqa: E402
from runtime.fallback import CompileError, InternalCompilerError  # noqa: E402

__all__ = ["compile", "explain", "elementwise", "math", "set_logs", "report_html", "clear_cache", "mark_dynamic",
           "CompileError", "InternalCompilerError"]

_configure_logs()  # SYMGRAD_LOG
_register_dynamo_backend()  # torch.compile(backend="symgrad") without the entry point too; imports no Dynamo
