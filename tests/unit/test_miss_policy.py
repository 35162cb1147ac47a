"""Miss policies: tune (block and tune), default (run a default now, pick up the winner
later without a restart), strict (raise)."""

from __future__ import annotations

import pytest
import torch

from tunecache import MissingConfig, ops
from tunecache.store import default_store
from tunecache.tuning.tuner import tune


def test_strict_raises_naming_the_kernel(db_url, monkeypatch):
    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "strict")
    with pytest.raises(MissingConfig, match=r"matmul\.\w+ .*TUNECACHE_MISS_POLICY=strict"):
        ops.matmul(torch.randn(8, 8), torch.randn(8, 8))


def test_unknown_policy_is_rejected(db_url, monkeypatch):
    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "sometimes")
    with pytest.raises(ValueError, match="TUNECACHE_MISS_POLICY must be one of"):
        ops.matmul(torch.randn(8, 8), torch.randn(8, 8))


def test_default_runs_now_enqueues_and_picks_up_the_winner(db_url, monkeypatch):
    from tunecache import backends
    from tunecache.key import interpreter_device

    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "default")
    monkeypatch.setenv("TUNECACHE_RECHECK_S", "0")
    a, b = torch.randn(40, 24), torch.randn(24, 36)
    torch.testing.assert_close(ops.matmul(a, b), a @ b)
    store = default_store()
    assert store.counts()["trials"] == 0, "policy default must not tune inline"
    (job,) = store.list_jobs()
    assert job.status == "queued"
    (entry,) = ops.OP_LAUNCHERS["matmul"].memo.values()
    assert entry.provisional
    # a worker tunes the queued key...
    mod = backends.module_for_kernel(job.key.kernel)
    result = tune(mod, dict(job.key.problem), interpreter_device(), source="worker")
    store.put_config(result.record(interpreter_device()), result.trials)
    # ...and the running process switches to the winner on its next call
    torch.testing.assert_close(ops.matmul(a, b), a @ b)
    (entry,) = ops.OP_LAUNCHERS["matmul"].memo.values()
    assert not entry.provisional and entry.config == result.config


def test_default_prefers_the_nearest_tuned_neighbour(db_url, monkeypatch):
    from tunecache import backends
    from tunecache.cache.config_cache import CACHE
    from tunecache.key import interpreter_device
    from tunecache.ops.launcher import launchable
    from tunecache.tuning.tuner import make_key
    from tunecache_kernels import problems

    mod = backends.backend_module("matmul", "portable")
    dev = interpreter_device()
    near = problems.matmul_problem(torch.randn(64, 64), torch.randn(64, 64))
    far = problems.matmul_problem(torch.randn(16, 16), torch.randn(16, 16))
    store = default_store()
    tuned_near = tune(mod, near, dev)
    far_result = tune(mod, far, dev)
    for r in (tuned_near, far_result):
        store.put_config(r.record(dev), r.trials)
    query = problems.matmul_problem(torch.randn(60, 64), torch.randn(64, 60))

    def nearest(problem):
        return CACHE.nearest(make_key(mod, problem, dev), launchable(mod, problem, dev))

    assert nearest(query) == tuned_near.config
    other_dtype = problems.matmul_problem(torch.randn(60, 64).half(), torch.randn(64, 60).half())
    assert nearest(other_dtype) is None


def test_a_sure_miss_is_known_before_the_store_opens(db_url):
    """A GPU call that will tune starts its trial runner before the fleet is asked and the store
    opened (`launcher._runner_ahead`), on a miss known from the SQLite file alone: no file yet,
    or no row. A stored winner is no sure miss, and neither is a store that cannot be read here."""
    from tunecache import backends
    from tunecache.cache.config_cache import CACHE
    from tunecache.key import interpreter_device
    from tunecache.store import quick_read
    from tunecache.tuning.tuner import make_key

    a, b = torch.randn(40, 24), torch.randn(24, 36)
    problem = ops.OP_LAUNCHERS["matmul"].problem_fn(a, b)
    mod = backends.backends_for("matmul", interpreter_device(), problem)[0]
    digest = make_key(mod, problem, interpreter_device()).digest
    quick_read.forget()
    assert CACHE.surely_missing(digest)  # no file yet
    ops.matmul(a, b)  # tunes and keeps the winner
    quick_read.forget()
    assert not CACHE.surely_missing(digest)
    assert CACHE.surely_missing("0" * 64)  # a key the store has no row for
    quick_read.forget()


def test_default_on_a_gpu_runs_torchs_op_until_the_winner_and_checks_no_backend_meanwhile(db_url, monkeypatch):
    """On a GPU (a Hopper class given by hand: the vendor's op runs on these CPU tensors as it
    runs on a GPU's), a miss under policy default runs torch's own op: nothing to compile and no
    first-contact check of a backend that runs nothing yet (both seconds inside a first step)."""
    import torch.nn.functional as F

    from tunecache.key import device_of
    from tunecache.ops import selfcheck
    from tunecache_kernels import conv2d_fprop_hopper as hopper

    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "default")
    monkeypatch.setenv("TUNECACHE_DEVICE", "sm_90:132")
    selfcheck.forget()
    x, w = torch.randn(2, 6, 6, 8, dtype=torch.bfloat16), torch.randn(4, 3, 3, 8, dtype=torch.bfloat16)
    y = ops.conv2d_fprop(x, w, 1, 1)
    ref = F.conv2d(x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2), padding=1).permute(0, 2, 3, 1)
    torch.testing.assert_close(y, ref)
    (entry,) = ops.OP_LAUNCHERS["conv2d_fprop"].memo.values()
    assert entry.provisional and entry.vendor and entry.kernel == hopper.KERNEL
    (job,) = default_store().list_jobs()
    assert job.key.kernel == hopper.KERNEL and job.status == "queued"
    assert selfcheck.unknown(hopper, device_of(x)), "a backend that runs nothing yet was self-checked"
    assert default_store().counts()["trials"] == 0
