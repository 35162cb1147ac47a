"""The wheel built from the tree installs into a fresh venv, and `tunecache doctor` runs there."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from support import ROOT


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_doctor_runs(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(ROOT)],
        check=True,
        timeout=600,
    )
    (wheel,) = dist.glob("tunecache-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("tunecache_migrations/versions/0001") for n in names), "migrations not shipped"
    assert "tunecache_migrations/script.py.mako" in names
    assert "tunecache_kernels/spaces/portable.py" in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    # dependencies come from the index (or pip's cache); nothing from this environment leaks in
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], check=True, timeout=1200)
    env = dict(os.environ, TUNECACHE_DB_URL=f"sqlite:///{tmp_path / 'doctor.sqlite'}")
    env.pop("PYTHONPATH", None)
    out = subprocess.run(
        [str(venv / "bin" / "tunecache"), "doctor"], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tuned_configs" in out.stdout and "schema" in out.stdout
    where = subprocess.run(
        [str(py), "-c", "import tunecache; print(tunecache.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        check=True,
    ).stdout
    assert str(venv) in where
