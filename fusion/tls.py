"""TLS for every fusion service: server credentials, client channels, the exposure warning.

Servers (the coordinator, each worker's Executor) listen with TLS when given a
certificate and its key (``--tls-cert``/``--tls-key``). Clients verify servers against a
CA bundle (``--tls-ca``): the coordinator and the workers' executors must present
certificates that CA signed, for the host name or IP address that is dialled. A process
sets its CA once (:func:`set_client_ca`); every channel it opens afterwards uses TLS
(plain-text channels are then refused, so a misconfigured peer fails loudly instead of
silently downgrading).
"""

from __future__ import annotations

import ipaddress
import logging
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from fusion.errors import ConfigError

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def _read(path: str | Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read the TLS {what} {path}: {e}") from e
    if not data.strip():
        raise ConfigError(f"the TLS {what} {path} is empty")
    return data


@dataclass(frozen=True, kw_only=True)
class ServerTls:
    """A server's certificate chain and private key (PEM)."""

    cert_pem: bytes
    """Certificate chain, leaf first."""
    key_pem: bytes
    """Private key of the leaf certificate."""

    @classmethod
    def from_files(cls, cert: str | Path | None, key: str | Path | None) -> ServerTls | None:
        """``None`` when neither is given; ``ConfigError`` when only one is."""
        if cert is None and key is None:
            return None
        if cert is None or key is None:
            raise ConfigError("TLS needs both --tls-cert and --tls-key")
        return cls(cert_pem=_read(cert, "certificate"), key_pem=_read(key, "key"))

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])


def add_port(server: grpc.Server, address: str, tls: ServerTls | None) -> int:
    """Listen on ``address`` with TLS when configured; returns the bound port (0: failed)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.credentials())


_client_ca: bytes | None = None
_client_lock = threading.Lock()


def set_client_ca(ca: str | Path | bytes | None) -> None:
    """Make every channel this process opens from now on use TLS, verified against ``ca``."""
    global _client_ca
    data = ca if isinstance(ca, bytes) or ca is None else _read(ca, "CA bundle")
    with _client_lock:
        _client_ca = data


def client_ca() -> bytes | None:
    """The CA bundle this process verifies servers against (``None``: plain text)."""
    with _client_lock:
        return _client_ca


def open_channel(
    address: str, *, options: Sequence[tuple[str, int | str]] = (), ca: bytes | None = None
) -> grpc.Channel:
    """A channel to ``address``: TLS when a CA is given (or set for the process)."""
    root = ca if ca is not None else client_ca()
    if root is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=root), options=list(options))


def is_loopback(host: str) -> bool:
    """Whether ``host`` is only reachable from this machine."""
    host = host.strip("[]")
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, tls: ServerTls | None, what: str) -> bool:
    """Print a loud warning when ``what`` listens beyond loopback without TLS; returns whether it did."""
    if tls is not None or is_loopback(host):
        return False
    print(
        f"WARNING: {what} listens on {host} WITHOUT TLS: job specs, parameters and tensors cross the network in "
        "clear text, the coordinator token is sent in clear at registration, and calls can be tampered with in flight. "
        "Pass --tls-cert and --tls-key (and give clients --tls-ca).",
        file=sys.stderr,
        flush=True,
    )
    logger.warning("%s listens on %s without TLS", what, host)
    return True
