"""`tunecache worker --gpu N`: claim tuning jobs of this GPU's device class, tune, publish.

One process per GPU. A job is leased, and the lease is extended from a heartbeat thread
while the tuner runs; a worker that dies stops heartbeating, its lease runs out and another
worker claims the job again. With a fleet configured (TUNECACHE_SERVER_URL) the queue is
the service's; without one it is the local store's, so miss policy `default` plus one local
worker is background tuning of cache misses on a single host.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol

from . import settings
from .key import DeviceClass, TuneKey, interpreter_device
from .store import STORE_ERRORS, ConfigRecord, Store, TrialRecord, default_store

log = logging.getLogger("tunecache.worker")


class Job(Protocol):
    id: int
    key: TuneKey
    attempts: int
    max_attempts: int


# ---- queues: the local store's, or the fleet's through the service -------------------------


class LocalQueue:
    """The queue in a store (SQLite on one host, or Postgres reached directly)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    @property
    def where(self) -> str:
        return self.store.safe_url

    def enqueue(self, key: TuneKey, priority: int = 0, max_attempts: int = 3) -> Any:
        return self.store.enqueue(key, priority=priority, max_attempts=max_attempts)

    def claim(self, owner: str, device: DeviceClass, lease_s: float, kernel_versions: Mapping[str, str],
              triton_version: str | None) -> Job | None:
        return self.store.claim_job(owner, arch=device.arch, sm_count=device.sm_count, lease_s=lease_s,
                                    kernel_versions=kernel_versions, triton_version=triton_version)

    def heartbeat(self, job_id: int, owner: str, lease_s: float) -> bool | None:
        return self.store.heartbeat(job_id, owner, lease_s=lease_s)

    def complete(self, job_id: int, owner: str, tune_seconds: float | None = None) -> bool | None:
        return self.store.complete_job(job_id, owner)

    def fail(self, job_id: int, owner: str, error: str, backoff_s: float = 5.0) -> bool | None:
        return self.store.fail_job(job_id, owner, error, backoff_s=backoff_s) is not None

    def release(self, job_id: int, owner: str) -> bool | None:
        return self.store.release_job(job_id, owner)

    def lookup(self, key: TuneKey) -> ConfigRecord | None:
        return self.store.get_config(key.digest)

    def publish(self, rec: ConfigRecord, trials: Iterable[TrialRecord], tune_seconds: float | None) -> Any:
        return True  # the tuner stored it in this very store

    def active(self, device: DeviceClass) -> int | None:
        c = self.store.job_counts(arch=device.arch, sm_count=device.sm_count)
        return c["queued"] + c["running"]

    def statuses(self, digests: Iterable[str]) -> dict[str, str] | None:
        return self.store.job_statuses(digests)


class FleetQueue:
    """The service's queue; results are kept in the local store too (write-through)."""

    def __init__(self, client) -> None:
        self.client = client

    @property
    def where(self) -> str:
        return self.client.url

    def enqueue(self, key: TuneKey, priority: int = 0, max_attempts: int = 3) -> Any:
        return self.client.enqueue(key, priority=priority, max_attempts=max_attempts)

    def claim(self, owner: str, device: DeviceClass, lease_s: float, kernel_versions: Mapping[str, str],
              triton_version: str | None) -> Job | None:
        return self.client.claim(owner, device, lease_s=lease_s, kernel_versions=kernel_versions,
                                 triton_version=triton_version)

    def heartbeat(self, job_id: int, owner: str, lease_s: float) -> bool | None:
        return self.client.heartbeat(job_id, owner, lease_s=lease_s)

    def complete(self, job_id: int, owner: str, tune_seconds: float | None = None) -> bool | None:
        return self.client.complete(job_id, owner, tune_seconds=tune_seconds)

    def fail(self, job_id: int, owner: str, error: str, backoff_s: float = 5.0) -> bool | None:
        return self.client.fail(job_id, owner, error, backoff_s=backoff_s)

    def release(self, job_id: int, owner: str) -> bool | None:
        return self.client.release(job_id, owner)

    def lookup(self, key: TuneKey) -> ConfigRecord | None:
        return self.client.lookup(key)

    def publish(self, rec: ConfigRecord, trials: Iterable[TrialRecord], tune_seconds: float | None) -> Any:
        return self.client.publish(rec, trials, tune_seconds=tune_seconds)

    def active(self, device: DeviceClass) -> int | None:
        c = self.client.queue_counts(device)
        return None if c is None else c.get("queued", 0) + c.get("running", 0)

    def statuses(self, digests: Iterable[str]) -> dict[str, str] | None:
        return self.client.job_statuses(digests)


