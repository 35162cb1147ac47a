"""Alembic environment and revisions of the tunecache store (shipped inside the wheel)."""
