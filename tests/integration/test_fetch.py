"""``fusion fetch`` end to end: a ``fusion-coordinator`` and a ``fusion-worker`` process on
loopback run a tiny job to completion, then the job owner's CLI downloads its outputs over
the Coordinator's ``FetchOutputs`` stream into a temporary directory.

The verifier's refusals (a tampered, short or cut stream) are tested with fake streams in
``tests/unit/test_fetch.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from fusion.cli.env import EXIT_BAD_INPUT, EXIT_NOT_FOUND
from fusion.cli.main import main
from fusion.config import load_job
from fusion.coordinator.client import CoordinatorClient
from fusion.coordinator.service import CoordinatorService, start_coordinator_server
from fusion.coordinator.store import Store
from fusion.launch import Fleet
from fusion.training import build_job_model

TOKEN = "fetch-test-token-0123"
STEPS = 6
OUTPUTS = ("model.safetensors", "metrics.jsonl", "loss.png", "plan.json", "measured.json", "summary.json")

pytestmark = pytest.mark.timeout(300)


def job_text(out: Path, *, min_workers: int = 1) -> str:
    return textwrap.dedent(f"""
        name = "fetch"
        [model]
        name = "gpt2"
        preset = "tiny"
        [data]
        batch_size = 4
        seq_len = 16
        [train]
        steps = {STEPS}
        optimizer = "sgd"
        lr = 0.1
        [cluster]
        min_workers = {min_workers}
        [plan]
        strategy = "uniform"
        [checkpoint]
        durable_every = 2
        keep = 2
        [output]
        dir = "{out}"
    """)


def wait_state(client: CoordinatorClient, job_id: str, timeout_s: float = 240.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = client.status(job_id)
        if s["state"] in ("succeeded", "failed", "cancelled"):
            return s
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not end in {timeout_s}s: {client.status(job_id)}")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    base = tmp_path_factory.mktemp("fetch-fleet")
    with Fleet(base / "logs") as f:
        f.start_coordinator(token=TOKEN, state_dir=base / "state", heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0)
        f.start_worker("w0", token=TOKEN)
        yield f


@pytest.fixture(scope="module")
def finished(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The status of a job that ran to completion on the fleet."""
    base = tmp_path_factory.mktemp("fetch-job")
    job_file = base / "job.toml"
    job_file.write_text(job_text(base / "out"))
    with CoordinatorClient(fleet.coordinator_address, TOKEN) as c:
        s = wait_state(c, c.submit(load_job(job_file)))
    assert s["state"] == "succeeded", s
    return {**s, "job_file": job_file}


def fetch(fleet: Fleet, *args: str, token: str = TOKEN) -> int:
    return main(["fetch", *args, "--coordinator", fleet.coordinator_address, "--token", token])


def leftovers(d: Path) -> list[str]:
    return [p.name for p in d.rglob("*") if p.name.startswith(".") or p.name.endswith(".part")]


