"""The cache never makes a call slower, wronger or dead: a config that cannot run here is never
launched, one that raises falls back and is dropped, and a backend that fails its first-contact
self-check is skipped for the next one. The test-only `crashy` backend stands in for a kernel
that crashes, hangs or does not fit the device."""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

import crashy_backend as crashy  # tests/support/kernels, on sys.path through pytest's `pythonpath`
from tunecache import ops
from tunecache.key import interpreter_device
from tunecache.ops import selfcheck
from tunecache.store import ConfigRecord, default_store
from tunecache.tuning.tuner import make_key


@pytest.fixture
def crashy_first(db_url, monkeypatch):
    crashy.register(monkeypatch)
    # tuning here meets only well-behaved candidates (test_isolation.py has the others)
    monkeypatch.setattr(crashy, "config_space", lambda p, d: [{**crashy.GOOD, "behaviour": "ok"}])
    monkeypatch.setenv("TUNECACHE_SELFCHECK", "never")
    selfcheck.forget()
    yield crashy
    selfcheck.forget()
    ops.clear_memo()


def _store_winner(a, b, behaviour: str) -> str:
    key = make_key(crashy, crashy.problem(a, b), interpreter_device())
    rec = ConfigRecord(key=key, config={**crashy.GOOD, "behaviour": behaviour}, median_ms=1e-3)
    default_store().put_config(rec)
    return key.digest


def test_a_stored_config_the_backend_prunes_is_never_launched(crashy_first, caplog):
    a, b = torch.randn(24, 16), torch.randn(16, 20)
    digest = _store_winner(a, b, "oversized")  # launching it would kill this process
    with caplog.at_level(logging.WARNING, logger="tunecache"):
        torch.testing.assert_close(ops.matmul(a, b), a @ b)
    assert "pruning refuses it" in caplog.text
    kept = default_store().get_config(digest)
    assert kept is not None and kept.config["behaviour"] == "ok", "the bad row is replaced by a tuned one"


def test_a_config_that_raises_at_launch_falls_back_and_is_dropped(crashy_first, caplog, monkeypatch):
    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "strict")  # nothing may be tuned: only fallbacks
    a, b = torch.randn(24, 16), torch.randn(16, 20)
    digest = _store_winner(a, b, "raise")
    with caplog.at_level(logging.WARNING, logger="tunecache"):
        out = ops.matmul(a, b)
    torch.testing.assert_close(out, a @ b)
    assert "launching it raised RuntimeError" in caplog.text
    assert default_store().get_config(digest) is None, "the bad local row is dropped"
    (entry,) = ops.OP_LAUNCHERS["matmul"].memo.values()
    assert entry.config["behaviour"] == "ok"  # the default config, kept for the next calls
    torch.testing.assert_close(ops.matmul(a, b), a @ b)


def test_a_backend_that_hangs_its_self_check_is_skipped_with_one_warning(crashy_first, monkeypatch, caplog):
    monkeypatch.setenv("TUNECACHE_SELFCHECK", "always")
    monkeypatch.setenv("TUNECACHE_CANDIDATE_TIMEOUT_S", "3")
    monkeypatch.setattr(crashy, "default_config", lambda p, d: {**crashy.GOOD, "behaviour": "hang"})
    with caplog.at_level(logging.WARNING, logger="tunecache"):
        for m in (24, 40):
            a, b = torch.randn(m, 16), torch.randn(16, 20)
            torch.testing.assert_close(ops.matmul(a, b), a @ b)
    warnings = [r.getMessage() for r in caplog.records if "self-check" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "matmul.crashy backend failed its self-check" in warnings[0] and "timed out" in warnings[0]
    assert "using matmul.portable instead" in warnings[0]
    assert {e.kernel for e in ops.OP_LAUNCHERS["matmul"].memo.values()} == {"matmul.portable"}
    # the verdict is kept: a later process does not run the check again
    from tunecache.backends import kernel_version
    from tunecache.key import triton_version

    dev = interpreter_device()
    ok, detail = default_store().get_selfcheck(
        "matmul.crashy", kernel_version(crashy), triton_version(), dev.arch, dev.sm_count
    )
    assert not ok and "timed out" in detail


def test_a_backend_that_passes_its_self_check_is_used(crashy_first, monkeypatch):
    monkeypatch.setenv("TUNECACHE_SELFCHECK", "always")
    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "default")  # nothing tuned: the check runs its grid
    a, b = torch.randn(24, 16), torch.randn(16, 20)
    torch.testing.assert_close(ops.matmul(a, b), a @ b)
    assert {e.kernel for e in ops.OP_LAUNCHERS["matmul"].memo.values()} == {"matmul.crashy"}
    v = selfcheck.verdict(crashy, interpreter_device())
    assert v.ok and v.cases == 2


def test_a_first_tune_is_the_backends_check(crashy_first, monkeypatch):
    """A miss that tunes checks every candidate, the default config among them, against
    PyTorch in the isolated runner: that stands for the first-contact check (kept as the
    verdict), which would only have run the same default config before it."""
    monkeypatch.setenv("TUNECACHE_SELFCHECK", "always")
    ran = []
    monkeypatch.setattr(selfcheck, "run_check", lambda *a, **k: ran.append(a))
    a, b = torch.randn(24, 16), torch.randn(16, 20)
    torch.testing.assert_close(ops.matmul(a, b), a @ b)
    assert {e.kernel for e in ops.OP_LAUNCHERS["matmul"].memo.values()} == {"matmul.crashy"}
    assert ran == [], "no separate check ran"
    v = selfcheck.verdict(crashy, interpreter_device())
    assert v.ok and "checked by this host's tuning" in v.detail


def test_when_no_backend_passes_pytorch_answers(crashy_first, monkeypatch):
    from tunecache_kernels import matmul_portable

    monkeypatch.setenv("TUNECACHE_SELFCHECK", "always")
    monkeypatch.setattr(crashy, "default_config", lambda p, d: {**crashy.GOOD, "behaviour": "exit"})
    monkeypatch.setattr(
        matmul_portable,
        "default_config",
        lambda p, d: {"BLOCK_M": 24, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 1, "num_warps": 4, "num_stages": 1},
    )  # not a power of two: it cannot compile
    a, b = torch.randn(24, 16), torch.randn(16, 20)
    torch.testing.assert_close(ops.matmul(a, b), a @ b)
    assert {e.kernel for e in ops.OP_LAUNCHERS["matmul"].memo.values()} == {"torch"}


def test_selftest_prints_a_table_of_verdicts(db_url):
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "tunecache.cli", "selftest", "--op", "conv2d_fprop"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "160"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "conv2d_fprop" in proc.stdout and "portable" in proc.stdout and "ok" in proc.stdout
    assert "not for this device: conv2d_fprop.blackwell, conv2d_fprop.hopper" in proc.stdout
