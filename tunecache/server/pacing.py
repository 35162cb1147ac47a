"""Publishes take at most a set share of a service process's time, so lookups are never starved.

A publish of a 2,000-trial result costs the process ~40 ms of Python (validation, the trials'
rows), holding the interpreter's lock while lookups wait: three clients publishing back to back
took lookups at 100 in flight down to 66-78 % of their quiet rate on a 2-core host.
`PublishPacer` runs one publish at a time per process and, after each, holds the next one back
for as long as it takes to keep publishes within `share` of the process's time (TUNECACHE_PUBLISH_SHARE):
after a publish that took 40 ms, at share 0.15, the next waits 227 ms. Only while there are
readers to make room for: when no lookup came (`reads`, counted by the lookup path) since the
publish before ended, nothing is held back, so a quiet service takes publishes at full speed.
(Not "during this publish": a publish holding the interpreter keeps the lookups it starves
from being counted.) Publishers wait, their requests open (a host publishes from its writer
thread, which no training step waits on). Scale-out (`tunecache serve --workers N`) paces each
process on its own.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


def _ignore(seconds: float) -> None:
    pass


class PublishPacer:
    """One publish at a time, each followed by the rest that keeps publishes within `share`."""

    def __init__(
        self,
        share: float,
        on_publish: Callable[[float], None] = _ignore,
        on_hold: Callable[[float], None] = _ignore,
    ) -> None:
        self.share = share
        self.reads = 0  # lookups answered by this process (the lookup path counts them)
        self.on_publish, self.on_hold = on_publish, on_hold  # seconds publishing, seconds held back
        self._turn = asyncio.Lock()
        self._free_at = 0.0  # monotonic time when the next publish may start
        self._reads_seen = 0  # `reads` when the last publish ended

    def pause_after(self, took_s: float) -> float:
        """Seconds the next publish waits after one that took `took_s`."""
        return 0.0 if self.share >= 1 else took_s * (1 / self.share - 1)

    async def run(self, publish: Callable[[], Awaitable[T]]) -> T:
        async with self._turn:
            wait = self._free_at - time.monotonic()
            if wait > 0:
                self.on_hold(wait)
                await asyncio.sleep(wait)
            start = time.monotonic()
            try:
                return await publish()
            finally:
                end = time.monotonic()
                self.on_publish(end - start)
                readers = self.reads != self._reads_seen
                self._reads_seen = self.reads
                self._free_at = end + (self.pause_after(end - start) if readers else 0.0)
