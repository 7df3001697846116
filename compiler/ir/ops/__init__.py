"""The op catalog (``catalog``), PyTorch's conventions as scalar functions (``scalar``), and
the table that maps the torch functions a program calls onto catalog ops (``bindings``)."""
