"""The dashboard (issue 12, item 5) in headless Chromium (Debian's `chromium`), over a real
service on Postgres: behind a read token unless anonymous reads are on; per device class and
kernel, what tuning bought (the tuned config against the default config and against the vendor's
op) and each shape's tuning time as plots with a mark per shape; the queue with ages; the hit and
miss rates. The screenshot is written beside the test's own files (an example is kept in
benchmarks/results/dashboard-20261123.png)."""

from __future__ import annotations

import re
import struct
import subprocess
from datetime import date
from pathlib import Path

import httpx

from support.browser import chromium, needs_chromium
from support.fleet import Server

# the page refreshes itself every 10 s: the virtual-time budget stays under that
BUDGET_MS = 3000

H100 = ("sm_90", 132, "NVIDIA H100 80GB HBM3")
CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
# (op, shape, tuned ms, default ms, vendor ms, tuning seconds): None is "not measured"
MATMULS = [
    ("matmul", dict(M=4096, N=4096, K=4096, dtype="bfloat16"), 0.262, 0.491, 0.281, 48.0),
    ("matmul", dict(M=8192, N=1024, K=4096, dtype="bfloat16"), 0.121, 0.262, 0.118, 41.5),
    ("matmul", dict(M=1024, N=1024, K=1024, dtype="bfloat16"), 0.0142, 0.0305, 0.0161, 36.0),
    ("matmul", dict(M=16384, N=8192, K=1024, dtype="float16"), 0.487, 0.612, 0.455, 95.0),
    ("matmul", dict(M=512, N=4096, K=4096, dtype="float16"), 0.0455, None, None, None),
]
CONVS = [
    (
        "conv2d_fprop",
        dict(N=32, H=56, W=56, Ci=64, Co=64, R=3, S=3, padding=1, dtype="float16"),
        0.301,
        0.552,
        0.344,
        120.0,
    ),
    (
        "conv2d_fprop",
        dict(N=32, H=28, W=28, Ci=128, Co=128, R=3, S=3, padding=1, dtype="float16"),
        0.262,
        0.401,
        0.251,
        88.0,
    ),
    (
        "conv2d_fprop",
        dict(N=32, H=14, W=14, Ci=256, Co=256, R=3, S=3, padding=1, dtype="float16"),
        0.233,
        0.377,
        None,
        70.0,
    ),
]


def _key(op: str, shape: dict, kernel: str | None = None, arch: str = H100[0], sm_count: int = H100[1]):
    from tunecache.key import TuneKey
    from tunecache.shapes import canonical_problem

    return TuneKey(kernel or f"{op}.hopper", "v-dash", "3.9.0", arch, sm_count, canonical_problem(op, shape))


