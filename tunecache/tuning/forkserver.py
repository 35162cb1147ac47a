"""A per-host server that forks tunecache's worker processes with torch already imported.

A tune's trial runner is a process of its own (`tunecache.tuning.isolated`), and its `import torch`
(4-5 s on an H100 host) was most of a cold tune. The first tune on a host starts this server
beside its own runner; every later process of the user on the host (the next script, another
job, each DDP rank) gets its runner and compile workers forked from it in milliseconds. The server exits after
TUNECACHE_RUNNER_SERVER_IDLE_S with no runner alive; TUNECACHE_RUNNER_SERVER=0 turns it off.

Trust: the socket lives in a directory only this user can enter, and the server forks only for
its own user (SO_PEERCRED): a forked runner imports whatever module a request names, as us.
Isolation is the same as a fresh process's: the fork happens before any CUDA context exists,
the caller's environment and working directory replace the server's in the child before it
does anything else, and a runner dies with its caller (the server kills it when the caller's
connection closes). The server is keyed by what `import torch` depends on (the interpreter,
the library and import paths, torch's and tunecache's files), so a change to any of them gets
a new server rather than a stale one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("tunecache")

# what `import torch` reads from the environment (the rest is applied in the forked child);
# CUDA_VISIBLE_DEVICES is read when CUDA starts, after the fork: DDP ranks share one server
_IMPORT_ENV = ("PYTHON", "LD_", "TORCH", "PYTORCH", "OMP_", "MKL_", "CUDA_")
_PER_CHILD_ENV = ("CUDA_VISIBLE_DEVICES",)
_MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes
_CONNECT_TIMEOUT_S = 5.0
_RESTART_AFTER_S = 60.0  # a process asks for a server at most this often
_started: dict[str, float] = {}


def _files_stamp(directory: Path, pattern: str) -> list:
    return sorted(
        (str(p.relative_to(directory)), p.stat().st_mtime_ns, p.stat().st_size) for p in directory.glob(pattern)
    )


def server_key(env: dict[str, str]) -> str:
    """What a server must share with its callers for a fork of it to be what a fresh
    `python -m tunecache.tuning.isolated_main` would have been."""
    import importlib.util

    package = Path(__file__).resolve().parents[1]  # tunecache/, every subpackage included
    torch_spec = importlib.util.find_spec("torch")
    torch_file = Path(torch_spec.origin) if torch_spec and torch_spec.origin else None
    parts = {
        "python": [sys.executable, sys.version, os.getuid()],
        "env": sorted((k, v) for k, v in env.items() if k.startswith(_IMPORT_ENV) and k not in _PER_CHILD_ENV),
        "torch": [str(torch_file), _files_stamp(torch_file.parent, "*.py")[:64] if torch_file else None],
        "tunecache": [str(package), _files_stamp(package, "**/*.py")],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _private_dir() -> Path | None:
    """The runtime directory, made if need be; None unless it is this user's alone."""
    from tunecache import settings

    d = settings.runtime_dir()
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = d.stat()
    except OSError:
        return None
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        log.debug("tunecache: %s is not this user's alone: no runner server", d)
        return None
    return d


def socket_path(env: dict[str, str]) -> str | None:
    d = _private_dir()
    if d is None:
        return None
    path = str(d / f"runner-{server_key(env)}.sock")
    return path if len(path.encode()) <= _MAX_SOCKET_PATH else None


def serving(env: dict[str, str]) -> bool:
    """Whether a runner server for `env` seems up (its socket is there)."""
    try:
        path = socket_path(env)
    except (OSError, ValueError):
        return False
    return path is not None and os.path.exists(path)


