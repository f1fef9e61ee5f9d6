"""Progress reporting for long commands (build, convert, prefetch, benchmarks).

Owns: `Progress`, which reports phases ("reading", "uploading", ...) of a command on a text
stream (stderr by default): a live one-line bar redrawn in place when the stream is a TTY,
plain periodic lines when it is not (logs, CI), nothing when quiet. The total may be unknown
(a tar on stdin): then only the count and the rate are shown.

Must not: print results (commands print those on stdout) or log through `logging`.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from weenvfs.units import format_size

TTY_INTERVAL = 0.1  # seconds between redraws of the live bar
LINE_INTERVAL = 10.0  # seconds between plain progress lines
BAR_WIDTH = 24


class Progress:
    """Reports one phase at a time: `begin(label, total)`, `update(n)`..., `end()`.

    `mode` is 'auto' (bar on a TTY, lines otherwise), 'bar', 'lines' or 'quiet'. Counts are
    bytes unless `unit` is given (e.g. 'files'). Thread-safe: workers may call `update`.
    `clock` is injectable so tests need no sleeping.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        mode: str = "auto",
        *,
        clock: Callable[[], float] = time.monotonic,
        interval: float | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if mode == "auto":
            isatty = getattr(self.stream, "isatty", lambda: False)
            mode = "bar" if isatty() else "lines"
        if mode not in ("bar", "lines", "quiet"):
            raise ValueError(f"unknown progress mode {mode!r}")
        self.mode = mode
        self._clock = clock
        self._interval = (
            interval if interval is not None else (TTY_INTERVAL if mode == "bar" else LINE_INTERVAL)
        )
        self._lock = threading.Lock()
        self._label = ""
        self._unit: str | None = None
        self._total: int | None = None
        self.done = 0
        self._start = self._last = 0.0
        self._active = False

    @classmethod
    def quiet(cls) -> Progress:
        """A reporter that prints nothing."""
        return cls(mode="quiet")

    def begin(self, label: str, total: int | None = None, unit: str | None = None) -> None:
        """Start a phase (ending any phase still open)."""
        if self._active:
            self.end()
        with self._lock:
            self._label, self._total, self._unit = label, total, unit
            self.done = 0
            self._start = self._last = self._clock()
            self._active = True

    def set_total(self, total: int | None) -> None:
        """Set or correct the total of the current phase once it is known."""
        with self._lock:
            self._total = total

    def update(self, n: int) -> None:
        """Count `n` more units done; redraw if the interval has passed."""
        with self._lock:
            self.done += n
            now = self._clock()
            if self.mode == "quiet" or now - self._last < self._interval:
                return
            self._last = now
            self._emit(now, final=False)

    def end(self) -> None:
        """Finish the current phase with a final line."""
        with self._lock:
            if not self._active:
                return
            self._active = False
            if self.mode != "quiet":
                self._emit(self._clock(), final=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.end()

    # -- rendering --------------------------------------------------------------------------

    def _amount(self, n: float) -> str:
        return format_size(n) if self._unit is None else f"{int(n)} {self._unit}"

    def render(self, now: float) -> str:
        """The text of the current state (without line control characters)."""
        elapsed = max(now - self._start, 1e-9)
        rate = f"{self._amount(self.done / elapsed)}/s"
        text = f"{self._label}: {self._amount(self.done)}"
        if self._total:
            frac = min(self.done / self._total, 1.0)
            text += f" / {self._amount(self._total)} ({frac:.0%})"
            if self.mode == "bar":
                filled = int(frac * BAR_WIDTH)
                text = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] " + text
        return f"{text}, {rate}, {elapsed:.1f} s"

    def _emit(self, now: float, final: bool) -> None:
        text = self.render(now)
        if self.mode == "bar":
            self.stream.write("\r\x1b[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