def _seed(db_url: str) -> dict:
    """Tuned configs on an H100 (their default and vendor times set where measured, their
    tuning time recorded as a worker's publish records it), and a job in each queue state."""
    from tunecache.store import ConfigRecord, Store, TrialRecord

    store = Store(db_url, migrate=False)
    seeded: dict = {"default": set(), "vendor": set(), "tune": set(), "all": set(), "shapes": []}
    for op, shape, ms, default_ms, vendor_ms, tune_s in MATMULS + CONVS:
        key = _key(op, shape)
        rec = ConfigRecord(
            key,
            dict(CONFIG),
            ms,
            tflops=None,
            candidates=48,
            device_name=H100[2],
            source="worker",
            default_ms=default_ms,
            vendor_ms=vendor_ms,
        )
        trials = [TrialRecord(dict(CONFIG), "ok", ms), TrialRecord(dict(CONFIG, num_stages=4), "ok", ms * 1.3)]
        if tune_s is None:
            store.put_config(rec, trials)
        else:
            store.publish(rec, trials, submitted_by="test-worker", tune_seconds=tune_s)
        kept = store.get_config(key.digest)
        assert kept is not None
        assert (kept.default_ms, kept.vendor_ms) == (default_ms, vendor_ms), (
            "the store must keep default_ms and vendor_ms (the columns of migration 0005)"
        )
        seeded["all"].add(key.digest)
        for name, v in (("default", default_ms), ("vendor", vendor_ms), ("tune", tune_s)):
            if v is not None:
                seeded[name].add(key.digest)
    # the queue: one queued, one running (leased to a named worker), one failed on its last attempt
    store.enqueue(_key("matmul", dict(M=2048, N=2048, K=2048, dtype="bfloat16")))
    store.enqueue(_key("matmul", dict(M=3072, N=3072, K=3072, dtype="bfloat16")), priority=5)
    assert store.claim_job("gpu-host-7:4242", "sm_90", 132, lease_s=300).priority == 5
    failing = _key("conv2d_fprop", dict(N=8, H=7, W=7, Ci=512, Co=512, R=3, S=3, padding=1, dtype="float16"))
    store.enqueue(failing, max_attempts=1)
    job = store.claim_job("gpu-host-2:77", "sm_90", 132, kernels=["conv2d_fprop.hopper"])
    assert job is not None and job.digest == failing.digest
    error = "Traceback (most recent call last):\n" + "  File x\n" * 60 + "RuntimeError: CUDA error: illegal <boom>"
    assert store.fail_job(job.id, job.lease_secret, error) == "failed"
    store.close()
    return seeded


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    proc = chromium(tmp_path / "profile", *args, budget_ms=BUDGET_MS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def _marks(dom: str, series: str) -> set[str]:
    return set(re.findall(rf'<g id="tcm-[0-9-]+" class="mark {series}" data-digest="([0-9a-f]{{64}})">', dom))


@needs_chromium
def test_the_dashboard_renders_its_plots_in_chromium(clean_fleet, tmp_path):
    seeded = _seed(clean_fleet.db_url)

    # behind a token: none gets the login form, a read token the page
    with httpx.Client(base_url=clean_fleet.url, timeout=30) as anon:
        page = anon.get("/")
        assert page.status_code == 401 and 'action="/login"' in page.text
        assert "What tuning bought" not in page.text and "matmul.hopper" not in page.text
    with httpx.Client(
        base_url=clean_fleet.url, timeout=60, headers={"Authorization": f"Bearer {clean_fleet.tokens['read']}"}
    ) as reader:
        page = reader.get("/")
        assert page.status_code == 200 and "What tuning bought" in page.text
        assert page.headers["x-frame-options"] == "DENY" and page.headers["cache-control"] == "no-store"
        assert _marks(page.text, "speedup-default") == seeded["default"]

    # anonymous reads on: Chromium opens the page as is (a second service over the same database)
    server = Server(clean_fleet.db_url, tmp_path / "anon.log", anonymous_read=True).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as api:  # 3 hits and a miss, in that process
            for digest in sorted(seeded["all"])[:3]:
                assert api.get(f"/v1/configs/{digest}").status_code == 200
            assert api.get(f"/v1/configs/{'0' * 64}").status_code == 404
        dom = _chromium(tmp_path, "--dump-dom", f"{server.url}/").stdout
        shot = tmp_path / "dashboard.png"
        _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1400,2000", f"{server.url}/")
    finally:
        server.stop()

    # the plots: one figure per (device class, kernel), a mark per measured shape and series
    assert dom.count('<figure class="plot"') == 2, dom[:3000]
    assert 'data-kernel="matmul.hopper" data-device="sm_90:132"' in dom
    assert 'data-kernel="conv2d_fprop.hopper" data-device="sm_90:132"' in dom
    assert _marks(dom, "speedup-default") == seeded["default"]
    assert _marks(dom, "speedup-vendor") == seeded["vendor"]
    assert _marks(dom, "tune-time") == seeded["tune"]
    assert len(seeded["default"]) == 7 and len(seeded["vendor"]) == 6 and len(seeded["tune"]) == 7
    # each mark is a drawn bar with its numbers in its tooltip
    d = _key(*MATMULS[0][:2]).digest
    assert re.search(
        rf'class="mark speedup-default" data-digest="{d}"><title>4096x4096x4096 bf16: tuned 0\.2620 ms '
        rf'vs the default config 0\.4910 ms = 1\.87× \(faster\)</title>\s*<path d="M ',
        dom,
    ), dom[:2000]
    assert "cuBLAS 0.2810 ms = 1.07×" in dom and "tuned in 48.0 s" in dom
    # what was not measured is said, not drawn
    assert "the default config: not measured" in dom and "cuBLAS: not measured" in dom
    assert "cuDNN: not measured" in dom and "not recorded" in dom
    # shapes in their short form, on one line: no implicit-GEMM fields, no key=value soup
    assert "4096x4096x4096 bf16" in dom and "N32 56x56 64&gt;64 3x3/s1p1 f16" in dom
    assert "gemm_M" not in dom and "M=4096" not in dom
    # the summary: the geomean of what tuning bought per kernel and device class
    summary = dom[dom.index('id="bought"') : dom.index('<figure class="plot"')]
    assert "matmul.hopper" in summary and "cuBLAS" in summary and "cuDNN" in summary and "4/5" in summary

    # the queue, with ages, its worker and the failed job's error tail (escaped)
    queue = dom[dom.index('id="queue"') : dom.index('id="lookups"')]
    assert "Queued jobs" in queue and "2048x2048x2048 bf16" in queue and "ready" in queue
    assert "gpu-host-7:4242" in queue and "3072x3072x3072 bf16" in queue and re.search(r"in [0-9]+m", queue)
    assert "N8 7x7 512&gt;512 3x3/s1p1 f16" in queue and "RuntimeError: CUDA error: illegal &lt;boom&gt;" in queue
    assert "<boom></boom>" not in dom, "the error's text is text, not markup"
    assert re.search(r'<td class="num">[0-9]+s</td>', queue), "a job's age"
    # the lookups from the metrics of the process that served them
    lookups = dom[dom.index('id="lookups"') : dom.index('id="configs"')]
    assert re.search(r"hits</td><td class=\"num\">3</td><td class=\"num\">75\.0%", lookups), lookups
    assert re.search(r"misses</td><td class=\"num\">1</td><td class=\"num\">25\.0%", lookups), lookups

    # the screenshot: a full page, not a blank one
    width, height = _png_size(shot)
    assert (width, height) == (1400, 2000)
    assert shot.stat().st_size > 60_000, "a page with plots and tables compresses to more than this"
    from PIL import Image

    with Image.open(shot) as img:  # much of the page is drawn: not one colour
        colours = img.convert("RGB").resize((350, 500)).getcolors(maxcolors=1 << 16)
        assert colours is None or len(colours) > 50
        # the test's artifact (benchmarks/results/dashboard-20261123.png is one, kept as an example)
        out = shot.with_name(f"dashboard-{date.today():%Y%m%d}.png")
        img.convert("RGB").quantize(colors=128).save(out, optimize=True)
    assert out.stat().st_size > 20_000
