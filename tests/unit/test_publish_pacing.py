"""Readers are never starved by writers: a service process takes one publish at a time, and
while lookups come in, holds the next back until publishes have had no more than their share
of its time (TUNECACHE_PUBLISH_SHARE); with no lookups, publishes run back to back."""

from __future__ import annotations

import asyncio
import time

from tunecache.server.pacing import PublishPacer

WORK_S = 0.05


async def _publishes(pacer: PublishPacer, n: int, reading: bool) -> tuple[float, list[tuple[float, float]]]:
    """n publishes of WORK_S each sent at once (lookups counted during each when `reading`):
    the seconds they took in all, and each one's (start, end)."""
    spans: list[tuple[float, float]] = []

    async def publish() -> None:
        start = time.monotonic()
        if reading:
            pacer.reads += 1
        await asyncio.sleep(WORK_S)
        spans.append((start, time.monotonic()))

    t0 = time.monotonic()
    await asyncio.gather(*(pacer.run(publish) for _ in range(n)))
    return time.monotonic() - t0, sorted(spans)


def test_publishes_run_one_at_a_time_and_keep_to_their_share_while_lookups_come_in():
    took, spans = asyncio.run(_publishes(PublishPacer(0.25), 3, reading=True))
    for (_, end), (start, _) in zip(spans, spans[1:]):
        # each waited out the pause the one before it earned: 3x its 50 ms at a quarter share
        assert start - end >= 3 * WORK_S * 0.9, spans
    assert took >= 3 * WORK_S + 2 * 3 * WORK_S * 0.9


def test_a_quiet_service_takes_publishes_back_to_back():
    took, spans = asyncio.run(_publishes(PublishPacer(0.25), 3, reading=False))
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end, "one at a time"
    assert took < 3 * WORK_S + 2 * 3 * WORK_S * 0.9, "less than the pauses alone would take: none was made"


def test_a_share_of_one_paces_nothing():
    assert PublishPacer(1.0).pause_after(10.0) == 0.0
    assert PublishPacer(0.15).pause_after(0.04) == 0.04 * (1 / 0.15 - 1)
