"""Progress of long work (`hyperkafka verify`, a mirror catching up): counters plus a
throttled renderer.

The per-unit path (`Progress.advance`, called per block) only adds to counters and
decrements a countdown; the clock is read once every `CHECK_EVERY` calls, and a line is
rendered only when `interval` seconds have passed since the last one. Rendering is a bar
redrawn in place (``\\r``) when the stream is a terminal, a plain line otherwise (or a
`logging` record when a logger is given: a broker's stderr is its log). Sans-I/O apart
from writing the rendered text: the clock and the stream are injected, so tests drive it
with a fake clock. May import the standard library only.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

# How often `advance` looks at the clock: reading it per block would cost more than the
# counting does; 256 blocks take well under the shortest interval in practice.
CHECK_EVERY = 256
BAR_WIDTH = 24
BAR_INTERVAL_S = 0.2  # a bar is redrawn often; a log line every LINE_INTERVAL_S
LINE_INTERVAL_S = 5.0


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_duration(s: float) -> str:
    s = int(s + 0.5)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Work measured in units (bytes or blocks) over items (archives).

    `total` is a number or a callable read at render time (a mirror's remote length
    grows while it catches up). `unit="bytes"` renders sizes as KiB/MiB."""

    def __init__(
        self,
        label: str,
        total: int | Callable[[], int | None],
        *,
        unit: str = "bytes",
        items_total: int = 0,
        item_name: str = "archives",
        stream: TextIO | None = None,
        tty: bool | None = None,
        logger: logging.Logger | None = None,
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self._total = total
        self.unit = unit
        self.items_total = items_total
        self.item_name = item_name
        self.stream = stream if stream is not None else sys.stderr
        self.logger = logger
        self.tty = False if logger is not None else tty if tty is not None else _isatty(self.stream)
        self.interval = (
            interval if interval is not None else (BAR_INTERVAL_S if self.tty else LINE_INTERVAL_S)
        )
        self.clock = clock
        self.done = 0
        self.items_done = 0
        self.started = clock()
        self._last = self.started
        self._countdown = CHECK_EVERY
        self._drawn = False  # a bar is on the terminal's current line
        self._shown = (-1, -1)  # (done, items_done) last rendered
        self.rendered = 0  # lines or bars rendered so far

    @property
    def total(self) -> int:
        t = self._total() if callable(self._total) else self._total
        return max(t or 0, self.done)

    def advance(self, n: int = 1) -> None:
        """Count `n` units done: the per-block path, so no clock read but 1 in CHECK_EVERY."""
        self.done += n
        self._countdown -= 1
        if self._countdown <= 0:
            self._countdown = CHECK_EVERY
            self.tick()

    def item_done(self) -> None:
        self.items_done += 1
        self.tick()

    def tick(self) -> bool:
        """Render when `interval` has passed since the last rendering; True if it did."""
        now = self.clock()
        if now - self._last < self.interval:
            return False
        self._last = now
        self._render(now)
        return True

    def render(self, now: float | None = None) -> str:
        """The text of one progress report (without a bar), e.g.
        ``verify: 3/7 archives, 12.0 MiB/40.0 MiB (30%), 4.0 MiB/s, ETA 7s``."""
        now = self.clock() if now is None else now
        total, done = self.total, self.done
        elapsed = max(now - self.started, 1e-9)
        rate = done / elapsed
        parts = []
        if self.items_total:
            parts.append(f"{self.items_done}/{self.items_total} {self.item_name}")
        pct = f" ({100 * done // total}%)" if total else ""
        if self.unit == "bytes":
            parts.append(f"{human_bytes(done)}/{human_bytes(total)}{pct}")
            parts.append(f"{human_bytes(rate)}/s")
        else:
            parts.append(f"{done}/{total} {self.unit}{pct}")
            parts.append(f"{rate:.0f} {self.unit}/s")
        if rate > 0 and total > done:
            parts.append(f"ETA {human_duration((total - done) / rate)}")
        return f"{self.label}: " + ", ".join(parts)

    def bar(self, now: float | None = None) -> str:
        total = self.total
        filled = BAR_WIDTH * self.done // total if total else 0
        return "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "] " + self.render(now)

    def _render(self, now: float) -> None:
        self.rendered += 1
        self._shown = (self.done, self.items_done)
        if self.logger is not None:
            self.logger.info("%s", self.render(now))
        elif self.tty:
            self.stream.write("\r\x1b[K" + self.bar(now))
            self.stream.flush()
            self._drawn = True
        else:
            self.stream.write(self.render(now) + "\n")
            self.stream.flush()

    def clear(self) -> None:
        """Take the bar off the terminal's line (before other output is written there)."""
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False

    def finish(self) -> None:
        """Render the final state once if anything was rendered before (a short job says
        nothing), leaving the terminal on a fresh line."""
        if self.rendered:
            # once, unless that state is on screen already (a bar taken off by `clear` is not)
            if self._shown != (self.done, self.items_done) or (self.tty and not self._drawn):
                self._render(self.clock())
            if self.tty:
                self.stream.write("\n")
                self.stream.flush()
                self._drawn = False


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
