"""Per-source limits: the address a gRPC peer string names, the bounded token buckets, and
the rule that a valid credential is served whatever its address's failures.

The servers' checks are called directly with a stand-in for the gRPC context (only the
peer string, the metadata and the deadline matter to them); the real-network version of
the same property is ``tests/integration/test_lockout.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from executor.access import ExecutorAccess
from fusion.auth import AUTH_METADATA, SCHEME_CONTROL, KeyRing, RateLimiter, new_key, peer_host, sign
from fusion.coordinator.service import CoordinatorService
from fusion.coordinator.store import Store
from fusion.errors import AuthError, RateLimitError, WireError

PEER = "ipv4:203.0.113.7:50412"
TOKEN = "the-right-token-0123456789"


class Context:
    """What the access checks read of a ``grpc.ServicerContext``."""

    def __init__(self, credential: str = "", peer: str = PEER) -> None:
        self._metadata = ((AUTH_METADATA, credential),) if credential else ()
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float:
        return 10.0


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:127.0.0.1:41756", "127.0.0.1"),
        ("ipv4:203.0.113.7:1", "203.0.113.7"),
        ("ipv6:%5B::1%5D:58248", "::1"),  # how grpcio 1.6x+ writes it
        ("ipv6:[::1]:58248", "::1"),
        ("ipv6:%5B2001:db8:0:0::5%5D:443", "2001:db8::5"),
        ("ipv6:%5B::ffff:127.0.0.1%5D:9", "127.0.0.1"),  # dual-stack listener, IPv4 client
        ("unix:", "local unix socket"),  # a client's end of a unix socket has no path
        ("unix:/run/fusion.sock", "unix:/run/fusion.sock"),
        ("", "unknown address"),
    ],
)
def test_peer_host_names_the_address_without_the_port(peer: str, host: str) -> None:
    assert peer_host(peer) == host


def test_connections_of_one_host_share_a_source() -> None:
    assert peer_host("ipv6:%5B::1%5D:1000") == peer_host("ipv6:%5B::1%5D:2000")
    assert peer_host("ipv4:10.0.0.1:1000") == peer_host("ipv4:10.0.0.1:2000")


def test_rate_limiter_is_bounded_and_refills() -> None:
    limiter = RateLimiter(burst=2, per_s=1.0, max_peers=100)
    assert limiter.allow("a", now_s=0.0) and limiter.allow("a", now_s=0.0)
    assert not limiter.allow("a", now_s=0.0)
    assert limiter.allow("a", now_s=1.0)  # one token back after a second
    for i in range(10_000):  # a flood of addresses: the table keeps the newest 100
        limiter.allow(f"flood-{i}", now_s=2.0)
    assert len(limiter._buckets) == 100


def test_executor_serves_a_valid_credential_from_a_source_over_its_budget() -> None:
    key = new_key()
    access = ExecutorAccess(keyring=KeyRing(), control_key=key, failure_burst=3, failures_per_s=0.01)
    forged = Context(sign(new_key(), scheme=SCHEME_CONTROL, method="Ping"))
    for _ in range(3):
        with pytest.raises(AuthError):
            access.authenticate("Ping", forged)
    for credential in ("", "control - 1 2 3", sign(new_key(), scheme=SCHEME_CONTROL, method="Ping")):
        with pytest.raises(RateLimitError, match="too many failed authentications from 203.0.113.7 "):
            access.authenticate("Ping", Context(credential))
    principal = access.authenticate("Ping", Context(sign(key, scheme=SCHEME_CONTROL, method="Ping")))
    assert principal.scheme == SCHEME_CONTROL
    # Another address is not affected by this one's failures.
    with pytest.raises(AuthError) as info:
        access.authenticate("Ping", Context(peer="ipv4:198.51.100.1:5"))
    assert not isinstance(info.value, RateLimitError)


@pytest.fixture
def service(tmp_path: Path) -> CoordinatorService:
    return CoordinatorService(
        store=Store(tmp_path / "state.sqlite"),
        token=TOKEN,
        auth_failure_burst=3,
        auth_failures_per_s=0.01,
        register_burst=2,
        registers_per_s=0.01,
    )


def test_coordinator_serves_the_token_from_a_source_over_its_budget(service: CoordinatorService) -> None:
    for _ in range(3):
        with pytest.raises(AuthError):
            service._check_owner(Context("wrong"))
    with pytest.raises(RateLimitError, match="too many failed authentications from 203.0.113.7 "):
        service._check_owner(Context("wrong"))
    # Malformed requests without the token count and are refused alike; with it, they are a bug report.
    assert isinstance(service.malformed(Context(), WireError("malformed ListJobs request")), RateLimitError)
    assert type(service.malformed(Context(TOKEN), WireError("malformed"))) is WireError
    service._check_owner(Context(TOKEN))


def test_registrations_are_limited_per_source_only_once_the_token_is_proven(service: CoordinatorService) -> None:
    from fusion.wire import coordinator_pb2 as cpb

    for _ in range(10):  # others at this address fail: no registration is used up
        with pytest.raises((AuthError, RateLimitError)):
            service._check_owner(Context("wrong"))
    request = cpb.RegisterRequest(name="w", address="127.0.0.1:9")
    for _ in range(2):
        assert service.Register.__wrapped__(service, request, Context(TOKEN)).worker_id
    with pytest.raises(RateLimitError, match="too many registrations from 203.0.113.7 "):
        service.Register.__wrapped__(service, request, Context(TOKEN))
