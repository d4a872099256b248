"""Durable checkpoints: the whole model's training state on the coordinator's disk.

One checkpoint is ``ckpt-<step>.safetensors`` (keys as in :mod:`fusion.checkpoint.state`)
plus ``ckpt-<step>.json`` (step, size, SHA-256). Both are written to a temporary name,
flushed and renamed, the JSON last, so a checkpoint exists only once it is complete; a
crash mid-write leaves a ``.tmp`` file that is ignored and cleaned up. Loading re-hashes the
file and refuses it on any mismatch (a flipped byte is never loaded). The newest ``keep``
are kept.

A write that fails (a full disk: ``ENOSPC``, or any other ``OSError``) raises that error and
leaves the directory as it found it: no partial file, and the older checkpoints all kept
(pruning happens only after a complete write), so a later write can succeed once there is
room again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from fusion.checkpoint.snapshot import decode, encode
from fusion.errors import CheckpointError


@dataclass(frozen=True)
class CheckpointFile:
    step: int
    path: Path
    sha256: str
    size_bytes: int


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file; on any ``OSError`` the temporary
    file is removed and the error raised (``path`` is untouched)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


class CheckpointDir:
    """The durable checkpoints of one job."""

    def __init__(self, root: str | Path, keep: int = 3) -> None:
        self.root = Path(root)
        self.keep = keep

    def _paths(self, step: int) -> tuple[Path, Path]:
        return self.root / f"ckpt-{step:09d}.safetensors", self.root / f"ckpt-{step:09d}.json"

    def write(
        self, step: int, state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
    ) -> CheckpointFile:
        """Write the state after ``step`` optimizer steps; prune to the newest ``keep``.

        Raises the ``OSError`` of a failed write (e.g. ``ENOSPC``) with nothing of this
        checkpoint left behind and every older one kept."""
        self.root.mkdir(parents=True, exist_ok=True)
        data, sha = encode(state, {**(metadata or {}), "step": str(step), "format": "fusion-checkpoint-1"})
        blob, meta = self._paths(step)
        _write_atomic(blob, data)
        try:
            _write_atomic(
                meta, json.dumps({"step": step, "sha256": sha, "size_bytes": len(data), "file": blob.name}).encode()
            )
        except OSError:
            blob.unlink(missing_ok=True)  # a blob without its record is no checkpoint
            raise
        for old in self.list()[: -self.keep]:
            for p in self._paths(old.step):
                p.unlink(missing_ok=True)
        for tmp in self.root.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        return CheckpointFile(step=step, path=blob, sha256=sha, size_bytes=len(data))

    def list(self) -> list[CheckpointFile]:
        """Complete checkpoints (a JSON record and its blob), oldest first."""
        out = []
        if not self.root.is_dir():
            return out
        for meta in sorted(self.root.glob("ckpt-*.json")):
            try:
                rec = json.loads(meta.read_text())
                path = self.root / str(rec["file"])
                out.append(
                    CheckpointFile(
                        step=int(rec["step"]), path=path, sha256=str(rec["sha256"]), size_bytes=int(rec["size_bytes"])
                    )
                )
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return sorted((c for c in out if c.path.is_file()), key=lambda c: c.step)

    def latest(self) -> CheckpointFile | None:
        found = self.list()
        return found[-1] if found else None

    def load(self, ckpt: CheckpointFile) -> dict[str, torch.Tensor]:
        """The state in ``ckpt``, after checking size and SHA-256 (raises :class:`CheckpointError`)."""
        try:
            data = ckpt.path.read_bytes()
        except OSError as e:
            raise CheckpointError(f"cannot read checkpoint {ckpt.path}: {e}") from None
        if len(data) != ckpt.size_bytes:
            raise CheckpointError(f"checkpoint {ckpt.path} has {len(data)} bytes, {ckpt.size_bytes} were written")
        return decode(data, ckpt.sha256, what=f"checkpoint {ckpt.path}")

    def load_latest_valid(
        self, on_skip: Callable[[CheckpointFile, CheckpointError], None] | None = None
    ) -> tuple[CheckpointFile, dict[str, torch.Tensor]] | None:
        """The newest checkpoint that passes its checks; corrupt ones are skipped (and reported)."""
        for ckpt in reversed(self.list()):
            try:
                return ckpt, self.load(ckpt)
            except CheckpointError as e:
                if on_skip is not None:
                    on_skip(ckpt, e)
        return None
