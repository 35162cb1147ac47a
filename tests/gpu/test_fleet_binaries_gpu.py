"""On a GPU: a host that never tuned launches the fleet's kernel without compiling it. A tuning
host tunes a matmul (a worker token: it publishes the winner and its compiled kernels); a
fresh host with an empty store and an empty Triton cache calls the same op, gets the winner
and its kernels from the fleet, and its Triton cache then holds no entry it compiled itself."""

from __future__ import annotations

import pytest

from support import KERNELS
from support.fleet import host_env, run_host, start_fleet

CALL = """
import json, torch
import tunecache.ops as ops
torch.manual_seed(0)
a = torch.randn(1536, 1024, device="cuda", dtype=torch.bfloat16)
b = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
out = ops.matmul(a, b)
ref = a.float() @ b.float()
print(json.dumps({"err": ((out.float() - ref).norm() / ref.norm()).item()}))
"""


def _entries(cache):
    """(installed, compiled): Triton cache entries with only a kernel's metadata and cubin, and
    those holding the IRs a compile leaves."""
    dirs = [d for d in cache.iterdir() if d.is_dir()] if cache.exists() else []
    compiled = [d for d in dirs if any(f.suffix in (".ptx", ".ttgir") for f in d.iterdir())]
    installed = [d for d in dirs if any(f.suffix == ".cubin" for f in d.iterdir()) and d not in compiled]
    return installed, compiled


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_a_host_that_never_tuned_launches_the_fleets_kernels_without_compiling(tmp_path):
    fleet = start_fleet(f"sqlite:///{tmp_path / 'fleet.sqlite'}", tmp_path)
    try:
        tuner = host_env(
            tmp_path,
            "tuner",
            fleet.url,
            fleet.tokens["worker"],
            TRITON_CACHE_DIR=str(tmp_path / "tuner-triton"),
            TUNECACHE_MAX_CANDIDATES="4",
            TUNECACHE_VENDOR="0",  # a kernel wins (cuBLAS would beat 4 candidates, and it has no binaries)
        )
        fresh = host_env(tmp_path, "fresh", fleet.url, fleet.tokens["read"], TRITON_CACHE_DIR=str(tmp_path / "fresh"))
        for env in (tuner, fresh):
            env.pop("TRITON_INTERPRET")
            env.pop("TUNECACHE_BACKEND")
        assert run_host(CALL, tuner)["err"] < 2e-2
        assert run_host(CALL, fresh)["err"] < 2e-2
        installed, compiled = _entries(tmp_path / "fresh")
        assert installed and not compiled, (installed, compiled)
    finally:
        fleet.stop()


DROP_IN = """
import json, torch
import autotune_kernels as k
a = torch.randn(96, 64, device="cuda", dtype=torch.float16)
b = torch.randn(64, 80, device="cuda", dtype=torch.float16)
out = k.matmul(a, b)
print(json.dumps({"err": ((out.float() - a.float() @ b.float()).norm() / (a.float() @ b.float()).norm()).item()}))
"""


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_a_host_that_never_tuned_runs_the_fleets_tunecache_autotune_kernel_without_compiling(tmp_path):
    fleet = start_fleet(f"sqlite:///{tmp_path / 'fleet.sqlite'}", tmp_path)
    try:
        envs = []
        for name, scope in (("tuner", "worker"), ("fresh", "read")):
            env = host_env(
                tmp_path, name, fleet.url, fleet.tokens[scope], TRITON_CACHE_DIR=str(tmp_path / f"{name}-triton")
            )
            env.pop("TRITON_INTERPRET")
            env["PYTHONPATH"] = f"{KERNELS}:{env.get('PYTHONPATH', '')}"
            envs.append(env)
        for env in envs:
            assert run_host(DROP_IN, env)["err"] < 1e-2
        installed, compiled = _entries(tmp_path / "fresh-triton")
        assert installed and not compiled, (installed, compiled)
    finally:
        fleet.stop()
