"""Memory a worker lends, in the words people read.

A volunteer lends a capped amount of memory (``fusion-worker --memory-gb X``; by default
what the machine has free when the worker starts). The cap is the worker's reported memory:
the planner never plans over it, the executor refuses a stage whose planned peak does not
fit and fails a step whose measured peak does not, and a job whose workers cannot hold it
waits for more. Every message about it shows bytes the same way (:func:`format_bytes`).
"""

from __future__ import annotations

#: Bytes in the gigabyte of ``--memory-gb`` and a topology's ``memory_gb`` (GiB, as the
#: topology files have always read it).
GIB = 1 << 30


def gb_to_bytes(memory_gb: float) -> int:
    """``memory_gb`` (GiB, > 0) as whole bytes."""
    if not memory_gb > 0:
        raise ValueError(f"memory must be positive, got {memory_gb} GB")
    return max(1, int(round(memory_gb * GIB)))


def format_bytes(size_bytes: float) -> str:
    """``size_bytes`` in the largest binary unit that keeps it at 0.1 or more, to two
    decimals: ``0.93 GiB``, ``12.00 MiB``, ``512 B`` (GiB as ``--memory-gb`` counts them)."""
    size = float(size_bytes)
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(size) >= 0.1 * scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(size)} B"


def shortfall_text(needed_bytes: int, lent_bytes: int, num_workers: int) -> str:
    """What a job waiting for memory says: ``needs 1.40 GiB of worker memory, has 0.90 GiB
    (2 workers)``."""
    workers = "1 worker" if num_workers == 1 else f"{num_workers} workers"
    return f"needs {format_bytes(needed_bytes)} of worker memory, has {format_bytes(lent_bytes)} ({workers})"
