"""Export and import of tuned configs as JSON; every imported entry is validated."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tunecache.store.records import ConfigRecord

if TYPE_CHECKING:
    from tunecache.store import Store

FORMAT = "tunecache-configs/1"


class ImportErrorReport(ValueError):
    """The document as a whole is not an export."""


def export_configs(store: Store, kernel: str | None = None, arch: str | None = None) -> dict:
    return {"format": FORMAT, "configs": [r.to_json() for r in store.list_configs(kernel=kernel, arch=arch)]}


def validate_entry(entry: Any) -> ConfigRecord:
    """A ConfigRecord whose kernel is known and whose config lies in its space; else ValueError."""
    from tunecache_kernels.spaces import UnknownKernel, space_for

    if not isinstance(entry, dict):
        raise ValueError(f"entry is a {type(entry).__name__}, not an object")
    try:
        rec = ConfigRecord.from_json(entry)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed entry ({type(e).__name__}: {e})") from None
    try:
        space = space_for(rec.key.kernel)
    except UnknownKernel as e:
        raise ValueError(str(e)) from None
    space.check(rec.config)
    return rec


def import_configs(store: Store, data: Any, source: str = "import") -> dict:
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("configs"), list):
        raise ImportErrorReport(
            f"not a tunecache export (expected an object with format {FORMAT!r} and a 'configs' list)"
        )
    stored = kept = 0
    rejected: list[str] = []
    for i, entry in enumerate(data["configs"]):
        try:
            rec = validate_entry(entry)
        except ValueError as e:
            rejected.append(f"#{i}: {e}")
            continue
        rec.source = source
        _, won = store.put_config(rec)
        stored += won
        kept += not won
    return {"stored": stored, "kept": kept, "rejected": rejected}
