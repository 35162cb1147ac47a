"""The fleet: one `Fleet` protocol (tunecache.fleet.protocol) with its two sides, the service
over HTTP (client.py) and a store reached directly (store_fleet.py); the worker that tunes the
fleet's queue (worker.py); `tunecache pretune` (pretune.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tunecache.fleet.protocol import Fleet
    from tunecache.store import Store


def default_fleet(store: Store | None = None) -> Fleet:
    """The fleet service when TUNECACHE_SERVER_URL is set, else the local store (its own queue)."""
    from tunecache import settings

    url = settings.server_url()
    if url:
        from tunecache.fleet.client import fleet_client

        return fleet_client(url)
    from tunecache.fleet.store_fleet import StoreFleet
    from tunecache.store.process import default_store

    return StoreFleet(store or default_store())
