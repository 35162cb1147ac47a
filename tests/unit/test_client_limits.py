"""The fleet client never stalls or bloats the user's call: one deadline per request however
slowly the service talks, a cap on the answer's size, https:// that trusts a private CA from
the environment, a warning when a token would cross the network in clear, and settings whose
bad values warn instead of failing the call. Every service here is a real one on loopback."""

from __future__ import annotations

import datetime
import http.server
import json
import logging
import shutil
import socket
import ssl
import subprocess
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from support.raw_http import RawServer, head
from tunecache import settings
from tunecache.fleet.client import FleetClient, is_loopback, sends_token_in_clear
from tunecache.key import TuneKey
from tunecache.store.records import ConfigRecord

SLACK_S = 0.5
KEY = TuneKey(
    "matmul.portable",
    "v1",
    "3.9.0",
    "cpu",
    0,
    {"M": 64, "N": 64, "K": 64, "dtype": "float32", "a_layout": "row", "b_layout": "row"},
)
RECORD = ConfigRecord(
    KEY, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}, 1.0
)
TRUST_VARS = ("TUNECACHE_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR")
CLIENT_VARS = (
    "TUNECACHE_SERVER_TIMEOUT_S",
    "TUNECACHE_SERVER_MAX_BYTES",
    "TUNECACHE_BREAKER_FAILURES",
    "TUNECACHE_BREAKER_OPEN_S",
    *TRUST_VARS,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in CLIENT_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def client_log(caplog):
    caplog.set_level(logging.WARNING, logger="tunecache.fleet.client")
    return caplog


def _warnings(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


@pytest.fixture
def serve():
    servers: list[RawServer] = []

    def start(answer) -> RawServer:
        servers.append(RawServer(answer))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


# ---- one deadline per request ---------------------------------------------------------


def dribble_body(server: RawServer, conn: socket.socket) -> None:
    """Valid headers at once, then the body a byte every 0.5 s: no single read ever times out."""
    body = json.dumps(RECORD.to_json()).encode()
    server.send(conn, head(Content_Length=len(body)))
    for i in range(len(body)):
        if server.stop.wait(0.5):
            return
        server.send(conn, body[i : i + 1])


def dribble_headers(server: RawServer, conn: socket.socket) -> None:
    """A status line, then one header a byte every 0.3 s, never finished."""
    server.send(conn, b"HTTP/1.1 200 OK\r\nX-Dribble: ")
    while not server.stop.wait(0.3):
        server.send(conn, b"a")


@pytest.mark.parametrize("answer", [dribble_body, dribble_headers], ids=["body", "headers"])
def test_a_dribbling_service_cannot_hold_a_lookup_past_the_deadline(serve, clean_env, client_log, answer):
    clean_env.setenv("TUNECACHE_SERVER_TIMEOUT_S", "1")
    server = serve(answer)
    client = FleetClient(server.url, "tc_token", failures=1, open_s=60)
    try:
        t0 = time.monotonic()
        assert client.lookup(KEY) is None
        elapsed = time.monotonic() - t0
        assert elapsed < 1.0 + SLACK_S, f"the lookup took {elapsed:.2f} s with a deadline of 1 s"
        assert server.sent > 0, "the service was talking, slowly"
        assert client.breaker.is_open, "running out of time is a failure of the breaker"
        assert _warnings(client_log, "deadline of 1 s (TUNECACHE_SERVER_TIMEOUT_S)")
    finally:
        client.close()


def test_a_slow_but_timely_answer_is_used(serve):
    def in_pieces(server: RawServer, conn: socket.socket) -> None:
        body = json.dumps(RECORD.to_json()).encode()
        server.send(conn, head(Content_Length=len(body)))
        for i in range(0, len(body), len(body) // 4 + 1):
            time.sleep(0.1)
            server.send(conn, body[i : i + len(body) // 4 + 1])

    server = serve(in_pieces)
    client = FleetClient(server.url, timeout_s=2.0, failures=1)
    try:
        rec = client.lookup(KEY)
        assert rec is not None and rec.config == RECORD.config and not client.breaker.is_open
    finally:
        client.close()


# ---- a cap on the answer's size ------------------------------------------------------------

BIG = 20 << 20


@pytest.fixture(scope="module")
def big_answer() -> bytes:
    return json.dumps({**RECORD.to_json(), "pad": "x" * BIG}).encode()


@pytest.mark.parametrize("framing", ["content-length", "chunked", "until-close"])
def test_an_oversized_answer_is_refused_without_reading_it(serve, client_log, big_answer, framing):
    def answer(server: RawServer, conn: socket.socket) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
        framed = {
            "content-length": head(Content_Length=len(big_answer)),
            "chunked": head(Transfer_Encoding="chunked"),
            "until-close": head(Connection="close"),
        }[framing]
        server.send(conn, framed)
        step = 1 << 16
        for i in range(0, len(big_answer), step):
            piece = big_answer[i : i + step]
            server.send(conn, b"%x\r\n%s\r\n" % (len(piece), piece) if framing == "chunked" else piece)
        if framing == "chunked":
            server.send(conn, b"0\r\n\r\n")

    server = serve(answer)
    client = FleetClient(server.url, timeout_s=5.0, failures=1, open_s=60)
    cap = client.max_bytes
    assert cap == settings.SERVER_MAX_BYTES == 4 << 20
    try:
        tracemalloc.start()
        t0 = time.monotonic()
        try:
            assert client.lookup(KEY) is None
            elapsed = time.monotonic() - t0
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert elapsed < 3.0, f"refusing the answer took {elapsed:.2f} s"
        limit = 1 << 20 if framing == "content-length" else 3 * cap  # the body is 20 MiB
        assert peak < limit, f"the lookup held {peak / 2**20:.1f} MiB of a {BIG >> 20} MiB answer"
        assert server.sent < len(big_answer), "the service could not push the whole answer"
        assert client.breaker.is_open, "an oversized answer is a failure of the breaker"
        size = str(len(big_answer)) if framing == "content-length" else f"cap of {cap} bytes"
        assert _warnings(client_log, size) and _warnings(client_log, "TUNECACHE_SERVER_MAX_BYTES")
    finally:
        client.close()


def test_the_size_cap_is_a_setting(serve, clean_env):
    def answer(server: RawServer, conn: socket.socket) -> None:
        body = json.dumps(RECORD.to_json()).encode()
        server.send(conn, head(Content_Length=len(body)) + body)

    server = serve(answer)
    clean_env.setenv("TUNECACHE_SERVER_MAX_BYTES", "100")
    small = FleetClient(server.url, failures=1)
    clean_env.delenv("TUNECACHE_SERVER_MAX_BYTES")
    default = FleetClient(server.url, failures=1)
    try:
        assert small.max_bytes == 100 and small.lookup(KEY) is None
        assert default.lookup(KEY) is not None
    finally:
        small.close()
        default.close()


# ---- https:// behind a private CA ----------------------------------------------------------


def _make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A private CA and a certificate for 127.0.0.1 it signed: (ca.pem, server.pem, server.key)."""
    ca_pem, cert_pem, key_pem = d / "ca.pem", d / "server.pem", d / "server.key"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        x509 = None
    if x509 is None:
        if not shutil.which("openssl"):
            pytest.skip("needs the cryptography package or the openssl command")
        run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True, cwd=d)  # noqa: E731
        new_key = ("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")  # a P-256 key, unencrypted
        run(
            *new_key,
            "-x509",
            "-keyout",
            "ca.key",
            "-out",
            ca_pem.name,
            "-days",
            "2",
            "-subj",
            "/CN=tunecache test CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        )
        run(
            *new_key,
            "-keyout",
            key_pem.name,
            "-out",
            "server.csr",
            "-subj",
            "/CN=127.0.0.1",
        )
        (d / "ext.cnf").write_text(
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
        )
        run(
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            ca_pem.name,
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            cert_pem.name,
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
        )
        return ca_pem, cert_pem, key_pem

    import ipaddress

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tunecache test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_pem.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return ca_pem, cert_pem, key_pem


class _ConfigService(http.server.BaseHTTPRequestHandler):
    """GET /v1/configs/{digest}: RECORD for its digest, 404 otherwise."""

    def do_GET(self) -> None:
        found = self.path == f"/v1/configs/{RECORD.digest}"
        body = json.dumps(RECORD.to_json() if found else {"detail": "no config"}).encode()
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def private_ca(tmp_path_factory):
    """An https:// service on loopback whose certificate a private CA signed: (url, ca.pem)."""
    d = tmp_path_factory.mktemp("tls")
    ca_pem, cert_pem, key_pem = _make_certs(d)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert_pem, key_pem)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ConfigService)
    httpd.daemon_threads = True
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"https://127.0.0.1:{httpd.server_address[1]}", ca_pem
    httpd.shutdown()
    httpd.server_close()


def _hashed_dir(ca_pem: Path) -> Path:
    """A directory holding the CA as OpenSSL's capath wants it (<subject hash>.0)."""
    if not shutil.which("openssl"):
        pytest.skip("needs the openssl command to hash a CA directory")
    h = subprocess.run(
        ["openssl", "x509", "-hash", "-noout", "-in", str(ca_pem)], check=True, capture_output=True, text=True
    ).stdout.strip()
    d = ca_pem.parent / "ca-dir"
    d.mkdir(exist_ok=True)
    shutil.copy(ca_pem, d / f"{h}.0")
    return d


@pytest.mark.parametrize(
    "var,form",
    [
        ("TUNECACHE_CA_BUNDLE", "file"),
        ("TUNECACHE_CA_BUNDLE", "dir"),
        ("SSL_CERT_FILE", "file"),
        ("SSL_CERT_DIR", "dir"),
    ],
)
def test_https_behind_a_private_ca_connects_when_the_environment_names_its_bundle(private_ca, clean_env, var, form):
    import certifi

    url, ca_pem = private_ca
    clean_env.setenv(var, str(ca_pem if form == "file" else _hashed_dir(ca_pem)))
    if var == "TUNECACHE_CA_BUNDLE":  # it comes first: a system bundle without the private CA is not used
        clean_env.setenv("SSL_CERT_FILE", certifi.where())
    client = FleetClient(url, "tc_token", timeout_s=3.0, failures=1)
    try:
        rec = client.lookup(KEY)
        assert rec is not None and rec.config == RECORD.config and not client.breaker.is_open
    finally:
        client.close()


def test_https_behind_a_private_ca_fails_softly_without_its_bundle(private_ca, client_log):
    url, _ = private_ca
    client = FleetClient(url, "tc_token", timeout_s=3.0, failures=1, open_s=60)
    try:
        assert client.lookup(KEY) is None
        assert client.breaker.is_open, "an untrusted certificate is a failure of the breaker"
        assert _warnings(client_log, "CERTIFICATE_VERIFY_FAILED")
    finally:
        client.close()


@pytest.mark.parametrize("bad", ["missing", "not PEM"])
def test_a_bad_ca_bundle_warns_naming_its_variable_and_fails_no_call(private_ca, clean_env, client_log, tmp_path, bad):
    url, _ = private_ca
    path = tmp_path / "ca.pem"
    if bad == "not PEM":
        path.write_text("this is not a certificate\n")
    clean_env.setenv("TUNECACHE_CA_BUNDLE", str(path))
    client = FleetClient(url, "tc_token", timeout_s=3.0, failures=1)
    try:
        assert _warnings(client_log, f"TUNECACHE_CA_BUNDLE={str(path)!r}")
        assert client.lookup(KEY) is None  # the default bundle does not hold the private CA
    finally:
        client.close()


# ---- a token over plain http:// --------------------------------------------------------


@pytest.mark.parametrize(
    "url,token,warned",
    [
        ("http://192.0.2.1:9", "tc_x", True),
        ("http://fleet.example.com:8000/", "tc_x", True),
        ("http://127.0.0.1:8000", "tc_x", False),
        ("http://127.4.5.6:8000", "tc_x", False),
        ("http://localhost:8000", "tc_x", False),
        ("http://[::1]:8000", "tc_x", False),
        ("https://fleet.example.com", "tc_x", False),
        ("http://fleet.example.com", None, False),
    ],
)
def test_a_token_in_clear_is_recognised(url, token, warned):
    assert sends_token_in_clear(url, token) is warned


def test_loopback_is_localhost_127_8_and_ipv6_one():
    assert all(map(is_loopback, ["localhost", "LOCALHOST.", "127.0.0.1", "127.255.0.9", "::1", "::ffff:127.0.0.1"]))
    assert not any(map(is_loopback, ["10.0.0.1", "192.0.2.1", "::2", "localhost.example.com", "fleet"]))


def test_a_token_sent_in_clear_off_this_machine_is_warned_about_once(client_log):
    client = FleetClient("http://192.0.2.1:9", "tc_secret", timeout_s=0.3, failures=2, open_s=60)
    try:
        t0 = time.monotonic()
        for _ in range(3):
            assert client.lookup(KEY) is None
        assert time.monotonic() - t0 < 2 * (0.3 + SLACK_S)
        warned = _warnings(client_log, "sent unencrypted")
        assert len(warned) == 1 and "192.0.2.1" in warned[0] and "tc_secret" not in warned[0]
    finally:
        client.close()


def test_a_token_sent_to_loopback_is_not_warned_about(serve, client_log):
    server = serve(lambda s, conn: s.send(conn, head("404 Not Found", Content_Length=2) + b"{}"))
    client = FleetClient(server.url, "tc_secret", failures=1)
    try:
        assert client.lookup(KEY) is None and not client.breaker.is_open  # a miss, not a failure
        assert not _warnings(client_log, "unencrypted")
    finally:
        client.close()


# ---- settings ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "var,value,read",
    [
        ("TUNECACHE_SERVER_TIMEOUT_S", "fast", settings.server_timeout_s),
        ("TUNECACHE_SERVER_TIMEOUT_S", "0", settings.server_timeout_s),
        ("TUNECACHE_SERVER_TIMEOUT_S", "inf", settings.server_timeout_s),
        ("TUNECACHE_SERVER_MAX_BYTES", "4MiB", settings.server_max_bytes),
        ("TUNECACHE_SERVER_MAX_BYTES", "-1", settings.server_max_bytes),
        ("TUNECACHE_BREAKER_FAILURES", "2.5", settings.breaker_failures),
        ("TUNECACHE_BREAKER_FAILURES", "0", settings.breaker_failures),
        ("TUNECACHE_BREAKER_OPEN_S", "nan", settings.breaker_open_s),
    ],
)
def test_a_bad_client_setting_names_itself_and_the_client_uses_the_default(clean_env, client_log, var, value, read):
    clean_env.setenv(var, value)
    with pytest.raises(ValueError, match=f"{var} .*{value!r}"):
        read()
    client = FleetClient("http://127.0.0.1:9")
    try:
        assert (client.timeout_s, client.max_bytes, client.breaker.failures, client.breaker.open_s) == (
            settings.SERVER_TIMEOUT_S,
            settings.SERVER_MAX_BYTES,
            settings.BREAKER_FAILURES,
            settings.BREAKER_OPEN_S,
        )
        assert len(_warnings(client_log, var)) == 1
    finally:
        client.close()


def test_client_settings_are_read_from_the_environment(clean_env):
    clean_env.setenv("TUNECACHE_SERVER_TIMEOUT_S", "0.75")
    clean_env.setenv("TUNECACHE_SERVER_MAX_BYTES", "1000")
    clean_env.setenv("TUNECACHE_BREAKER_FAILURES", "5")
    clean_env.setenv("TUNECACHE_BREAKER_OPEN_S", "0")
    client = FleetClient("http://127.0.0.1:9")
    try:
        assert (client.timeout_s, client.max_bytes, client.breaker.failures, client.breaker.open_s) == (
            0.75,
            1000,
            5,
            0.0,
        )
    finally:
        client.close()
