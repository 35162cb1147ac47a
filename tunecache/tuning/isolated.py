"""Work that may crash or hang runs in processes of our own, never in the caller's.

A `Worker` is a child started as `python -m tunecache.tuning.isolated_main` (its own entry point:
it never re-imports the caller's `__main__`, so a plain script or a notebook with no
`if __name__ == "__main__":` guard can tune). Requests and answers are JSON lines on pipes;
every request has a deadline. A child that dies (a segfault in ptxas, an illegal address
on the GPU, the OOM killer) or outlives its deadline (a deadlocked mbarrier protocol) is
killed and replaced, and the request fails with the reason in words: the caller's process
and its CUDA context are never touched.

Two uses: a pool of compile workers (`CompilePool`, one per CPU core, warm across tuning
runs) and one trial runner per GPU (`runner_for`), which makes the problem's inputs itself,
launches each candidate, checks it against the reference and times it. Both are forked from
the host's runner server when it is up (`tunecache.tuning.forkserver`: torch imported once per host),
else started as fresh processes.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Callable

# environment variables that change what a worker computes: a worker started under other
# values is replaced rather than reused
_ENV_PREFIXES = ("TRITON_", "CUDA_", "TUNECACHE_COMPILE", "PYTHONPATH", "LD_LIBRARY_PATH")
_START_TIMEOUT_S = 300.0  # importing torch and initialising CUDA on a busy host
_STDERR_TAIL = 1500


class WorkerFailed(RuntimeError):
    """The worker died or ran past its deadline; `reason` says which, in words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def env_fingerprint(env: dict[str, str] | None = None) -> tuple:
    env = os.environ if env is None else env
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(_ENV_PREFIXES)))


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class Worker:
    """One child process serving requests one at a time."""

    def __init__(self, role: str, env: dict[str, str] | None = None, *, forkable: bool = False) -> None:
        self.role = role
        self.env = dict(os.environ if env is None else env)
        # forked from the host's runner server when one is up (tunecache.tuning.forkserver): torch
        # and the interpreter's start are done there once per host, not once per process
        self.forkable = forkable
        self.forked = False
        # one request at a time: a warm-up started on a thread and the next request may meet
        self._lock = threading.RLock()
        self.proc: subprocess.Popen | None = None
        self._greeted = False
        self.warming = 0  # warm-ups still running on threads (in_background): the child is not ready
        self._warming_lock = threading.Lock()  # counted from two threads; not the request lock, held for seconds
        self._buf = b""
        self._err = None
        self.started = 0  # how many processes this worker has started (replacements included)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def spawn(self) -> None:
        """Start the child unless it runs, without waiting for it. Call it from a thread that
        lives as long as the child should: the child dies with the thread that started it
        (PR_SET_PDEATHSIG follows the thread)."""
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                return
            self._err = tempfile.TemporaryFile()
            forked = None
            if self.forkable:
                from tunecache.tuning import forkserver

                forked = forkserver.runner(self.role, self.env, self._err.fileno())
            self.forked = forked is not None
            self.proc = forked or subprocess.Popen(
                [sys.executable, "-m", "tunecache.tuning.isolated_main", self.role],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._err,
                env=self.env,
                close_fds=True,
            )
            self._buf = b""
            self.started += 1
            self._greeted = False

    def call(self, msg: dict, timeout: float | None) -> dict:
        """Send one request and return its answer; WorkerFailed if the child dies or runs past
        `timeout` seconds (it is then killed; the next call starts a fresh one)."""
        with self._lock:
            self.spawn()
            if not self._greeted:
                self._request({"cmd": "hello", "sys_path": list(sys.path)}, _START_TIMEOUT_S)
                self._greeted = True
            return self._request(msg, timeout)

    def warm_up(self, torch_device: str | None = None, *, torch: bool = False) -> None:
        """The imports (torch's too if `torch`) and CUDA's start on `torch_device` that a first
        real request would wait for."""
        self.call({"cmd": "warm", "torch_device": torch_device, "torch": torch}, _START_TIMEOUT_S)

    def in_background(self, work: Callable[[], object]) -> threading.Thread:
        """Start the child here and run `work` (its requests) on a thread, so that the child's
        start-up overlaps the caller's own work. A failure there is left for the next call to
        meet (and report)."""
        self.spawn()
        with self._warming_lock:
            self.warming += 1

        def run() -> None:
            try:
                work()
            except Exception:  # noqa: BLE001 - met again, and reported, by the next call
                pass
            finally:
                with self._warming_lock:
                    self.warming -= 1

        t = threading.Thread(target=run, name=f"tunecache-warm-{self.role}", daemon=True)
        t.start()
        return t

    def _request(self, msg: dict, timeout: float | None) -> dict:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerFailed(self._death()) from None
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self.kill()
                raise WorkerFailed(
                    f"timed out after {timeout:g} s (TUNECACHE_CANDIDATE_TIMEOUT_S); the {self.role} process was killed"
                )
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise WorkerFailed(self._death())
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        answer = json.loads(line)
        if answer.get("restart"):  # its CUDA context is gone: the next call starts a fresh one
            self.kill()
        if "fatal" in answer:  # the child could not serve the request at all
            raise WorkerFailed(answer["fatal"])
        return answer

    def _death(self) -> str:
        """Why the child is gone, with the end of what it wrote to stderr."""
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.returncode
        how = f"was killed by {_signal_name(code)}" if code is not None and code < 0 else f"exited with {code}"
        tail = self._stderr_tail()
        self.proc = None
        return f"the {self.role} process {how}" + (f": {tail}" if tail else "")

    def _stderr_tail(self) -> str:
        if self._err is None:
            return ""
        try:
            self._err.seek(0, os.SEEK_END)
            size = self._err.tell()
            self._err.seek(max(0, size - _STDERR_TAIL))
            text = self._err.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return " | ".join(lines[-6:])

    def kill(self) -> None:
        if self.proc is not None:
            try:
                self.proc.kill()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self.proc = None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # EOF: the child exits on its own
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        if self._err is not None:
            self._err.close()
            self._err = None


