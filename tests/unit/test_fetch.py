"""``fusion fetch`` in parts: what the coordinator serves from a job's output directory
(only files inside it), and how the client verifies a stream of chunks (size, SHA-256,
order) and leaves no partial file when a check fails.

The real gRPC path, with a coordinator and a worker running a job, is
``tests/integration/test_fetch.py``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fusion.checkpoint import CheckpointDir
from fusion.cli.fetch import receive_outputs
from fusion.coordinator.fetch import contained, file_parts, output_files, stream_outputs
from fusion.coordinator.store import JobRow
from fusion.errors import RemoteError, StateError, WireError
from fusion.wire import coordinator_pb2 as cpb

pytestmark = pytest.mark.timeout(60)


def job_row(output_dir: Path, state: str = "succeeded") -> JobRow:
    return JobRow(
        job_id="job-1234abcd",
        name="t",
        spec_json="{}",
        state=state,
        reason=None,
        created_at=0.0,
        started_at=None,
        finished_at=None,
        step=0,
        steps=1,
        loss=None,
        samples_per_s=None,
        output_dir=str(output_dir),
        plan_json=None,
        workers_json=None,
    )


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    d = tmp_path / "out" / "job-1234abcd"
    d.mkdir(parents=True)
    (d / "summary.json").write_text('{"state": "succeeded"}\n')
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    return d


# ------------------------------------------------------------- serving side
def test_serves_the_output_files_that_exist(job_dir: Path) -> None:
    files = output_files(job_row(job_dir), checkpoint=False)
    assert [name for name, _ in files] == ["summary.json", "model.safetensors"]


def test_symlink_out_of_the_directory_is_refused(job_dir: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    (job_dir / "plan.json").symlink_to(secret)
    with pytest.raises(StateError, match="plan.json .*resolves outside"):
        output_files(job_row(job_dir), checkpoint=False)
    assert contained(job_dir, "summary.json") == (job_dir / "summary.json").resolve()


def test_symlink_inside_the_directory_is_served(job_dir: Path) -> None:
    (job_dir / "plan.json").symlink_to(job_dir / "summary.json")
    assert contained(job_dir, "plan.json") == (job_dir / "summary.json").resolve()


def test_a_directory_in_place_of_a_file_is_refused(job_dir: Path) -> None:
    (job_dir / "loss.png").mkdir()
    with pytest.raises(StateError, match="not a regular file"):
        output_files(job_row(job_dir), checkpoint=False)


def test_checkpoint_record_pointing_outside_is_refused(job_dir: Path, tmp_path: Path) -> None:
    ckpts = job_dir / "checkpoints"
    ckpts.mkdir()
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(b"x" * 10)
    (ckpts / "ckpt-000000009.json").write_text(
        json.dumps({"step": 9, "sha256": "0" * 64, "size_bytes": 10, "file": "../../../elsewhere.safetensors"})
    )
    with pytest.raises(StateError, match="resolves outside"):
        output_files(job_row(job_dir), checkpoint=True)


def test_newest_checkpoint_is_served(job_dir: Path) -> None:
    ckpts = CheckpointDir(job_dir / "checkpoints", keep=3)
    for step in (2, 4):
        ckpts.write(step, {"w": torch.full((3,), float(step))})
    names = [name for name, _ in output_files(job_row(job_dir), checkpoint=True)]
    assert names[-2:] == ["checkpoints/ckpt-000000004.safetensors", "checkpoints/ckpt-000000004.json"]


def test_no_outputs_and_no_checkpoint_are_clear_errors(tmp_path: Path, job_dir: Path) -> None:
    with pytest.raises(StateError, match="no outputs yet .*pending"):
        output_files(job_row(tmp_path / "never-ran", state="pending"), checkpoint=False)
    with pytest.raises(StateError, match="no durable checkpoint yet"):
        output_files(job_row(job_dir), checkpoint=True)


def test_file_parts_are_chunked_and_digested(job_dir: Path) -> None:
    path = job_dir / "model.safetensors"
    parts = list(file_parts("model.safetensors", path, chunk_bytes=1000))
    data = path.read_bytes()
    assert parts[0].start.size_bytes == len(data)
    chunks = [p.data for p in parts[1:-1]]
    assert max(map(len, chunks)) == 1000 and b"".join(chunks) == data
    assert parts[-1].end.sha256 == hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------- receiving side
def stream_of(files: dict[str, bytes], *, chunk_bytes: int = 7) -> list[cpb.FetchOutputsResponse]:
    out = []
    for name, data in files.items():
        out.append(cpb.FetchOutputsResponse(start=cpb.OutputFileStart(path=name, size_bytes=len(data))))
        out += [cpb.FetchOutputsResponse(data=data[i : i + chunk_bytes]) for i in range(0, len(data), chunk_bytes)]
        out.append(cpb.FetchOutputsResponse(end=cpb.OutputFileEnd(sha256=hashlib.sha256(data).hexdigest())))
    return out


def listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


FILES = {"summary.json": b'{"a": 1}\n', "model.safetensors": b"\x01\x02" * 50, "checkpoints/ckpt-2.json": b"{}"}


def test_received_files_equal_the_sent_bytes(tmp_path: Path) -> None:
    got = receive_outputs(stream_of(FILES), tmp_path / "job")
    assert [f.name for f in got] == list(FILES)
    for name, data in FILES.items():
        assert (tmp_path / "job" / name).read_bytes() == data
    assert listing(tmp_path / "job") == sorted(FILES)


def test_server_stream_round_trips_through_the_receiver(job_dir: Path, tmp_path: Path) -> None:
    receive_outputs(stream_outputs(job_row(job_dir), checkpoint=False), tmp_path / "copy")
    for name in ("summary.json", "model.safetensors"):
        assert (tmp_path / "copy" / name).read_bytes() == (job_dir / name).read_bytes()


def tampered(parts: list[cpb.FetchOutputsResponse]) -> list[cpb.FetchOutputsResponse]:
    out = list(parts)
    i = next(i for i, p in enumerate(out) if p.WhichOneof("part") == "data" and i > 5)
    flipped = bytearray(out[i].data)
    flipped[0] ^= 0xFF
    out[i] = cpb.FetchOutputsResponse(data=bytes(flipped))
    return out


def short(parts: list[cpb.FetchOutputsResponse]) -> list[cpb.FetchOutputsResponse]:
    out = list(parts)
    i = next(i for i, p in enumerate(out) if p.WhichOneof("part") == "data" and i > 5)
    del out[i]
    return out


def cut(parts: list[cpb.FetchOutputsResponse]) -> list[cpb.FetchOutputsResponse]:
    return parts[:8]


def extra(parts: list[cpb.FetchOutputsResponse]) -> list[cpb.FetchOutputsResponse]:
    out = list(parts)
    i = next(i for i, p in enumerate(out) if p.WhichOneof("part") == "data" and i > 5)
    out.insert(i, cpb.FetchOutputsResponse(data=b"more"))
    return out


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (tampered, "model.safetensors: SHA-256 .* does not match"),
        (short, r"model.safetensors: received \d+ of 100 bytes"),
        (cut, "model.safetensors: the stream ended after"),
        (extra, "model.safetensors: the coordinator sent more than the 100 bytes"),
    ],
)
def test_damaged_stream_is_refused_and_leaves_no_partial_file(tmp_path: Path, damage, message: str) -> None:
    dest = tmp_path / "job"
    dest.mkdir()
    (dest / "model.safetensors").write_bytes(b"an earlier fetch")
    with pytest.raises(WireError, match=message):
        receive_outputs(damage(stream_of(FILES)), dest)
    # The file before the damaged one arrived whole; the damaged one kept its earlier copy
    # and no temporary file is left.
    assert listing(dest) == ["model.safetensors", "summary.json"]
    assert (dest / "model.safetensors").read_bytes() == b"an earlier fetch"


def test_stream_failure_names_the_file_and_leaves_nothing(tmp_path: Path) -> None:
    def failing() -> Iterator[cpb.FetchOutputsResponse]:
        yield from stream_of({"model.safetensors": b"x" * 100})[:3]
        raise RemoteError("FetchOutputs on here failed with UNAVAILABLE: gone", code="UNAVAILABLE")

    with pytest.raises(RemoteError, match="while receiving model.safetensors") as e:
        receive_outputs(failing(), tmp_path / "job")
    assert e.value.code == "UNAVAILABLE"
    assert listing(tmp_path / "job") == []


@pytest.mark.parametrize("name", ["../escape.txt", "/etc/passwd", "a/../../b", "", "checkpoints//x"])
def test_unsafe_paths_from_the_server_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(WireError, match="unsafe output path"):
        receive_outputs(stream_of({name: b"payload"}), tmp_path / "job")
    assert not (tmp_path / "escape.txt").exists()
    assert not (tmp_path / "job").exists() or listing(tmp_path / "job") == []


def test_second_receive_overwrites(tmp_path: Path) -> None:
    receive_outputs(stream_of(FILES), tmp_path / "job")
    newer = {**FILES, "summary.json": b'{"a": 2}\n'}
    receive_outputs(stream_of(newer), tmp_path / "job")
    assert (tmp_path / "job" / "summary.json").read_bytes() == b'{"a": 2}\n'
    assert listing(tmp_path / "job") == sorted(FILES)
