"""Two service processes over one Postgres serve one fleet (docs/fleet.md, "Scaling out"): a
write through either process is served at once by the one that took it and by the other
within TUNECACHE_LOOKUP_CACHE_S; so is a change made on the database itself; a job is
claimed once, whichever process the workers ask."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from support.fleet import Server, reset_fleet_tables, start_fleet, wait_for
from tunecache.key import TuneKey

TTL_S = 1.0
CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


def result(m: int, median_ms: float = 1.0) -> dict:
    return {
        "kernel": "matmul.portable",
        "kernel_version": "v1",
        "triton_version": "3.9.0",
        "arch": "cpu",
        "sm_count": 0,
        "problem": {"M": m, "N": 64, "K": 64, "dtype": "float32", "a_layout": "row", "b_layout": "row"},
        "config": dict(CONFIG),
        "median_ms": median_ms,
    }


def digest_of(body: dict) -> str:
    return TuneKey.from_fields(body).digest


@pytest.fixture(scope="module")
def two(pg_url, tmp_path_factory):
    """Processes A and B of one fleet (`tunecache serve` twice over one database)."""
    d = tmp_path_factory.mktemp("scale-out")
    env = {"TUNECACHE_LOOKUP_CACHE_S": str(TTL_S)}
    with start_fleet(pg_url, d, prefix="scale", env=env) as a, Server(pg_url, d / "b.log", env=env).start() as b:
        b.tokens, b.db_url = a.tokens, pg_url
        reset_fleet_tables(pg_url)
        yield a, b


def api(server: Server, scope: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.tokens[scope]}"}, timeout=10)


def status(client: httpx.Client, digest: str) -> int:
    return client.get(f"/v1/configs/{digest}").status_code


def test_a_result_published_through_one_process_is_served_by_both(two):
    a, b = two
    body = result(1001)
    digest = digest_of(body)
    with api(a, "read") as read_a, api(b, "read") as read_b, api(a, "worker") as worker_a:
        assert status(read_a, digest) == status(read_b, digest) == 404  # both now remember the miss
        assert worker_a.post("/v1/configs", json=body).json()["accepted"]
        assert status(read_a, digest) == 200, "the process that took the write serves it at once"
        t0 = time.monotonic()
        wait_for(lambda: status(read_b, digest) == 200, timeout=TTL_S + 2, what="B to serve the new winner")
        assert time.monotonic() - t0 <= TTL_S + 1.0
        assert read_b.get(f"/v1/configs/{digest}").json()["config"] == CONFIG
        by_key = read_b.post("/v1/lookup", json={k: v for k, v in body.items() if k not in ("config", "median_ms")})
        assert by_key.status_code == 200 and by_key.json()["digest"] == digest


def test_a_winner_deleted_through_one_process_is_gone_from_both_and_the_generation_moves(two):
    a, b = two
    body = result(1002)
    digest = digest_of(body)
    with api(a, "worker") as worker_a, api(a, "read") as read_a, api(b, "admin") as admin_b:
        assert worker_a.post("/v1/configs", json=body).json()["accepted"]
        assert status(read_a, digest) == status(admin_b, digest) == 200  # both now remember the hit
        before = int(read_a.get("/v1/generation").json()["generation"])
        assert admin_b.delete(f"/v1/configs/{digest}").json() == {"deleted": True}
        assert status(admin_b, digest) == 404, "the process that took the delete answers at once"
        wait_for(lambda: status(read_a, digest) == 404, timeout=TTL_S + 2, what="A to drop the deleted winner")
        moved = wait_for(
            lambda: int(read_a.get("/v1/generation").json()["generation"]) > before,
            timeout=TTL_S + 2,
            what="A's generation to move",
        )
        assert moved
        assert read_a.get(f"/v1/configs/{digest}").headers["X-Tunecache-Generation"] != str(before)


def test_a_change_made_on_the_database_is_served_within_the_cache_time(two):
    """`tunecache fleet purge` and other admin commands write the database, not a process."""
    from tunecache.store import Store

    a, b = two
    body = result(1003)
    digest = digest_of(body)
    with api(a, "worker") as worker_a, api(b, "read") as read_b:
        assert worker_a.post("/v1/configs", json=body).json()["accepted"]
        wait_for(lambda: status(read_b, digest) == 200, timeout=TTL_S + 2, what="B to serve the winner")
        store = Store(a.db_url)
        try:
            assert store.delete_config(digest)
        finally:
            store.close()
        wait_for(lambda: status(read_b, digest) == 404, timeout=TTL_S + 2, what="B to see the deletion")


def test_a_job_is_claimed_once_whichever_process_the_workers_ask(two):
    a, b = two
    key = {k: v for k, v in result(1004).items() if k not in ("config", "median_ms")}
    with api(a, "worker") as worker_a, api(b, "worker") as worker_b:
        queued = worker_a.post("/v1/jobs", json=key).json()
        assert queued["status"] == "queued"
        got: list[dict] = []

        def claim(client: httpx.Client, owner: str) -> None:
            r = client.post("/v1/jobs/claim", json={"owner": owner, "arch": "cpu", "sm_count": 0, "lease_s": 30})
            got.append(r.json())

        threads = [
            threading.Thread(target=claim, args=(c, f"w{i}"))
            for i, c in enumerate([worker_a, worker_b, worker_a, worker_b])
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        claimed = [g["job"] for g in got if g["job"] is not None]
        assert [j["id"] for j in claimed] == [queued["id"]], got
