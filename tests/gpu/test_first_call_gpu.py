"""On a GPU host, a call with CPU tensors is PyTorch's own op, and says so (the first-call tests
of tests/integration/test_first_call.py run wherever the suite runs)."""

from __future__ import annotations

import pytest

from support import run_py


@pytest.mark.gpu
def test_cpu_tensors_on_a_gpu_host_get_pytorchs_answer(db_url):
    proc = run_py(
        "import torch, tunecache.ops as ops; a = torch.randn(48, 40); b = torch.randn(40, 24); "
        "print(bool(torch.allclose(ops.matmul(a, b), a @ b, atol=1e-4)))",
        {"TUNECACHE_DB_URL": db_url},
    )
    assert proc.stdout.strip() == "True" and "CPU tensors run PyTorch's own ops" in proc.stderr, proc.stderr


@pytest.mark.gpu
def test_under_policy_default_a_miss_runs_torchs_op_at_once_and_queues_the_key(db_url, monkeypatch):
    import torch

    from tunecache import ops
    from tunecache.key import cuda_device
    from tunecache.ops import OP_LAUNCHERS, selfcheck
    from tunecache.store import default_store
    from tunecache_kernels import conv2d_fprop_hopper as hop

    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "default")
    ops.clear_memo()
    unchecked = selfcheck.unknown(hop, cuda_device(0))
    x = torch.randn(4, 20, 20, 48, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(40, 3, 3, 48, device="cuda", dtype=torch.bfloat16)
    y = ops.conv2d_fprop(x, w, stride=1, padding=1)
    ref = torch.nn.functional.conv2d(x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2), padding=1).permute(0, 2, 3, 1)
    torch.testing.assert_close(y.float(), ref.float(), atol=1e-2, rtol=1e-2)
    (entry,) = OP_LAUNCHERS["conv2d_fprop"].memo.values()
    assert entry.provisional and entry.vendor
    assert [j.key.kernel for j in default_store().list_jobs()] == [entry.key.kernel]
    # nothing of the backend ran, so its first-contact check (compiles in the runner) waits too
    assert selfcheck.unknown(hop, cuda_device(0)) == unchecked
