"""`Store`: the one class that reads and writes a database of tuned configs, tuning jobs and
trials, in SQLite (one host) or Postgres (the fleet, which also keeps every submission, its API
tokens and the audit log there), written by concern:

- tunecache.store.base: opening the database, sessions, the database's clock;
- tunecache.store.configs: tuned configs, trials, binaries, fleet copies, self-checks;
- tunecache.store.jobs: the tuning queue;
- tunecache.store.trust: publishes, submissions, reports, tokens, audit, retention.
"""

from __future__ import annotations

from tunecache.store.configs import ConfigStore
from tunecache.store.jobs import JobStore
from tunecache.store.trust import TrustStore


class Store(ConfigStore, JobStore, TrustStore):
    """One database, local or fleet. Thread-safe; safe for many processes on one SQLite file.

    A store opened with `writable=False` (tunecache.store.local does, for a file it may only
    read) skips put_config and add_trials, and raises ReadOnlyStoreError on any other write.
    """
