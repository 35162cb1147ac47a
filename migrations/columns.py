"""Columns that more than one revision creates alike: a row's id and key digest, which backend
on which device class a row is about, and a tuning result. A revision's schema is history and a
change here would change the old revisions too: a new column set is a new function, never an
edit of one of these."""

import sqlalchemy as sa


def digest_row_columns() -> list[sa.Column]:
    """id (the primary key) and digest (a key's, NOT NULL), in that order: how every table of
    rows about a key begins."""
    return [
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("digest", sa.String(64), nullable=False),
    ]


def backend_columns() -> list[sa.Column]:
    """kernel, kernel_version, triton_version, arch, sm_count: each NOT NULL, in that order."""
    return [
        sa.Column("kernel", sa.String(128), nullable=False),
        sa.Column("kernel_version", sa.String(64), nullable=False),
        sa.Column("triton_version", sa.String(32), nullable=False),
        sa.Column("arch", sa.String(16), nullable=False),
        sa.Column("sm_count", sa.Integer, nullable=False),
    ]


def result_columns() -> list[sa.Column]:
    """A tuning result as the winners (0001) and the submissions (0002) first held it: config,
    median_ms, tflops, candidates, tuned_by, tuned_at, source, in that order."""
    return [
        sa.Column("config", sa.JSON, nullable=False),
        sa.Column("median_ms", sa.Float, nullable=False),
        sa.Column("tflops", sa.Float, nullable=True),
        sa.Column("candidates", sa.Integer, nullable=False, server_default="0"),
        sa.Column("tuned_by", sa.String(128), nullable=False, server_default=""),
        sa.Column("tuned_at", sa.DateTime, nullable=False),
        sa.Column("source", sa.String(16), nullable=False, server_default="inline"),
    ]
