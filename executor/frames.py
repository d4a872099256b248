"""Tensor frames for the direct data plane: a fixed binary prefix, an authenticated header,
then the payload streamed straight into (or out of) tensor memory.

A frame carries one transfer (the same :class:`~fusion.wire.tensor_pb2.TransferHeader` and
payload layout as a gRPC ``Send``)::

    prefix   PREFIX (little-endian, fixed size):
             magic b"FSND" | version u8 | type u8 | job id bytes u16 | header bytes u32 |
             payload bytes u64 | sequence u64 | timestamp u64 (Unix s) | nonce 16 bytes
    job id   UTF-8, names the key that signs the frame
    header   TransferHeader (protobuf): stage pair, step, micro-batch, kind, and each
             tensor's name, dtype, shape, codec and byte size
    mac      HMAC-SHA256(job key, prefix | job id | header), 32 bytes
    payload  the tensors' bytes in header order
    tag      Poly1305(one-time key, payload), 16 bytes; the one-time key is
             HMAC-SHA256(job key, "fusion-frame-payload-v1|" | nonce)

The receiver reads the prefix and checks its lengths against the limits, then reads the
(bounded) job id, header and mac, verifies the mac with the job's key, refuses a
timestamp more than :data:`fusion.auth.CLOCK_SKEW_S` off its clock or a nonce seen before
(:class:`fusion.auth.NonceCache`, the replay protection of every gRPC call) and a sequence
number other than the connection's next, and validates the header (structure, sizes, the
stage's expected names, dtypes and shapes) -- all before one payload byte is read. Only
then does it allocate the tensors (``torch.empty``) and ``recv_into`` them piece by piece,
feeding the payload MAC as the pieces arrive; nothing is delivered unless the tag matches.
The header MAC binds the nonce, so the one-time payload key is bound to this frame.

A *warm-up* frame (type :data:`TYPE_WARMUP`) has the same prefix, MAC, freshness and
sequence checks, a header that names the job and no tensors, and a payload of at most
:data:`MAX_WARMUP_BYTES` zero bytes under the same tag; the receiver reads it, checks the
tag, answers and discards it (:mod:`executor.stream_client` says why a sender sends one).
Poly1305 (RFC 8439, one key per message) is used for the payload because it runs several
times faster than HMAC-SHA256; the header stays under HMAC-SHA256 like the gRPC credential.
Nothing is unpickled: the header is protobuf, the payload raw bytes.
"""

from __future__ import annotations

import hmac
import secrets
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from cryptography.hazmat.primitives.poly1305 import Poly1305

from executor.receive_buffers import ReceiveBuffers
from executor.transport import HEADER_ALLOWANCE_BYTES, check_header_shape, dtype_from_wire
from fusion.auth import CLOCK_SKEW_S, NonceCache
from fusion.errors import AuthError, StateError, WireError
from fusion.wire import tensor_pb2 as pb

MAGIC = b"FSND"
VERSION = 1
#: Frame types: a transfer, and a warm-up (padding that opens a new connection's sending
#: rate; module docstring). The receiver's answer is :mod:`executor.stream_server`'s.
TYPE_TRANSFER = 1
TYPE_WARMUP = 2
#: Largest warm-up payload a receiver reads.
MAX_WARMUP_BYTES = 8 << 20

PREFIX = struct.Struct("<4sBBHIQQQ16s")
MAC_BYTES = 32
TAG_BYTES = 16
#: Longest job id a frame may name.
MAX_JOB_ID_BYTES = 256
#: Largest serialised header a frame may carry (as the gRPC path's header allowance).
MAX_HEADER_BYTES = HEADER_ALLOWANCE_BYTES
#: Most bytes moved per ``send``/``recv_into`` call and fed to the payload MAC at once: large
#: enough that the per-call overhead (a syscall, a poll under a timeout, a Python loop turn)
#: is small next to the copy, small enough that a piece is still in cache when the MAC reads
#: it right after the copy (one pass over memory from the kernel, not two).
PIECE_BYTES = 4 << 20
#: Most bytes a receiver waits for in one ``recv_into`` before feeding them to the payload
#: MAC: small enough that the MAC of one piece runs while the next is still arriving.
RECV_PIECE_BYTES = 256 << 10

