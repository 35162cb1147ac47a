"""Bad input gets a clear error that names the argument; bad store rows are never launched."""

from __future__ import annotations

import logging

import pytest
import torch

from tunecache import ops
from tunecache.store import Store, StoreError


@pytest.fixture(autouse=True)
def _store(db_url, monkeypatch):
    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "default")


def test_wrong_dtype_names_the_argument():
    with pytest.raises(TypeError, match=r"\ba\b.*int32"):
        ops.matmul(torch.ones(4, 4, dtype=torch.int32), torch.ones(4, 4))
    with pytest.raises(TypeError, match=r"\bw\b has dtype torch.float16 but x"):
        ops.conv2d_fprop(torch.randn(1, 4, 4, 3), torch.randn(2, 3, 3, 3, dtype=torch.float16))


def test_wrong_device_names_the_argument():
    with pytest.raises(ValueError, match=r"\bb\b is on meta"):
        ops.matmul(torch.randn(4, 4), torch.randn(4, 4, device="meta"))


def test_wrong_layout_names_the_argument():
    x = torch.randn(1, 3, 6, 6).permute(0, 2, 3, 1)  # NHWC view, not contiguous
    with pytest.raises(ValueError, match=r"\bx\b must be a contiguous NHWC"):
        ops.conv2d_fprop(x, torch.randn(2, 3, 3, 3))
    a = torch.randn(8, 8)[::2]  # strided rows
    with pytest.raises(ValueError, match=r"\ba\b must be row-major"):
        ops.matmul(a, torch.randn(8, 3))


def test_mismatched_shapes_name_the_arguments():
    with pytest.raises(ValueError, match=r"a.shape\[1\] must equal b.shape\[0\]"):
        ops.matmul(torch.randn(3, 4), torch.randn(5, 3))
    with pytest.raises(ValueError, match=r"w has 4 input channels .* x has 3"):
        ops.conv2d_fprop(torch.randn(1, 5, 5, 3), torch.randn(2, 3, 3, 4))
    with pytest.raises(ValueError, match=r"grad_out is 5x5 .*gives 3x3"):
        ops.conv2d_wgrad(torch.randn(1, 5, 5, 3), torch.randn(1, 5, 5, 2), 3, 3)
    with pytest.raises(ValueError, match=r"\bx\b must be 4-D"):
        ops.conv2d_fprop(torch.randn(5, 5, 3), torch.randn(2, 3, 3, 3))
    with pytest.raises(ValueError, match=r"w has 4 output channels \(w.shape\[0\]\) but grad_out has 2"):
        ops.conv2d_dgrad(torch.randn(1, 3, 3, 2), torch.randn(4, 3, 3, 5), 5, 5)
    with pytest.raises(ValueError, match=r"grad_out is 5x5 .*H=5, W=5 gives 3x3.*forward call's H, W"):
        ops.conv2d_dgrad(torch.randn(1, 5, 5, 2), torch.randn(2, 3, 3, 4), 5, 5)
    with pytest.raises(ValueError, match=r"H \(the input's height\) must be positive"):
        ops.conv2d_dgrad(torch.randn(1, 3, 3, 2), torch.randn(2, 3, 3, 4), 0, 5)


def test_stride_and_padding_are_checked():
    x, w = torch.randn(1, 5, 5, 3), torch.randn(2, 3, 3, 3)
    with pytest.raises(ValueError, match="stride must be positive"):
        ops.conv2d_fprop(x, w, stride=0)
    with pytest.raises(ValueError, match="stride must be positive"):
        ops.conv2d_fprop(x, w, stride=(1, -1))
    with pytest.raises(ValueError, match="padding must be non-negative"):
        ops.conv2d_fprop(x, w, padding=-1)
    with pytest.raises(TypeError, match="stride must be an int or a pair"):
        ops.conv2d_fprop(x, w, stride=1.5)
    with pytest.raises(ValueError, match=r"\bR\b \(filter size\) must be positive"):
        ops.conv2d_wgrad(x, torch.randn(1, 3, 3, 2), 0, 3)


def test_empty_output_geometry():
    with pytest.raises(ValueError, match="empty output"):
        ops.conv2d_fprop(torch.randn(1, 2, 2, 3), torch.randn(2, 5, 5, 3))


def test_unopenable_store_url_is_named(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError, match="store directory"):
        Store(f"sqlite:///{blocker}/sub/store.sqlite")
    with pytest.raises(StoreError, match="not a valid SQLAlchemy URL"):
        Store("not a url")
    with pytest.raises(StoreError, match="cannot open the store"):
        Store("postgresql+psycopg://nobody@127.0.0.1:1/none")


def _tuned_then_edited(monkeypatch, sql: str, *params):
    """A matmul tuned into the store, then its row edited by `sql` (`params`, then the key's
    digest): the store, the key and the call's inputs."""
    from tunecache.store import default_store

    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "tune")
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    ops.matmul(a, b)
    (entry,) = ops.OP_LAUNCHERS["matmul"].memo.values()
    store = default_store()
    with store.engine.begin() as conn:
        conn.exec_driver_sql(sql, (*params, entry.key.digest))
    return store, entry.key, (a, b)


def _refused_with_a_warning(monkeypatch, caplog, inputs, logger: str, warning: str) -> None:
    """A fresh process's strict call finds no config it may launch, and the log says why."""
    ops.clear_memo()
    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "strict")
    with caplog.at_level(logging.WARNING, logger=logger):
        with pytest.raises(LookupError, match="no tuned config"):
            ops.matmul(*inputs)
    assert warning in caplog.text


def test_corrupt_row_is_skipped_with_a_warning(db_url, monkeypatch, caplog):
    _, _, inputs = _tuned_then_edited(monkeypatch, "UPDATE tuned_configs SET config = '{not json' WHERE digest = ?")
    _refused_with_a_warning(monkeypatch, caplog, inputs, "tunecache.store", "corrupt")


def test_config_outside_the_space_is_never_launched(db_url, monkeypatch, caplog):
    outside = '{"BLOCK_M": 7, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}'
    _, _, inputs = _tuned_then_edited(monkeypatch, "UPDATE tuned_configs SET config = ? WHERE digest = ?", outside)
    _refused_with_a_warning(monkeypatch, caplog, inputs, "tunecache", "outside the space")


def test_foreign_row_under_another_digest_is_skipped(db_url, monkeypatch, caplog):
    # a row whose fields no longer hash to its digest (edited by hand or by a foreign tool)
    store, key, _ = _tuned_then_edited(monkeypatch, "UPDATE tuned_configs SET sm_count = 999 WHERE digest = ?")
    with caplog.at_level(logging.WARNING, logger="tunecache.store"):
        assert store.get_config(key.digest) is None
    assert "hash to" in caplog.text
