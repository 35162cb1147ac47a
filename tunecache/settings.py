"""Settings from the environment, read when asked (tests and workers change them)."""

from __future__ import annotations

import os
from pathlib import Path

MISS_POLICIES = ("tune", "default", "strict")


def db_url() -> str:
    """TUNECACHE_DB_URL, else a SQLite file under the user cache dir."""
    url = os.environ.get("TUNECACHE_DB_URL")
    if url:
        return url
    from platformdirs import user_cache_dir

    path = Path(user_cache_dir("tunecache")) / "tunecache.sqlite"
    return f"sqlite:///{path}"


def miss_policy() -> str:
    policy = os.environ.get("TUNECACHE_MISS_POLICY", "tune").strip().lower()
    if policy not in MISS_POLICIES:
        raise ValueError(f"TUNECACHE_MISS_POLICY must be one of {MISS_POLICIES}, got {policy!r}")
    return policy


def server_url() -> str | None:
    return os.environ.get("TUNECACHE_SERVER_URL") or None


def server_token() -> str | None:
    return os.environ.get("TUNECACHE_TOKEN") or None


def recheck_seconds() -> float:
    """How often a provisional (default-config) memo entry asks the store for a winner."""
    return float(os.environ.get("TUNECACHE_RECHECK_S", "30"))


def backend_override() -> str | None:
    """TUNECACHE_BACKEND=portable forces a backend (benchmarks, debugging)."""
    return os.environ.get("TUNECACHE_BACKEND") or None


def max_candidates() -> int | None:
    """TUNECACHE_MAX_CANDIDATES caps how many configs one tuning run benchmarks (backends
    order their pruned candidates likeliest-first), bounding a tune at about a minute;
    0 searches the whole pruned space."""
    v = os.environ.get("TUNECACHE_MAX_CANDIDATES", "48")
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"TUNECACHE_MAX_CANDIDATES must be an integer, got {v!r}") from None
    if n < 0:
        raise ValueError(f"TUNECACHE_MAX_CANDIDATES must be >= 0, got {v!r}")
    return n or None
