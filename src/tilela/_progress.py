"""A one-line progress display on stderr, without dependencies.

    with Progress("check", total=12) as bar:
        for item in items:
            bar.update(f"{item}")      # show what runs now
            ...
            bar.advance()              # one more done
            bar.echo("a result line")  # printed to stdout above the bar

The line reads ``<label> <done>/<total> <what> <elapsed>s`` and is redrawn in place with a carriage return, every
half second while open (so a long compile still shows time passing). It is shown only when stderr is a terminal or
``enabled=True``; otherwise nothing is written to stderr and ``echo`` just prints.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int | None = None, *, enabled: bool | None = None,
                 stream: TextIO | None = None, interval: float = 0.5):
        self.label, self.total = label, total
        self.stream = sys.stderr if stream is None else stream
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.done, self.what = 0, ""
        self.start = time.perf_counter()
        self._drawn, self._width = "", 0  # the line last drawn and its length, to blank what a shorter line leaves
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker = None
        if self.enabled:
            self._ticker = threading.Thread(target=self._tick, args=(interval,), daemon=True)
            self._ticker.start()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def update(self, what: str = "") -> None:
        """Show what runs now."""
        self.what = what
        self._draw()

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def echo(self, line: str) -> None:
        """Print line (and a newline) to stdout, above the progress line."""
        with self._lock:
            if self.enabled:
                self.stream.write("\r" + " " * self._width + "\r")
                self.stream.flush()
                self._drawn, self._width = "", 0
            print(line, flush=True)
        self._draw()

    def close(self) -> None:
        """Stop redrawing; the last line stays, followed by a newline."""
        if self._ticker is not None:
            self._stop.set()
            self._ticker.join()
            self._ticker = None
            self._draw()
            self.stream.write("\n")
            self.stream.flush()

    def line(self) -> str:
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        return " ".join(part for part in (self.label, count, self.what, f"{self.elapsed():.0f}s") if part)

    def _draw(self) -> None:
        if not self.enabled:
            return
        with self._lock:
            text = self.line()
            if text == self._drawn:
                return
            self._drawn = text
            self.stream.write("\r" + text + " " * max(self._width - len(text), 0))
            self.stream.flush()
            self._width = len(text)

    def _tick(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self._draw()
