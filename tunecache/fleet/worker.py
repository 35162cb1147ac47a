"""`tunecache worker --gpu N`: claim tuning jobs of this GPU's device class, tune, publish.

One process per GPU. A job is leased (the claim returns a secret that holds the lease: every
heartbeat, complete, fail and release presents it), and the lease is extended from a heartbeat
thread while the tuner runs; a worker that dies stops heartbeating, its lease runs out and
another worker claims the job again. With a fleet configured (TUNECACHE_SERVER_URL) the queue
is the service's; without one it is the local store's (either side of `tunecache.fleet.Fleet`), so
miss policy `default` plus one local worker is background tuning of cache misses on a single
host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from tunecache.errors import last_line, short
from tunecache.fleet import default_fleet
from tunecache.fleet.protocol import REFUSED, ClaimedJob, Fleet, FleetError, Runs
from tunecache.key import DeviceClass, interpreter_device, interpreting
from tunecache.shapes import OPS
from tunecache.store.process import default_store
from tunecache.store.records import MAX_LEASE_S

if TYPE_CHECKING:
    from tunecache.store import Store

log = logging.getLogger("tunecache.fleet.worker")


# ---- the device and what this worker can tune -------------------------------------------


def worker_device(gpu: int) -> tuple[DeviceClass, str]:
    """(device class, torch device) for GPU `gpu`; the interpreter on a host without CUDA."""
    import torch

    if interpreting():
        return interpreter_device(), "cpu"
    from tunecache.key import cuda_device

    if gpu >= torch.cuda.device_count():
        raise ValueError(f"--gpu {gpu}: this host has {torch.cuda.device_count()} CUDA device(s)")
    torch.cuda.set_device(gpu)
    return cuda_device(gpu), f"cuda:{gpu}"


def tunable_kernels(device: DeviceClass) -> dict[str, str]:
    """{kernel: version} of every backend this worker can run on `device`. Only jobs whose key
    it reproduces exactly (same kernel source, same Triton) are claimed."""
    from tunecache import backends

    out = {}
    for op in OPS:
        for backend in backends.available_backends(op):
            if device.arch == "cpu" and backend != "portable":
                continue  # the interpreter runs only plain triton.language kernels
            try:
                mod = backends.backend_module(op, backend)
                out[mod.KERNEL] = backends.kernel_version(mod)
            except Exception as e:  # a backend that does not import here is not tuned here
                log.warning("tunecache: worker skips %s.%s (%s: %s)", op, backend, type(e).__name__, e)
    return out


# ---- the lease ---------------------------------------------------------------------------


class Lease:
    """Heartbeats a job's lease from a thread until stopped; notes when the lease is lost."""

    def __init__(self, queue: Fleet, job: ClaimedJob, lease_s: float) -> None:
        self.queue, self.job, self.lease_s = queue, job, lease_s
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{job.id}", daemon=True)

    def __enter__(self) -> "Lease":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            ok = self.queue.heartbeat(self.job, self.lease_s)
            if ok is False:  # None: the service is unreachable; keep trying, the lease may hold
                self.lost = True
                log.warning(
                    "tunecache: lost the lease of job %d (it ran out and was claimed again, or was dropped)",
                    self.job.id,
                )
                return


# ---- the worker --------------------------------------------------------------------------


@dataclass
class Outcome:
    job_id: int
    kernel: str
    status: str  # tuned | present | failed | lost | unpublished
    seconds: float = 0.0
    detail: str = ""


# a --burst worker stops, with an error, after this many polls in a row that reach no queue
BURST_UNREACHABLE_POLLS = 3


