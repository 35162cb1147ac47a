"""Triton's CUDA driver, made in a thread while a first call imports its kernels and looks
its config up.

On a host (or a Triton cache) that never ran Triton, Triton's first launch builds its C
utilities with gcc: 0.7 s on an H100 host, kept in Triton's cache afterwards. gcc is a
subprocess, so started when a call's slow path begins it runs beside the kernel modules'
imports, the hashing of Triton's cache key, the fleet lookup and a tune (whose compiles, checks
and timings run in processes of their own) instead of before them.
(Triton's key is not hashed in a thread: it imports Triton's packages as it walks them.)

Triton makes `driver.active` lazily and without a lock: two threads that both reach it first
both build it. So the launcher waits for the thread (`ready`) before it publishes the call's
entry, whose launch is the first touch of the driver; any failure is left to that touch, which reports it as before.
"""

from __future__ import annotations

import sys
import threading

_lock = threading.Lock()
_thread: threading.Thread | None = None


def _made() -> bool:
    mod = sys.modules.get("triton.runtime.driver")
    return mod is not None and getattr(mod.driver, "_active", None) is not None


def _make_driver() -> None:
    try:
        from triton.runtime import driver

        driver.active.get_current_device()
    except Exception:  # noqa: BLE001 - the launch that needs it meets the same error and says why
        pass


def start() -> None:
    """Start making the driver, once per process, unless it is made already.

    What the thread runs is imported here first, on the caller's thread: an import racing the
    caller's own imports of Triton (the kernel modules) can hand one of them a module still
    half-initialized (Python breaks the would-be deadlock that way)."""
    global _thread
    if _thread is not None or _made():
        return
    with _lock:
        if _thread is None:
            try:
                import triton.backends  # noqa: F401 - each backend's driver module too
                import triton.runtime.build  # noqa: F401
                import triton.runtime.cache  # noqa: F401
                import triton.runtime.driver  # noqa: F401
            except Exception:  # noqa: BLE001 - no head start; the launch says what is wrong
                return
            t = threading.Thread(target=_make_driver, name="tunecache-triton-driver", daemon=True)
            t.start()
            _thread = t


def ready() -> None:
    """Wait for `start`'s thread, if one was started."""
    t = _thread
    if t is not None and t.is_alive():
        t.join()
