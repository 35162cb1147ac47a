"""Every TUNECACHE_* variable is declared once, in tunecache/settings.py, read through it
everywhere, and documented in the README's or docs/fleet.md's tables."""

from __future__ import annotations

import re

import pytest

from support import ROOT

READ = re.compile(
    r"""(?:environ\.get|getenv)\(\s*["'](TUNECACHE_\w+)|environ\[\s*["'](TUNECACHE_\w+)["']\s*\](?!\s*[=,])"""
)


def _sources():
    for folder in ("tunecache", "kernels"):
        yield from (p for p in (ROOT / folder).rglob("*.py") if p.name != "settings.py" or p.parent.name != "tunecache")


def test_no_module_but_settings_reads_a_variable():
    readers = {
        f"{p.relative_to(ROOT)}: {m.group(1) or m.group(2)}" for p in _sources() for m in READ.finditer(p.read_text())
    }
    assert not readers, f"read these through tunecache.settings instead: {sorted(readers)}"


def test_every_variable_is_documented():
    names = set(re.findall(r"TUNECACHE_[A-Z0-9_]+", (ROOT / "tunecache" / "settings.py").read_text()))
    rows = [
        line
        for doc in ("README.md", "docs/fleet.md")
        for line in (ROOT / doc).read_text().splitlines()
        if line.startswith("|")
    ]  # in a table, not only mentioned in passing
    missing = sorted(n for n in names if not any(f"`{n}`" in row for row in rows))
    assert not missing, f"document these in the README's or docs/fleet.md's settings table: {missing}"


@pytest.mark.parametrize(
    "name,value,reader",
    [
        ("TUNECACHE_SERVER_THREADS", "lots", "server_threads"),
        ("TUNECACHE_COMPILE_WORKERS", "0", "compile_workers"),
        ("TUNECACHE_GLUON_DIRECT_LAUNCH", "maybe", "gluon_direct_launch"),
        ("TUNECACHE_CANDIDATE_TIMEOUT_S", "-1", "candidate_timeout_s"),
        ("TUNECACHE_PUBLISH_SHARE", "0", "publish_share"),
        ("TUNECACHE_PUBLISH_SHARE", "1.5", "publish_share"),
    ],
)
def test_a_bad_value_is_an_error_that_names_the_variable(monkeypatch, name, value, reader):
    from tunecache import settings

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        getattr(settings, reader)()
