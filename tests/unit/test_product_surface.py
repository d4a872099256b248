"""What a volunteer and the wire see carries no emulation and no fault injection.

Emulated devices, link proxies and injected faults live in ``testbeds/`` and ``tests/``
and reach the executor through its seams (:mod:`executor.hooks`); ``fusion-worker --help``,
the bare executor's ``--help``, the ``.proto`` sources and the code generated from them
mention none of it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from executor.server import build_parser as executor_parser
from fusion.cli.worker import build_parser as worker_parser

REPO_ROOT = Path(__file__).resolve().parents[2]
#: Words of the testbeds and the tests; ``default`` is not a fault.
FORBIDDEN = re.compile(r"emulat|slowdown|inject|(?<!de)fault|peer.?map", re.IGNORECASE)


@pytest.mark.parametrize("parser", [worker_parser, executor_parser], ids=["fusion-worker", "executor.server"])
def test_the_help_a_volunteer_reads_mentions_no_emulation_or_injection(parser: object) -> None:
    text = parser().format_help()  # type: ignore[operator]
    assert "--coordinator" in text or "--listen" in text
    assert not FORBIDDEN.findall(text), FORBIDDEN.findall(text)


def test_the_wire_mentions_no_emulation_or_injection() -> None:
    files = sorted((REPO_ROOT / "proto").rglob("*.proto")) + sorted((REPO_ROOT / "fusion" / "wire").glob("*_pb2*"))
    assert len(files) >= 6
    hits = {str(f.relative_to(REPO_ROOT)): FORBIDDEN.findall(f.read_text()) for f in files}
    assert not any(hits.values()), {f: h for f, h in hits.items() if h}