class CompilePool:
    """`workers` compile processes, kept warm; a task that kills its process fails alone.

    A task submitted `ahead` (a later shape's candidates, compiled while this one's are timed)
    runs only when no other task waits, so a tune never queues behind work done for the next;
    `hurry` moves one to the front when its own tune asks for it."""

    _NOW, _AHEAD = 0, 1  # priorities: lower runs first

    def __init__(self, workers: int, env: dict[str, str]) -> None:
        self.size = workers
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._queued: dict[Future, _Task] = {}  # tasks asked ahead that no thread has taken yet
        self._queued_lock = threading.Lock()  # also guards _idle
        self._idle: set[Worker] = set()  # waiting for a task: close() stops them at once
        self._closed = False
        # a worker starts at its first task, from the thread that serves it (it dies with it)
        for i in range(workers):
            w = Worker("compile", env, forkable=True)
            threading.Thread(target=self._serve, args=(w,), name=f"tunecache-compile-{i}", daemon=True).start()

    def submit(self, msg: dict, timeout: float | None, *, ahead: bool = False) -> "Future[dict | WorkerFailed]":
        """Run `msg` on the next idle worker (after every task not asked `ahead`, if it is); the
        future holds its answer or its WorkerFailed."""
        task = _Task(msg, timeout, Future())
        if ahead:
            with self._queued_lock:
                self._queued[task.future] = task
        self._queue.put((self._AHEAD if ahead else self._NOW, next(self._order), task))
        return task.future

    def hurry(self, future: Future) -> None:
        """A task asked ahead is wanted now: it runs before every other task still asked ahead."""
        with self._queued_lock:
            task = self._queued.pop(future, None)
        if task is not None:
            self._queue.put((self._NOW, next(self._order), task))  # its first entry is skipped

    def _serve(self, worker: Worker) -> None:
        while True:
            with self._queued_lock:
                self._idle.add(worker)
            _, _, task = self._queue.get()
            with self._queued_lock:
                self._idle.discard(worker)
                if task is not None and task.taken:  # hurried: it ran under its second entry
                    continue
                if task is not None:
                    task.taken = True
                    self._queued.pop(task.future, None)
            if task is None:
                with worker._lock:  # close() may be stopping it too
                    worker.close()
                return
            if not task.future.set_running_or_notify_cancel():
                continue
            try:
                task.future.set_result(worker.call(task.msg, task.timeout))
            except WorkerFailed as e:
                task.future.set_result(e)
            except BaseException as e:  # noqa: BLE001 - the caller meets it at .result()
                task.future.set_exception(e)

    def run(self, msgs: list[dict], timeout: float | None) -> list[dict | WorkerFailed]:
        return [f.result() for f in [self.submit(m, timeout) for m in msgs]]

    def close(self) -> None:
        """Stop the workers once the tasks not asked ahead are done; those asked ahead are dropped."""
        if self._closed:
            return
        self._closed = True
        with self._queued_lock:
            dropped, self._queued = list(self._queued.values()), {}
            for task in dropped:
                task.taken = True
        for task in dropped:
            if task.future.set_running_or_notify_cancel():
                task.future.set_result(WorkerFailed("the compile pool was closed before this task ran"))
        for _ in range(self.size):
            self._queue.put((self._NOW + 0.5, next(self._order), None))
        with self._queued_lock:
            idle = list(self._idle)
        for w in idle:  # the busy ones stop after their task (their thread holds the lock)
            if w._lock.acquire(blocking=False):
                try:
                    w.close()
                finally:
                    w._lock.release()


