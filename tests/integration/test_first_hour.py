"""A newcomer's first hour (issue 42): each way in, typed as a user types it, says what it is
doing and what went wrong. Every test runs the installed `tunecache` entry point (or a plain
`python -c`) in a fresh process and reads what the user reads: the words, the exit code, the
port, the files left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TUNECACHE = str(Path(sys.executable).with_name("tunecache"))  # the console script pip installed


def tc(*args: str, cwd=None, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """`tunecache ARGS` in a fresh process, its output not a terminal (a log, a CI job)."""
    return subprocess.run(
        [TUNECACHE, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200", **env},
    )


# ---- row 2: the README's spelling, tunecache.nn after a plain `import tunecache` ---------------


def test_tunecache_nn_is_reached_from_a_plain_import():
    code = (
        "import sys, torch, tunecache; print('tunecache.nn' in sys.modules); "
        "m = tunecache.nn.convert(torch.nn.Sequential(torch.nn.Linear(4, 4))); "
        "print(type(m[0]).__module__, callable(tunecache.ops.matmul))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "tunecache.nn", "True"], proc.stdout


# ---- row 3: square brackets are the user's text, never console markup ----------------------


def test_square_brackets_stay_in_error_messages(db_url, tmp_path):
    bad = tc("tune", "matmul", "-p", "M=4,N=4,K=4,dtype=float32,[x]=1")
    assert bad.returncode == 2 and "unknown key(s) [x] for matmul" in bad.stderr, bad.stderr
    empty = tmp_path / "empty.toml"
    empty.write_text("# no shapes yet\n")
    none = tc("pretune", str(empty))
    assert none.returncode == 2 and "no [[shape]] entries" in none.stderr, none.stderr


# ---- row 4: a model file in the current directory, and a mistyped --input ---------------------


def test_manifest_imports_a_model_beside_you_and_names_a_bad_input_size(tmp_path):
    (tmp_path / "mymodels.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(16, 32))\n"
    )
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}  # the current directory is not on it
    ok = tc("manifest", "--from-model", "mymodels:build", "--input", "16", "-o", "m.toml", cwd=tmp_path, **env)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "[[shape]]" in (tmp_path / "m.toml").read_text() and "mymodels:build: 3 distinct problem(s)" in ok.stderr
    bad = tc("manifest", "--from-model", "mymodels:build", "--input", "3,x,16", cwd=tmp_path, **env)
    assert bad.returncode == 2 and "--input: 'x' in '3,x,16' is not a size" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and not bad.stdout
