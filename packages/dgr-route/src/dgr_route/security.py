"""How a client reaches secured workers (story DGR-044): TLS with the CA that signed the workers'
certificates, a client certificate where workers require mutual TLS, and a bearer token where
they were started with `--auth-token-file`. Secrets are read from files, never from argv."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.max_send_message_length", 256 << 20),
    # keepalive as on the workers' own links: a worker that vanished without a reset is noticed
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # a route opened after a failure connects afresh: gRPC's process-wide subchannel pool would
    # hand it the connection the failed route used, which may sit on a dead path until
    # keepalive gives up on it
    ("grpc.use_local_subchannel_pool", 1),
]


@dataclass(frozen=True)
class Security:
    ca: bytes | None = None  # PEM: verify workers' certificates (TLS when set)
    cert: bytes | None = None  # PEM: this client's certificate, for mutual TLS
    key: bytes | None = None
    token: str | None = None  # sent as "authorization: Bearer <token>"

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate and its key go together")
        if self.cert is not None and self.ca is None:
            raise ValueError("a client certificate needs TLS: give the CA that signed the workers")

    @classmethod
    def from_files(
        cls,
        ca: Path | None = None,
        cert: Path | None = None,
        key: Path | None = None,
        token_file: Path | None = None,
    ) -> Security:
        """Read the files given; ValueError names the one that cannot be read or is empty."""
        if (cert is None) != (key is None):  # said before either is read
            raise ValueError("a client certificate and its key go together")
        token = None
        if token_file:
            try:
                token = (
                    _read(token_file, "the bearer token file", pem=False).decode("utf-8").strip()
                )
            except UnicodeDecodeError:
                raise ValueError(f"the bearer token file {token_file}: not UTF-8 text") from None
            if not token:
                raise ValueError(f"{token_file}: the file holds no token")
        return cls(
            ca=_read(ca, "the TLS CA") if ca else None,
            cert=_read(cert, "the client certificate") if cert else None,
            key=_read(key, "the client key") if key else None,
            token=token,
        )

    def cleartext_refusal(self, address: str) -> str | None:
        """Why a channel to `address` may not be opened (None: it may): the bearer token would
        cross a link that is not TLS and leaves this host. The workers enforce the same rule on
        their own links to each other."""
        if self.token is None or self.ca is not None or loopback_address(address):
            return None
        return (
            f"the link to {address} is not TLS and leaves this host: the bearer token is never "
            "sent in clear (give the CA that signed the workers' certificates)"
        )

    def channel(self, address: str) -> grpc.Channel:
        """A channel to `address`; CleartextCredential where the token would travel in clear."""
        if (why := self.cleartext_refusal(address)) is not None:
            raise CleartextCredential(why)
        if self.ca is None:
            return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        creds = grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )
        return grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


class CleartextCredential(ValueError):
    """A credential would cross a plaintext link off this host."""


def _read(path: Path, what: str, pem: bool = True) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror or exc}") from None
    if pem and not data.strip():
        raise ValueError(f"{what} {path}: the file is empty")
    if pem and b"-----BEGIN " not in data:
        # gRPC would only say "Failed to create security handshaker" on the first call
        raise ValueError(f"{what} {path}: not PEM (no -----BEGIN line)")
    return data


def loopback_address(address: str) -> bool:
    """Whether every address HOST:PORT resolves to is this host's loopback (unix sockets count);
    an address that does not resolve is not."""
    if address.startswith("unix:"):
        return True
    host, _, _port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host:
        return False
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    return bool(found) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in found)


PLAIN = Security()
