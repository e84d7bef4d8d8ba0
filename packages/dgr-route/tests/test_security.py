"""Worker security (story DGR-044) on real worker processes: a bearer token, TLS and mutual TLS.
A client without the token or the client certificate is refused (UNAUTHENTICATED, or the TLS
handshake fails); with them the route generates as usual. Certificates come from openssl."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from dgr_cli.workers import WorkerProcess, descriptor_args, start_worker
from dgr_route.route import Route, RouteError
from dgr_route.security import Security

LAYERS = (0, 30)


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a worker certificate for 127.0.0.1/localhost and a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=dgr-test-ca",
        "-keyout",
        str(d / "ca.key"),
        "-out",
        str(d / "ca.pem"),
    )
    for name, ext in [
        # a worker serves clients and, in forward mode, is the client of its next stage
        (
            "worker",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth",
        ),
        ("client", "extendedKeyUsage=clientAuth"),
    ]:
        (d / f"{name}.ext").write_text(ext + "\n")
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN=dgr-{name}",
            "-keyout",
            str(d / f"{name}.key"),
            "-out",
            str(d / f"{name}.csr"),
        )
        openssl(
            "x509",
            "-req",
            "-in",
            str(d / f"{name}.csr"),
            "-CA",
            str(d / "ca.pem"),
            "-CAkey",
            str(d / "ca.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            str(d / f"{name}.ext"),
            "-out",
            str(d / f"{name}.pem"),
        )
    (d / "token").write_text("s3cret-token\n")
    (d / "wrong-token").write_text("not-the-token\n")
    return d


@pytest.fixture(scope="module")
def secured(smollm2: Path, pki: Path) -> Iterator[dict[str, WorkerProcess]]:
    descriptor = descriptor_args(smollm2)
    tls = ["--tls-cert", str(pki / "worker.pem"), "--tls-key", str(pki / "worker.key")]
    flavours = {
        "token": ["--auth-token-file", str(pki / "token")],
        "tls": tls,
        "mtls": [*tls, "--tls-client-ca", str(pki / "ca.pem")],
    }
    started = {
        name: start_worker(smollm2, *LAYERS, descriptor=descriptor, n_ctx=256, extra=extra)
        for name, extra in flavours.items()
    }
    yield started
    for w in started.values():
        w.stop()


def generates(worker: WorkerProcess, security: Security) -> bool:
    route = Route.open([worker.address], timeout=10, security=security)
    try:
        return len(list(route.generate([1, 2, 3], 2))) == 2
    finally:
        route.close()


def refused(worker: WorkerProcess, security: Security) -> RouteError:
    with pytest.raises(RouteError) as info:
        generates(worker, security)
    return info.value


def test_a_bearer_token_is_required(secured: dict[str, WorkerProcess], pki: Path) -> None:
    worker = secured["token"]
    assert refused(worker, Security()).code == grpc.StatusCode.UNAUTHENTICATED
    wrong = Security.from_files(token_file=pki / "wrong-token")
    err = refused(worker, wrong)
    assert err.code == grpc.StatusCode.UNAUTHENTICATED and "wrong bearer token" in err.what
    assert generates(worker, Security.from_files(token_file=pki / "token"))


def test_tls_serves_clients_that_trust_its_ca(secured: dict[str, WorkerProcess], pki: Path) -> None:
    worker = secured["tls"]
    assert refused(worker, Security()).code == grpc.StatusCode.UNAVAILABLE  # plaintext client
    assert generates(worker, Security.from_files(ca=pki / "ca.pem"))


def test_mutual_tls_needs_a_client_certificate(
    secured: dict[str, WorkerProcess], pki: Path
) -> None:
    worker = secured["mtls"]
    assert (
        refused(worker, Security.from_files(ca=pki / "ca.pem")).code == grpc.StatusCode.UNAVAILABLE
    )
    client = Security.from_files(ca=pki / "ca.pem", cert=pki / "client.pem", key=pki / "client.key")
    assert generates(worker, client)


def test_forward_mode_links_authenticate_worker_to_worker(smollm2: Path, pki: Path) -> None:
    """Three mTLS + token workers: each reaches the next stage (and the tail the head) with its
    own certificate and token, so the route generates; a middle stage refuses a boundary from
    a peer that cannot authenticate, and the route names the stage that refused."""
    descriptor = descriptor_args(smollm2)
    secure = [
        "--tls-cert",
        str(pki / "worker.pem"),
        "--tls-key",
        str(pki / "worker.key"),
        "--tls-client-ca",
        str(pki / "ca.pem"),
        "--auth-token-file",
        str(pki / "token"),
    ]
    client = Security.from_files(
        ca=pki / "ca.pem", cert=pki / "client.pem", key=pki / "client.key", token_file=pki / "token"
    )
    layout = [(0, 10), (10, 20), (20, 30)]
    fleet = [
        start_worker(smollm2, a, b, descriptor=descriptor, n_ctx=256, extra=secure)
        for a, b in layout
    ]
    # a head with the certificate but without the route's token: its peers refuse it
    impostor = start_worker(smollm2, 0, 10, descriptor=descriptor, n_ctx=256, extra=secure[:-2])
    try:
        route = Route.open([w.address for w in fleet], timeout=10, security=client)
        assert len(list(route.generate([1, 2, 3], 4))) == 4
        route.close()
        mixed = Route.open(
            [impostor.address, fleet[1].address, fleet[2].address], timeout=10, security=client
        )
        with pytest.raises(RouteError) as info:
            list(mixed.generate([1, 2, 3], 4))
        assert info.value.stage == 1 and info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "missing authorization" in info.value.what
        mixed.close()
    finally:
        for w in [*fleet, impostor]:
            w.stop()


def test_secrets_come_in_pairs_and_from_files(pki: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="go together"):
        Security.from_files(ca=pki / "ca.pem", cert=pki / "client.pem")
    with pytest.raises(ValueError, match="needs TLS"):
        Security.from_files(cert=pki / "client.pem", key=pki / "client.key")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="holds no token"):
        Security.from_files(token_file=tmp_path / "empty")


def test_the_tokenizer_service_needs_the_token_too(
    secured: dict[str, WorkerProcess], pki: Path
) -> None:
    from dgr_route.tokenizer import RemoteTokenizer, TokenizerError

    worker = secured["token"]
    for security in (Security(), Security.from_files(token_file=pki / "wrong-token")):
        with pytest.raises(TokenizerError) as info:
            RemoteTokenizer(security.channel(worker.address), worker.address, security.metadata)
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    good = Security.from_files(token_file=pki / "token")
    remote = RemoteTokenizer(good.channel(worker.address), worker.address, good.metadata)
    assert remote.detokenize(remote.encode("Hello")).endswith(b"Hello")


class RecordingProxy:
    """A TCP proxy on loopback that records every byte its clients send to `target`: stands at
    a stage's peer address, where anything listening would read what the previous stage sends."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.sent = bytearray()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            host, port = self.target.rsplit(":", 1)
            upstream = socket.create_connection((host, int(port)))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if record:
                    with self._lock:
                        self.sent += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


