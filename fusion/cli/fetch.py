"""``fusion fetch JOB_ID [--out DIR] [--checkpoint]``: bring a job's outputs to this machine.

The coordinator streams each output file in chunks with its size and SHA-256
(:mod:`fusion.coordinator.fetch`); :func:`receive_outputs` writes each one to a temporary
name in ``DIR/JOB_ID/``, checks its size and digest, flushes it to disk and only then renames
it over the final name. A file that fails any check, or a stream cut short, leaves no file
behind (an earlier copy of that file stays as it was) and the error names the file.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, TextIO

from fusion.errors import ConfigError, RemoteError, WireError
from fusion.wire import coordinator_pb2 as cpb

#: Files at least this large get progress lines on stderr.
PROGRESS_MIN_BYTES = 8 << 20
#: Seconds between progress lines when stderr is not a terminal.
PROGRESS_EVERY_S = 2.0
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class ReceivedFile:
    """A file written and verified by :func:`receive_outputs`."""

    name: str
    path: Path
    size_bytes: int
    sha256: str


def _safe_name(name: str) -> PurePosixPath:
    """``name`` as a relative path that stays inside the destination (the server's word is
    not trusted: an absolute path or ``..`` is refused)."""
    rel = PurePosixPath(name)
    if not name or rel.is_absolute() or any(p in ("", ".", "..") for p in name.split("/")) or "\\" in name:
        raise WireError(f"the coordinator sent an unsafe output path {name!r}; nothing was written for it")
    return rel


class _Progress:
    """Progress of one large file on stderr: an updating line on a terminal, else a plain
    line every :data:`PROGRESS_EVERY_S` seconds."""

    def __init__(self, name: str, size_bytes: int, out: TextIO | None) -> None:
        self.name = name
        self.size_bytes = size_bytes
        self.out = out if size_bytes >= PROGRESS_MIN_BYTES else None
        self.tty = bool(self.out is not None and self.out.isatty())
        self.t0 = self.last = time.monotonic()
        self.shown_bytes = -1

    def update(self, done_bytes: int, *, final: bool = False) -> None:
        if self.out is None:
            return
        now = time.monotonic()
        if not self.tty and (done_bytes == self.shown_bytes or (not final and now - self.last < PROGRESS_EVERY_S)):
            return
        self.last, self.shown_bytes = now, done_bytes
        rate = done_bytes / max(now - self.t0, 1e-9) / 1e6
        line = (
            f"{self.name}: {done_bytes / 1e6:.1f}/{self.size_bytes / 1e6:.1f} MB "
            f"({100 * done_bytes / max(self.size_bytes, 1):.0f}%, {rate:.1f} MB/s)"
        )
        if self.tty:
            self.out.write("\r" + line + ("\n" if final else ""))
        else:
            self.out.write(line + "\n")
        self.out.flush()


class _Incoming:
    """One file being received into a temporary sibling of its final path."""

    def __init__(self, dest: Path, start: cpb.OutputFileStart, progress: TextIO | None) -> None:
        self.name = start.path
        self.size_bytes = int(start.size_bytes)
        self.path = dest.joinpath(*_safe_name(self.name).parts)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".part", dir=self.path.parent)
        self.tmp = Path(tmp)
        self.file: BinaryIO = os.fdopen(fd, "wb")
        self.digest = hashlib.sha256()
        self.received_bytes = 0
        self.progress = _Progress(self.name, self.size_bytes, progress)

    def write(self, data: bytes) -> None:
        if self.received_bytes + len(data) > self.size_bytes:
            raise WireError(
                f"{self.name}: the coordinator sent more than the {self.size_bytes} bytes it announced; "
                "nothing was written for it"
            )
        self.file.write(data)
        self.digest.update(data)
        self.received_bytes += len(data)
        self.progress.update(self.received_bytes)

    def finish(self, sha256: str) -> ReceivedFile:
        """Check size and digest, flush to disk and rename into place."""
        if self.received_bytes != self.size_bytes:
            raise WireError(
                f"{self.name}: received {self.received_bytes} of {self.size_bytes} bytes; nothing was written for it"
            )
        if self.digest.hexdigest() != sha256:
            raise WireError(
                f"{self.name}: SHA-256 of the bytes received does not match the coordinator's "
                f"({self.digest.hexdigest()[:16]}… vs {sha256[:16]}…): corrupted in transit; nothing was written "
                "for it, fetch again"
            )
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.chmod(self.tmp, 0o644)  # mkstemp makes 0600
        os.replace(self.tmp, self.path)
        _fsync_dir(self.path.parent)
        self.progress.update(self.received_bytes, final=True)
        return ReceivedFile(name=self.name, path=self.path, size_bytes=self.size_bytes, sha256=sha256)

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def receive_outputs(
    parts: Iterable[cpb.FetchOutputsResponse], dest: Path, *, progress: TextIO | None = None
) -> list[ReceivedFile]:
    """Write the files of a ``FetchOutputs`` stream under ``dest`` (created when the first
    file starts), each verified and renamed into place as its end arrives.

    Raises :class:`~fusion.errors.WireError` naming the file on any mismatch (size, SHA-256,
    an unsafe path, parts out of order, a stream that stops inside a file), and re-raises a
    failure of the stream itself naming the file it cut; either way no partial file is left.
    Files completed before the failure stay (each is whole and verified)."""
    received: list[ReceivedFile] = []
    seen: set[str] = set()
    current: _Incoming | None = None
    try:
        for part in parts:
            kind = part.WhichOneof("part")
            if kind == "start":
                if current is not None:
                    raise WireError(f"{current.name}: the next file started before this one ended; not written")
                if part.start.path in seen:
                    raise WireError(f"the coordinator sent {part.start.path} twice")
                seen.add(part.start.path)
                current = _Incoming(dest, part.start, progress)
            elif current is None:
                raise WireError(f"the coordinator sent file {kind or 'nothing'} outside any file")
            elif kind == "data":
                current.write(part.data)
            elif kind == "end":
                received.append(current.finish(part.end.sha256))
                current = None
            else:
                raise WireError(f"{current.name}: an empty part in the stream; nothing was written for it")
        if current is not None:
            raise WireError(
                f"{current.name}: the stream ended after {current.received_bytes} of {current.size_bytes} bytes; "
                "nothing was written for it"
            )
    except RemoteError as e:
        if current is None:
            raise
        raise RemoteError(
            f"{e} (while receiving {current.name}; nothing was written for it)", code=e.code, peer=e.peer
        ) from e
    except OSError as e:
        where = current.name if current is not None else str(dest)
        raise ConfigError(f"cannot write {where} under {dest}: {e}; pass another --out") from e
    finally:
        if current is not None:
            current.discard()
    return received


def cmd_fetch(args: argparse.Namespace) -> int:
    from fusion.cli.env import resolve_token
    from fusion.coordinator.client import CoordinatorClient
    from fusion.tls import set_client_ca

    if not _JOB_ID.fullmatch(args.job_id):
        raise ConfigError(f"{args.job_id!r} is not a job id (fusion jobs lists them)")
    token = resolve_token(args.token, args.token_file)
    assert token is not None
    if args.tls_ca:
        set_client_ca(args.tls_ca)
    dest = Path(args.out).expanduser() / args.job_id
    with CoordinatorClient(args.coordinator, token) as client:
        files = receive_outputs(
            client.fetch_outputs(args.job_id, checkpoint=args.checkpoint), dest, progress=sys.stderr
        )
    width = max((len(f.name) for f in files), default=0)
    for f in files:
        print(f"  {f.name:<{width}} {f.size_bytes / 1e6:9.2f} MB  sha256 {f.sha256[:16]}…")
    total = sum(f.size_bytes for f in files)
    print(f"fetched {len(files)} file(s), {total / 1e6:.2f} MB, of {args.job_id} into {dest}")
    return 0


def add_fetch_parser(sub: Any) -> None:
    """Register ``fusion fetch`` on the ``fusion`` sub-command parser."""
    from fusion.cli.env import add_connection_args, add_log_arg, env_tls_ca

    text = "download a job's outputs from the coordinator into DIR/JOB_ID/ (verified by SHA-256)"
    sp = sub.add_parser("fetch", help=text, description=text)
    sp.add_argument("job_id", help="job id (fusion jobs lists them)")
    sp.add_argument("--out", default=".", help="directory to put JOB_ID/ in (default: the current directory)")
    sp.add_argument("--checkpoint", action="store_true", help="also fetch the newest durable checkpoint")
    add_connection_args(sp)
    sp.add_argument(
        "--tls-ca",
        default=env_tls_ca(),
        help="CA bundle that signed the coordinator's certificate: talk TLS (default: $FUSION_TLS_CA)",
    )
    add_log_arg(sp)
    sp.set_defaults(func=cmd_fetch)
