"""A host that never tuned never compiles: a fleet winner brings its compiled kernels.

The "tuning host" compiles a Hopper matmul config for sm_90a here on the CPU (Triton needs no
GPU to compile) into its own Triton cache, publishes the winner with a worker token and sends
the kernels; the service checks each against the key; a fresh host with an empty Triton cache
gets them by `tunecache sync` or by its first lookup, and Triton then finds the kernel in its
cache instead of compiling it. What only a GPU shows (the launch itself, and the time of a
first call) is in tests/gpu and benchmarks/bench_coldstart.py.
"""

from __future__ import annotations

import base64
import json
import os

import httpx
import pytest

from support import ROOT
from support.fleet import host_env, run_host
from tunecache.key import TuneKey

pytestmark = pytest.mark.timeout(600)

PROBLEM = {"M": 1024, "N": 1024, "K": 1024, "dtype": "bfloat16"}

# the tuning host: compile the backend's default config for sm_90a into its Triton cache
TUNING_HOST = """
import json
from tunecache.tuning import binaries
from tunecache import backends
from tunecache.tuning.compile import canonical_problem, compile_spec, device_for
from tunecache.key import triton_version
mod = backends.backend_module("matmul", "hopper")
device = device_for("sm_90a")
problem = canonical_problem("matmul", %r)
config = mod.default_config(problem, device)
entries = {}
for spec in mod.compile_specs(problem, config, device):
    k = compile_spec(spec, "sm_90a")
    entries[k.hash] = {n: p for n, p in k.metadata_group.items() if n.endswith(binaries.SUFFIXES)}
print(json.dumps({
    "problem": problem, "config": config, "kernel_version": backends.kernel_version(mod),
    "triton_version": triton_version(), "entries": entries,
}))
"""

# a host: does Triton compile the same spec, or find it in this host's cache?
COMPILES_AGAIN = """
import json
from triton import knobs
from tunecache import backends
from tunecache.tuning.compile import compile_spec, device_for
hits = []
knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
mod = backends.backend_module("matmul", "hopper")
problem, config = %r, %r
for spec in mod.compile_specs(problem, config, device_for("sm_90a")):
    compile_spec(spec, "sm_90a")
print(json.dumps({"cache_hits": hits}))
"""


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """What the tuning host compiled: problem, config, versions, and its kernels' files."""
    d = tmp_path_factory.mktemp("tuning-host")
    env = host_env(d, "tuner", None, None, TRITON_CACHE_DIR=str(d / "triton"))
    env.pop("TRITON_INTERPRET")
    out = run_host(TUNING_HOST % (PROBLEM,), env, timeout=600)
    assert out["entries"], "the compile produced no cache entry"
    out["files"] = {
        h: {name: open(path, "rb").read() for name, path in paths.items()} for h, paths in out["entries"].items()
    }
    return out


def key_body(tuned, **over) -> dict:
    body = {
        "kernel": "matmul.hopper",
        "kernel_version": tuned["kernel_version"],
        "triton_version": tuned["triton_version"],
        "arch": "sm_90",
        "sm_count": 132,
        "problem": tuned["problem"],
    }
    body.update(over)
    return body


def binaries_body(tuned, config=None, edit=None) -> dict:
    out = []
    for h, files in tuned["files"].items():
        files = dict(files)
        if edit:
            h, files = edit(h, files)
        out.append({"triton_hash": h, "files": {n: base64.b64encode(b).decode() for n, b in files.items()}})
    return {"config": config or tuned["config"], "binaries": out}


def api(fleet, scope):
    return httpx.Client(base_url=fleet.url, headers={"Authorization": f"Bearer {fleet.tokens[scope]}"}, timeout=30)


def publish_winner(fleet, tuned) -> str:
    body = {**key_body(tuned), "config": tuned["config"], "median_ms": 0.05, "source": "worker"}
    with api(fleet, "worker") as w:
        r = w.post("/v1/configs", json=body)
        assert r.status_code == 200 and r.json()["accepted"], r.text
    return TuneKey.from_fields(key_body(tuned)).digest


def test_only_a_tuning_host_may_publish_a_winners_kernels_and_each_is_checked(clean_fleet, tuned):
    digest = publish_winner(clean_fleet, tuned)
    url = f"/v1/configs/{digest}/binaries"
    with api(clean_fleet, "publish") as p, api(clean_fleet, "worker") as w, api(clean_fleet, "read") as r:
        assert p.put(url, json=binaries_body(tuned)).status_code == 403, "a publish token cannot send code"
        other = dict(tuned["config"], num_warps=8 if tuned["config"].get("num_warps") != 8 else 4)
        assert w.put(url, json=binaries_body(tuned, config=other)).status_code == 409, "kernels of another config"

        def forged_hash(h, files):
            return "0" * 64, files

        def wrong_name(h, files):
            return h, {f"../{n}": b for n, b in files.items()}

        def other_gpu(h, files):
            meta_name = next(n for n in files if n.endswith(".json"))
            meta = json.loads(files[meta_name])
            meta["target"]["arch"] = 100
            return h, {**files, meta_name: json.dumps(meta).encode()}

        for edit, words in ((forged_hash, "hash"), (wrong_name, "kernel name"), (other_gpu, "built for")):
            bad = w.put(url, json=binaries_body(tuned, edit=edit))
            assert bad.status_code == 422 and words in bad.json()["detail"], (edit.__name__, bad.text)
        assert r.get(url).json()["binaries"] == [], "nothing refused was kept"

        stored = w.put(url, json=binaries_body(tuned))
        assert stored.status_code == 200 and stored.json() == {"stored": len(tuned["files"])}
        got = r.get(url).json()
        assert got["config"] == tuned["config"]
        assert {b["triton_hash"]: {n: base64.b64decode(x) for n, x in b["files"].items()} for b in got["binaries"]} == (
            tuned["files"]
        )

        # the winner replaced by another config: its kernels are no longer served
        faster = {**key_body(tuned), "config": other, "median_ms": 0.01, "source": "worker"}
        assert w.post("/v1/configs", json=faster).json()["accepted"]
        assert r.get(url).json() == {"digest": digest, "config": other, "binaries": []}
    # and `db prune` removes what no winner uses any more
    from tunecache.store import Store

    store = Store(clean_fleet.db_url)
    try:
        assert store.prune(365 * 86400.0)["binaries"] == len(tuned["files"])
        assert store.prune(365 * 86400.0)["binaries"] == 0
    finally:
        store.close()


