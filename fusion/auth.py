"""Proof of membership on every RPC: HMAC credentials in gRPC metadata, replay protection,
rate limits.

Who holds which secret:

- the **coordinator token**: job owners, and volunteers when they register (coordinator
  only; see :mod:`fusion.coordinator.service`);
- a worker's **session** credential, issued by ``Register`` (the coordinator stores only
  its SHA-256); the worker's **control key** is derived from that hash, so the coordinator
  can derive it again after a restart without ever storing the session itself;
- a **job key**, drawn at random by the driver for each job and delivered in
  ``LoadStage`` wrapped (XOR with an HMAC pad) under the worker's control key, so it never
  crosses the wire in clear even without TLS;
- a **probe key**: a short-lived key the coordinator derives from a worker's control key
  and hands to that worker's peers, so they may measure the link to it (``Probe``) and
  nothing else.

A call proves a key without sending it: the ``fusion-auth`` metadata is
``SCHEME SCOPE TIMESTAMP NONCE MAC`` with ``MAC = HMAC-SHA256(key,
"SCHEME|METHOD|SCOPE|TIMESTAMP|NONCE")``. The receiver recomputes the MAC, accepts
timestamps within :data:`CLOCK_SKEW_S` of its own clock and remembers every nonce it
accepted for that long, so a captured credential cannot be replayed. The MAC does not
cover the message body: without TLS an active man in the middle can still rewrite calls
(SECURITY.md).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import ipaddress
import secrets
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from fusion.errors import AuthError

AUTH_METADATA = "fusion-auth"

#: Largest difference between the signer's and the verifier's clocks (seconds). Volunteers'
#: clocks are not trusted to be exact; five minutes is Kerberos's default.
CLOCK_SKEW_S = 300.0
#: How many accepted nonces a verifier remembers at most. Only verified calls enter the
#: cache, so only key holders can fill it; 10^6 calls in ten minutes is ~1,700 calls/s.
MAX_NONCES = 1_000_000
#: Lifetime of a probe key handed out for link measurement (seconds).
PROBE_KEY_TTL_S = 900

SCHEME_CONTROL = "control"
SCHEME_JOB = "job"
SCHEME_PROBE = "probe"
SCHEMES = frozenset({SCHEME_CONTROL, SCHEME_JOB, SCHEME_PROBE})
#: RPCs by which peers deliver a job's activations and gradients (a stream, or one message).
SEND_METHODS = frozenset({"Send", "SendWhole"})
#: RPCs a probe key may call (a stream, or one message).
PROBE_METHODS = frozenset({"Probe", "ProbeWhole"})

Metadata = tuple[tuple[str, str], ...]


def session_hash(session: str) -> str:
    """What the coordinator stores of a worker's session credential (hex SHA-256)."""
    return hashlib.sha256(session.encode()).hexdigest()


def control_key_from_hash(session_sha256: str) -> bytes:
    """A worker's control key, from the SHA-256 of its session credential."""
    try:
        secret = bytes.fromhex(session_sha256)
    except ValueError as e:
        raise AuthError("malformed session hash") from e
    return hmac.new(secret, b"fusion-executor-control-v1", hashlib.sha256).digest()


def control_key(session: str) -> bytes:
    """A worker's control key, from its session credential (what the worker computes)."""
    return control_key_from_hash(session_hash(session))


def probe_key(control: bytes, expiry: int) -> bytes:
    """The probe key for a worker, valid until ``expiry`` (Unix seconds)."""
    return hmac.new(control, f"fusion-probe-v1|{expiry}".encode(), hashlib.sha256).digest()


def new_key() -> bytes:
    """A fresh random 256-bit key."""
    return secrets.token_bytes(32)


def _mac(key: bytes, scheme: str, method: str, scope: str, ts: int, nonce: str) -> str:
    return hmac.new(key, f"{scheme}|{method}|{scope}|{ts}|{nonce}".encode(), hashlib.sha256).hexdigest()