class Worker:
    def __init__(
        self,
        gpu: int = 0,
        queue: Fleet | None = None,
        store: Store | None = None,
        *,
        lease_s: float = 60.0,
        poll_s: float = 2.0,
        burst: bool = False,
        source: str = "worker",
        owner: str | None = None,
    ) -> None:
        if not 0 < lease_s <= MAX_LEASE_S:
            raise ValueError(
                f"--lease-s must be more than 0 and at most {MAX_LEASE_S:g} s (the queue's cap), got {lease_s:g}"
            )
        self.gpu = gpu
        self.device, self.torch_device = worker_device(gpu)
        self.store = store or default_store()
        self.queue = queue or default_fleet(self.store)
        self.lease_s, self.poll_s, self.burst, self.source = lease_s, poll_s, burst, source
        host = socket.gethostname()[:80]
        self.owner = owner or f"{host}:{os.getpid()}:gpu{gpu}"
        from tunecache.key import triton_version

        self.versions = tunable_kernels(self.device)
        self.triton_version = triton_version()
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()

    def stop(self) -> None:
        """Finish the current job, then return from run()."""
        self._stop.set()

    def run(self, max_jobs: int | None = None) -> list[Outcome]:
        log.info(
            "tunecache: worker %s on %s serving %s (%d kernels)%s",
            self.owner,
            self.device,
            self.queue.where,
            len(self.versions),
            " until the queue is empty" if self.burst else "",
        )
        if self.device.arch != "cpu":  # its trial runner imports torch and starts CUDA while the worker claims
            from tunecache.tuning.isolated import runner_for

            runner = runner_for(self.torch_device)
            runner.in_background(lambda: runner.warm_up(self.torch_device))
        unreachable = 0  # polls in a row that could not tell whether the queue is empty
        while not self._stop.is_set() and (max_jobs is None or len(self.outcomes) < max_jobs):
            job = None
            try:
                with signals_deferred():  # a signal during a claim must not lose the claimed job
                    runs = Runs(self.versions, self.triton_version)
                    job = self.queue.claim(self.owner, self.device, self.lease_s, runs)
                if job is None:
                    active = self._active_mine() if self.burst else None
                    if self.burst and active == 0:
                        break
                    unreachable = unreachable + 1 if self.burst and active is None else 0
                    if unreachable >= BURST_UNREACHABLE_POLLS:  # a burst must end: it cannot see the queue
                        raise FleetError(
                            f"{self.queue.where} could not be reached ({unreachable} tries, see the warnings "
                            "above): a --burst worker cannot tell whether its queue is empty, so it stops. "
                            "Check TUNECACHE_SERVER_URL (`tunecache doctor`)"
                        )
                    self._stop.wait(self.poll_s * random.uniform(0.75, 1.25))
                    continue
                self.outcomes.append(self.process(job))
            except KeyboardInterrupt:
                # Ctrl-C or SIGTERM: hand the job back now rather than when its lease runs out
                # (a second signal, e.g. Ctrl-C followed by pretune's SIGTERM, must not cut it short)
                _ignore_signals()
                if job is not None:
                    self.queue.release(job)
                raise
        return self.outcomes

    def _active_mine(self) -> int | None:
        """Queued or running jobs of this device class that this worker runs (its kernel at its
        version, on its Triton), or None when the queue cannot be listed: `--burst` exits at 0,
        so that jobs for kernels this host does not have (a user's kernel, other code) are not
        waited for."""
        try:
            jobs = [*self.queue.jobs("queued", 1000, self.device), *self.queue.jobs("running", 1000, self.device)]
        except Exception as e:  # unreachable, or refused: as active() answering None
            log.debug("tunecache: worker cannot list the queue (%s)", e)
            return None
        return sum(
            j.unreadable is None
            and self.versions.get(j.key.kernel) == j.key.kernel_version
            and j.key.triton_version == self.triton_version
            for j in jobs
        )

    def process(self, job: ClaimedJob) -> Outcome:
        from tunecache import backends
        from tunecache.cache.config_cache import CACHE
        from tunecache.tuning.tuner import make_key, tune

        key = job.key
        log.info(
            "tunecache: job %d: %s %s on %s (attempt %d/%d)",
            job.id,
            key.kernel,
            dict(key.problem),
            self.device,
            job.attempts,
            job.max_attempts,
        )
        try:
            mod = backends.module_for_kernel(key.kernel)
            mine = make_key(mod, dict(key.problem), self.device)
            if mine.digest != key.digest:
                raise ValueError(
                    f"this worker's {key.kernel} is version {mine.kernel_version} on Triton "
                    f"{mine.triton_version}; the job wants {key.kernel_version} on {key.triton_version}"
                )
            if not mod.supports(dict(key.problem), self.device):
                raise ValueError(f"{key.kernel} does not support {dict(key.problem)} on {self.device}")
        except Exception as e:
            return self._fail(job, f"cannot tune here: {type(e).__name__}: {e}")
        if not job.retime and self.queue.lookup(key) is not None:
            # published by a worker that died before it marked the job done (a re-timing is
            # tuned although a winner is there: a submission claimed to beat it)
            self.queue.complete(job)
            return Outcome(job.id, key.kernel, "present")
        t0 = time.perf_counter()
        with Lease(self.queue, job, self.lease_s) as lease:
            try:
                result = tune(
                    mod,
                    dict(key.problem),
                    self.device,
                    torch_device=self.torch_device,
                    source=self.source,
                    ranking=CACHE.ranking(key.kernel, self.device, store=self.store, fleet=self.queue),
                )
            except Exception as e:
                return self._fail(job, short("".join(traceback.format_exception(e)), 4000))
            seconds = time.perf_counter() - t0
            if lease.lost:
                return Outcome(job.id, key.kernel, "lost", seconds, "lease lost while tuning; not published")
            # this host's copy first (the service may be away right now), then the fleet's word
            sent = CACHE.keep_tuned(
                result, self.device, store=self.store, fleet=self.queue, publish="always", publish_attempts=5
            ).published
            if sent.status == REFUSED:
                return self._fail(job, "the service rejected the result (see its log)")
            if not sent.reached:
                # the service is unreachable: the lease runs out and the job is tuned again
                return Outcome(job.id, key.kernel, "unpublished", seconds, "service unreachable")
            self.queue.complete(job, tune_seconds=seconds)
        log.info(
            "tunecache: job %d: %s in %.1f s -> %s (%.4f ms)",
            job.id,
            key.kernel,
            seconds,
            result.config,
            result.median_ms,
        )
        return Outcome(job.id, key.kernel, "tuned", seconds)

    def _fail(self, job: ClaimedJob, error: str) -> Outcome:
        log.warning("tunecache: job %d (%s) failed: %s", job.id, job.key.kernel, last_line(error, 300))
        self.queue.fail(job, error)
        return Outcome(job.id, job.key.kernel, "failed", detail=error)


