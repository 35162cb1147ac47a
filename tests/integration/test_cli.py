"""The CLI mirrors the library: tune, ls, show, export/import, doctor."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def cli(*args, env=None, check=True):
    proc = subprocess.run(
        [sys.executable, "-m", "tunecache.cli", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, COLUMNS="200", **(env or {})),
        timeout=600,
    )
    if check and proc.returncode != 0:
        raise AssertionError(proc.stdout + proc.stderr)
    return proc


def test_tune_shows_on_a_terminal_what_is_timed_of_how_many_the_best_so_far_and_time_left(db_url):
    import re

    proc = cli(
        "tune", "matmul", "-p", "M=40,N=24,K=32,dtype=float32", env={"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"}
    )
    shown, said = (re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", text) for text in (proc.stderr, proc.stdout))
    frames = re.findall(r"tuning matmul\.portable on cpu:0 .*? (\d+)/(\d+) timed · best ([\d.]+) ms .*?left", shown)
    assert frames, shown[-2000:]
    assert {int(total) for _, total, _ in frames} == {int(re.search(r"(\d+) candidates", said).group(1))}
    assert int(frames[-1][0]) == int(frames[-1][1]), "the last frame: every candidate timed"


def test_tune_then_ls_show_export_import(db_url, tmp_path):
    out = cli("tune", "matmul", "--problem", "M=40,N=24,K=32,dtype=float32").stdout
    assert "matmul.portable" in out and "candidates" in out
    assert "already tuned" in cli("tune", "matmul", "-p", "M=40,N=24,K=32,dtype=float32").stdout
    listing = cli("ls").stdout
    assert "matmul.portable" in listing and "1 config(s)" in listing
    from tunecache.store import Store

    (rec,) = Store(db_url).list_configs()
    shown = json.loads(cli("show", rec.digest[:10]).stdout)
    assert shown["config"] == rec.config and shown["trials"]
    cli("export", str(tmp_path / "x.json"))
    other = f"sqlite:///{tmp_path / 'other.sqlite'}"
    assert "imported 1" in cli("import", str(tmp_path / "x.json"), env={"TUNECACHE_DB_URL": other}).stdout
    assert Store(other).get_config(rec.digest).config == rec.config


def test_bad_arguments_are_named():
    bad = cli("tune", "matmul", "-p", "M=4,N=4,dtype=float32", check=False)
    assert bad.returncode == 2 and "missing K" in bad.stderr
    bad = cli("tune", "conv9", "-p", "M=4", check=False)
    assert bad.returncode == 2 and "unknown op" in bad.stderr
    bad = cli("import", "/nonexistent.json", check=False)
    assert bad.returncode == 2 and "cannot read" in bad.stderr


def test_doctor_reports_versions_and_store(db_url):
    out = cli("doctor").stdout
    assert "triton" in out and "tuned_configs" in out and db_url.split("///")[1][:20] in out
