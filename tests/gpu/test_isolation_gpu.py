"""On a real GPU: a candidate that writes out of bounds or spins forever is a failed trial of the
isolated trial runner, and the caller's CUDA context goes on; a config that does not fit the
device is never launched; a plain script tunes the Gluon backends through `tunecache.ops`."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_a_candidate_that_faults_or_spins_on_the_gpu_leaves_the_caller_untouched(db_url, monkeypatch):
    import gpu_bad_backend as bad
    from tunecache.key import cuda_device
    from tunecache.tuning.tuner import tune

    bad.register(monkeypatch)
    monkeypatch.setenv("TUNECACHE_CANDIDATE_TIMEOUT_S", "20")
    monkeypatch.setenv("TUNECACHE_VENDOR", "0")  # the backend's own candidates: cuBLAS would beat its "ok" one
    x = torch.randn(512, 512, device="cuda")  # the caller's own work, before and after
    before = (x @ x).sum().item()
    a, b = (
        torch.randn(256, 128, device="cuda", dtype=torch.float16),
        torch.randn(128, 192, device="cuda", dtype=torch.float16),
    )
    t0 = time.perf_counter()
    result = tune(bad, bad.problem(a, b), cuda_device(0), torch_device="cuda:0")
    seconds = time.perf_counter() - t0
    by = {t.config["behaviour"]: t for t in result.trials}
    print(
        f"tuned past a faulting and a spinning candidate in {seconds:.1f} s: "
        f"{ {k: (t.status, (t.error or '')[:160]) for k, t in by.items()} }"
    )
    assert result.config["behaviour"] == "ok"
    assert by["out_of_bounds"].status == "failed" and "illegal" in by["out_of_bounds"].error.lower()
    assert by["spin"].status == "failed" and "timed out after 20 s" in by["spin"].error
    torch.cuda.synchronize()  # the caller's context is alive
    assert (x @ x).sum().item() == before


def test_a_stored_config_that_does_not_fit_the_device_is_never_launched(db_url, monkeypatch, caplog):
    from tunecache import ops
    from tunecache.key import cuda_device
    from tunecache.store import ConfigRecord, default_store
    from tunecache.tuning.tuner import make_key
    from tunecache_kernels import matmul_hopper as hop

    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "default")
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    huge = {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4}
    huge |= {"num_stages": 6, "SWAP_AB": 0}
    assert hop.smem_bytes(huge) > 232448  # 525,360 B: in the space, not on an sm_90 part
    key = make_key(hop, hop.problem(a, b), cuda_device(0))
    default_store().put_config(ConfigRecord(key=key, config=huge, median_ms=1e-6, source="fleet"))
    with caplog.at_level(logging.WARNING, logger="tunecache"):
        out = ops.matmul(a, b)
    torch.testing.assert_close(out.float(), (a @ b).float(), atol=0.5, rtol=2e-2)
    assert "pruning refuses it" in caplog.text
    assert default_store().get_config(key.digest) is None


SCRIPT = """
import time, torch
from tunecache import ops
from tunecache.store import default_store
t0 = time.perf_counter()
x = torch.randn(8, 28, 28, 64, device="cuda", dtype=torch.bfloat16)
w = torch.randn(64, 3, 3, 64, device="cuda", dtype=torch.bfloat16)
y = ops.conv2d_fprop(x, w, stride=1, padding=1)
ref = torch.nn.functional.conv2d(x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2), padding=1).permute(0, 2, 3, 1)
torch.testing.assert_close(y.float(), ref.float(), atol=0.5, rtol=2e-2)
(rec,) = default_store().list_configs()
print("TUNED", rec.key.kernel, default_store().counts()["trials"], f"{time.perf_counter() - t0:.1f}")
"""


def test_a_plain_script_tunes_a_gluon_conv_through_the_ops(tmp_path, db_url):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = proc.stdout.split("TUNED")[-1].split()
    print("plain script:", proc.stdout.strip().splitlines()[-1])
    assert line[0] == "conv2d_fprop.hopper" and int(line[1]) > 1
