"""Fuzzing every RPC of a real coordinator and a real executor process.

Hypothesis throws malformed bytes, truncated and type-confused messages (a valid message
of another RPC), streams of such chunks, and oversized messages at every method of both
services, with no credential, a forged one, or a valid one (so the handlers behind the
access checks are reached too). The properties:

- every call ends within its deadline (no hang) with a gRPC status;
- no answer is ``UNKNOWN`` or ``INTERNAL`` (an unhandled exception), ``UNAVAILABLE`` (the
  server died) or ``DEADLINE_EXCEEDED`` (a hang);
- a call without a valid credential never succeeds;
- afterwards both processes are alive and serve correct requests.

The number of cases run is printed at the end (``pytest -s``) and asserted to be large.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor.client import ChannelPool, ExecutorClient
from fusion.auth import AUTH_METADATA, SCHEME_CONTROL, SCHEME_JOB, process_keyring, sign
from fusion.errors import RemoteError
from fusion.launch import Fleet
from fusion.launch.executors import LocalCluster
from fusion.wire import coordinator_pb2 as cpb
from fusion.wire import executor_pb2 as epb
from fusion.wire import tensor_pb2 as pb

TOKEN = "fuzz-token-" + secrets.token_hex(8)
CALL_TIMEOUT_S = 10.0
EXAMPLES_PER_SERVICE = 400

EXECUTOR = epb.DESCRIPTOR.services_by_name["Executor"]
COORDINATOR = cpb.DESCRIPTOR.services_by_name["Coordinator"]

#: Codes that mean a bug, a crash or a hang.
FORBIDDEN = {
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}

CASES: dict[str, int] = {"executor": 0, "coordinator": 0, "ok": 0}


def _chunk(job_id: str, *, kind: int = pb.TRANSFER_KIND_ACTIVATION, data: bytes = b"\0" * 16) -> bytes:
    header = pb.TransferHeader(job_id=job_id, stage_idx=0, src_stage_idx=0, step=0, kind=kind)
    header.tensors.append(pb.TensorMeta(name="x", dtype=pb.DTYPE_FLOAT32, shape=[4], size_bytes=16))
    return pb.TensorChunk(header=header, data=data).SerializeToString()


def _templates() -> list[bytes]:
    """Valid messages of many types (type confusion, and truncation sources).

    They name jobs and models that do not exist, so a template that happens to be valid
    for the method it is sent to is answered quickly.
    """
    msgs = [
        epb.LoadStageRequest(
            job_id="fz",
            stage_idx=1,
            model=epb.ModelSpec(name="nosuchmodel", preset="tiny"),
            nodes=["a", "b"],
            auth="00:11",
        ),
        epb.GetStateRequest(job_id="fz", stage_idx=3, kind=epb.STATE_KIND_PARAMETERS, names=["w"]),
        epb.RunStepRequest(job_id="fz", stage_idx=0, step=7, num_micro_batches=4, schedule=epb.SCHEDULE_1F1B),
        epb.WaitStepRequest(job_id="fz", stage_idx=0, step=1, timeout_s=0.5),
        epb.ApplyStepRequest(job_id="fz", stage_idx=2, step=1, optimizer_step=True),
        epb.AbortRequest(job_id="fz", reason="x" * 100),
        epb.UnloadJobRequest(job_id="fz"),
        epb.ProfileModelRequest(model=epb.ModelSpec(name="nosuchmodel"), repeats=1),
        epb.ProbeLinksRequest(
            addresses=["127.0.0.1:1"], sizes_bytes=[1024], repeats=1, auth='{"127.0.0.1:1": [1, "00"]}'
        ),
        cpb.RegisterRequest(name="fz", address="127.0.0.1:1", resources=cpb.WorkerResources(num_cores=1, device="cpu")),
        cpb.HeartbeatRequest(worker_id="w-nosuch"),
        cpb.DeregisterRequest(worker_id="w-nosuch", reason="fz"),
        cpb.SubmitJobRequest(spec_json='{"model": {"name": "nosuchmodel"}}'),
        cpb.GetJobRequest(job_id="job-nosuch"),
        cpb.CancelJobRequest(job_id="job-nosuch"),
        cpb.GetLogsRequest(job_id="job-nosuch", after_seq=3),
    ]
    if hasattr(epb, "SnapshotChunk"):  # snapshot RPCs (checkpoint/recovery)
        msgs += [
            epb.TakeSnapshotRequest(job_id="fz", stage_idx=0, step=1),
            epb.ListSnapshotsRequest(job_id="fz"),
            epb.GetSnapshotRequest(job_id="fz", stage_key="k", step=1),
            epb.RestoreStageRequest(job_id="fz", stage_idx=0, step=1, source_address="127.0.0.1:1"),
            epb.SnapshotChunk(
                info=epb.SnapshotInfo(job_id="fz", stage_idx=0, stage_key="k", step=1, size_bytes=8, sha256="00"),
                data=b"12345678",
            ),
        ]
    out = [m.SerializeToString() for m in msgs]
    out += [
        _chunk("fz"),
        _chunk("fz", kind=pb.TRANSFER_KIND_PROBE),
        _chunk("", kind=pb.TRANSFER_KIND_PARAMETER, data=b"\1" * 8),
    ]
    return out


TEMPLATES = _templates()

payloads = st.one_of(
    st.binary(max_size=2048),  # malformed
    st.sampled_from(TEMPLATES),  # type-confused (or, by chance, valid)
    st.tuples(st.sampled_from(TEMPLATES), st.integers(min_value=0, max_value=400)).map(
        lambda t: t[0][: t[1] % max(1, len(t[0]))]
    ),  # truncated
    st.tuples(st.sampled_from(TEMPLATES), st.binary(min_size=1, max_size=64)).map(
        lambda t: t[0] + t[1]
    ),  # trailing junk
)
auth_modes = st.sampled_from(["none", "forged", "valid", "wrong-scheme"])


def _forged() -> tuple[tuple[str, str], ...]:
    return ((AUTH_METADATA, sign(secrets.token_bytes(32), scheme=SCHEME_CONTROL, method="Ping")),)


def _call(
    channel: grpc.Channel, service: str, method: object, payload: list[bytes], metadata: tuple[tuple[str, str], ...]
) -> bool:
    """Make one raw call; returns whether it succeeded. Fails the test on a forbidden code."""
    path = f"/{service}/{method.name}"  # type: ignore[attr-defined]
    try:
        if method.client_streaming:  # type: ignore[attr-defined]
            call = channel.stream_unary(path, request_serializer=None, response_deserializer=None)
            call(iter(payload), timeout=CALL_TIMEOUT_S, metadata=metadata)
        elif method.server_streaming:  # type: ignore[attr-defined]
            call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
            for _ in call(payload[0], timeout=CALL_TIMEOUT_S, metadata=metadata):
                pass
        else:
            call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
            call(payload[0], timeout=CALL_TIMEOUT_S, metadata=metadata)
    except grpc.RpcError as e:
        assert e.code() not in FORBIDDEN, f"{method.name}: {e.code()} {e.details()}"  # type: ignore[attr-defined]
        return False
    return True


@pytest.fixture(scope="module")
def executor() -> Iterator[LocalCluster]:
    with LocalCluster(1, torch_threads=1, extra_args=["--auth-failure-burst", "1000000"]) as c:
        yield c


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str]]:
    root = tmp_path_factory.mktemp("fuzz")
    with Fleet(root / "logs") as fleet:
        address = fleet.start_coordinator(
            token=TOKEN,
            state_dir=root / "state",
            extra_args=["--auth-failure-burst", "1000000", "--register-burst", "1000000", "--registers-per-s", "1000"],
        )
        yield fleet, address


def _bulk(n: int) -> bytes:
    return b"\x0a" + b"\xff" * 5 + b"\0" * n


@settings(max_examples=EXAMPLES_PER_SERVICE, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    method=st.sampled_from(list(EXECUTOR.methods)), items=st.lists(payloads, min_size=1, max_size=4), auth=auth_modes
)
def _fuzz_executor(channel: grpc.Channel, address: str, method: object, items: list[bytes], auth: str) -> None:
    keys = process_keyring()
    if auth == "valid":
        metadata = keys.metadata(address, method.name)  # type: ignore[attr-defined]
    elif auth == "wrong-scheme":  # a job credential for a job this worker does not hold
        metadata = ((AUTH_METADATA, sign(secrets.token_bytes(32), scheme=SCHEME_JOB, method=method.name, scope="fz")),)  # type: ignore[attr-defined]
    elif auth == "forged":
        metadata = _forged()
    else:
        metadata = ()
    ok = _call(channel, EXECUTOR.full_name, method, items, metadata)
    assert not ok or auth == "valid", f"{method.name} succeeded without a valid credential"  # type: ignore[attr-defined]
    CASES["executor"] += 1
    CASES["ok"] += ok


@settings(max_examples=EXAMPLES_PER_SERVICE, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(list(COORDINATOR.methods)), payload=payloads, auth=auth_modes)
def _fuzz_coordinator(channel: grpc.Channel, method: object, payload: bytes, auth: str) -> None:
    if auth == "valid":
        metadata: tuple[tuple[str, str], ...] = ((AUTH_METADATA, TOKEN),)
    elif auth == "forged":
        metadata = ((AUTH_METADATA, TOKEN[:-1] + "x"),)
    elif auth == "wrong-scheme":
        metadata = _forged()
    else:
        metadata = ()
    ok = _call(channel, COORDINATOR.full_name, method, [payload], metadata)
    # Heartbeat of an unknown worker id answers known=false without a credential (that is
    # how a worker learns the coordinator restarted); it reveals nothing else.
    assert not ok or auth == "valid" or method.name == "Heartbeat", f"{method.name} succeeded without the token"  # type: ignore[attr-defined]
    CASES["coordinator"] += 1
    CASES["ok"] += ok


def test_fuzz_executor(executor: LocalCluster) -> None:
    address = executor.addresses[0]
    pool = ChannelPool()
    channel = pool.get(address)
    _fuzz_executor(channel, address)
    # Oversized messages on every method, with and without a credential.
    for method in EXECUTOR.methods:
        for metadata in ((), process_keyring().metadata(address, method.name)):
            assert not _call(channel, EXECUTOR.full_name, method, [_bulk(6 << 20)], metadata)
            CASES["executor"] += 1
    assert executor.processes[0].poll() is None, "the executor died"
    client = ExecutorClient(address, pool)
    assert client.ping().worker_name == "local-0"
    # The tensor path still works: a correct probe goes through.
    for size in (1 << 20, pool.chunk_bytes + 1):  # one message (ProbeWhole), then a stream (Probe)
        _, response = client.probe(size)
        assert response.received_bytes == size
    pool.close()


def test_fuzz_coordinator(coordinator: tuple[Fleet, str]) -> None:
    fleet, address = coordinator
    channel = grpc.insecure_channel(address)
    _fuzz_coordinator(channel)
    for method in COORDINATOR.methods:
        for metadata in ((), ((AUTH_METADATA, TOKEN),)):
            assert not _call(channel, COORDINATOR.full_name, method, [_bulk(5 << 20)], metadata)
            CASES["coordinator"] += 1
    assert fleet.coordinator is not None and fleet.coordinator.poll() is None, "the coordinator died"
    from fusion.coordinator.client import CoordinatorClient

    with CoordinatorClient(address, TOKEN) as c:
        registered = c.register(
            "after-fuzz", "127.0.0.1:9", cpb.WorkerResources(num_cores=1, device="cpu", machine="box-1/cpu")
        )
        assert registered.worker_id and registered.session
        assert any(w.name == "after-fuzz" and w.resources.machine == "box-1/cpu" for w in c.workers())
        with pytest.raises(RemoteError, match="resources.machine is 300 characters; at most 255"):
            c.register("long-label", "127.0.0.1:9", cpb.WorkerResources(machine="m" * 300))
        assert not any(w.name == "long-label" for w in c.workers())
        with pytest.raises(RemoteError) as info:  # a job that does not exist has no profile
            c.get_profile("no-such-job")
        assert info.value.code == "NOT_FOUND"
    channel.close()


def test_zz_report_cases() -> None:
    """Runs last: how many cases ran (``pytest -s`` shows it)."""
    total = CASES["executor"] + CASES["coordinator"]
    print(
        f"\nfuzz cases: executor {CASES['executor']}, coordinator {CASES['coordinator']}, total {total} "
        f"({CASES['ok']} valid requests answered OK)"
    )
    if CASES["executor"] and CASES["coordinator"]:
        assert total >= EXAMPLES_PER_SERVICE