def tls_records(data: bytes) -> bool:
    """Whether `data` is a sequence of TLS records (content type 20-23, version 3.x, length)."""
    at = 0
    while at < len(data):
        if len(data) - at < 5 or data[at] not in (20, 21, 22, 23) or data[at + 1] != 3:
            return False
        at += 5 + int.from_bytes(data[at + 3 : at + 5], "big")
    return len(data) > 0


def peer_link_route(
    smollm2: Path, pki: Path, middle_extra: list[str], head_extra: list[str]
) -> tuple[list[WorkerProcess], RecordingProxy]:
    descriptor = descriptor_args(smollm2)
    token = ["--auth-token-file", str(pki / "token")]
    head = start_worker(smollm2, 0, 10, descriptor=descriptor, n_ctx=256, extra=token + head_extra)
    middle = start_worker(
        smollm2, 10, 30, descriptor=descriptor, n_ctx=256, extra=token + middle_extra
    )
    return [head, middle], RecordingProxy(middle.address)


SERVER_TLS = ["--tls-cert", "worker.pem", "--tls-key", "worker.key"]


def server_tls(pki: Path) -> list[str]:
    return [str(pki / a) if a.endswith((".pem", ".key")) else a for a in SERVER_TLS]


@pytest.mark.parametrize("peer_ca", [True, False])
def test_a_tls_worker_speaks_only_tls_to_its_peers(smollm2: Path, pki: Path, peer_ca: bool) -> None:
    """Server-only TLS and a bearer token (no client CA), with a recording proxy at the middle
    stage's peer address: the head's link to it is TLS records from the first byte and the
    token never appears in clear. With --peer-ca the route generates; without it the head
    verifies the middle stage against the system's trust store, which does not know the test
    CA, so the link is refused and the route names stage 1, having sent nothing in clear."""
    # every stage verifies the peers it reaches (the tail reaches the head with its tokens)
    extra = server_tls(pki) + (["--peer-ca", str(pki / "ca.pem")] if peer_ca else [])
    (head, middle), proxy = peer_link_route(smollm2, pki, extra, extra)
    client = Security.from_files(ca=pki / "ca.pem", token_file=pki / "token")
    try:
        route = Route.open(
            [head.address, middle.address],
            timeout=10,
            security=client,
            peers=[head.address, proxy.address],
        )
        try:
            if peer_ca:
                assert len(list(route.generate(list(range(100, 140)), 4))) == 4
            else:
                with pytest.raises(RouteError) as info:
                    list(route.generate(list(range(100, 140)), 4))
                assert info.value.stage == 1 and proxy.address in info.value.address
        finally:
            route.close()
        time.sleep(0.2)
        assert proxy.sent, "the head never reached the middle stage's peer address"
        assert tls_records(bytes(proxy.sent)), bytes(proxy.sent[:64])
        assert b"s3cret-token" not in proxy.sent
    finally:
        proxy.close()
        head.stop()
        middle.stop()


