"""A tiny progress bar on stderr: what runs now, how far along, how long it has taken.

On a terminal the bar redraws in place; in a log (not a terminal) each step is one line.

>>> bar = Progress(2, stream=io.StringIO())
>>> bar.start("gelu · eager"); bar.done(); bar.close()
"""

from __future__ import annotations

import io  # noqa: F401  (the doctest's stream)
import sys
import time


class Progress:
    def __init__(self, total: int, stream=None, width: int = 24, enabled: bool = True):
        self.total = max(total, 1)
        self.count = 0
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.enabled = enabled
        self.label = ""
        self.started = time.perf_counter()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_len = 0

    def start(self, label: str) -> None:
        """Show that ``label`` is running now."""
        self.label = label
        self._draw()

    def done(self, steps: int = 1) -> None:
        self.count = min(self.total, self.count + steps)
        if self.tty:
            self._draw()

    def note(self, text: str) -> None:
        """A message of its own line, above the bar."""
        if not self.enabled:
            return
        self._clear()
        self.stream.write(text.rstrip() + "\n")
        self._draw()

    def close(self) -> None:
        if not self.enabled:
            return
        self.label = "done"
        self._draw()
        if self.tty:
            self.stream.write("\n")
        self.stream.flush()

    def _line(self) -> str:
        filled = round(self.width * self.count / self.total)
        elapsed = int(time.perf_counter() - self.started)
        return (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.count}/{self.total} "
                f"{elapsed // 60:02d}:{elapsed % 60:02d}  {self.label}")

    def _clear(self) -> None:
        if self.tty and self._last_len:
            self.stream.write("\r" + " " * self._last_len + "\r")

    def _draw(self) -> None:
        if not self.enabled:
            return
        line = self._line()
        if self.tty:
            self._clear()
            self.stream.write(line)
            self._last_len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
