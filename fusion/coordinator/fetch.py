"""A job's output files, served to its owner in chunks (the Coordinator's ``FetchOutputs``).

What is served: the files of :mod:`fusion.coordinator.outputs` that exist in the job's
output directory and, when asked, the newest durable checkpoint (its ``.safetensors``, then
its ``.json`` record, under ``checkpoints/``). Nothing else: each name is resolved (symbolic
links followed) and must land on a regular file inside the job's resolved output directory,
so a link pointing elsewhere is refused, not followed.

The stream, per file: an ``OutputFileStart`` (path relative to the output directory, size),
the bytes in ``data`` messages of at most :data:`CHUNK_BYTES`, an ``OutputFileEnd`` with the
SHA-256 of exactly the bytes sent. The size is taken from the open file when it starts, so a
file that grows meanwhile (``metrics.jsonl`` of a running job) is sent as a consistent
prefix, and one replaced by rename is sent as it was when opened.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc

from executor.status import status_code_of
from fusion.checkpoint import CheckpointDir
from fusion.coordinator.outputs import (
    LOSS_PLOT_FILE,
    MEASURED_FILE,
    METRICS_FILE,
    MODEL_FILE,
    PLAN_FILE,
    SUMMARY_FILE,
)
from fusion.coordinator.store import JobRow
from fusion.errors import FusionError, StateError
from fusion.wire import coordinator_pb2 as cpb

logger = logging.getLogger(__name__)

#: Bytes per ``data`` message: far below the 4 MiB a gRPC client receives by default.
CHUNK_BYTES = 1 << 20
#: The output files served, in the order they are sent.
OUTPUT_FILES = (SUMMARY_FILE, PLAN_FILE, MEASURED_FILE, METRICS_FILE, LOSS_PLOT_FILE, MODEL_FILE)
#: Where a job's durable checkpoints live, relative to its output directory.
CHECKPOINT_DIR = "checkpoints"

F = TypeVar("F", bound=Callable[..., Iterator[Any]])


def contained(root: Path, name: str) -> Path | None:
    """The real path of ``root/name`` when it is a regular file inside ``root``; ``None``
    when nothing is there. Raises :class:`StateError` when it resolves outside ``root``
    (a symbolic link pointing elsewhere) or is not a regular file."""
    real_root = root.resolve()
    candidate = real_root / name
    if not os.path.lexists(candidate):
        return None
    real = candidate.resolve()
    if not real.is_relative_to(real_root):
        raise StateError(
            f"{name} in {real_root} resolves outside that directory (a symbolic link?); only files inside a job's "
            "output directory are served"
        )
    if not real.exists():
        return None  # a dangling link inside the directory: nothing to send
    if not real.is_file():
        raise StateError(f"{name} in {real_root} is not a regular file; it is not served")
    return real


def output_files(job: JobRow, *, checkpoint: bool) -> list[tuple[str, Path]]:
    """``(relative name, real path)`` of what ``FetchOutputs`` sends for ``job``.

    Raises :class:`StateError` when the job has no outputs yet, or ``checkpoint`` is asked
    and it has no durable checkpoint yet."""
    root = Path(job.output_dir)
    found = [(name, path) for name in OUTPUT_FILES if (path := contained(root, name)) is not None]
    if not found:
        raise StateError(
            f"job {job.job_id} has no outputs yet (it is {job.state}); they appear in {job.output_dir} on the "
            "coordinator once it runs"
        )
    if checkpoint:
        latest = CheckpointDir(root / CHECKPOINT_DIR).latest()
        if latest is None:
            raise StateError(
                f"job {job.job_id} has no durable checkpoint yet (one is written every checkpoint.durable_every "
                "steps); fetch without --checkpoint for its outputs"
            )
        blob = Path(os.path.relpath(latest.path, root))
        for name in (blob.as_posix(), blob.with_suffix(".json").as_posix()):  # the record last, as it is written
            real = contained(root, name)
            if real is None:
                raise StateError(f"job {job.job_id}: checkpoint file {name} vanished (a newer one replaced it); retry")
            found.append((name, real))
    return found


def file_parts(name: str, path: Path, *, chunk_bytes: int = CHUNK_BYTES) -> Iterator[cpb.FetchOutputsResponse]:
    """One file's start, its bytes in chunks and its end (SHA-256 of the bytes sent)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise StateError(f"{name} is not a regular file; it is not served")
        size = st.st_size
        yield cpb.FetchOutputsResponse(start=cpb.OutputFileStart(path=name, size_bytes=size))
        digest = hashlib.sha256()
        left = size
        while left > 0:
            chunk = f.read(min(chunk_bytes, left))
            if not chunk:
                raise StateError(f"{name} shrank while it was being sent ({size - left} of {size} bytes); retry")
            digest.update(chunk)
            left -= len(chunk)
            yield cpb.FetchOutputsResponse(data=chunk)
    yield cpb.FetchOutputsResponse(end=cpb.OutputFileEnd(sha256=digest.hexdigest()))


def stream_outputs(job: JobRow, *, checkpoint: bool) -> Iterator[cpb.FetchOutputsResponse]:
    """Every file :func:`output_files` names, one after the other."""
    files = output_files(job, checkpoint=checkpoint)
    total = sum(path.stat().st_size for _, path in files)
    logger.info("job %s: sending %d output file(s), %.1f MB", job.job_id, len(files), total / 1e6)
    for name, path in files:
        yield from file_parts(name, path)


def stream_errors(method: F) -> F:
    """Decorate a server-streaming servicer method (a generator): fusion errors raised while
    it streams end the call with their status code and message, anything else with
    ``INTERNAL``; the server thread survives (:func:`executor.status.rpc_errors` for streams)."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from method(self, request, context)
        except FusionError as e:
            code = status_code_of(e)
            logger.info("%s refused: %s (%s)", method.__name__, e, code.name)
            context.abort(code, f"{type(e).__name__}: {e}")
        except OSError as e:
            logger.warning("%s failed: %s", method.__name__, e)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        except Exception as e:
            logger.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

    return wrapper  # type: ignore[return-value]
