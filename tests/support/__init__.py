"""Plain helpers of the tests (fixtures live in the conftest.py files; helpers are imported):

    from support import ROOT, KERNELS, run_py
    from support.fleet import Server, host_env, ...

`support/kernels/` holds test-only kernel modules (autotune_kernels, autotune_plain,
crashy_backend, gpu_bad_backend), imported by their top-level names: pytest puts that folder on
sys.path (`pythonpath` in pyproject.toml), and a child process that imports one needs KERNELS
on its PYTHONPATH."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent
KERNELS = TESTS / "support" / "kernels"


def run_py(code: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run Python code in a fresh process with this test's environment."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc
