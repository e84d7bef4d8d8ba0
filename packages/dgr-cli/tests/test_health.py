"""`dgr health`: a real worker's grpc.health.v1 answer as an exit code (what the container's
HEALTHCHECK runs), a closed port and bad TLS arguments as failures that say why."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from dgr_cli import main
from dgr_cli.workers import descriptor_args, start_worker


def test_serving_worker_answers_serving(smollm2: Path, capfd: pytest.CaptureFixture[str]) -> None:
    worker = start_worker(smollm2, 0, 30, descriptor=descriptor_args(smollm2), n_ctx=256)
    try:
        assert main(["health", worker.address]) == 0
        assert capfd.readouterr().out.strip().splitlines()[-1] == f"{worker.address}: SERVING"
    finally:
        worker.stop()
    # stopped: nothing answers any more
    assert main(["health", worker.address, "--timeout", "1"]) == 1
    assert "UNAVAILABLE" in capfd.readouterr().err


def test_closed_port_and_bad_tls_arguments_fail_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["health", f"127.0.0.1:{port}", "--timeout", "1"]) == 1
    assert f"127.0.0.1:{port}: " in capsys.readouterr().err
    cert = tmp_path / "client.pem"
    cert.write_text("not a certificate")
    assert main(["health", "127.0.0.1:1", "--tls-cert", str(cert)]) == 2
    assert "certificate and its key go together" in capsys.readouterr().err
    assert main(["health", "127.0.0.1:1", "--tls-ca", str(tmp_path / "missing.pem")]) == 2
    assert "missing.pem" in capsys.readouterr().err