KeyLookup = Callable[[str], bytes | None]


def _payload_key(job_key: bytes, nonce: bytes) -> bytes:
    return hmac.digest(job_key, b"fusion-frame-payload-v1|" + nonce, "sha256")


def _header_mac(job_key: bytes, prefix: bytes, job: bytes, header: bytes) -> bytes:
    return hmac.digest(job_key, prefix + job + header, "sha256")


@dataclass(frozen=True)
class FramePrefix:
    """The fixed part of a frame, parsed and size-checked."""

    ftype: int
    job_len: int
    header_len: int
    payload_len: int
    seq: int
    ts: int
    nonce: bytes


def parse_prefix(raw: bytes, *, max_payload_bytes: int) -> FramePrefix:
    """Check a frame's fixed prefix; ``WireError`` for a bad magic, version, type or size."""
    if len(raw) != PREFIX.size:
        raise WireError(f"truncated frame: prefix of {len(raw)} bytes, expected {PREFIX.size}")
    magic, version, ftype, job_len, header_len, payload_len, seq, ts, nonce = PREFIX.unpack(raw)
    if magic != MAGIC:
        raise WireError(f"bad frame magic {magic!r}: not a fusion data-plane peer")
    if version != VERSION:
        raise WireError(f"frame version {version} is not supported (this worker speaks {VERSION})")
    if ftype not in (TYPE_TRANSFER, TYPE_WARMUP):
        raise WireError(f"frame type {ftype} is neither a transfer nor a warm-up")
    if not 0 < job_len <= MAX_JOB_ID_BYTES:
        raise WireError(f"frame names a job id of {job_len} bytes (1..{MAX_JOB_ID_BYTES})")
    if header_len > MAX_HEADER_BYTES:
        raise WireError(f"frame header of {header_len} bytes is above the limit of {MAX_HEADER_BYTES}")
    if ftype == TYPE_WARMUP and payload_len > MAX_WARMUP_BYTES:
        raise WireError(f"warm-up frame declares {payload_len} bytes, above the limit of {MAX_WARMUP_BYTES}")
    if ftype == TYPE_TRANSFER and payload_len > max_payload_bytes:
        raise WireError(f"frame declares {payload_len} payload bytes, above the limit of {max_payload_bytes}")
    return FramePrefix(ftype, job_len, header_len, payload_len, seq, ts, nonce)


def encode_head(
    job_key: bytes,
    header: pb.TransferHeader,
    payload_len: int,
    seq: int,
    *,
    nonce: bytes | None = None,
    ftype: int = TYPE_TRANSFER,
) -> tuple[bytes, bytes]:
    """The bytes before the payload, and the frame's nonce (fresh unless given)."""
    nonce = nonce if nonce is not None else secrets.token_bytes(16)
    job = header.job_id.encode()
    hb = header.SerializeToString()
    prefix = PREFIX.pack(MAGIC, VERSION, ftype, len(job), len(hb), payload_len, seq, int(time.time()), nonce)
    return prefix + job + hb + _header_mac(job_key, prefix, job, hb), nonce


def payload_pieces(views: list[memoryview]) -> Iterator[memoryview]:
    """The payload in pieces of at most :data:`PIECE_BYTES`."""
    for view in views:
        for start in range(0, len(view), PIECE_BYTES):
            yield view[start : start + PIECE_BYTES]


def payload_mac(job_key: bytes, nonce: bytes) -> Poly1305:
    """The payload MAC of the frame with ``nonce``; feed it with ``update``, end with ``finalize``."""
    return Poly1305(_payload_key(job_key, nonce))


@dataclass(frozen=True)
class VerifiedHeader:
    """A frame header whose MAC, freshness and sequence number were checked."""

    prefix: FramePrefix
    header: pb.TransferHeader
    job_key: bytes
    payload_len: int