def sign(key: bytes, *, scheme: str, method: str, scope: str = "-", now_s: float | None = None) -> str:
    """The ``fusion-auth`` value proving ``key`` for one call of ``method``.

    ``scope`` is the job id (job key), the probe key's expiry (probe key) or ``-``.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}")
    if not scope or any(c.isspace() for c in scope):
        raise AuthError(f"cannot sign for scope {scope!r}: it must be non-empty without spaces")
    ts = int(time.time() if now_s is None else now_s)
    nonce = secrets.token_hex(12)
    return f"{scheme} {scope} {ts} {nonce} {_mac(key, scheme, method, scope, ts, nonce)}"


@dataclass(frozen=True)
class Claim:
    """A parsed ``fusion-auth`` value, not yet verified."""

    scheme: str
    scope: str
    ts: int
    nonce: str
    mac: str


def parse(value: str) -> Claim:
    """Split a ``fusion-auth`` value; ``AuthError`` if it is not of the signed form."""
    parts = value.split(" ")
    if len(parts) != 5 or parts[0] not in SCHEMES:
        raise AuthError("missing or malformed fusion-auth credential")
    scheme, scope, ts, nonce, mac = parts
    if not ts.isdigit() or len(ts) > 12 or not 16 <= len(nonce) <= 64 or len(mac) != 64:
        raise AuthError("malformed fusion-auth credential")
    return Claim(scheme=scheme, scope=scope, ts=int(ts), nonce=nonce, mac=mac)


def metadata_value(metadata: object) -> str:
    """The ``fusion-auth`` entry of a call's invocation metadata, or ``""``."""
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == AUTH_METADATA:
            return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return ""


class NonceCache:
    """Nonces accepted within the clock-skew window; a second use is a replay."""

    def __init__(self, *, window_s: float = CLOCK_SKEW_S, max_entries: int = MAX_NONCES) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: dict[str, float] = {}
        self._order: collections.deque[tuple[float, str]] = collections.deque()
        self._lock = threading.Lock()

    def add(self, nonce: str, now_s: float) -> None:
        """Remember ``nonce``; ``AuthError`` if it was used before (or the cache is full)."""
        with self._lock:
            while self._order and self._order[0][0] < now_s:
                _, old = self._order.popleft()
                self._seen.pop(old, None)
            if nonce in self._seen:
                raise AuthError("replayed credential: this nonce was already used")
            if len(self._seen) >= self.max_entries:
                raise AuthError("too many authenticated calls in the replay window; slow down")
            expiry = now_s + 2 * self.window_s
            self._seen[nonce] = expiry
            self._order.append((expiry, nonce))


def verify(claim: Claim, key: bytes, *, method: str, nonces: NonceCache, now_s: float | None = None) -> None:
    """Check a claim's MAC, age and freshness; ``AuthError`` names what failed."""
    now = time.time() if now_s is None else now_s
    expected = _mac(key, claim.scheme, method, claim.scope, claim.ts, claim.nonce)
    if not hmac.compare_digest(expected, claim.mac):
        raise AuthError(f"wrong {claim.scheme} credential for {method}")
    if abs(now - claim.ts) > CLOCK_SKEW_S:
        raise AuthError(
            f"credential timestamp is {now - claim.ts:+.0f}s off this machine's clock (limit {CLOCK_SKEW_S:.0f}s): "
            "synchronise the clocks (NTP)"
        )
    nonces.add(claim.nonce, now)


def wrap_job_key(control: bytes, job_key: bytes) -> str:
    """Encrypt a 32-byte job key under a worker's control key for ``LoadStage.auth``."""
    if len(job_key) != 32:
        raise ValueError("job keys are 32 bytes")
    nonce = secrets.token_bytes(16)
    pad = hmac.new(control, b"fusion-job-key-v1|" + nonce, hashlib.sha256).digest()
    return nonce.hex() + ":" + bytes(a ^ b for a, b in zip(job_key, pad, strict=False)).hex()


def unwrap_job_key(control: bytes, wrapped: str) -> bytes:
    """Inverse of :func:`wrap_job_key`; ``AuthError`` if malformed."""
    try:
        nonce_hex, body_hex = wrapped.split(":")
        nonce, body = bytes.fromhex(nonce_hex), bytes.fromhex(body_hex)
    except ValueError:
        raise AuthError("LoadStage carries no well-formed job key (field auth)") from None
    if len(nonce) != 16 or len(body) != 32:
        raise AuthError("LoadStage carries no well-formed job key (field auth)")
    pad = hmac.new(control, b"fusion-job-key-v1|" + nonce, hashlib.sha256).digest()
    return bytes(a ^ b for a, b in zip(body, pad, strict=False))


