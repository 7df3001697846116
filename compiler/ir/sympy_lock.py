"""The one lock every stage takes around its SymPy work.

SymPy is not thread-safe: asking an expression an assumption (``is_positive``) writes into that
object's ``_assumptions`` dict, while another thread may be iterating it (comparing two symbols,
copying assumptions), which raises "dictionary changed size during iteration"
(sympy/sympy#16734; a copy-on-write fix, sympy/sympy#30088, is unreleased). SymPy's cache
shares equal expressions between threads, so two recordings, or a backward built on demand
beside a template being instantiated, touch the same objects. Stages that build expressions
(capture's bindings, autodiff, fusion and codegen, template fitting) hold this lock, as Dynamo
holds its compile lock (``torch._dynamo.convert_frame.compile_lock``): builds are serialized
process-wide, replays (which touch no SymPy) are not. Reentrant: a build may build a part on demand.
"""

import threading

SYMPY_LOCK = threading.RLock()
