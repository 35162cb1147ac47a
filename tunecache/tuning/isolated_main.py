"""The child side of `tunecache.tuning.isolated`: `python -m tunecache.tuning.isolated_main ROLE`.

Reads one JSON request per line on stdin and answers one JSON line on the pipe that was its
stdout (stdout itself is pointed at stderr, so a kernel's or a library's prints cannot
corrupt an answer). Ends on EOF, and with the parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

_STATE: dict[str, Any] = {}
_ERROR_CHARS = 2000


def _die_with_parent() -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _defer(name: str) -> None:
    """Import `name` only when something first reads one of its attributes. A compile worker
    imports the kernel modules (whose host code uses torch) but compiles with Triton alone;
    torch's import is most of a worker's start (seconds, when a pool of them starts at once).
    `import torch` statements find this stand-in (it carries the real spec, so the import
    system takes it as loaded); the first attribute read imports torch and the stand-in
    takes on its namespace."""
    import importlib.util
    import types

    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None:
        return

    class Deferred(types.ModuleType):
        def __getattr__(self, attr: str) -> Any:
            if sys.modules.get(name) is self:
                del sys.modules[name]
            import importlib

            real = importlib.import_module(name)
            self.__dict__.update(real.__dict__)
            return getattr(real, attr)

    stand_in = Deferred(name)
    stand_in.__spec__ = spec
    sys.modules[name] = stand_in


def _short(e: BaseException) -> str:
    from tunecache.errors import short

    return short(e, _ERROR_CHARS)


def hello(msg: dict) -> dict:
    # the caller's import path, so that its own backend modules (and tests') import here too
    for p in reversed(msg.get("sys_path", [])):
        if p not in sys.path:
            sys.path.insert(0, p)
    if "TRITON_INTERPRET" not in os.environ:
        import warnings

        warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
        from tunecache.tuning import triton_key_cache

        triton_key_cache.install()  # every compile and trial process would hash Triton itself
    return {"pid": os.getpid()}


def warm(msg: dict) -> dict:
    """Do the imports (and the CUDA initialisation) a first real request would wait for."""
    if msg.get("torch_device") or msg.get("torch"):
        import torch

        if (msg.get("torch_device") or "").startswith("cuda"):
            torch.cuda.set_device(torch.device(msg["torch_device"]))
            torch.cuda.init()
    if "TRITON_INTERPRET" not in os.environ:
        import triton  # noqa: F401 - most of what a first compile or launch imports
    return {"warm": True}


def compile_spec(msg: dict) -> dict:
    from dataclasses import asdict

    from tunecache.tuning.compile import compile_in_worker

    return asdict(compile_in_worker(*msg["task"]))


def launch_utils(msg: dict) -> dict:
    """Build Triton's launch module into its cache (needs the CUDA driver library, not a GPU)."""
    try:
        from triton.backends.nvidia.driver import CudaUtils

        CudaUtils()
    except Exception as e:  # noqa: BLE001 - no CUDA here: the first launch builds it, as before
        return {"built": False, "error": _short(e)}
    return {"built": True}


def compile_asm(msg: dict) -> dict:
    from tunecache.tuning.compile import asm_in_worker

    return asm_in_worker(*msg["task"])


# ---- trials: one problem's inputs, then candidates one at a time ---------------------------


def setup(msg: dict) -> dict:
    """Make the problem's inputs (seeded) and the reference output."""
    import importlib
    import time

    seconds = {}
    t = time.perf_counter()

    def took(stage: str) -> None:
        nonlocal t
        now = time.perf_counter()
        seconds[stage] = round(now - t, 3)
        t = now

    import torch

    took("import_torch")
    _STATE.clear()
    mod = importlib.import_module(msg["module"])
    launch = sys.modules.get("tunecache_kernels.gluon_launch")
    if launch is not None:  # a Gluon backend: the caller's direct-launch setting holds here too
        from tunecache import settings

        launch.set_direct_launch(settings.gluon_direct_launch())
    took("import_backend")
    dev = msg["torch_device"]
    if dev.startswith("cuda:"):
        torch.cuda.set_device(torch.device(dev))
        torch.cuda.init()
        took("cuda_init")
    torch.manual_seed(0)
    from tunecache_kernels import problems

    problems.use_precision(msg["problem"])  # the reference's (and the vendor's) float32 products
    args = mod.inputs(msg["problem"], dev)
    took("inputs")
    ref = mod.reference(*args)
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
    took("reference")
    on_gpu = dev.startswith("cuda")
    # the GPU's timer is named by its UUID: CUDA_VISIBLE_DEVICES numbers GPUs per process
    timer = str(torch.cuda.get_device_properties(torch.device(dev)).uuid) if on_gpu else "cpu"
    _STATE.update(mod=mod, args=args, ref=ref, on_gpu=on_gpu, tol=msg["tolerance"], digest=msg["digest"], timer=timer)
    return {"ready": msg["digest"], "seconds": seconds}