@dataclasses.dataclass(eq=False)
class _Task:
    msg: dict
    timeout: float | None
    future: Future
    taken: bool = False  # a thread runs it (or it was dropped): a second entry is skipped


_LOCK = threading.Lock()
_POOLS: dict[tuple, CompilePool] = {}
_RUNNERS: dict[tuple, Worker] = {}


def compile_pool(workers: int, extra_env: dict[str, str] | None = None) -> CompilePool:
    """The process's warm compile pool for this width and environment."""
    env = dict(os.environ)
    # compile workers build real binaries even when the caller runs the CPU interpreter
    env.pop("TRITON_INTERPRET", None)
    env.update(extra_env or {})
    k = (workers, env_fingerprint(env))
    with _LOCK:
        pool = _POOLS.get(k)
        if pool is None:
            for old in _POOLS.values():  # one warm pool at a time: each worker holds a Triton
                old.close()
            _POOLS.clear()
            pool = _POOLS[k] = CompilePool(workers, env)
        return pool


def runner_for(torch_device: str) -> Worker:
    """The process's trial runner for this device ("cuda:0", "cpu")."""
    k = (torch_device, env_fingerprint())
    with _LOCK:
        w = _RUNNERS.get(k)
        if w is None:
            for old_key in [o for o in _RUNNERS if o[0] == torch_device]:  # started under other settings
                _RUNNERS.pop(old_key).close()
            w = _RUNNERS[k] = Worker(f"trial runner for {torch_device}", forkable=True)
        return w


def runner_is_warm(torch_device: str) -> bool:
    """Whether this process's trial runner for the device is up, has answered and is done
    warming up (a tune that uses it waits for no start: a runner that greeted and still imports
    torch in the background is seconds away, a new host's first tune)."""
    w = _RUNNERS.get((torch_device, env_fingerprint()))
    return w is not None and w.proc is not None and w.proc.poll() is None and w._greeted and not w.warming


def runner_start_s(torch_device: str) -> float:
    """Roughly how long a tune waits for its trial runner to start (the H100 host's figures):
    none for a warm one, a fork of the host's runner server (torch imported), else a process
    that imports torch itself."""
    w = _RUNNERS.get((torch_device, env_fingerprint()))
    if runner_is_warm(torch_device) or (w is not None and w.forked):
        return 0.0
    from tunecache.tuning import forkserver

    return 0.3 if forkserver.serving(dict(os.environ)) else 4.0


def shutdown() -> None:
    """Stop every worker of this process (also run at exit)."""
    with _LOCK:
        for pool in _POOLS.values():
            pool.close()
        for w in _RUNNERS.values():
            w.close()
        _POOLS.clear()
        _RUNNERS.clear()


atexit.register(shutdown)
