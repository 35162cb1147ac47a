"""Triton's CUDA driver, made in a thread while a first call looks its config up.

Triton makes its driver at the first launch, and on a host (or Triton build) that never ran
Triton that means building its C utilities with gcc: 0.7 s on an H100 host, kept in Triton's
cache afterwards. gcc is a subprocess, so started when a call's slow path begins it runs
beside the fleet lookup and the kernel modules' imports instead of after them.

Triton makes `driver.active` lazily and without a lock: two threads that both reach it first
both build it. So the launcher waits for the thread (`ready`) before anything of tunecache
can touch the driver; any failure is left to that touch, which reports it as before.
"""

from __future__ import annotations

import sys
import threading

_lock = threading.Lock()
_thread: threading.Thread | None = None


def _made() -> bool:
    mod = sys.modules.get("triton.runtime.driver")
    return mod is not None and getattr(mod.driver, "_active", None) is not None


def _make() -> None:
    try:
        from triton.runtime import driver

        driver.active.get_current_device()
    except Exception:  # noqa: BLE001 - the launch that needs it meets the same error and says why
        pass


def start() -> None:
    """Make the driver in a thread, once per process, unless it is made already."""
    global _thread
    if _thread is not None or _made():
        return
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_make, name="tunecache-triton-driver", daemon=True)
            _thread.start()


def ready() -> None:
    """Wait for `start`'s thread, if one was started."""
    t = _thread
    if t is not None and t.is_alive():
        t.join()