def test_fetch_brings_back_the_coordinators_bytes(
    fleet: Fleet, finished: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job_id, source = finished["id"], Path(finished["output_dir"])
    assert fetch(fleet, job_id, "--out", str(tmp_path)) == 0
    got = tmp_path / job_id
    assert sorted(p.name for p in got.iterdir()) == sorted(OUTPUTS)
    for name in OUTPUTS:
        assert (got / name).read_bytes() == (source / name).read_bytes(), name
    out = capsys.readouterr().out
    assert f"fetched {len(OUTPUTS)} file(s)" in out and str(got) in out
    digest = hashlib.sha256((source / "model.safetensors").read_bytes()).hexdigest()
    assert digest[:16] in out
    # The model loads into the job's architecture.
    model = build_job_model(load_job(finished["job_file"]))
    model.load_state_dict(load_file(got / "model.safetensors"))
    assert json.loads((got / "summary.json").read_text())["state"] == "succeeded"
    assert leftovers(tmp_path) == []


def test_checkpoint_brings_the_newest_and_a_second_fetch_overwrites(
    fleet: Fleet, finished: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job_id, source = finished["id"], Path(finished["output_dir"])
    got = tmp_path / job_id
    assert fetch(fleet, job_id, "--out", str(tmp_path)) == 0
    (got / "summary.json").write_text("edited locally")
    (got / "model.safetensors").write_bytes(b"truncated")
    assert fetch(fleet, job_id, "--out", str(tmp_path), "--checkpoint") == 0
    for name in ("summary.json", "model.safetensors"):
        assert (got / name).read_bytes() == (source / name).read_bytes(), name
    # Written at steps 2 and 4 (one due while the previous is still being written is skipped).
    newest = max((source / "checkpoints").glob("ckpt-*.safetensors"))
    fetched = sorted(p.name for p in (got / "checkpoints").iterdir())
    assert fetched == [newest.with_suffix(".json").name, newest.name]
    assert (got / "checkpoints" / newest.name).read_bytes() == newest.read_bytes()
    assert set(load_file(got / "checkpoints" / newest.name))  # a safetensors file with tensors
    assert leftovers(tmp_path) == []
    capsys.readouterr()


def test_wrong_token_is_refused(
    fleet: Fleet, finished: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert fetch(fleet, finished["id"], "--out", str(tmp_path), token="not-the-token-at-all") == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "token" in err
    assert list(tmp_path.iterdir()) == []


def test_unknown_job_is_a_clear_error(fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert fetch(fleet, "job-00000000", "--out", str(tmp_path)) == EXIT_NOT_FOUND
    err = capsys.readouterr().err
    assert "no job with id 'job-00000000'" in err
    assert list(tmp_path.iterdir()) == []
    assert fetch(fleet, "../etc", "--out", str(tmp_path)) == 2
    assert "is not a job id" in capsys.readouterr().err


def test_job_without_outputs_yet_is_a_clear_error(
    fleet: Fleet, finished: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job_file = tmp_path / "waiting.toml"
    job_file.write_text(job_text(tmp_path / "out", min_workers=2))  # one worker: it waits
    with CoordinatorClient(fleet.coordinator_address, TOKEN) as c:
        job_id = c.submit(load_job(job_file))
        try:
            assert fetch(fleet, job_id, "--out", str(tmp_path / "fetched")) == 1
        finally:
            c.cancel(job_id)
    err = capsys.readouterr().err
    assert f"job {job_id} has no outputs yet (it is pending)" in err
    assert not (tmp_path / "fetched").exists()


def test_large_file_crosses_in_chunks_and_links_out_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A coordinator in this process serving a job directory made by hand: a file larger
    than a gRPC message may be (4 MiB at the client) arrives whole, and a symbolic link to
    a file outside the directory is refused."""
    out = tmp_path / "out" / "job-0000beef"
    out.mkdir(parents=True)
    model = os.urandom(9 << 20)
    (out / "model.safetensors").write_bytes(model)
    store = Store(tmp_path / "state" / "coordinator.db")
    store.add_job(job_id="job-0000beef", name="by-hand", spec_json="{}", steps=1, output_dir=str(out))
    store.transition("job-0000beef", "cancelled")
    service = CoordinatorService(store=store, token=TOKEN)
    server, port = start_coordinator_server(service, "127.0.0.1", 0)
    address = f"127.0.0.1:{port}"
    try:
        args = ["fetch", "job-0000beef", "--out", str(tmp_path / "got"), "--coordinator", address, "--token", TOKEN]
        assert main(args) == 0
        assert (tmp_path / "got" / "job-0000beef" / "model.safetensors").read_bytes() == model
        assert "model.safetensors: 9.4/9.4 MB (100%" in capsys.readouterr().err  # progress, on stderr

        secret = tmp_path / "secret.txt"
        secret.write_text("the coordinator's own file")
        (out / "plan.json").symlink_to(secret)
        assert main([*args[:3], str(tmp_path / "again"), *args[4:]]) == 1
        err = capsys.readouterr().err
        assert "plan.json" in err and "resolves outside" in err
        assert not (tmp_path / "again").exists()
    finally:
        server.stop(grace=None)
        service.close()
        store.close()