def verify_head(
    prefix: FramePrefix,
    rest: bytes,
    raw_prefix: bytes,
    *,
    keys: KeyLookup,
    nonces: NonceCache,
    expected_seq: int,
    retired: Callable[[str], list[bytes]] | None = None,
    now_s: float | None = None,
) -> VerifiedHeader:
    """Authenticate and parse what follows the prefix (job id, header, mac).

    Raises ``AuthError`` (unknown job, wrong key, stale timestamp, replayed nonce),
    ``StateError`` (signed with one of the job's ``retired`` keys: a stage of a replaced
    placement still sending, as :meth:`executor.access.ExecutorAccess.authenticate` says for
    gRPC) or ``WireError`` (sequence gap, malformed header, header sizes that disagree with
    the prefix).
    """
    if len(rest) != prefix.job_len + prefix.header_len + MAC_BYTES:
        raise WireError("truncated frame: the header ended early")
    job = rest[: prefix.job_len]
    hb = rest[prefix.job_len : prefix.job_len + prefix.header_len]
    mac = rest[prefix.job_len + prefix.header_len :]
    try:
        job_id = job.decode()
    except UnicodeDecodeError:
        raise WireError("frame job id is not UTF-8") from None
    key = keys(job_id)
    if key is None:
        raise AuthError(f"no job {job_id!r} is loaded here; its job key is unknown")
    if not hmac.compare_digest(_header_mac(key, raw_prefix, job, hb), mac):
        for old in retired(job_id) if retired is not None else ():
            if hmac.compare_digest(_header_mac(old, raw_prefix, job, hb), mac):
                raise StateError(
                    f"stale frame for job {job_id!r}: it is signed with the job key of a placement that was replaced "
                    "(the sender missed a re-plan); refused, the current placement is unchanged"
                )
        raise AuthError(f"wrong job key for a frame of job {job_id!r}")
    now = time.time() if now_s is None else now_s
    if abs(now - prefix.ts) > CLOCK_SKEW_S:
        raise AuthError(
            f"frame timestamp is {now - prefix.ts:+.0f}s off this machine's clock (limit {CLOCK_SKEW_S:.0f}s): "
            "synchronise the clocks (NTP)"
        )
    nonces.add("frame:" + prefix.nonce.hex(), now)  # AuthError for a replayed frame
    if prefix.seq != expected_seq:
        raise WireError(f"frame sequence {prefix.seq} where {expected_seq} was due: a frame was replayed or dropped")
    try:
        header = pb.TransferHeader.FromString(hb)
    except Exception as e:  # protobuf's DecodeError
        raise WireError(f"malformed transfer header in a frame: {e}") from e
    if header.job_id != job_id:
        raise AuthError(f"a frame signed for job {job_id!r} cannot reach job {header.job_id!r}")
    if prefix.ftype == TYPE_WARMUP:
        if header.tensors:
            raise WireError(f"a warm-up frame names {len(header.tensors)} tensors; it carries none")
        return VerifiedHeader(prefix=prefix, header=header, job_key=key, payload_len=prefix.payload_len)
    total = check_header_shape(header)
    if total != prefix.payload_len:
        raise WireError(f"frame header declares {total} tensor bytes but the prefix {prefix.payload_len}")
    return VerifiedHeader(prefix=prefix, header=header, job_key=key, payload_len=total)


def receive_buffers(
    header: pb.TransferHeader, pool: ReceiveBuffers | None = None
) -> list[tuple[pb.TensorMeta, torch.Tensor, memoryview]]:
    """Preallocated tensors for a verified header, with a writable byte view of each: each
    raw tensor in its own dtype and shape, each encoded one as bytes; from ``pool`` when
    given (:mod:`executor.receive_buffers`)."""
    out = []
    for meta in header.tensors:
        raw = meta.codec in (pb.CODEC_NONE, pb.CODEC_UNSPECIFIED)
        dtype = dtype_from_wire(meta.dtype) if raw else torch.uint8
        if meta.size_bytes == 0:
            out.append((meta, torch.empty(tuple(meta.shape) if raw else (0,), dtype=dtype), memoryview(bytearray())))
            continue
        buf = pool.buffer(meta.size_bytes) if pool is not None else bytearray(meta.size_bytes)
        t = torch.frombuffer(buf, dtype=dtype)
        out.append((meta, t.view(tuple(meta.shape)) if raw else t, memoryview(buf)))
    return out