def default_queue(store: Store | None = None) -> LocalQueue | FleetQueue:
    """The fleet's queue when TUNECACHE_SERVER_URL is set, else the local store's."""
    url = settings.server_url()
    if url:
        from .client import fleet_client

        return FleetQueue(fleet_client(url))
    return LocalQueue(store or default_store())


# ---- the device and what this worker can tune -------------------------------------------


def worker_device(gpu: int) -> tuple[DeviceClass, str]:
    """(device class, torch device) for GPU `gpu`; the interpreter on a host without CUDA."""
    import torch

    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return interpreter_device(), "cpu"
    from .key import cuda_device

    if gpu >= torch.cuda.device_count():
        raise ValueError(f"--gpu {gpu}: this host has {torch.cuda.device_count()} CUDA device(s)")
    torch.cuda.set_device(gpu)
    return cuda_device(gpu), f"cuda:{gpu}"


def tunable_kernels(device: DeviceClass) -> dict[str, str]:
    """{kernel: version} of every backend this worker can run on `device`. Only jobs whose key
    it reproduces exactly (same kernel source, same Triton) are claimed."""
    from . import registry

    out = {}
    for op in registry.OPS:
        for backend in registry.available_backends(op):
            if device.arch == "cpu" and backend != "portable":
                continue  # the interpreter runs only plain triton.language kernels
            try:
                mod = registry.backend_module(op, backend)
                out[mod.KERNEL] = registry.kernel_version(mod)
            except Exception as e:  # a backend that does not import here is not tuned here
                log.warning("tunecache: worker skips %s.%s (%s: %s)", op, backend, type(e).__name__, e)
    return out


# ---- the lease ---------------------------------------------------------------------------


class Lease:
    """Heartbeats a job's lease from a thread until stopped; notes when the lease is lost."""

    def __init__(self, queue, job_id: int, owner: str, lease_s: float) -> None:
        self.queue, self.job_id, self.owner, self.lease_s = queue, job_id, owner, lease_s
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{job_id}", daemon=True)

    def __enter__(self) -> "Lease":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            ok = self.queue.heartbeat(self.job_id, self.owner, self.lease_s)
            if ok is False:  # None: the service is unreachable; keep trying, the lease may hold
                self.lost = True
                log.warning("tunecache: lost the lease of job %d (it ran out and was claimed again)", self.job_id)
                return


# ---- the worker --------------------------------------------------------------------------


@dataclass
class Outcome:
    job_id: int
    kernel: str
    status: str  # tuned | present | failed | lost | unpublished
    seconds: float = 0.0
    detail: str = ""


