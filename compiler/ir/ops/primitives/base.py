"""What a scalar primitive declares, and the helpers its declarations share.

A *primitive* is a function that can appear in a pointwise expression (a SymPy head such as
``sympy.exp`` or our ``Relu``). One class declares everything about it:

* the SymPy function itself: our own ``sympy.Function`` subclass with an ``fdiff`` that states
  PyTorch's rule at kinks (``class Relu(Primitive, sympy.Function)``), or, for a SymPy
  builtin, a declaration that wraps it (``class Exp(Builtin): function = sympy.exp``);
* ``triton``: the Triton function it prints as (``"libdevice.log1p"``), or a ``render``
  classmethod for anything more than a call; the C++ CPU kernels print the same call as its
  ``<cmath>`` function, or a ``render_cpp`` classmethod where ``render`` is its own;
* ``torch_fn``: the torch function that evaluates it (the eager path of user ops, and the
  reference), or a ``torch_eval`` classmethod;
* ``re_im``: its real and imaginary parts for a complex argument, where it has a rule;
* ``interpreter``: a NumPy stand-in for a ``libdevice`` function that Triton's interpreter
  lacks (kernels run in the interpreter on CPU machines);
* when it is also a catalog op (``op = "log1p"``): its dtype kind (``result``), the torch
  callables it binds (``binds``: names looked up on ``torch``, ``torch.Tensor`` and
  ``torch.special``), whether ``Tensor.<op>_`` is generated (``in_place``), whether it is
  exported by ``compiler.math`` (``math``).

Named ops that are compositions (gelu, clamp, a loss's scalar part) are declared next to the
primitives with ``composite(name, expression, ...)``: one expression each, the same op facts.
Subclassing ``Primitive`` (or ``Builtin``) registers the class in ``registry``.
"""

from __future__ import annotations

import inspect

import sympy
import torch

from compiler.ir.ops.primitives import registry

# Dtype kinds of an op's result (torch._refs' ELEMENTWISE_TYPE_PROMOTION_KIND, in our words).
SAME = "same"     # the promoted dtype of the operands (add of two int tensors is int)
FLOAT = "float"   # integer operands give the default float dtype (sin of an int tensor)
BOOL = "bool"     # always bool (comparisons, logic)


class NotPrintable(Exception):
    """The expression uses something the Triton printer cannot express."""


class OpFacts:
    """The facts of a catalog op (a name ``emit_pointwise`` accepts), shared by primitives and
    composites. Defaults: same dtype as the operands, no generated binding, no in-place variant."""

    op: str | None = None          # the catalog name (``SCALAR_FUNCTIONS[op]``); None: not an op
    result: str = SAME             # SAME, FLOAT or BOOL
    binds: tuple = ()              # torch names bound by a generated binding (aliases included)
    also_binds: tuple = ()         # further callables for the generated binding (F.sigmoid)
    complex_inputs: bool = False   # whether the generated binding accepts complex tensors
    integers_unchanged: bool = False  # rounding: an integer tensor is returned as it is
    in_place: bool = False         # generate Tensor.<op>_ from the binding of Tensor.<op>
    math: bool = False             # exported by compiler.math


