"""Property-based fuzzing of compiled functions against eager PyTorch.

``ops`` is the op table (what each op applies to and how it is written), ``program``
draws random programs from it (straight-line Python source over tensor inputs), ``check``
runs one program eagerly and compiled and compares everything eager shows. ``python -m
tests.fuzz`` is the long run; tests/test_fuzz.py the CI-sized one.
"""
