"""Fixtures of the integration tests: a real `tunecache serve` (uvicorn on loopback) over the
session's Postgres database or over a SQLite file, with a token per scope. The helpers they
are built from are in support/fleet.py."""

from __future__ import annotations

import pytest

from support.fleet import reset_fleet_tables, start_fleet

# The shared services' tables are emptied behind their backs between tests (`clean_fleet`),
# which a service sees only after TUNECACHE_LOOKUP_CACHE_S: these answer every lookup from the
# database. The lookup cache itself is tested in test_fleet_scale_out.py and measured by
# benchmarks/bench_lookup.py, at its default.
NO_LOOKUP_CACHE = {"TUNECACHE_LOOKUP_CACHE_S": "0"}


@pytest.fixture(scope="module")
def fleet(pg_url, tmp_path_factory):
    """A running service over the session's Postgres database, and a token per scope."""
    with start_fleet(pg_url, tmp_path_factory.mktemp("server"), env=NO_LOOKUP_CACHE) as server:
        yield server


@pytest.fixture(scope="module")
def sqlite_fleet(tmp_path_factory):
    """The same service as `fleet`, over a SQLite file (the store's other engine)."""
    d = tmp_path_factory.mktemp("sqlite-fleet")
    with start_fleet(f"sqlite:///{d / 'fleet.sqlite'}", d, env=NO_LOOKUP_CACHE) as server:
        yield server


@pytest.fixture
def clean_fleet(fleet):
    """`fleet` with its queue and configs emptied (tokens stay), and the clients forgotten."""
    reset_fleet_tables(fleet.db_url)
    from tunecache.fleet import client

    client.reset_clients()
    yield fleet
    client.reset_clients()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_db_url(request, tmp_path):
    """An empty database of each engine, no schema yet: for migrations and upgrades."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'old.sqlite'}"
        return
    import uuid

    import psycopg
    from sqlalchemy.engine import make_url

    base = make_url(request.getfixturevalue("pg_url"))
    name = f"tc_old_{uuid.uuid4().hex[:10]}"
    conn = psycopg.connect(
        host=base.host, port=base.port or 5432, user=base.username, dbname=base.database, autocommit=True
    )
    conn.execute(f'CREATE DATABASE "{name}"')
    yield base.set(database=name).render_as_string(hide_password=False)
    conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    conn.close()
