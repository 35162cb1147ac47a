"""`tunecache.autotune` and `patch_triton()` on the CPU interpreter.

Each check that tuning persists runs the kernel in two fresh processes (TRITON_INTERPRET=1)
against one temporary SQLite store: the first benchmarks and stores, the second must not
benchmark and must launch the same config. The kernels live in support/kernels/
(autotune_kernels.py and autotune_plain.py: jit needs a real file).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

from support import KERNELS, ROOT


def run_child(code: str, db_url: str) -> tuple[dict, str]:
    """Run `code` in a fresh process on the CPU interpreter (on a GPU host too): its last
    stdout line is JSON. `db_url` is conftest's fresh store for this test."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TUNECACHE_SERVER_URL", "TUNECACHE_DEVICE", "TRITON_CACHE_AUTOTUNING")
    }
    env.update(
        TRITON_INTERPRET="1",
        TUNECACHE_DB_URL=db_url,
        PYTHONPATH=os.pathsep.join([str(KERNELS), str(ROOT), env.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def open_store(db_url: str):
    from tunecache.store import Store

    return Store(db_url)


MATMUL = """
    import hashlib, json, torch
    import autotune_kernels as k

    torch.manual_seed(0)
    a, b = torch.randn(48, 40), torch.randn(40, 48)
    c = k.matmul(a, b)
    best = k.matmul_kernel.best_config
    print(json.dumps({
        "bench_calls": len(k.BENCH_CALLS),
        "best": k.MATMUL_CONFIGS.index(best),
        "best_is_live": any(best is cfg for cfg in k.MATMUL_CONFIGS),
        "timed": len(k.matmul_kernel.configs_timings),
        "err": (c - a @ b).abs().max().item(),
        "sha": hashlib.sha256(c.numpy().tobytes()).hexdigest(),
        "sqlalchemy": "sqlalchemy" in __import__("sys").modules,
    }))
"""


def test_matmul_is_tuned_once_and_served_from_the_store_to_the_next_process(db_url):
    first, _ = run_child(MATMUL, db_url)
    assert first["bench_calls"] == 3  # every config benchmarked
    assert first["best"] == 2  # counting_bench makes the last candidate win
    assert first["err"] < 1e-4

    store = open_store(db_url)
    (rec,) = store.list_configs()
    assert rec.key.kernel == "triton:tutorial_matmul.matmul_kernel"
    assert (rec.key.arch, rec.key.sm_count) == ("cpu", 0)
    assert rec.key.problem == {
        "M": 48,
        "N": 48,
        "K": 40,
        "a_ptr.dtype": "torch.float32",
        "b_ptr.dtype": "torch.float32",
        "c_ptr.dtype": "torch.float32",
    }
    assert rec.config == {
        "kwargs": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1},
        "num_warps": 2,
        "num_stages": 3,
        "num_ctas": 1,
        "maxnreg": None,
    }
    assert rec.candidates == 3
    from tunecache_kernels.spaces import space_for

    space_for(rec.key.kernel).check(rec.config)  # the shape the fleet service validates
    trials_after_first = store.counts()["trials"]
    assert trials_after_first == 3

    second, _ = run_child(MATMUL, db_url)
    assert second["bench_calls"] == 0
    assert second["best"] == first["best"] and second["best_is_live"]
    assert second["sha"] == first["sha"]  # the same result, bit for bit
    assert second["timed"] == 3  # configs_timings comes back from the stored trials
    assert second["sqlalchemy"] is False  # a warm host's first call reads without the database layer
    counts = store.counts()
    assert (counts["tuned_configs"], counts["trials"]) == (1, trials_after_first)  # nothing new benchmarked


def test_dtypes_and_key_values_are_part_of_the_key(db_url):
    out, _ = run_child(
        """
        import json, torch
        import autotune_kernels as k

        calls = []
        for M, dtype in ((48, torch.float32), (48, torch.float16), (32, torch.float32), (48, torch.float32)):
            a, b = torch.randn(M, 40).to(dtype), torch.randn(40, 48).to(dtype)
            c = k.matmul(a, b)
            assert c.dtype == dtype and (c.float() - a.float() @ b.float()).abs().max().item() < 0.1
            calls.append(len(k.BENCH_CALLS))
        print(json.dumps({"calls": calls}))
    """,
        db_url,
    )
    assert out["calls"] == [3, 6, 9, 9]  # a new dtype or M tunes again; a repeat hits the memo
    problems = sorted((r.key.problem["M"], r.key.problem["a_ptr.dtype"]) for r in open_store(db_url).list_configs())
    assert problems == [(32, "torch.float32"), (48, "torch.float16"), (48, "torch.float32")]


SCALE = """
    import json, torch
    import autotune_kernels as k

    torch.manual_seed(0)
    x = torch.randn(40, 24)
    y = k.scale(x)
    best = k.scale_kernel.best_config
    print(json.dumps({
        "bench_calls": len(k.BENCH_CALLS),
        "hooks": k.HOOK_CALLS,
        "best": k.SCALE_CONFIGS.index(best),
        "hook_kept": best.pre_hook is k.set_block_shape,
        "err": (y - 2 * x).abs().max().item(),
    }))
"""


def test_configs_with_a_pre_hook_are_cached_and_reloaded_with_their_hook(db_url):
    # Triton's own disk cache gives up on configs with a pre_hook; the store keeps them.
    first, _ = run_child(SCALE, db_url)
    assert first["bench_calls"] == 3 and first["best"] == 2 and first["err"] == 0
    assert first["hooks"] == [[16, 8], [32, 8], [16, 16], [16, 16]]  # three benchmarks, one launch

    second, _ = run_child(SCALE, db_url)
    assert second["bench_calls"] == 0
    assert second["best"] == 2 and second["hook_kept"]
    # the hook set the descriptor's block shape: without it the kernel cannot load a tile
    assert second["hooks"] == [[16, 16]]
    assert second["err"] == 0


def test_a_stored_config_matching_no_live_config_is_never_launched(db_url):
    from tunecache.store.records import ConfigRecord

    run_child(SCALE, db_url)
    store = open_store(db_url)
    (rec,) = store.list_configs()
    foreign = {"kwargs": {"BLOCK_M": 64, "BLOCK_N": 8}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
    _, won = store.put_config(ConfigRecord(key=rec.key, config=foreign, median_ms=rec.median_ms / 10))
    assert won

    out, stderr = run_child(SCALE, db_url)
    assert "matches none of the kernel's configs" in stderr
    assert out["bench_calls"] == 3  # benchmarked instead
    assert [64, 8] not in out["hooks"]
    assert out["err"] == 0


FLEET = """
    import json, torch
    from tunecache.store.records import ConfigRecord
    import autotune_kernels as k

    class FakeFleet:  # what tunecache.fleet.client's FleetClient answers
        published, asked = [], []

        generation = 1

        def fetch(self, key):
            self.asked.append(key.kernel)
            if key.problem["M"] != 40:
                return "miss", None
            values = {"kwargs": {"BLOCK_M": 32, "BLOCK_N": 8}, "num_warps": 4, "num_stages": 3, "num_ctas": 1,
                      "maxnreg": None}
            return "hit", ConfigRecord(key=key, config=values, median_ms=1.0, source="worker")

        def announce(self, key, holder, seconds=60.0):
            return None  # as a service older than announcements answers: the host tunes alone

        def publish(self, rec, trials=(), tune_seconds=None):
            from tunecache.fleet.protocol import Published

            self.published.append([rec.key.problem["M"], rec.config["kwargs"], len(list(trials))])
            return Published("recorded")

    from tunecache.cache.config_cache import CACHE
    CACHE.fleet = FakeFleet
    x, z = torch.randn(40, 24), torch.randn(24, 24)
    y, w = k.scale(x), k.scale(z)
    print(json.dumps({
        "bench_calls": len(k.BENCH_CALLS), "asked": len(FakeFleet.asked), "published": FakeFleet.published,
        "ok": bool(torch.equal(y, 2 * x) and torch.equal(w, 2 * z)),
    }))
"""


def test_fleet_winner_is_used_and_kept_and_a_local_tuning_is_published(db_url):
    out, _ = run_child(FLEET, db_url)
    assert out["ok"] and out["asked"] == 2
    # M=40: the fleet's winner, no benchmark; M=24: the fleet has none, tuned here and published
    assert out["bench_calls"] == 3
    assert out["published"] == [[24, {"BLOCK_M": 16, "BLOCK_N": 16}, 3]]
    by_m = {r.key.problem["M"]: r for r in open_store(db_url).list_configs()}
    assert by_m[40].source == "fleet" and by_m[40].config["kwargs"] == {"BLOCK_M": 32, "BLOCK_N": 8}
    assert by_m[24].source == "inline"


PLAIN = """
    import json, torch
    import tunecache

    tunecache.patch_triton()
    import autotune_plain as p  # unmodified: it uses @triton.autotune
    from tunecache.dropin.autotuner import Autotuner

    bench_calls = []  # count the benchmarks, around the wall-clock do_bench the interpreter gets
    timer = p.add_one_kernel.do_bench
    p.add_one_kernel.do_bench = lambda fn, quantiles: bench_calls.append(1) or timer(fn, quantiles=quantiles)

    x = torch.arange(200, dtype=torch.float32)
    y = p.add_one(x)
    print(json.dumps({
        "ours": isinstance(p.add_one_kernel, Autotuner),
        "bench_calls": len(bench_calls),
        "ok": bool(torch.equal(y, x + 1)),
        "best": p.add_one_kernel.best_config.kwargs,
    }))
"""


def test_patch_triton_makes_an_unmodified_module_persist_its_tuning(db_url):
    # No do_bench in that module: under the interpreter candidates are timed by the wall clock
    # (triton.autotune itself fails there, finding no GPU driver to benchmark with).
    first, _ = run_child(PLAIN, db_url)
    assert first["ours"] and first["ok"]
    assert first["bench_calls"] == 2
    store = open_store(db_url)
    (rec,) = store.list_configs()
    assert rec.key.kernel == "triton:autotune_plain.add_one_kernel"
    assert store.counts()["trials"] == 2

    second, _ = run_child(PLAIN, db_url)
    assert second["ok"] and second["bench_calls"] == 0  # served by the store
    assert second["best"] == first["best"] == rec.config["kwargs"]
    assert store.counts()["trials"] == 2


def _load_fresh(path: Path):
    """Execute a module file under a new name, as a library imported after (or before) a patch."""
    spec = importlib.util.spec_from_file_location(f"plain_{uuid.uuid4().hex}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_patch_triton_is_idempotent_reversible_and_covers_every_import_path():
    import triton
    import triton.runtime
    import triton.runtime.autotuner as triton_autotuner

    import tunecache
    from tunecache.dropin.autotuner import Autotuner

    original = triton.autotune
    assert original is triton_autotuner.autotune is triton.runtime.autotune
    assert type(_load_fresh(KERNELS / "autotune_plain.py").add_one_kernel) is triton_autotuner.Autotuner
    try:
        tunecache.patch_triton()
        tunecache.patch_triton()
        assert triton.autotune is triton.runtime.autotune is triton_autotuner.autotune is tunecache.autotune
        from triton import autotune

        assert autotune is tunecache.autotune
        assert isinstance(_load_fresh(KERNELS / "autotune_plain.py").add_one_kernel, Autotuner)
    finally:
        tunecache.unpatch_triton()
    assert triton.autotune is triton.runtime.autotune is triton_autotuner.autotune is original
    assert type(_load_fresh(KERNELS / "autotune_plain.py").add_one_kernel) is triton_autotuner.Autotuner


def test_signature_is_triton_autotune_s():
    import triton.runtime.autotuner as triton_autotuner

    import tunecache

    assert inspect.signature(tunecache.autotune) == inspect.signature(triton_autotuner.autotune)


def test_kernel_version_follows_the_configs():
    import triton

    import tunecache

    jit_fn = _load_fresh(KERNELS / "autotune_plain.py").add_one_kernel.fn
    configs = lambda *blocks: [triton.Config({"BLOCK": b}) for b in blocks]  # noqa: E731
    a = tunecache.autotune(configs(16, 64), key=["n"])(jit_fn)
    b = tunecache.autotune(configs(16, 64), key=["n"])(jit_fn)
    c = tunecache.autotune(configs(16, 128), key=["n"])(jit_fn)
    assert a.kernel_version == b.kernel_version != c.kernel_version
    assert a.kernel_name.startswith("triton:plain_") and a.kernel_name.endswith(".add_one_kernel")
    assert a.cache_results  # accepted, and always on


def test_importing_the_decorator_module_is_light_and_keeps_the_decorator():
    code = """
        import sys
        from tunecache.dropin import patch_triton
        import tunecache
        heavy = [m for m in ("torch", "triton", "sqlalchemy") if m in sys.modules]
        print(heavy, tunecache.autotune.__name__, callable(tunecache.autotune))
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "autotune", "True"]
