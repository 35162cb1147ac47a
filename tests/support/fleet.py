"""Shared pieces of the fleet tests: a real uvicorn on loopback over a real Postgres database,
tokens, and "hosts" (separate processes, each with its own local SQLite store). The fixtures
built from them (`fleet`, `sqlite_fleet`, `clean_fleet`) are in tests/integration/conftest.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`tunecache serve` in a subprocess on a free loopback port."""

    def __init__(
        self,
        db_url: str,
        log_path: Path,
        *,
        anonymous_read: bool = False,
        env: dict | None = None,
        args: tuple[str, ...] = (),
    ):
        self.db_url, self.log_path, self.anonymous_read = db_url, log_path, anonymous_read
        self.env, self.args = env or {}, tuple(args)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> "Server":
        cmd = [
            sys.executable,
            "-m",
            "tunecache.cli",
            "serve",
            "--port",
            str(self.port),
            "--db-url",
            self.db_url,
            "--log-level",
            "warning",
        ]
        if self.anonymous_read:
            cmd.append("--anonymous-read")
        cmd += self.args
        env = {**os.environ, **self.env}
        env.pop("TUNECACHE_SERVER_URL", None)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server did not come up in {timeout} s:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def pause(self) -> None:
        """SIGSTOP: the socket still accepts connections, but nothing answers (a hung service)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


def result_body(median_ms: float, config: dict, problem: dict, /, **key) -> dict:
    """A published result as `POST /v1/configs` takes it, for the portable matmul on the CPU
    interpreter unless `key` says otherwise."""
    body = {
        "kernel": "matmul.portable",
        "kernel_version": "v1",
        "triton_version": "3.9.0",
        "arch": "cpu",
        "sm_count": 0,
        "problem": dict(problem),
        "config": dict(config),
        "median_ms": median_ms,
    }
    body.update(key)
    return body


def reset_fleet_tables(db_url: str) -> None:
    """Empty the queue and the configs between tests (tokens stay)."""
    from sqlalchemy import create_engine

    engine = create_engine(db_url)
    with engine.begin() as conn:
        if engine.dialect.name == "sqlite":
            for table in (
                "tuned_configs",
                "tuning_jobs",
                "trials",
                "submissions",
                "kernel_binaries",
                "tune_announcements",
            ):
                conn.exec_driver_sql(f"DELETE FROM {table}")
        else:
            conn.exec_driver_sql(
                "TRUNCATE tuned_configs, tuning_jobs, trials, submissions, kernel_binaries, tune_announcements "
                "RESTART IDENTITY"
            )
    engine.dispose()


def make_tokens(db_url: str, prefix: str = "test") -> dict[str, str]:
    """A token per scope, named PREFIX-SCOPE (a live name is unique: an earlier module's go first)."""
    from tunecache.store import Store

    store = Store(db_url)
    scopes = ("read", "publish", "worker", "admin")
    for scope in scopes:
        store.revoke_token(f"{prefix}-{scope}")
    out = {scope: store.create_token(f"{prefix}-{scope}", [scope])[0] for scope in scopes}
    store.close()
    return out


def host_env(tmp_path: Path, name: str, server_url: str | None, token: str | None, **extra: str) -> dict:
    """The environment of one host: its own local store, the fleet, the CPU interpreter."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNECACHE_")}
    env.update(
        TUNECACHE_DB_URL=f"sqlite:///{tmp_path / name}.sqlite",
        TRITON_INTERPRET="1",
        TUNECACHE_BACKEND="portable",
        PYTHONUNBUFFERED="1",
    )
    if server_url:
        env["TUNECACHE_SERVER_URL"] = server_url
    if token:
        env["TUNECACHE_TOKEN"] = token
    env.update(extra)
    return env


def run_host(code: str, env: dict, timeout: float = 300) -> dict:
    """Run `code` in a fresh process; it must print one JSON object as its last line."""
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    if proc.returncode != 0:
        raise AssertionError(f"host process failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def local_counts(env: dict) -> dict:
    """Rows in a host's local store (read from this process, no tuning involved)."""
    from tunecache.store import Store

    store = Store(env["TUNECACHE_DB_URL"])
    try:
        return store.counts()
    finally:
        store.close()


def start_worker(env: dict, log_path: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tunecache.cli", "worker", "--gpu", "0", *args]
    return subprocess.Popen(cmd, env=env, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, cwd=ROOT)


def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def start_fleet(db_url: str, log_dir: Path, prefix: str = "test", **server_kwargs) -> Server:
    """A running service over `db_url` (migrated first), with `tokens` ({scope: secret}, named
    PREFIX-SCOPE) and `db_url`."""
    from tunecache.store import Store

    Store(db_url).close()
    tokens = make_tokens(db_url, prefix)
    server = Server(db_url, log_dir / "server.log", **server_kwargs).start()
    server.tokens, server.db_url = tokens, db_url
    return server


def pg_service(name: str, env: dict[str, str]):
    """A test module's own service fixture (module scope) over the session's Postgres database,
    started with `env` (the settings the module probes), its tokens named NAME-SCOPE."""

    @pytest.fixture(scope="module")
    def svc(pg_url, tmp_path_factory):
        with start_fleet(pg_url, tmp_path_factory.mktemp(name), prefix=name, env=env) as server:
            yield server

    return svc
