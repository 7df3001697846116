"""The ground floor: what a compiled program is and how it runs — guards and cache
(``dispatch``), replay of recorded calls (``replay``, ``trace``), the autograd bridge,
programs and kernel launching, and the eager fallback. Never imports ``compiler``."""
