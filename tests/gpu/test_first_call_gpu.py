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
