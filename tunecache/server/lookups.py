"""The lookup answers a service process keeps in memory, so that a hit costs no query.

A fleet asks the same few thousand keys over and over (every job start, every host), and a
lookup's answer changes rarely. Each process keeps what it answered. A change made through
another process, or on the database itself, is seen within TUNECACHE_LOOKUP_CACHE_S (10 s):

- a removed or replaced winner moves the fleet's generation, which each process reads at most
  once a second (one query a second, not one per lookup) and which drops everything it keeps;
- a miss is kept for TUNECACHE_LOOKUP_CACHE_S (a new winner does not move the generation);
- a hit is kept up to HIT_LIFE times that while the generation stands, for good measure.

A write through this process drops what it changed at once: its key's answer (a publish, a
report) or everything (`drops_lookups`: a delete, an import, a purge). Lifetimes are
spread (each 80-100 % of its length) so that answers read together are not all read again
together. A host keeps its own copy of a fleet winner far longer (TUNECACHE_FLEET_TTL_S), so
the service's seconds change nothing a host sees; 0 turns the cache off.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Callable, Generic, TypeVar

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError

T = TypeVar("T")

MAX_ENTRIES = 200_000
MAX_BATCH = 500  # keys read by one query
GENERATION_POLL_S = 1.0
HIT_LIFE = 6


class LookupCache:
    """digest -> (the answer's JSON body or None for a miss, the generation), for a while."""

    def __init__(self, ttl_s: float, max_entries: int = MAX_ENTRIES) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._answers: dict[str, tuple[float, bytes | None, int]] = {}
        self._generation: int | None = None
        self._generation_read_at = -float("inf")
        self._polling = False  # a request is reading the generation (poll_generation)
        # moved by clear(): an answer read from the store before a write and kept after it is dropped
        self.epoch = 0

    def answer(self, digest: str) -> tuple[bytes | None, int] | None:
        """(body or None for a known miss, generation), or None when this process must ask the store."""
        hit = self._answers.get(digest)
        if hit is None or hit[0] <= time.monotonic():
            return None
        return hit[1], hit[2]

    def keep(self, digest: str, body: bytes | None, generation: int, epoch: int) -> None:
        """Keep an answer read from the store since `epoch` (read before asking it)."""
        if self.ttl_s <= 0 or epoch != self.epoch:
            return
        if len(self._answers) >= self.max_entries:
            self._answers.clear()
        life = self.ttl_s * (1 if body is None else HIT_LIFE) * random.uniform(0.8, 1.0)
        self._answers[digest] = (time.monotonic() + life, body, generation)

    def generation_due(self) -> bool:
        """Time to read the fleet's generation again (at most once a second per process)."""
        return self.ttl_s > 0 and time.monotonic() - self._generation_read_at >= min(GENERATION_POLL_S, self.ttl_s)

    def poll_generation(self) -> bool:
        """Whether the caller is to read the generation now (`refresh_generation`): it is due and
        no other request is reading it. Called on the event loop's thread only."""
        if self._polling or not self.generation_due():
            return False
        self._polling = True
        return True

    def refresh_generation(self, read: Callable[[], int]) -> int:
        """Read the generation (`poll_generation` said so) and note it."""
        try:
            generation = read()
            self.note_generation(generation)
            return generation
        finally:
            self._polling = False

    def note_generation(self, generation: int) -> None:
        """The generation as just read from the store: when it moved, a winner was removed or
        replaced somewhere, and every kept answer goes."""
        if self._generation is not None and generation != self._generation:
            self.clear()
        self._generation, self._generation_read_at = generation, time.monotonic()

    def known_generation(self) -> int | None:
        """The generation as read within the last poll, or None."""
        if self.generation_due() or self.ttl_s <= 0:
            return None
        return self._generation

    def generation(self, read: Callable[[], int]) -> int:
        """The generation as read within the last poll, else `read()` (the store's), noted."""
        known = self.known_generation()
        if known is None:
            known = read()
            self.note_generation(known)
        return known

    def clear(self) -> None:
        self.epoch += 1
        self._answers.clear()

    def forget(self, digest: str) -> None:
        """Drop one key's answer (a write to that key); reads under way are not kept either."""
        self.epoch += 1
        self._answers.pop(digest, None)


async def drops_lookups(request: Request):
    """A dependency of every route that may change many lookups' answers (a delete, an import,
    a purge): this process's kept answers are dropped once the route has run, unless it was
    refused (a 4xx changes nothing stored: a flood of refused requests must not cost the
    lookups their cache). Another process sees the change as this module's docstring says."""
    try:
        yield
    except (HTTPException, RequestValidationError) as e:
        if getattr(e, "status_code", 422) >= 500:
            request.app.state.lookups.clear()
        raise
    except BaseException:
        request.app.state.lookups.clear()
        raise
    request.app.state.lookups.clear()


class BatchedReads(Generic[T]):
    """The lookups that missed the cache, read from the store together: one read at a time (a
    thread of the pool and one query for up to MAX_BATCH keys), the keys missed meanwhile all
    in the next. A read per miss, each a thread that waits its turn for the interpreter beside a
    saturated event loop, left a tenth of the lookups seconds behind at 1,000 in flight on 2
    cores (docs/fleet.md, Readers beside writers).
    `read(keys)` runs on the thread pool and answers every key. Used on the event loop's thread."""

    def __init__(self, read: Callable[[list[str]], dict[str, T]]) -> None:
        self._read = read
        self._pending: dict[str, asyncio.Future] = {}
        self._task: asyncio.Future | None = None  # the reads under way (kept: the loop holds tasks weakly)

    async def get(self, key: str) -> T:
        future = self._pending.get(key)
        if future is None:
            future = self._pending[key] = asyncio.get_running_loop().create_future()
            if self._task is None or self._task.done():
                self._task = asyncio.ensure_future(self._drain())
        return await asyncio.shield(future)  # a caller that goes away cancels only its own wait

    async def _drain(self) -> None:
        from starlette.concurrency import run_in_threadpool

        while self._pending:  # no await between the last look and the end: a get() sees it done
            keys = list(self._pending)[:MAX_BATCH]
            batch = {k: self._pending.pop(k) for k in keys}
            try:
                answers = await run_in_threadpool(self._read, keys)
            except Exception as e:  # noqa: BLE001 - each waiting lookup answers it (a 503 for the database away)
                for f in batch.values():
                    if not f.done():
                        f.set_exception(e)
                continue
            for k, f in batch.items():
                if not f.done():
                    f.set_result(answers[k])
