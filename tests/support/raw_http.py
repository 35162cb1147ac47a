"""A raw HTTP server on loopback that answers however a test scripts it: garbage, a body that
dribbles in, headers that never end (what a real server would never send)."""

from __future__ import annotations

import socket
import threading
from typing import Callable


class RawServer:
    """A TCP server on loopback: each connection reads one request, then `answer(server, conn)`
    writes what it likes. `requests` counts the requests read, `sent` the bytes that got out."""

    def __init__(self, answer: Callable[["RawServer", socket.socket], None]) -> None:
        self.answer = answer
        self.requests = 0
        self.sent = 0
        self._count = threading.Lock()
        self.stop = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                request = b""
                while b"\r\n\r\n" not in request:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    request += chunk
                with self._count:
                    self.requests += 1
                self.answer(self, conn)
            except OSError:
                pass  # the client hung up: what the tests want

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def close(self) -> None:
        self.stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        except OSError:
            pass
        self.sock.close()


def head(status: str = "200 OK", **headers: object) -> bytes:
    """A response's status line and headers (Content-Type JSON, then `headers`, `_` read as `-`)."""
    lines = [
        f"HTTP/1.1 {status}",
        "Content-Type: application/json",
        *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()
