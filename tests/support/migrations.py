"""What the schema tests do to a database that the store never does: step its schema down, and
read the columns and indexes a table has at a revision."""

from __future__ import annotations

from sqlalchemy import Engine, inspect


def downgrade(engine: Engine, revision: str) -> None:
    """Alembic's downgrade of `engine`'s database to `revision` (the store only upgrades)."""
    from alembic import command

    from tunecache.store.migrate import alembic_config

    cfg = alembic_config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def columns(engine: Engine, table: str) -> set[str]:
    return {c["name"] for c in inspect(engine).get_columns(table)}


def indexes(engine: Engine, table: str) -> set[str]:
    return {i["name"] for i in inspect(engine).get_indexes(table)}