class ForkedProcess:
    """What `subprocess.Popen` gives a caller, for a process the server forked: its pid, its
    exit status as the server reports it (it is the server's child, not ours), signals sent
    through the server (which knows whether the pid is still its child's)."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self.pid = pid
        self.stdin: Any = None
        self.stdout: Any = None
        self.returncode: int | None = None
        self._conn: socket.socket | None = conn

    def _hear(self, timeout: float | None) -> None:
        """Wait up to `timeout` s for the server's word that the child exited."""
        if self._conn is None:
            return
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return
        try:
            data = self._conn.recv(4096)
        except OSError:
            data = b""
        if not data:  # the server is gone, and its runners with it (PR_SET_PDEATHSIG)
            self.returncode = -signal.SIGKILL
        else:
            self.returncode = int(json.loads(data).get("exit", -signal.SIGKILL))
        self._conn.close()
        self._conn = None

    def poll(self) -> int | None:
        self._hear(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired("tunecache trial runner", timeout)
            self._hear(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self._conn is not None:
            try:
                self._conn.send(json.dumps({"signal": int(sig)}).encode())
            except OSError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def runner(role: str, env: dict[str, str], stderr_fd: int) -> ForkedProcess | None:
    """A worker process (`python -m tunecache.tuning.isolated_main ROLE`) forked from this host's
    server, its stdin and stdout pipes of ours; None: no server (one is started for later
    workers), or it did not answer: the caller starts a process of its own."""
    r_in, w_in = os.pipe()
    r_out, w_out = os.pipe()
    try:
        forked = spawn("tunecache.tuning.isolated_main", [role], env, (r_in, w_out, stderr_fd))
    finally:
        os.close(r_in)
        os.close(w_out)
    if forked is None:
        os.close(w_in)
        os.close(r_out)
        return None
    forked.stdin, forked.stdout = os.fdopen(w_in, "wb"), os.fdopen(r_out, "rb")
    return forked


def spawn(
    module: str, args: list[str], env: dict[str, str], fds: tuple[int, int, int], on_close: int = signal.SIGKILL
) -> ForkedProcess | None:
    """`python -m MODULE ARGS` (a tunecache module) forked from this host's server with `fds`
    as its stdin, stdout and stderr, or None (see `runner`). When our end of the connection
    closes (this process exits, even by kill -9), the server sends it `on_close`."""
    from tunecache import settings

    if not module.startswith("tunecache."):
        raise ValueError(f"the runner server runs tunecache's own modules, not {module!r}")
    try:
        if not settings.runner_server():
            return None
        path = socket_path(env)
    except (OSError, ValueError) as e:
        log.debug("tunecache: no runner server: %s", e)
        return None
    if path is None:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(_CONNECT_TIMEOUT_S)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        _start(path, env)
        return None
    try:
        request = {"module": module, "args": args, "env": env, "cwd": os.getcwd(), "on_close": int(on_close)}
        socket.send_fds(conn, [json.dumps(request).encode()], list(fds))
        answer = json.loads(conn.recv(4096) or b"{}")
        pid = int(answer["pid"])
    except (OSError, ValueError, KeyError) as e:
        log.debug("tunecache: the runner server did not fork %s: %s", module, e)
        conn.close()
        return None
    conn.settimeout(None)
    return ForkedProcess(conn, pid)


def ensure_server(env: dict[str, str], wait_s: float = 0.0) -> bool:
    """Start this host's runner server unless it is up; wait up to `wait_s` for it to listen.
    Whether it is up."""
    path = socket_path(env)
    if path is None:
        return False
    if not os.path.exists(path):
        _start(path, env)
    deadline = time.monotonic() + wait_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return os.path.exists(path)


def _start(path: str, env: dict[str, str]) -> None:
    """Start a server for `path` in the background (it imports torch, then listens)."""
    now = time.monotonic()
    if now - _started.get(path, -1e9) < _RESTART_AFTER_S:
        return
    _started[path] = now
    from tunecache import settings

    try:
        with open(path[: -len(".sock")] + ".log", "ab") as err:
            subprocess.Popen(
                [sys.executable, "-m", "tunecache.tuning.forkserver", path, str(settings.runner_server_idle_s())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=env,
                cwd="/",
                start_new_session=True,  # not in the caller's process group: its Ctrl-C is not ours
                close_fds=True,
            )
    except (OSError, ValueError) as e:
        log.debug("tunecache: could not start the runner server: %s", e)


def stop(path: str, wait_s: float = 10.0) -> None:
    """Ask the server at `path` to exit (its runners die with it), and wait until it has."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(_CONNECT_TIMEOUT_S)
    try:
        conn.connect(path)
        socket.send_fds(conn, [b'{"cmd": "stop"}'], [])
        conn.recv(16)
    except OSError:
        return
    finally:
        conn.close()
    import fcntl

    deadline = time.monotonic() + wait_s
    with open(path[: -len(".sock")] + ".lock", "a") as lock:  # the server holds it while it lives
        while time.monotonic() < deadline:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                time.sleep(0.02)
                continue
            fcntl.flock(lock, fcntl.LOCK_UN)
            return


def server_pid(path: str) -> int | None:
    """The pid of the server listening at `path`, as it wrote it beside its socket."""
    try:
        return int(Path(path[: -len(".sock")] + ".lock").read_text().strip() or 0) or None
    except (OSError, ValueError):
        return None


# ---- the server ---------------------------------------------------------------------------


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _child(request: dict, fds: list[int], server_side: list) -> None:
    """In the forked child: become the caller's trial runner. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for s in server_side:  # the server's sockets, files and pipes are not the runner's
            try:
                os.close(s) if isinstance(s, int) else s.close()
            except OSError:
                pass
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        try:
            os.chdir(request["cwd"])
        except OSError:
            pass
        import runpy

        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - said on the caller's stderr, then gone
        import traceback

        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()  # as a process's normal exit would: its own workers closed
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os._exit(code)


def serve(path: str, idle_s: float) -> None:
    """Import torch, listen at `path`, fork a runner per request; exit after `idle_s` with no
    runner alive, when asked, or when another server took the path over."""
    import fcntl

    lock = open(path[: -len(".sock")] + ".lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # another server starts or serves here
    import torch  # noqa: F401 - what the server is for

    from tunecache.tuning import isolated_main  # noqa: F401 - and what every runner runs

    if socket_path(dict(os.environ)) != path:  # started under other files than its caller's
        print(f"tunecache runner server: {path} is not this installation's; exiting", file=sys.stderr)
        return
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    os.chmod(path, 0o600)
    srv.listen(64)
    inode = os.stat(path).st_ino
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    alive: dict[int, socket.socket] = {}  # child pid -> its caller's connection
    conns: dict[socket.socket, int] = {}  # connection -> its child's pid
    on_close: dict[int, int] = {}  # child pid -> the signal it gets when its caller is gone
    last = time.monotonic()

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = alive.pop(pid, None)
            on_close.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass

    def forget(conn: socket.socket) -> None:
        pid = conns.pop(conn, None)
        if pid is not None and alive.get(pid) is conn:  # its caller is gone: so is the child
            try:
                os.kill(pid, on_close.get(pid, signal.SIGKILL))
            except ProcessLookupError:
                pass
        conn.close()

    try:
        while True:
            ready, _, _ = select.select([srv, wake_r, *conns], [], [], 30.0)
            for r in ready:
                if r == wake_r:
                    os.read(wake_r, 4096)
                elif r is srv:
                    conn, _ = srv.accept()
                    last = time.monotonic()
                    if _peer_uid(conn) != os.getuid():
                        conn.close()
                        continue
                    conn.settimeout(_CONNECT_TIMEOUT_S)
                    try:
                        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                        request = json.loads(data)
                    except (OSError, ValueError):
                        conn.close()
                        continue
                    if request.get("cmd") == "stop":
                        conn.close()
                        for fd in fds:
                            os.close(fd)
                        return
                    if len(fds) != 3 or not str(request.get("module", "")).startswith("tunecache."):
                        conn.close()
                        for fd in fds:
                            os.close(fd)
                        continue
                    pid = os.fork()
                    if pid == 0:
                        _child(request, fds, [srv, lock, wake_r, wake_w, *conns, conn])
                    for fd in fds:
                        os.close(fd)
                    conn.settimeout(None)
                    alive[pid] = conn
                    conns[conn] = pid
                    on_close[pid] = int(request.get("on_close", signal.SIGKILL))
                    try:
                        conn.send(json.dumps({"pid": pid}).encode())
                    except OSError:
                        forget(conn)
                else:
                    try:
                        data = r.recv(4096)
                    except OSError:
                        data = b""
                    if not data:
                        forget(r)
                    elif conns.get(r) in alive:
                        try:
                            os.kill(conns[r], int(json.loads(data).get("signal", signal.SIGKILL)))
                        except (ProcessLookupError, ValueError):
                            pass
            reap()
            if alive:
                last = time.monotonic()
            elif time.monotonic() - last > idle_s:
                return
            try:
                if os.stat(path).st_ino != inode:
                    return  # removed, or another server's now
            except FileNotFoundError:
                return
    finally:
        try:
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        except OSError:
            pass
        for conn in list(conns):
            forget(conn)


if __name__ == "__main__":
    serve(sys.argv[1], float(sys.argv[2]))
