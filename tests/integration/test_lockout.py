"""Nobody sharing an address can lock a job owner or a volunteer out by failing.

A real ``fusion-coordinator`` process and a real executor process on loopback, each with a
small failed-authentication budget. From one address (this test process) a burst of
malformed requests, missing, wrong and forged credentials is thrown at them until their
budgets are long exhausted; the failing calls must then be refused ``RESOURCE_EXHAUSTED``
with the address in the message, and a correctly authenticated call from the same address
must be answered at once: ``ListJobs``, ``fusion jobs``, a registration and a worker's
heartbeat on the coordinator; ``Ping`` (unary) and a probe transfer (a stream) on the
executor.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import grpc
import pytest

from executor.client import ChannelPool, ExecutorClient
from fusion.auth import AUTH_METADATA, SCHEME_CONTROL, SCHEME_JOB, process_keyring, sign
from fusion.coordinator.client import CoordinatorClient
from fusion.launch import Fleet
from fusion.launch.executors import LocalCluster
from fusion.wire import coordinator_pb2 as cpb
from fusion.wire import executor_pb2 as epb

TOKEN = "lockout-token-" + secrets.token_hex(8)
#: Failed calls a source may make at once (both servers); the burst below is many times this.
FAILURE_BURST = 20
#: Failing calls in the burst: enough to exhaust the budget many times over, quick on loopback.
BURST_CALLS = 400
#: A correct call after the burst must answer within this (a correctness bound, generous
#: for a loaded CI machine; a locked-out caller waited up to a minute).
ANSWER_BOUND_S = 2.0
#: The address every call of this test comes from, as the servers name it.
HOST = "127.0.0.1"

COORDINATOR = cpb.DESCRIPTOR.services_by_name["Coordinator"].full_name
EXECUTOR = epb.DESCRIPTOR.services_by_name["Executor"].full_name

Metadata = tuple[tuple[str, str], ...]
T = TypeVar("T")


def _raw_call(channel: grpc.Channel, service: str, method: str, body: bytes, metadata: Metadata) -> grpc.RpcError:
    """One raw unary call expected to fail; returns its error."""
    call = channel.unary_unary(f"/{service}/{method}", request_serializer=None, response_deserializer=None)
    try:
        call(body, timeout=10, metadata=metadata)
    except grpc.RpcError as e:
        return e
    raise AssertionError(f"{method} with {metadata!r} succeeded")


def _burst(calls: list[Callable[[], grpc.RpcError]]) -> list[grpc.RpcError]:
    """Run the failing calls from 8 threads at once (one source address); their errors in order."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda call: call(), calls))