class Worker:
    def __init__(self, gpu: int = 0, queue=None, store: Store | None = None, *, lease_s: float = 60.0,
                 poll_s: float = 2.0, burst: bool = False, source: str = "worker",
                 owner: str | None = None) -> None:
        self.gpu = gpu
        self.device, self.torch_device = worker_device(gpu)
        self.store = store or default_store()
        self.queue = queue or default_queue(self.store)
        self.lease_s, self.poll_s, self.burst, self.source = lease_s, poll_s, burst, source
        host = socket.gethostname()[:80]
        self.owner = owner or f"{host}:{os.getpid()}:gpu{gpu}"
        from .key import triton_version

        self.versions = tunable_kernels(self.device)
        self.triton_version = triton_version()
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()

    def stop(self) -> None:
        """Finish the current job, then return from run()."""
        self._stop.set()

    def run(self, max_jobs: int | None = None) -> list[Outcome]:
        log.info("tunecache: worker %s on %s serving %s (%d kernels)%s", self.owner, self.device, self.queue.where,
                 len(self.versions), " until the queue is empty" if self.burst else "")
        while not self._stop.is_set() and (max_jobs is None or len(self.outcomes) < max_jobs):
            job = self.queue.claim(self.owner, self.device, self.lease_s, self.versions, self.triton_version)
            if job is None:
                if self.burst and self.queue.active(self.device) == 0:
                    break
                self._stop.wait(self.poll_s * random.uniform(0.75, 1.25))
                continue
            try:
                self.outcomes.append(self.process(job))
            except KeyboardInterrupt:
                # Ctrl-C or SIGTERM: hand the job back now rather than when its lease runs out
                # (a second signal, e.g. Ctrl-C followed by pretune's SIGTERM, must not cut it short)
                _ignore_signals()
                self.queue.release(job.id, self.owner)
                raise
        return self.outcomes

    def process(self, job: Job) -> Outcome:
        from . import registry
        from .tuner import make_key, tune

        key = job.key
        log.info("tunecache: job %d: %s %s on %s (attempt %d/%d)", job.id, key.kernel, dict(key.problem),
                 self.device, job.attempts, job.max_attempts)
        try:
            mod = registry.module_for_kernel(key.kernel)
            mine = make_key(mod, dict(key.problem), self.device)
            if mine.digest != key.digest:
                raise ValueError(f"this worker's {key.kernel} is version {mine.kernel_version} on Triton "
                                 f"{mine.triton_version}; the job wants {key.kernel_version} on {key.triton_version}")
            if not mod.supports(dict(key.problem), self.device):
                raise ValueError(f"{key.kernel} does not support {dict(key.problem)} on {self.device}")
        except Exception as e:
            return self._fail(job, f"cannot tune here: {type(e).__name__}: {e}")
        if self.queue.lookup(key) is not None:
            # published by a worker that died before it marked the job done
            self.queue.complete(job.id, self.owner)
            return Outcome(job.id, key.kernel, "present")
        t0 = time.perf_counter()
        with Lease(self.queue, job.id, self.owner, self.lease_s) as lease:
            try:
                result = tune(mod, dict(key.problem), self.device, torch_device=self.torch_device,
                              source=self.source)
            except Exception as e:
                return self._fail(job, _short(e))
            seconds = time.perf_counter() - t0
            if lease.lost:
                return Outcome(job.id, key.kernel, "lost", seconds, "lease lost while tuning; not published")
            rec = result.record(self.device)
            try:  # this host's copy first: the service may be away right now
                self.store.put_config(rec, result.trials, run_id=result.run_id)
            except STORE_ERRORS as e:
                log.warning("tunecache: job %d: cannot keep the result in the local store: %s", job.id, e)
            sent = self._publish(rec, result.trials, seconds)
            if sent is False:
                return self._fail(job, "the service rejected the result (see its log)")
            if sent is None:
                # the service is unreachable: the lease runs out and the job is tuned again
                return Outcome(job.id, key.kernel, "unpublished", seconds, "service unreachable")
            self.queue.complete(job.id, self.owner, tune_seconds=seconds)
        log.info("tunecache: job %d: %s in %.1f s -> %s (%.4f ms)", job.id, key.kernel, seconds, rec.config,
                 rec.median_ms)
        return Outcome(job.id, key.kernel, "tuned", seconds)

    def _publish(self, rec: ConfigRecord, trials: list[TrialRecord], seconds: float) -> Any:
        delay = 0.5
        for attempt in range(5):
            sent = self.queue.publish(rec, trials, seconds)
            if sent is not None:
                return sent
            if attempt < 4:
                time.sleep(delay)
                delay *= 2
        return None

    def _fail(self, job: Job, error: str) -> Outcome:
        log.warning("tunecache: job %d (%s) failed: %s", job.id, job.key.kernel, error.splitlines()[-1][:300])
        self.queue.fail(job.id, self.owner, error)
        return Outcome(job.id, job.key.kernel, "failed", detail=error)


def _short(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]


def _ignore_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def install_signal_handlers() -> None:
    """SIGTERM behaves like Ctrl-C: the current job is released, not left to its lease."""

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)


def run_worker(gpu: int = 0, *, lease_s: float = 60.0, poll_s: float = 2.0, burst: bool = False,
               source: str = "worker", max_jobs: int | None = None) -> list[Outcome]:
    """The `tunecache worker` command's body."""
    install_signal_handlers()
    worker = Worker(gpu, lease_s=lease_s, poll_s=poll_s, burst=burst, source=source)
    try:
        return worker.run(max_jobs=max_jobs)
    except KeyboardInterrupt:
        log.info("tunecache: worker %s interrupted; a job it held went back to the queue", worker.owner)
        return worker.outcomes