def _ignore_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


_DEFERRING: list[bool] = []
_PENDING: list[int] = []
_RAISED: list[float] = []  # when a signal was last raised as KeyboardInterrupt
_SECOND_SIGNAL_S = 5.0


def _interrupt(signum: int) -> None:
    """Raise KeyboardInterrupt, but not again within a few seconds: Ctrl-C at a terminal
    reaches pretune and its workers together, and pretune then sends SIGTERM; a second
    KeyboardInterrupt raised inside the first one's handling would cut short the release of
    the job. (A signal after that, should the first have been lost, interrupts again.)"""
    now = time.monotonic()
    if _RAISED and now - _RAISED[-1] < _SECOND_SIGNAL_S:
        return
    _RAISED.append(now)
    raise KeyboardInterrupt(f"signal {signum}")


def install_signal_handlers() -> None:
    """SIGTERM behaves like Ctrl-C: the current job is released, not left to its lease. Both
    wait while a claim is in flight (`signals_deferred`)."""

    def on_signal(signum, frame):
        if _DEFERRING:
            _PENDING.append(signum)
            return
        _interrupt(signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM (with `install_signal_handlers`) until the block is done, then
    raise KeyboardInterrupt: a job claimed in the block is then known, and released."""
    _DEFERRING.append(True)
    try:
        yield
    finally:
        _DEFERRING.pop()
        if _PENDING and not _DEFERRING:
            signum = _PENDING.pop()
            _PENDING.clear()
            _interrupt(signum)


def run_worker(
    gpu: int = 0,
    *,
    lease_s: float = 60.0,
    poll_s: float = 2.0,
    burst: bool = False,
    source: str = "worker",
    max_jobs: int | None = None,
) -> list[Outcome]:
    """The `tunecache worker` command's body."""
    install_signal_handlers()
    worker = Worker(gpu, lease_s=lease_s, poll_s=poll_s, burst=burst, source=source)
    try:
        return worker.run(max_jobs=max_jobs)
    except KeyboardInterrupt:
        log.info("tunecache: worker %s interrupted; a job it held went back to the queue", worker.owner)
        _forget_interrupt()
        return worker.outcomes


def _forget_interrupt() -> None:
    """CPython exits by SIGINT (status -2; 130 in a shell) once a KeyboardInterrupt has passed
    through code compiled from a string (`exec` of source: dataclasses, namedtuples, Triton's
    binders), even one handled since, as a stopped worker's is; the next such run clears it."""
    exec("pass")
