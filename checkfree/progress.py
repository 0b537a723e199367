"""Progress output that reads well in a terminal and in a log file.

In a terminal (stderr is a TTY) this is a tqdm bar. Anywhere else (piped to a file, under
systemd, in CI) carriage-return updates would pile up into one endless line, so progress
becomes one plain line every `every` steps or `interval_s` seconds, whichever comes first,
plus the last one: `train 40/200 (20%) loss=5.2100 failures=1, 3.1 s`.
"""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["Progress"]


class Progress:
    def __init__(self, total: int, desc: str, unit: str = "step", enabled: bool = True,
                 interval_s: float = 30.0, every: int | None = None) -> None:
        self.total, self.desc, self.position = total, desc, 0
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self._bar = None
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)
        self.every = every or max(1, total // 20)
        self.interval_s = interval_s
        self._t0 = self._last_t = time.monotonic()
        self._last_position = 0
        self._postfix: dict[str, Any] = {}

    def update(self, n: int, **postfix: Any) -> None:
        """Progress is at `n` (it may move back: a rollback); `postfix` are the figures shown."""
        self.position, self._postfix = n, postfix
        if self._bar is not None:
            self._bar.n = n
            self._bar.set_postfix(**postfix, refresh=False)
            self._bar.refresh()
        elif self.enabled:
            now = time.monotonic()
            if n >= self.total or abs(n - self._last_position) >= self.every or now - self._last_t >= self.interval_s:
                self._line(now)

    def write(self, text: str) -> None:
        """A status line that does not break the bar."""
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def _line(self, now: float) -> None:
        figures = " ".join(f"{k}={v}" for k, v in self._postfix.items())
        pct = 100 * self.position / self.total if self.total else 100.0
        print(f"{self.desc} {self.position}/{self.total} ({pct:.0f}%) {figures}, {now - self._t0:.1f} s".replace(" ,", ","),
              file=sys.stderr, flush=True)
        self._last_t, self._last_position = now, self.position

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self.position != self._last_position:
            self._line(time.monotonic())
