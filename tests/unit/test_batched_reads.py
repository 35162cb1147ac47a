"""The service reads the lookups its cache lacks together (issue 41): while one read is under way,
the keys missed meanwhile wait for the next, one read for all of them; a lookup that goes away
takes no other's answer with it, and a failed read reaches every lookup that waited on it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tunecache.server.lookups import BatchedReads


class Reader:
    """A store read that holds until released: the calls it got, with their keys."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.calls: list[list[str]] = []
        self.release = threading.Event()
        self.fail = fail

    def __call__(self, keys: list[str]) -> dict[str, str]:
        self.calls.append(list(keys))
        self.release.wait(10)
        if self.fail is not None:
            raise self.fail
        return {k: f"answer {k}" for k in keys}


def test_lookups_missed_during_a_read_are_read_together_by_the_next():
    reader = Reader()

    async def main() -> list[str]:
        reads = BatchedReads(reader)
        first = asyncio.ensure_future(reads.get("a"))
        await asyncio.sleep(0.05)  # the first read is under way
        rest = [asyncio.ensure_future(reads.get(k)) for k in ("b", "c", "b", "d")]
        await asyncio.sleep(0.05)
        reader.release.set()
        return await asyncio.gather(first, *rest)

    answers = asyncio.run(main())
    assert answers == ["answer a", "answer b", "answer c", "answer b", "answer d"]
    assert reader.calls == [["a"], ["b", "c", "d"]]  # 5 lookups, 2 reads, "b" read once


def test_a_lookup_that_goes_away_leaves_the_others_their_answer():
    reader = Reader()

    async def main() -> str:
        reads = BatchedReads(reader)
        gone = asyncio.ensure_future(reads.get("a"))
        stays = asyncio.ensure_future(reads.get("a"))
        await asyncio.sleep(0.05)
        gone.cancel()
        reader.release.set()
        return await stays

    assert asyncio.run(main()) == "answer a"


def test_a_failed_read_reaches_every_lookup_that_waited_and_the_next_read_runs():
    reader = Reader(fail=OSError("the database is away"))

    async def main() -> list:
        reads = BatchedReads(reader)
        waiting = [asyncio.ensure_future(reads.get(k)) for k in ("a", "b")]
        await asyncio.sleep(0.05)
        reader.release.set()
        failed = await asyncio.gather(*waiting, return_exceptions=True)
        reader.fail = None
        return [*failed, await reads.get("c")]

    a, b, c = asyncio.run(main())
    assert isinstance(a, OSError) and isinstance(b, OSError) and c == "answer c"


@pytest.mark.parametrize("n", [1, 3])
def test_a_store_reads_several_winners_in_one_call(tmp_path, n):
    from tunecache.key import TuneKey
    from tunecache.store import ConfigRecord, Store

    store = Store(f"sqlite:///{tmp_path / 's.sqlite'}")
    keys = [TuneKey("matmul.portable", "v", "3.9.0", "cpu", 0, {"M": m}) for m in range(1, n + 1)]
    for k in keys:
        store.put_config(ConfigRecord(k, {"BLOCK_M": 32}, 1.0))
    missing = "0" * 64
    found = store.get_configs([*(k.digest for k in keys), missing])
    assert sorted(found) == sorted(k.digest for k in keys) and missing not in found
    assert all(found[k.digest].key == k for k in keys)


def test_a_store_checks_several_tokens_in_one_call(tmp_path):
    from tunecache.store import Store

    store = Store(f"sqlite:///{tmp_path / 's.sqlite'}")
    live, _ = store.create_token("live", ["read"])
    revoked, _ = store.create_token("revoked", ["read"])
    store.revoke_token("revoked")
    found = store.verify_tokens([live, revoked, "made-up"])
    assert found[live].name == "live" and found[revoked] is None and found["made-up"] is None
