"""Worker security (story DGR-044) on real worker processes: a bearer token, TLS and mutual TLS.
A client without the token or the client certificate is refused (UNAUTHENTICATED, or the TLS
handshake fails); with them the route generates as usual. Certificates come from openssl."""

from __future__ import annotations

import subprocess
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
