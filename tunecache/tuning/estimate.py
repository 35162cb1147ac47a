"""How long a tune will take, said before it starts: learned from this store's past tunes of
the same kernel on the same device class, else a first guess.

The one rule behind every announcement of a tune (the launcher's, `tunecache tune`'s): the
trial runner's start (none when it is warm; as past tunes here paid it) plus the candidates
times the seconds a candidate took in past tunes here: the median over the past tunes nearest
this problem in size (on the CPU interpreter a candidate of a 100^3 matmul takes 5x one of
24^3; on a GPU compiles dominate and size matters less). Each past tune's seconds are its wall
seconds less its own runner start (`ConfigRecord.tune_seconds`, `start_seconds`), so a first
tune that started the runner does not make every later one look slow.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from tunecache.key import DeviceClass
    from tunecache.store.records import ConfigRecord

log = logging.getLogger("tunecache")

# the past tunes the seconds a candidate takes are the median of: the nearest in size of the
# newest RECENT of the kernel on the device class
NEAREST = 5
RECENT = 50


@dataclass(frozen=True)
class TuneEstimate:
    seconds: float
    past_tunes: int  # how many of the store's past tunes it was learned from; 0: a first guess

    @property
    def basis(self) -> str:
        """How it was made, in words."""
        n = self.past_tunes
        return f"from {n} past tune{'' if n == 1 else 's'} here" if n else "a first guess"

    def text(self) -> str:
        """'roughly 3.2 s (from 4 past tunes here)'."""
        return f"roughly {duration_text(self.seconds)} ({self.basis})"


def duration_text(seconds: float) -> str:
    """0.84 -> '0.8 s', 17.6 -> '18 s', 250 -> '4 min': as precise as an estimate is."""
    if seconds < 10:
        return f"{max(seconds, 0.1):.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"


def estimate_tune(
    mod: ModuleType,
    problem: dict,
    device: "DeviceClass",
    candidates: int,
    torch_device: str,
    past: "Sequence[ConfigRecord] | None" = None,
) -> TuneEstimate:
    """How long tuning `candidates` configs of `mod` for `problem` on `device` will take.
    `past`: the store's past tunes of the kernel on the device class (read from the local
    store when not given; none when it cannot be read)."""
    from tunecache.tuning.isolated import runner_start_s

    start = runner_start_s(torch_device)
    if past is None:
        past = past_tunes(mod.KERNEL, device)
    rates = seconds_per_candidate(past, _size(mod, problem), lambda rec: _size(mod, dict(rec.key.problem)))
    if not rates:
        return TuneEstimate(first_guess(candidates, device, start), 0)
    return TuneEstimate(runner_start(start, past) + statistics.median(rates) * candidates, len(rates))


def runner_start(guess: float, past: "Sequence[ConfigRecord]") -> float:
    """The trial runner's start as past tunes here paid it, where they paid one of the kind
    `guess` (runner_start_s: none for a warm runner, 0.3 s for a fork of the host's runner
    server, 4 s for a fresh process as on an H100 host: within 4x of it, 13x apart), else
    `guess` (a CPU-only host starts a fresh runner in about 2 s)."""
    if guess <= 0:
        return 0.0
    alike = [r.start_seconds for r in past if r.start_seconds is not None and guess / 4 <= r.start_seconds <= guess * 4]
    return statistics.median(alike) if alike else guess


# a GPU tune with nothing to learn from, as measured on an H200 host whose Triton cache was cold
# (a new host's first tunes; bench_tuning's held-out shapes, 13-24 candidates in 2.5-6.1 s): the
# runner's inputs and reference, then compiles in rounds of the pool's width, ~30 ms of checks
# and timings a candidate, and after them the leaders' run-time variants, their settling and the
# vendor's op
GPU_SETUP_S, COLD_ROUND_S, CANDIDATE_S, GPU_SETTLE_S = 0.7, 1.8, 0.03, 1.0


def first_guess(candidates: int, device: "DeviceClass", start: float) -> float:
    """With no past tune to learn from: the interpreter on small shapes, or a GPU's tune as
    measured with Triton's cache cold (a warm one compiles in a tenth of the time: the next
    tunes here learn that)."""
    if device.arch == "cpu":
        return candidates * 0.1
    from tunecache.tuning.compile_pool import default_workers

    rounds = -(-candidates // default_workers())
    return start + GPU_SETUP_S + rounds * COLD_ROUND_S + candidates * CANDIDATE_S + GPU_SETTLE_S


def seconds_per_candidate(past: "Sequence[ConfigRecord]", size: float | None, size_of) -> list[float]:
    """The seconds a candidate took in each of the (at most NEAREST) past tunes nearest `size`
    (all sizes alike when it is unknown), runner starts left out."""
    timed = [r for r in past if r.tune_seconds is not None and r.candidates > 0]

    def distance(rec: "ConfigRecord") -> float:
        other = size_of(rec)
        if size is None or other is None:
            return 0.0
        return abs(math.log(other) - math.log(size))

    nearest = sorted(timed, key=distance)[:NEAREST]  # a stable sort: the newest first among equals
    return [max(0.0, r.tune_seconds - (r.start_seconds or 0.0)) / r.candidates for r in nearest]


def past_tunes(kernel: str, device: "DeviceClass") -> "list[ConfigRecord]":
    """The local store's past tunes of `kernel` on the device class; none if it cannot say."""
    from tunecache.cache.config_cache import CACHE

    store = CACHE.store()
    if store is None:
        return []
    try:
        return CACHE.store_call(
            "read its past tunes", lambda: store.past_tunes(kernel, device.arch, device.sm_count, RECENT), []
        )
    except Exception as e:  # noqa: BLE001 - an estimate never fails the tune it announces
        log.debug("tunecache: no past tunes of %s for the estimate: %s", kernel, e)
        return []


def _size(mod: ModuleType, problem: dict) -> float | None:
    try:
        f = float(mod.flops(problem))
    except Exception:  # noqa: BLE001 - a size that cannot be had: every past tune is as near
        return None
    return f if f > 0 and math.isfinite(f) else None