def _assert_refused_for_failing(errors: list[grpc.RpcError]) -> None:
    """Within budget the failures are answered as such; past it, RESOURCE_EXHAUSTED naming the address."""
    codes = [e.code() for e in errors]
    allowed = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert set(codes) <= allowed, {c.name for c in codes}
    exhausted = [e for e in errors if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
    # The budget refills at 0.5/s: a few more failures get through while the burst runs.
    assert len(exhausted) >= BURST_CALLS - 2 * FAILURE_BURST, len(exhausted)
    for e in exhausted:
        assert f"too many failed authentications from {HOST} " in (e.details() or ""), e.details()


def _timed(call: Callable[[], T]) -> tuple[T, float]:
    start = time.monotonic()
    out = call()
    return out, time.monotonic() - start


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[tuple[Fleet, str]]:
    with Fleet(tmp_path / "logs") as fleet:
        address = fleet.start_coordinator(
            token=TOKEN, state_dir=tmp_path / "state", extra_args=["--auth-failure-burst", str(FAILURE_BURST)]
        )
        yield fleet, address


def test_coordinator_serves_valid_credentials_after_a_burst_of_failures(coordinator: tuple[Fleet, str]) -> None:
    fleet, address = coordinator
    assert address.startswith(f"{HOST}:")
    with CoordinatorClient(address, TOKEN) as owner:
        worker = owner.register("victim", "127.0.0.1:9", cpb.WorkerResources())
    channel = grpc.insecure_channel(address)
    wrong: list[Metadata] = [(), ((AUTH_METADATA, "not-the-token"),), ((AUTH_METADATA, TOKEN[:-1]),)]
    calls: list[Callable[[], grpc.RpcError]] = []
    for i in range(BURST_CALLS):
        metadata = wrong[i % len(wrong)]
        kind = i % 4
        if kind == 0:  # undecodable bytes
            calls.append(lambda m=metadata: _raw_call(channel, COORDINATOR, "ListJobs", b"\x0a\xff\xff\xff\xff", m))
        elif kind == 1:  # a well-formed request with a wrong token
            calls.append(lambda m=metadata: _raw_call(channel, COORDINATOR, "ListJobs", b"", m))
        elif kind == 2:  # a registration with a wrong token
            body = cpb.RegisterRequest(name="intruder", address="127.0.0.1:1").SerializeToString()
            calls.append(lambda m=metadata, b=body: _raw_call(channel, COORDINATOR, "Register", b, m))
        else:  # a heartbeat of the victim's worker id with a wrong session
            body = cpb.HeartbeatRequest(worker_id=worker.worker_id).SerializeToString()
            calls.append(lambda m=metadata, b=body: _raw_call(channel, COORDINATOR, "Heartbeat", b, m))
    _assert_refused_for_failing(_burst(calls))
    # A wrong call right now is still refused, naming the address.
    e = _raw_call(channel, COORDINATOR, "ListJobs", b"", ((AUTH_METADATA, "still-wrong"),))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and f"from {HOST} " in (e.details() or ""), e.details()

    # The same address, with the right credentials: answered at once.
    list_jobs = channel.unary_unary(f"/{COORDINATOR}/ListJobs", request_serializer=None, response_deserializer=None)
    _, took_s = _timed(lambda: list_jobs(b"", timeout=10, metadata=((AUTH_METADATA, TOKEN),)))
    assert took_s < ANSWER_BOUND_S, took_s
    with CoordinatorClient(address, TOKEN) as owner:
        jobs, took_s = _timed(lambda: owner.jobs())
        assert jobs == [] and took_s < ANSWER_BOUND_S, (jobs, took_s)
        joined, took_s = _timed(lambda: owner.register("newcomer", "127.0.0.1:10", cpb.WorkerResources()))
        assert joined.worker_id and took_s < ANSWER_BOUND_S, took_s
    with CoordinatorClient(address, worker.session) as victim:
        known, took_s = _timed(lambda: victim.heartbeat(worker.worker_id))
        assert known is True and took_s < ANSWER_BOUND_S, (known, took_s)
    # What a job owner types: `fusion jobs` (a new process, so no latency bound on it).
    out = subprocess.run(
        [sys.executable, "-m", "fusion.cli.main", "jobs", "--coordinator", address, "--token", TOKEN],
        capture_output=True,
        text=True,
        timeout=120,
        env=fleet.env,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    # Malformed requests carrying the right token are the owner's bug: answered as such, never rate-limited.
    e = _raw_call(channel, COORDINATOR, "ListJobs", b"\x0a\xff\xff\xff\xff", ((AUTH_METADATA, TOKEN),))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in (e.details() or ""), e.details()
    channel.close()


@pytest.fixture
def executor() -> Iterator[LocalCluster]:
    with LocalCluster(1, torch_threads=1, extra_args=["--auth-failure-burst", str(FAILURE_BURST)]) as c:
        yield c


def test_executor_serves_valid_credentials_after_a_burst_of_failures(executor: LocalCluster) -> None:
    address = executor.addresses[0]
    pool = ChannelPool()
    channel = pool.get(address)
    key = process_keyring().control(address)
    assert key is not None

    def forged(method: str) -> Metadata:
        return ((AUTH_METADATA, sign(secrets.token_bytes(32), scheme=SCHEME_CONTROL, method=method)),)

    def stale(method: str) -> Metadata:  # the right key, a timestamp far outside the window
        return ((AUTH_METADATA, sign(key, scheme=SCHEME_CONTROL, method=method, now_s=1.0e9)),)

    def foreign_job(method: str) -> Metadata:
        return ((AUTH_METADATA, sign(secrets.token_bytes(32), scheme=SCHEME_JOB, method=method, scope="other")),)

    def failing_stream(metadata: Metadata) -> grpc.RpcError:
        send = channel.stream_unary(f"/{EXECUTOR}/Send", request_serializer=None, response_deserializer=None)
        try:
            send(iter([b"\xff\xfe garbage"]), timeout=10, metadata=metadata)
        except grpc.RpcError as e:
            return e
        raise AssertionError("Send with a wrong credential succeeded")

    calls: list[Callable[[], grpc.RpcError]] = []
    for i in range(BURST_CALLS):
        kind = i % 5
        if kind == 0:
            calls.append(lambda: _raw_call(channel, EXECUTOR, "Ping", b"", forged("Ping")))
        elif kind == 1:
            calls.append(lambda: _raw_call(channel, EXECUTOR, "LoadStage", b"\x12\xff\xff\xff", stale("LoadStage")))
        elif kind == 2:
            calls.append(lambda: _raw_call(channel, EXECUTOR, "Ping", b"", ((AUTH_METADATA, "control - 1 2 3"),)))
        elif kind == 3:
            calls.append(lambda: _raw_call(channel, EXECUTOR, "Ping", b"\xff\xff", ()))
        else:
            calls.append(lambda: failing_stream(foreign_job("Send")))
    _assert_refused_for_failing(_burst(calls))
    e = _raw_call(channel, EXECUTOR, "Ping", b"", forged("Ping"))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and f"from {HOST} " in (e.details() or ""), e.details()

    # Correctly signed calls from the same address: answered at once, unary and streaming.
    client = ExecutorClient(address, pool)
    pong, took_s = _timed(lambda: client.ping(attempts=1))
    assert pong.worker_name == "local-0" and took_s < ANSWER_BOUND_S, took_s
    for size in (1 << 20, pool.chunk_bytes + 1):  # one message (ProbeWhole), then a stream (Probe)
        (_, response), took_s = _timed(lambda size=size: client.probe(size, attempts=1))
        assert response.received_bytes == size and took_s < ANSWER_BOUND_S, took_s
    # A replayed valid credential is a failure like any other: refused (and counted; by now
    # the budget may have refilled by one, so either answer).
    metadata = process_keyring().metadata(address, "Ping")
    ping = channel.unary_unary(f"/{EXECUTOR}/Ping", request_serializer=None, response_deserializer=None)
    ping(epb.PingRequest().SerializeToString(), timeout=10, metadata=metadata)
    e = _raw_call(channel, EXECUTOR, "Ping", b"", metadata)
    refused = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED)
    assert e.code() in refused and "replayed" in (e.details() or ""), (e.code(), e.details())
    pool.close()