def _cuda_broken() -> bool:
    """After an illegal memory access the context is gone: this process must be replaced."""
    import torch

    try:
        torch.cuda.synchronize()
        return False
    except RuntimeError:
        return True


def trial(msg: dict) -> dict:
    """Launch one config, check it against the reference, time it (quick or full), holding the
    GPU's timer (`tunecache.locks.gpu_timer`): no other process of the host runs candidates on
    it meanwhile."""
    from tunecache import locks

    if _STATE.get("digest") != msg["digest"]:
        return {"status": "failed", "error": "the trial runner lost the problem's inputs", "resetup": True}
    with locks.gpu_timer(_STATE["timer"]):
        return _trial(msg)


def _trial(msg: dict) -> dict:
    from tunecache.tuning import timing as bench
    from tunecache.tuning.accuracy import relative_error

    mod, args, on_gpu = _STATE["mod"], _STATE["args"], _STATE["on_gpu"]
    cfg = msg["config"]
    if msg.get("check", True):
        try:
            out = mod.launch(cfg, *args)
            if on_gpu:
                import torch

                torch.cuda.synchronize()
            err = relative_error(out, _STATE["ref"])
        except Exception as e:  # a config that does not compile or crashes never wins
            answer = {"status": "failed", "error": _short(e)}
            if on_gpu and _cuda_broken():
                answer["restart"] = True
            return answer
        tol = _STATE["tol"]
        if not err <= tol:  # NaN fails too
            return {"status": "wrong", "error": f"relative error {err:.3g} > {tol}"}
    if not msg.get("time", True):
        return {"status": "ok"}
    timing = msg.get("timing") or {}
    try:
        ms = bench.time_ms(lambda: mod.launch(cfg, *args), on_gpu, **timing)
    except Exception as e:
        answer = {"status": "failed", "error": _short(e)}
        if on_gpu and _cuda_broken():
            answer["restart"] = True
        return answer
    return {"status": "ok", "median_ms": ms}


def reference(msg: dict) -> dict:
    """Time the reference op (torch's: cuBLAS / cuDNN on a GPU) on the same inputs, holding the
    GPU's timer."""
    from tunecache import locks
    from tunecache.tuning import timing as bench

    if _STATE.get("digest") != msg["digest"]:
        return {"status": "failed", "error": "the trial runner lost the problem's inputs"}
    mod, args = _STATE["mod"], _STATE["args"]
    try:
        with locks.gpu_timer(_STATE["timer"]):
            ms = bench.time_ms(lambda: mod.reference(*args), _STATE["on_gpu"], **(msg.get("timing") or {}))
    except Exception as e:
        return {"status": "failed", "error": _short(e)}
    return {"status": "ok", "median_ms": ms}


def binaries(msg: dict) -> dict:
    """Launch one config once more and say which of Triton's cache entries the launch used:
    the winner's compiled kernels, for the fleet (tunecache.tuning.binaries)."""
    if _STATE.get("digest") != msg["digest"]:
        return {"status": "failed", "error": "the trial runner lost the problem's inputs"}
    if not _STATE["on_gpu"] or os.environ.get("TRITON_INTERPRET") == "1":
        return {"status": "ok", "binaries": {}}
    import torch

    from tunecache.tuning.binaries import capture

    mod, args = _STATE["mod"], _STATE["args"]
    try:
        with capture() as seen:
            mod.launch(msg["config"], *args)
            torch.cuda.synchronize()
    except Exception as e:
        return {"status": "failed", "error": _short(e)}
    return {"status": "ok", "binaries": seen}


HANDLERS: dict[str, Callable[[dict], dict]] = {
    "hello": hello,
    "warm": warm,
    "compile": compile_spec,
    "asm": compile_asm,
    "launch_utils": launch_utils,
    "setup": setup,
    "trial": trial,
    "reference": reference,
    "binaries": binaries,
}


def main() -> None:
    _die_with_parent()
    answers = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints go to stderr, not into the answers
    sys.stdout = sys.stderr
    if len(sys.argv) > 1 and sys.argv[1] == "compile":
        os.environ.pop("TRITON_INTERPRET", None)
        _defer("torch")
        # compiles yield to the trial runner, whose start (importing torch) every tune waits for
        try:
            os.nice(10)
        except OSError:
            pass
    for line in sys.stdin.buffer:
        msg = json.loads(line)
        handler = HANDLERS.get(msg.get("cmd"))
        try:
            answer = handler(msg) if handler else {"fatal": f"unknown request {msg.get('cmd')!r}"}
        except Exception as e:  # noqa: BLE001 - reported to the parent, which decides
            answer = {"fatal": f"{msg.get('cmd')} failed in the isolated process: {_short(e)}"}
        answers.write(json.dumps(answer).encode() + b"\n")
        if answer.get("restart"):
            break
    # libtriton's nanobind reports "leaked instances" at interpreter exit: noise
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)


if __name__ == "__main__":
    main()
