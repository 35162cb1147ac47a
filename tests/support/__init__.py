"""Plain helpers of the tests (fixtures live in the conftest.py files; helpers are imported):

    from support import ROOT, KERNELS, run_py
    from support.fleet import Server, host_env, ...

`support/kernels/` holds test-only kernel modules (autotune_kernels, autotune_plain,
crashy_backend, gpu_bad_backend), imported by their top-level names: pytest puts that folder on
sys.path (`pythonpath` in pyproject.toml), and a child process that imports one needs KERNELS
on its PYTHONPATH."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

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


def kernel_versions(first_on_path: Path, kernels: list[str]) -> dict[str, str]:
    """Each kernel's version (`tunecache.backends.kernel_version`) as a fresh process computes
    it with `first_on_path` ahead on its import path (a copy of the kernels, edited)."""
    code = (
        "import json; from tunecache import backends; "
        f"print(json.dumps({{k: backends.kernel_version(backends.module_for_kernel(k)) for k in {kernels!r}}}))"
    )
    env = {
        **os.environ,
        "PYTHONPATH": f"{first_on_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "TRITON_INTERPRET": "1",
    }
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def versions_after_edit(base: Path, kernels: list[str]) -> Callable[[str | None], dict[str, str]]:
    """edit (a kernels file name, or None) -> `kernels`' versions (kernel_versions) over a copy of
    the kernels under `base` with that file edited; each edit is copied and computed once."""
    seen: dict[str | None, dict[str, str]] = {}

    def versions(edit: str | None) -> dict[str, str]:
        if edit not in seen:
            root = base / (edit or "unedited").replace(".", "_")
            shutil.copytree(ROOT / "kernels", root / "tunecache_kernels", ignore=shutil.ignore_patterns("__pycache__"))
            if edit:
                with open(root / "tunecache_kernels" / edit, "a") as f:
                    f.write("\n# an edit\n")
            seen[edit] = kernel_versions(root, kernels)
        return seen[edit]

    return versions