def test_a_fresh_host_syncs_the_fleet_and_compiles_nothing(clean_fleet, tuned, tmp_path):
    digest = publish_winner(clean_fleet, tuned)
    with api(clean_fleet, "worker") as w:
        assert w.put(f"/v1/configs/{digest}/binaries", json=binaries_body(tuned)).status_code == 200
    cache = tmp_path / "fresh-triton"
    env = host_env(
        tmp_path,
        "fresh",
        clean_fleet.url,
        clean_fleet.tokens["read"],
        TRITON_CACHE_DIR=str(cache),
        TUNECACHE_DEVICE="sm_90:132",
        COLUMNS="200",
    )
    env.pop("TRITON_INTERPRET")
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "tunecache.cli", "sync"], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "synced 1 winner(s) of sm_90:132" in proc.stdout and "1 new or changed" in proc.stdout, proc.stdout
    assert f"{len(tuned['files'])} compiled kernel(s) installed" in proc.stdout, proc.stdout
    from tunecache.tuning.binaries import entry_dir

    for h in tuned["files"]:
        assert sorted(os.listdir(cache / entry_dir(h))) == sorted(
            [*tuned["files"][h], f"__grp__{_meta(tuned['files'][h])}"]
        )
    # the host's store holds the winner as a fleet copy
    from support.fleet import local_counts

    assert local_counts(env)["tuned_configs"] == 1
    hits = run_host(COMPILES_AGAIN % (tuned["problem"], tuned["config"]), env)["cache_hits"]
    assert hits and all(hits), f"Triton compiled again: {hits}"
    # a second sync changes nothing and says so
    again = subprocess.run(
        [sys.executable, "-m", "tunecache.cli", "sync"], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert "0 new or changed, 1 unchanged" in again.stdout and "0 compiled kernel(s) installed" in again.stdout, (
        again.stdout
    )


def test_a_fresh_hosts_first_lookup_brings_the_kernels_and_a_host_may_refuse_them(clean_fleet, tuned, tmp_path):
    from tunecache.tuning.binaries import entry_dir

    digest = publish_winner(clean_fleet, tuned)
    with api(clean_fleet, "worker") as w:
        assert w.put(f"/v1/configs/{digest}/binaries", json=binaries_body(tuned)).status_code == 200
    lookup = f"""
import json
from tunecache.cache.config_cache import CACHE
from tunecache.key import TuneKey
key = TuneKey.from_fields({key_body(tuned)!r})
rec = CACHE.get(key, lambda config: None)
print(json.dumps({{"config": rec and rec.config}}))
"""
    for refuse in (False, True):
        cache = tmp_path / f"triton-{refuse}"
        extra = {"TUNECACHE_FLEET_BINARIES": "0"} if refuse else {}
        env = host_env(
            tmp_path,
            f"host-{refuse}",
            clean_fleet.url,
            clean_fleet.tokens["read"],
            TRITON_CACHE_DIR=str(cache),
            **extra,
        )
        env.pop("TRITON_INTERPRET")
        assert run_host(lookup, env)["config"] == tuned["config"]
        installed = sorted(os.listdir(cache)) if cache.exists() else []
        assert installed == ([] if refuse else sorted(entry_dir(h) for h in tuned["files"])), installed


def _meta(files: dict) -> str:
    return next(n for n in files if n.endswith(".json"))


def test_a_token_syncs_a_few_times_a_minute_from_one_address(clean_fleet):
    """A sync answers up to 64 MiB: it is for a job's start, not a loop (429 with Retry-After)."""
    from tunecache.store import Store

    store = Store(clean_fleet.db_url)
    secret, _ = store.create_token(f"sync-limit-{os.getpid()}", ["read"])
    store.close()
    body = {"arch": "sm_90", "sm_count": 132, "triton_version": "3.9.0"}
    with httpx.Client(base_url=clean_fleet.url, headers={"Authorization": f"Bearer {secret}"}, timeout=30) as c:
        codes = [c.post("/v1/sync", json=body).status_code for _ in range(7)]
        assert codes == [200] * 6 + [429], codes
        refused = c.post("/v1/sync", json=body)
        assert int(refused.headers["Retry-After"]) >= 1 and "sync" in refused.json()["detail"]
        assert c.get("/v1/generation").status_code == 200, "other reads go on"


def test_purging_a_token_removes_the_kernels_it_uploaded(clean_fleet, tuned):
    digest = publish_winner(clean_fleet, tuned)
    with api(clean_fleet, "worker") as w, api(clean_fleet, "admin") as admin:
        assert w.put(f"/v1/configs/{digest}/binaries", json=binaries_body(tuned)).status_code == 200
        report = admin.post("/v1/admin/purge", json={"token_name": "test-worker"}).json()
        assert [r["digest"] for r in report["removed"]] == [digest]
    from sqlalchemy import create_engine, text

    engine = create_engine(clean_fleet.db_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM kernel_binaries")).scalar() == 0
    engine.dispose()
