"""`tunecache pretune`: the shipped manifests parse into the problems a library call computes;
a finished run's rerun does nothing; an interrupted run (kill -9 or Ctrl-C) resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import defaultdict

import httpx
import pytest

from support import ROOT
from support.fleet import host_env, wait_for


def test_shipped_manifests_parse():
    from tunecache.fleet.pretune import load_manifest

    resnet = load_manifest("resnet50")
    assert len(resnet.shapes) == 46 and {s.op for s in resnet.shapes} == {"conv2d_fprop", "conv2d_wgrad"}
    conv1 = resnet.shapes[0].problem
    assert (conv1["P"], conv1["Q"], conv1["gemm_K"], conv1["dtype"]) == (112, 112, 7 * 7 * 3, "bfloat16")
    last = [s for s in resnet.shapes if s.name == "s4_3x3" and s.op == "conv2d_wgrad"][0].problem
    assert (last["gemm_M"], last["gemm_N"], last["gemm_K"]) == (512, 3 * 3 * 512, 32 * 7 * 7)
    llama = load_manifest("llama_layer")
    assert len(llama.shapes) == 12 and {s.op for s in llama.shapes} == {"matmul"}
    fwd = [s for s in llama.shapes if s.name == "qkv_fwd"][0].problem
    assert fwd == {"M": 8192, "N": 6144, "K": 4096, "dtype": "bfloat16", "a_layout": "row", "b_layout": "col"}
    assert len(load_manifest("tiny_cpu").shapes) == 9


def test_pretune_enqueues_the_longest_tunes_first():
    """So that two GPUs run out of work together: on an H100 the resnet50 manifest's wgrad
    shapes with the largest spaces go first, the small matmul and fprop spaces last."""
    from tunecache.backends import module_for_kernel
    from tunecache.fleet.pretune import load_manifest, longest_first, plan
    from tunecache.key import DeviceClass

    h100 = DeviceClass("sm_90", 132, "NVIDIA H100 80GB HBM3")
    planned = plan(load_manifest("resnet50"), h100)

    def space(p):
        mod = module_for_kernel(p.kernel)
        return len(mod.prune(mod.config_space(p.shape.problem, h100), p.shape.problem, h100))

    ordered = longest_first(planned, h100)
    sizes = [space(p) for p in ordered]
    assert sizes == sorted(sizes, reverse=True) and len(sizes) == len(planned)
    assert ordered[0].kernel == "conv2d_wgrad.hopper" and sizes[0] > 4 * sizes[-1], (ordered[0].kernel, sizes)
    assert [p.key.digest for p in ordered] != [p.key.digest for p in planned]


def test_bad_manifest_names_the_problem(tmp_path):
    from tunecache.fleet.pretune import ManifestError, load_manifest

    bad = tmp_path / "bad.toml"
    bad.write_text('[[shape]]\nname = "x"\nop = "matmul"\ndtype = "float16"\nM = 8\nN = 8\n')
    with pytest.raises(ManifestError, match=r"bad.toml: shape x \(matmul\): .*missing K"):
        load_manifest(bad)
    bad.write_text('[[shape]]\nop = "fft"\n')
    with pytest.raises(ManifestError, match="unknown op 'fft'"):
        load_manifest(bad)
    with pytest.raises(ManifestError, match="no manifest 'nope'.*resnet50"):
        load_manifest("nope")


def _pretune(env, *args, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tunecache.cli", "pretune", "tiny_cpu", "--lease-s", "2", "--poll-s", "0.2", *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kw,
    )


def _state(store, digests):
    """(digests with a config, {digest: distinct tuning runs})."""
    runs = defaultdict(set)
    from sqlalchemy import select

    from tunecache.store import TrialRow

    with store._read() as s:
        for digest, run_id in s.execute(select(TrialRow.digest, TrialRow.run_id)):
            runs[digest].add(run_id)
    tuned = {d for d in digests if store.get_config(d) is not None}
    return tuned, {d: len(r) for d, r in runs.items()}


@pytest.mark.parametrize("interrupt", ["kill -9", "ctrl-c"])
def test_rerun_does_nothing_and_an_interrupted_run_resumes(tmp_path, interrupt):
    from tunecache.fleet.pretune import load_manifest, plan
    from tunecache.key import interpreter_device
    from tunecache.store import Store

    env = host_env(tmp_path, "pretune", None, None)
    store = Store(env["TUNECACHE_DB_URL"])
    digests = [p.key.digest for p in plan(load_manifest("tiny_cpu"), interpreter_device(), "portable")]
    assert len(set(digests)) == 9

    # 1. start, and interrupt it once some but not all shapes are tuned
    first = _pretune(env)
    wait_for(lambda: len(_state(store, digests)[0]) >= 2, 180, 0.02, "the first shapes to be tuned")
    if interrupt == "kill -9":
        os.killpg(first.pid, signal.SIGKILL)  # pretune and its worker, as a crash or an OOM kill would
        first.wait(30)
    else:
        os.killpg(first.pid, signal.SIGINT)  # what a terminal sends on Ctrl-C
        _, errs = first.communicate(timeout=60)
        assert first.returncode == 130, errs[-3000:]
        assert "run it again to resume" in errs
        # the worker handed its job back: nothing waits for a lease to run out
        assert not [j for j in store.list_jobs(status="running")], store.list_jobs(status="running")
    done_before, _ = _state(store, digests)
    assert 1 <= len(done_before) < 9, f"interrupt landed too late to test resuming ({len(done_before)} done)"

    # 2. rerun: it tunes only what is left
    second = _pretune(env)
    out, errs = second.communicate(timeout=300)
    assert second.returncode == 0, errs[-3000:]
    done, runs = _state(store, digests)
    assert done == set(digests)
    assert f"{len(done_before)} already tuned, {9 - len(done_before)} tuned now, 0 failed" in out, out
    assert all(runs.get(d) == 1 for d in digests), f"a shape was tuned twice: {runs}"
    assert {j.status for j in store.list_jobs()} <= {"done", "running"}

    # 3. rerun of a finished manifest: nothing to do, no worker, no tuning
    t0 = time.monotonic()
    third = _pretune(env)
    out, errs = third.communicate(timeout=120)
    assert third.returncode == 0, errs[-3000:]
    assert "9 already tuned, 0 tuned now" in out, out
    assert _state(store, digests) == (done, runs)
    assert time.monotonic() - t0 < 60
    store.close()


def test_pretune_through_the_fleet(clean_fleet, tmp_path):
    fleet = clean_fleet
    env = host_env(tmp_path, "gpuhost", fleet.url, fleet.tokens["worker"])
    first = _pretune(env)
    out, errs = first.communicate(timeout=300)
    assert first.returncode == 0, errs[-3000:]
    assert "0 already tuned, 9 tuned now, 0 failed" in out, out
    with httpx.Client(base_url=fleet.url, headers={"Authorization": f"Bearer {fleet.tokens['read']}"}) as api:
        configs = api.get("/v1/configs").json()
        jobs = api.get("/v1/jobs").json()
        assert len(configs) == 9 and {c["source"] for c in configs} == {"pretune"}
        assert len(jobs) == 9 and {j["status"] for j in jobs} == {"done"}
        assert all(len(api.get(f"/v1/configs/{c['digest']}/submissions").json()) == 1 for c in configs)
    # another host with an empty local store: the fleet already has everything
    rerun = _pretune(host_env(tmp_path, "otherhost", fleet.url, fleet.tokens["worker"]))
    out, errs = rerun.communicate(timeout=120)
    assert rerun.returncode == 0 and "9 already tuned, 0 tuned now" in out, out + errs[-2000:]


def test_workers_side_by_side_split_the_cores_for_compiling(monkeypatch):
    """pretune on N GPUs runs N workers on one host: each starts compile processes for its
    share of the cores, not one per core each (a user's TUNECACHE_COMPILE_WORKERS stands)."""
    from tunecache.fleet.pretune import worker_env

    monkeypatch.delenv("TUNECACHE_COMPILE_WORKERS", raising=False)
    monkeypatch.setattr("tunecache.tuning.compile_pool.default_workers", lambda: 16)
    assert worker_env(2)["TUNECACHE_COMPILE_WORKERS"] == "8"
    assert worker_env(32)["TUNECACHE_COMPILE_WORKERS"] == "1"
    assert "TUNECACHE_COMPILE_WORKERS" not in worker_env(1)
    monkeypatch.setenv("TUNECACHE_COMPILE_WORKERS", "3")
    assert worker_env(2)["TUNECACHE_COMPILE_WORKERS"] == "3"