class Primitive(OpFacts):
    """Base of every primitive; subclasses register themselves (see the module docstring).

    A ``sympy.Function`` subclass lists ``Primitive`` first: ``class Relu(Primitive,
    sympy.Function)``; the SymPy head is then the class itself.
    """

    function = None                # the SymPy head (set to the class itself for our own functions)
    triton: str | None = None      # "tl.exp": printed as a call; else ``render``
    torch_fn = None                # evaluates on tensors; else ``torch_eval``
    interpreter = None             # NumPy stand-in for a libdevice function the interpreter lacks
    re_im = None                   # classmethod (cls, cx, *args) -> (re, im); cx(arg): an argument's parts
    expression = None              # the op's expression over SymPy scalars; by default the head itself
    user_op: bool = True           # allowed in compiler.elementwise expressions
    gradient_undefined: bool = False  # eager's backward sends no gradient through it, not zeros
    abstract: bool = False         # a shared base (``_Rounding``), not a primitive itself

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("abstract", False):
            return
        if isinstance(cls, sympy.FunctionClass):
            cls.function = cls
        if cls.expression is None:  # SCALAR_FUNCTIONS["exp"] is sympy.exp itself
            cls.expression = staticmethod(cls.function)
        registry.register_primitive(cls)

    @classmethod
    def arity(cls) -> int:
        """The number of arguments of the head (its op's operands)."""
        return min(cls.function.nargs)

    @classmethod
    def render(cls, printer, e) -> str:
        """Triton source for ``e`` (an application of this primitive); ``printer.p`` prints an argument."""
        if cls.triton is None:
            raise NotPrintable(f"no Triton lowering for {cls.function.__name__}")
        return f"{cls.triton}({', '.join(printer.p(a) for a in e.args)})"

    @classmethod
    def render_cpp(cls, printer, e) -> str:
        """C++ source for ``e`` in a CPU kernel (``compiler.codegen.cpp_printer``): the <cmath>
        function its Triton call is (libdevice is the C math library), else NotPrintable (the
        kernel then runs on the torch path). A primitive with a lowering of its own overrides it."""
        from compiler.codegen.cpp_printer import cmath_function

        function = cmath_function(cls.triton)
        if function is None:
            raise NotPrintable(f"no C++ lowering for {cls.function.__name__}")
        return printer.call(function, *(printer.p(a) for a in e.args))

    @classmethod
    def folds_constants(cls) -> bool:
        """Whether an application to numbers prints as one constant (log(2)): a plain unary call."""
        return cls.triton is not None and cls.arity() == 1

    @classmethod
    def torch_eval(cls, *args):
        """The value on tensors (``args`` are evaluated arguments: tensors or numbers)."""
        if cls.torch_fn is None:
            raise NotImplementedError(f"no torch evaluation for {cls.function.__name__}")
        return cls.torch_fn(*[as_tensor(a) for a in args])


class Builtin(Primitive):
    """A declaration wrapping a SymPy builtin (``function = sympy.exp``)."""

    abstract = True


class Composite(OpFacts):
    """A named op that is one expression over other primitives (gelu, clamp, a loss's scalar part)."""

    def __init__(self, name, expression, **facts):
        self.op = name
        self.expression = expression
        for key, value in facts.items():
            if not hasattr(OpFacts, key):
                raise TypeError(f"composite {name!r}: unknown fact {key!r}")
            setattr(self, key, value)

    def arity(self) -> int:
        """The number of operands (parameters without a default: sympy.sqrt's ``evaluate`` is not one)."""
        parameters = inspect.signature(self.expression).parameters.values()
        return sum(1 for p in parameters if p.default is inspect.Parameter.empty)

    def __repr__(self):
        return f"<composite {self.op}>"


def composite(name, expression, **facts) -> Composite:
    """Declare (and register) the op ``name`` as ``expression`` over SymPy scalars.

    >>> composite("silu", lambda a: a * Sigmoid(a), result=FLOAT, math=True)
    """
    entry = Composite(name, expression, **facts)
    registry.register_op(entry)
    return entry


def is_number(*args) -> bool:
    return all(a.is_number for a in args)


def as_tensor(x):
    return x if isinstance(x, torch.Tensor) else torch.tensor(x)


# ----------------------------------------------------------------------------- complex parts
# Arithmetic on (re, im) pairs of real expressions, for the ``re_im`` rules and realify.
ZERO = sympy.Integer(0)


def complex_mul(p, q):
    (a, b), (c, d) = p, q
    return (a * c - b * d, a * d + b * c)


def complex_recip(p):
    a, b = p
    if b == 0:
        return (1 / a, ZERO)
    den = a * a + b * b
    return (a / den, -b / den)


def hypot(a, b):
    """|(a, b)| without overflow: the Hypot primitive (transcendental.py, imported here at call
    time because it prints with comparisons, which import this module)."""
    from compiler.ir.ops.primitives.transcendental import Hypot
    return Hypot(a, b)


def complex_exp(p):
    a, b = p
    if b == 0:
        return (sympy.exp(a), ZERO)
    e = sympy.exp(a)
    return (e * sympy.cos(b), e * sympy.sin(b))


def complex_log(p):
    a, b = p
    if b == 0:
        return (sympy.log(a), ZERO)
    return (sympy.log(hypot(a, b)), sympy.atan2(b, a))
