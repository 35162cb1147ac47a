"""A process's first tune does not wait for torch's import: its trial runner is forked from the
host's runner server (tunecache.tuning.forkserver), and is as isolated as a fresh process (the
caller's environment and directory, killed with its caller, a crash reported with its signal)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from support import KERNELS
from tunecache.tuning import forkserver

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the runner server is Linux's (SO_PEERCRED)")


@pytest.fixture
def runtime(monkeypatch):
    """A runtime directory of this test's own (short: a socket path holds 108 bytes), its
    servers stopped afterwards."""
    d = tempfile.mkdtemp(prefix="tc-")
    monkeypatch.setenv("TUNECACHE_RUNTIME_DIR", d)
    yield Path(d)
    for sock in Path(d).glob("*.sock"):
        forkserver.stop(str(sock))


def _wait_for_server(env: dict) -> tuple[str, int]:
    path = forkserver.socket_path(env)
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        assert time.monotonic() < deadline, "the runner server never listened"
        time.sleep(0.1)
    return path, forkserver.server_pid(path)


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("PPid:")[1].split()[0])


TUNE = """
import os, json, torch
from tunecache import ops
from tunecache.tuning.isolated import runner_for
from tunecache.store import default_store
torch.manual_seed(1)
a, b = torch.randn(40, 24), torch.randn(24, 36)
torch.testing.assert_close(ops.matmul(a, b), a @ b)
r = runner_for("cpu")
parent = int(open(f"/proc/{r.pid}/status").read().split("PPid:")[1].split()[0])
print(json.dumps({"forked": r.forked, "parent": parent, "winners": default_store().counts()["tuned_configs"]}))
"""


def _tune_in_a_script(tmp_path: Path, name: str, env: dict) -> dict:
    work = tmp_path / name
    work.mkdir()
    script = work / "train.py"
    script.write_text(textwrap.dedent(TUNE))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600, cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_later_script_gets_its_runner_from_the_hosts_server_under_its_own_environment(tmp_path, db_url, runtime):
    env = dict(os.environ)
    first = _tune_in_a_script(tmp_path, "first", {**env, "TUNECACHE_DB_URL": f"{db_url}1"})
    assert not first["forked"] and first["winners"] == 1  # no server yet: it started one
    path, server = _wait_for_server(env)
    # the server's own environment lacks the interpreter's switch: a runner that did not take its
    # caller's would compile for a GPU this machine has not, and every candidate would fail
    forkserver.stop(path)
    bare = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}
    forkserver._start(path, bare)
    path, server = _wait_for_server(env)
    second = _tune_in_a_script(tmp_path, "second", {**env, "TUNECACHE_DB_URL": f"{db_url}2"})
    assert second["forked"] and second["parent"] == server and second["winners"] == 1


CRASH_THEN_HANG = """
import json, sys, threading, time, torch
import crashy_backend as m
from tunecache.tuning.isolated import WorkerFailed, runner_for
from tunecache.key import interpreter_device
a, b = torch.randn(24, 16), torch.randn(16, 20)
setup = {"cmd": "setup", "module": "crashy_backend", "problem": m.problem(a, b), "torch_device": "cpu",
         "tolerance": 1e-2, "digest": "d"}
r = runner_for("cpu")
def trial(behaviour):
    r.call(setup, 300)
    return r.call({"cmd": "trial", "digest": "d", "config": {**m.GOOD, "behaviour": behaviour}}, None)
try:
    trial("segfault")
except WorkerFailed as e:
    print(json.dumps({"crash": e.reason, "forked": r.forked}), flush=True)
threading.Thread(target=trial, args=("hang",), daemon=True).start()
time.sleep(3)
print(json.dumps({"hung": r.pid, "forked": r.forked}), flush=True)
time.sleep(600)
"""


def test_a_forked_runner_reports_its_crash_and_dies_with_its_caller(tmp_path, runtime):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(KERNELS), os.environ.get("PYTHONPATH", "")])}
    forkserver._start(forkserver.socket_path(env), env)
    _, server = _wait_for_server(env)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(CRASH_THEN_HANG))
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        crash = json.loads(proc.stdout.readline())
        assert crash["forked"] and "SIGSEGV" in crash["crash"]
        hung = json.loads(proc.stdout.readline())
        assert hung["forked"] and _ppid(hung["hung"]) == server
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{hung['hung']}").exists() and _ppid(hung["hung"]) == server:
        assert time.monotonic() < deadline, "the hung runner outlived its caller"
        time.sleep(0.1)


def test_the_server_serves_its_own_user_only(runtime):
    env = dict(os.environ)
    path = forkserver.socket_path(env)
    assert path is not None and os.stat(runtime).st_mode & 0o077 == 0
    os.chmod(runtime, 0o755)  # a directory others can enter is not used
    assert forkserver.socket_path(env) is None
    assert forkserver.runner("trial runner for cpu", env, 2) is None
