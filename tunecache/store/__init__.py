"""The store: SQL lives here and nowhere else.

- store.py (`Store`, by concern in base, configs, jobs and trust), opened as this process's own
  store by process.py (`default_store()`) through local.py (a host's SQLite file and its faults);
- records.py: the plain records the store takes and hands out (no SQLAlchemy: the client and
  the service's schemas import only that module); rows.py: the tables as SQLAlchemy rows;
- engine.py (URLs, engine set-up), faults.py (exceptions, a database's faults in words),
  migrate.py (Alembic glue), quick_read.py (a warm host's read without SQLAlchemy),
  transfer.py (export/import files), floor.py (the fastest time physics allows).

The names below are importable from `tunecache.store` as they always were; each is loaded
when first asked for, so `import tunecache.store.quick_read` stays free of SQLAlchemy.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "ApiTokenRow": "tunecache.store.rows",
    "AuditRecord": "tunecache.store.records",
    "AuditRow": "tunecache.store.rows",
    "Base": "tunecache.store.rows",
    "ConfigRecord": "tunecache.store.records",
    "FleetMetaRow": "tunecache.store.rows",
    "JOB_STATUSES": "tunecache.store.records",
    "JobRecord": "tunecache.store.records",
    "JobStateError": "tunecache.store.faults",
    "MAX_BACKOFF_S": "tunecache.store.records",
    "MAX_LEASE_S": "tunecache.store.records",
    "NewerSchemaError": "tunecache.store.faults",
    "PurgeReport": "tunecache.store.records",
    "QueueWait": "tunecache.store.records",
    "REPLACE_MARGIN": "tunecache.store.base",
    "ReadOnlyStoreError": "tunecache.store.faults",
    "ResultColumns": "tunecache.store.rows",
    "STORE_ERRORS": "tunecache.store.engine",
    "SelfCheckRow": "tunecache.store.rows",
    "Store": "tunecache.store.store",
    "StoreError": "tunecache.store.faults",
    "SubmissionRecord": "tunecache.store.records",
    "SubmissionRow": "tunecache.store.rows",
    "TOKEN_SCOPES": "tunecache.store.records",
    "TokenRecord": "tunecache.store.records",
    "TrialRecord": "tunecache.store.records",
    "TrialRow": "tunecache.store.rows",
    "TunedConfigRow": "tunecache.store.rows",
    "TuningJobRow": "tunecache.store.rows",
    "default_store": "tunecache.store.process",
    "describe_fault": "tunecache.store.faults",
    "fault_kind": "tunecache.store.faults",
    "hash_token": "tunecache.store.records",
    "sqlite_path": "tunecache.store.engine",
    "sqlite_url": "tunecache.store.engine",
    "utcnow": "tunecache.store.records",
    "whoami": "tunecache.store.records",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    try:
        home = _HOMES[name]
    except KeyError:
        raise AttributeError(f"module 'tunecache.store' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