def test_a_peer_that_offers_no_tls_is_refused_by_name(smollm2: Path, pki: Path) -> None:
    """A TLS head whose next stage is a plaintext worker: the handshake fails, the route names
    stage 1, and the bytes that went to it are a TLS ClientHello, never the token."""
    tls = [*server_tls(pki), "--peer-ca", str(pki / "ca.pem")]
    (head, plain), proxy = peer_link_route(smollm2, pki, [], tls)
    # the client opens the route through a TLS stage 1; the head's peer address for stage 1
    # leads (through the proxy) to a plaintext worker of the same layers
    middle = start_worker(
        smollm2,
        10,
        30,
        descriptor=descriptor_args(smollm2),
        n_ctx=256,
        extra=[*tls, "--auth-token-file", str(pki / "token")],
    )
    try:
        route = Route.open(
            [head.address, middle.address],
            timeout=10,
            security=Security.from_files(ca=pki / "ca.pem", token_file=pki / "token"),
            peers=[head.address, proxy.address],
        )
        try:
            with pytest.raises(RouteError) as info:
                list(route.generate([1, 2, 3], 2))
            assert info.value.stage == 1 and proxy.address in info.value.address
        finally:
            route.close()
        assert tls_records(bytes(proxy.sent)) and b"s3cret-token" not in proxy.sent
    finally:
        proxy.close()
        for w in (head, plain, middle):
            w.stop()


def test_a_token_never_leaves_the_host_in_clear(smollm2: Path, pki: Path) -> None:
    """Plaintext workers with a token: a peer on loopback gets it over the data link (tested in
    test_data_links.py), but a peer address off this host is refused before any byte goes out,
    by the worker (FAILED_PRECONDITION naming the stage and the address) and by the client."""
    descriptor = descriptor_args(smollm2)
    token = ["--auth-token-file", str(pki / "token")]
    head = start_worker(smollm2, 0, 10, descriptor=descriptor, n_ctx=256, extra=token)
    tail = start_worker(smollm2, 10, 30, descriptor=descriptor, n_ctx=256, extra=token)
    off_host = "stage-two.invalid:7002"  # not loopback (it resolves to nothing at all)
    client = Security.from_files(token_file=pki / "token")
    try:
        # the worker: its link to stage 1 would leave the host in clear
        route = Route.open(
            [head.address, tail.address],
            timeout=10,
            security=client,
            peers=[head.address, off_host],
        )
        try:
            with pytest.raises(RouteError) as info:
                list(route.generate([1, 2, 3], 2))
            assert info.value.stage == 1 and info.value.address == off_host
            assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "never sent in clear" in info.value.what
        finally:
            route.close()
        # the client: the same rule for the addresses it reaches itself
        with pytest.raises(RouteError) as info:
            Route.open([off_host], timeout=10, security=client)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "never sent in clear" in info.value.what
        assert [w.sessions(token="s3cret-token") for w in (head, tail)] == [0, 0]
    finally:
        head.stop()
        tail.stop()


def test_loopback_addresses() -> None:
    from dgr_route.security import loopback_address

    for address in ["127.0.0.1:1", "127.8.9.1:1", "[::1]:7001", "localhost:7001", "unix:/tmp/x"]:
        assert loopback_address(address), address
    for address in ["10.0.0.1:7001", "[2001:db8::1]:1", "stage.invalid:1", ":7001", "nonsense"]:
        assert not loopback_address(address), address
