"""A starting coordinator answers status from its state file and refuses the rest as not up yet."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from fusion.auth import AUTH_METADATA
from fusion.coordinator.serving import STARTING, open_server, requeue_after_restart, starting_handler
from fusion.coordinator.store import Store
from fusion.wire import coordinator_pb2 as cpb
from fusion.wire import coordinator_pb2_grpc as cgrpc

pytestmark = pytest.mark.timeout(60)

TOKEN = "serving-test-token-0123"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "state.sqlite")
    s.add_job(job_id="job-1", name="tiny", spec_json="{}", steps=10, output_dir=str(tmp_path / "out"))
    s.transition("job-1", "planning")
    s.transition("job-1", "running")
    yield s
    s.close()


def test_status_is_answered_while_starting_and_in_flight_jobs_wait_again(store: Store) -> None:
    assert requeue_after_restart(store) == ["job-1"]
    server, port, board = open_server(starting_handler(store, TOKEN), "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = cgrpc.CoordinatorStub(channel)
        owner = ((AUTH_METADATA, TOKEN),)
        doc = json.loads(stub.GetJob(cpb.GetJobRequest(job_id="job-1"), timeout=10, metadata=owner).status_json)
        assert doc["state"] == "pending" and "coordinator restarted" in doc["reason"]
        assert [e["event"] for e in doc["events"]][-1] == "state"
        (listed,) = stub.ListJobs(cpb.ListJobsRequest(), timeout=10, metadata=owner).status_json
        assert json.loads(listed)["id"] == "job-1"
        with pytest.raises(grpc.RpcError) as wrong:
            stub.GetJob(cpb.GetJobRequest(job_id="job-1"), timeout=10, metadata=((AUTH_METADATA, "nope"),))
        assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as unknown:
            stub.GetJob(cpb.GetJobRequest(job_id="job-9"), timeout=10, metadata=owner)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as register:
            stub.Register(cpb.RegisterRequest(), timeout=10, metadata=owner)
        assert register.value.code() == grpc.StatusCode.UNAVAILABLE and register.value.details() == STARTING

        ready = starting_handler(store, "another-token-456789")  # any handler: the switch is what is tested
        board.ready(ready)
        with pytest.raises(grpc.RpcError) as after:
            stub.GetJob(cpb.GetJobRequest(job_id="job-1"), timeout=10, metadata=owner)
        assert after.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        channel.close()
        server.stop(grace=0)
    assert requeue_after_restart(store) == []