class KeyRing:
    """The keys a process signs its outgoing executor calls with.

    Control keys are looked up by the callee's address (``resolve_control`` can supply
    them on demand, e.g. the coordinator derives them from its worker table); job keys by
    job id. One keyring per process is the default (:func:`process_keyring`): the
    driver, a worker's peer sends and the tests that start local executors all share it.
    """

    def __init__(self, *, resolve_control: Callable[[str], bytes | None] | None = None) -> None:
        self._control: dict[str, bytes] = {}
        self._jobs: dict[str, bytes] = {}
        self._probe: dict[str, tuple[int, bytes]] = {}
        self._resolve = resolve_control
        self._lock = threading.Lock()

    def set_control(self, address: str, key: bytes) -> None:
        with self._lock:
            self._control[address] = key

    def drop_control(self, address: str) -> None:
        with self._lock:
            self._control.pop(address, None)

    def control(self, address: str) -> bytes | None:
        """The control key of the executor at ``address``, if this process holds it."""
        with self._lock:
            key = self._control.get(address)
        if key is None and self._resolve is not None:
            key = self._resolve(address)
        return key

    def set_job(self, job_id: str, key: bytes) -> None:
        with self._lock:
            self._jobs[job_id] = key

    def drop_job(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def job(self, job_id: str) -> bytes | None:
        with self._lock:
            return self._jobs.get(job_id)

    def set_probe(self, address: str, expiry: int, key: bytes) -> None:
        with self._lock:
            self._probe[address] = (expiry, key)

    def metadata(self, address: str, method: str, job_id: str = "") -> Metadata:
        """The ``fusion-auth`` metadata for one call (a fresh nonce each time).

        ``Send`` (and ``SendWhole``) proves the job key when this process holds it (peers
        hold nothing else), ``Probe`` (and ``ProbeWhole``) a probe key; every other call the
        callee's control key, falling back to the job key. No key at all: no metadata, and
        the callee refuses with a clear error.
        """
        control = self.control(address)
        job = self.job(job_id) if job_id else None
        with self._lock:
            probe = self._probe.get(address)
        if method in PROBE_METHODS and probe is not None and probe[0] > time.time() + 5:
            return ((AUTH_METADATA, sign(probe[1], scheme=SCHEME_PROBE, method=method, scope=str(probe[0]))),)
        if job is not None and (method in SEND_METHODS or control is None):
            return ((AUTH_METADATA, sign(job, scheme=SCHEME_JOB, method=method, scope=job_id)),)
        if control is not None:
            return ((AUTH_METADATA, sign(control, scheme=SCHEME_CONTROL, method=method)),)
        return ()


_PROCESS_KEYRING = KeyRing()


def process_keyring() -> KeyRing:
    """The keyring shared by every channel pool of this process that is given none."""
    return _PROCESS_KEYRING


class RateLimiter:
    """Token buckets per peer (e.g. per IP address), with a bound on peers tracked.

    ``burst`` events at once, then ``per_s`` per second. When more than ``max_peers`` are
    tracked the least recently seen are forgotten (they start again with a full bucket):
    the memory of the limiter is bounded whatever a flood of addresses does.
    """

    def __init__(self, *, burst: float, per_s: float, max_peers: int = 65_536) -> None:
        if burst < 1 or per_s <= 0:
            raise ValueError("a rate limit needs burst >= 1 and per_s > 0")
        self.burst = burst
        self.per_s = per_s
        self.max_peers = max_peers
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _level(self, peer: str, now: float) -> float:
        tokens, last = self._buckets.get(peer, (self.burst, now))
        return min(self.burst, tokens + (now - last) * self.per_s)

    def allow(self, peer: str, *, now_s: float | None = None) -> bool:
        """Take one token from ``peer``'s bucket; ``False`` if it is empty."""
        now = time.monotonic() if now_s is None else now_s
        with self._lock:
            tokens = self._level(peer, now)
            ok = tokens >= 1.0
            self._buckets[peer] = (tokens - 1.0 if ok else tokens, now)
            self._buckets.move_to_end(peer)
            while len(self._buckets) > self.max_peers:
                self._buckets.popitem(last=False)
            return ok


def peer_host(peer: str) -> str:
    """The address part of a gRPC peer string, the key of the per-source limits and the
    address their messages name.

    ``ipv4:1.2.3.4:5678`` → ``1.2.3.4``; ``ipv6:%5B::1%5D:5678`` (gRPC percent-encodes the
    brackets) or ``ipv6:[::1]:5678`` → ``::1``; an IPv4-mapped IPv6 address → its IPv4 form,
    so a client counts the same on a dual-stack listener; ``unix:/path`` → ``unix:/path``,
    and ``unix:`` (a client socket has no path) → ``local unix socket``. The port is dropped:
    every connection of one host shares its limits. Never empty.
    """
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and rest:
        host = urllib.parse.unquote(rest)
        if host.startswith("["):
            host = host[1 : host.find("]")] if "]" in host else host[1:]
        elif kind == "ipv4" or host.count(":") == 1:
            host = host.rsplit(":", 1)[0]
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return host or peer
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ip)
    if kind in ("unix", "unix-abstract"):
        return peer if rest else "local unix socket"
    return peer or "unknown address"
