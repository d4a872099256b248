"""Byte-level text corpus built from files already on this machine.

The default corpus is the Python standard library's own ``.py`` sources: every machine that
runs fusion has them, so a GPT-2 job needs no download and every worker of one Python
version reads the same bytes. Tokens are bytes (vocabulary 256), matching the ``tiny`` and
``mini`` GPT-2 presets.
"""

from __future__ import annotations

import functools
import logging
import os
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

from fusion.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["PySourceText", "stdlib_corpus"]

DEFAULT_MAX_BYTES = 2_000_000
"""Default corpus size; about 30k samples of 64 tokens, enough for small-model experiments."""

_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the standard library's ``.py`` files, concatenated.

    Files are read in sorted relative-path order (POSIX separators) so the corpus is the same
    on every machine with the same Python version. Installed packages (``site-packages``)
    and unreadable files are skipped. Cached per ``max_bytes``; callers must not modify the
    returned tensor.

    Args:
        max_bytes: the most bytes to return.

    Returns:
        uint8 tensor of shape (N,), N <= max_bytes.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    relative_paths: list[str] = []
    for dir_path, dir_names, file_names in os.walk(root):
        # Pruning in place keeps os.walk out of site-packages, which can be far larger.
        dir_names[:] = [d for d in dir_names if d not in _SKIPPED_DIRS]
        relative_dir = Path(dir_path).relative_to(root)
        relative_paths.extend((relative_dir / f).as_posix() for f in file_names if f.endswith(".py"))

    chunks: list[bytes] = []
    size_bytes = 0
    num_files = 0
    for relative_path in sorted(relative_paths):
        if size_bytes >= max_bytes:
            break
        try:
            data = (root / relative_path).read_bytes()
        except OSError as e:
            logger.debug("skipping unreadable %s: %s", relative_path, e)
            continue
        chunks.append(data[: max_bytes - size_bytes])
        size_bytes += len(chunks[-1])
        num_files += 1
    logger.info("read %d bytes from %d standard-library files under %s", size_bytes, num_files, root)
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


@functools.lru_cache(maxsize=4)
def _file_corpus(path: str, max_bytes: int) -> torch.Tensor:
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes)
    except OSError as e:
        raise ConfigError(f"cannot read text corpus {path!r}: {e}; give the path of a readable file") from e
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class PySourceText(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Next-byte prediction samples over a byte corpus.

    Sample ``i`` is ``(x, y)`` with ``x = corpus[i*L : i*L + L]`` and
    ``y = corpus[i*L + 1 : i*L + L + 1]`` (L = ``seq_len``), both int64 of shape (L,)
    with values in [0, 256). Samples do not overlap.

    Args:
        seq_len: tokens per sample; at most the model's ``block_size``.
        max_bytes: the most corpus bytes to read.
        path: a local text file to use instead of the standard-library sources.

    Raises:
        ConfigError: a size is not positive, the file cannot be read, or the corpus is too
            short for one sample.
    """

    def __init__(self, seq_len: int = 64, max_bytes: int = DEFAULT_MAX_BYTES, path: str | None = None) -> None:
        for name, value in (("seq_len", seq_len), ("max_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"pysource {name} must be a positive integer, got {value!r}")
        self.seq_len = seq_len
        self.corpus = stdlib_corpus(max_bytes) if path is None else _file_corpus(os.fspath(path), max_bytes)  # (N,)
        source = "the standard library" if path is None else repr(path)
        if self.corpus.numel() < seq_len + 1:
            raise ConfigError(
                f"text corpus from {source} has {self.corpus.numel()} bytes, fewer than seq_len + 1 = "
                f"{seq_len + 1}; use a longer text or a smaller seq_len"
            )

    def __len__(self) -> int:
        # The last target byte of the last sample must exist, hence the -1.
        return (self.corpus.numel() - 1) // self.seq_len

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample index {idx} out of range for {len(self)} samples")
        start = idx * self.seq_len
        chunk = self.corpus[start : start + self.seq_len + 1].long()  # (L + 1,)
        return chunk[:-1], chunk[1:]  # (L,), (L,)
