"""Authentication of executor calls, replay protection, and poisoned-update detection.

Real executor processes on loopback: calls without a credential, with a forged one, with
a replayed one, or with a job key of another job are refused before any handler runs; a
worker whose stages send NaN or hugely scaled gradients (a test hook, :mod:`tests.support.fault`)
is caught by the stage that receives them, and the driver names it; end to end, the coordinator excludes
that worker and the job re-plans and finishes with finite losses. Every coordinator RPC
refuses a missing or wrong token (or session), and a transfer that declares an oversized
tensor is refused after its header, before its payload is read.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
import torch

from executor.client import ChannelPool, ExecutorClient
from executor.driver import PipelineDriver
from executor.transport import tensor_meta
from fusion.auth import (
    AUTH_METADATA,
    SCHEME_CONTROL,
    SCHEME_JOB,
    KeyRing,
    process_keyring,
    sign,
)
from fusion.config import JobSpec, load_job
from fusion.coordinator.client import CoordinatorClient
from fusion.errors import PoisonedInputError, RemoteError
from fusion.graph.export import capture
from fusion.graph.split import split_stages
from fusion.launch import Fleet
from fusion.launch.distributed import train_distributed
from fusion.launch.executors import LocalCluster
from fusion.training import build_job_dataset, build_job_model, example_micro_batch
from fusion.wire import coordinator_pb2 as cpb
from fusion.wire import executor_pb2 as epb
from fusion.wire import tensor_pb2 as pb
from scheduler.baselines import uniform_assignment

JOB = JobSpec.from_dict(
    {
        "model": {"name": "gpt2", "preset": "tiny"},
        "data": {"batch_size": 4, "seq_len": 16},
        "train": {"steps": 2, "micro_batches": 2, "optimizer": "sgd", "lr": 0.1},
    }
)
EXECUTOR = epb.DESCRIPTOR.services_by_name["Executor"]


@pytest.fixture(scope="module")
def executor() -> Iterator[LocalCluster]:
    # A large failed-auth budget: this module fails authentication on purpose many times.
    with LocalCluster(1, torch_threads=1, extra_args=["--auth-failure-burst", "1000"]) as c:
        yield c


def _ping(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
    call = channel.unary_unary(f"/{EXECUTOR.full_name}/Ping", request_serializer=None, response_deserializer=None)
    try:
        call(b"", timeout=10, metadata=metadata)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_every_executor_rpc_refuses_missing_and_forged_credentials(executor: LocalCluster) -> None:
    channel = ChannelPool().get(executor.addresses[0])
    forged = ((AUTH_METADATA, sign(secrets.token_bytes(32), scheme=SCHEME_CONTROL, method="Ping")),)
    for method in EXECUTOR.methods:
        path = f"/{EXECUTOR.full_name}/{method.name}"
        for metadata in ((), forged, ((AUTH_METADATA, "control - 1 2 3"),)):
            try:
                if method.client_streaming:
                    channel.stream_unary(path, request_serializer=None, response_deserializer=None)(
                        iter([b""]), timeout=10, metadata=metadata
                    )
                elif method.server_streaming:
                    list(
                        channel.unary_stream(path, request_serializer=None, response_deserializer=None)(
                            b"", timeout=10, metadata=metadata
                        )
                    )
                else:
                    channel.unary_unary(path, request_serializer=None, response_deserializer=None)(
                        b"", timeout=10, metadata=metadata
                    )
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED, (method.name, e.code(), e.details())
            else:
                raise AssertionError(f"{method.name} answered a call without a valid credential")


def test_replayed_and_wrong_scope_credentials_are_refused(executor: LocalCluster) -> None:
    address = executor.addresses[0]
    channel = ChannelPool().get(address)
    metadata = process_keyring().metadata(address, "Ping")
    assert _ping(channel, metadata) == grpc.StatusCode.OK
    assert _ping(channel, metadata) == grpc.StatusCode.UNAUTHENTICATED  # the same nonce again: a replay
    # A valid signature for another method does not carry over.
    other = process_keyring().metadata(address, "UnloadJob")
    assert _ping(channel, other) == grpc.StatusCode.UNAUTHENTICATED
    # A job credential from an unregistered process (a key nobody delivered) reaches nothing.
    job = ((AUTH_METADATA, sign(secrets.token_bytes(32), scheme=SCHEME_JOB, method="Ping", scope="some-job")),)
    assert _ping(channel, job) == grpc.StatusCode.UNAUTHENTICATED
    # Old timestamps are refused even with the right key.
    key = process_keyring().control(address)
    assert key is not None
    stale = ((AUTH_METADATA, sign(key, scheme=SCHEME_CONTROL, method="Ping", now_s=1.0e9)),)
    assert _ping(channel, stale) == grpc.StatusCode.UNAUTHENTICATED
    assert ExecutorClient(address, ChannelPool()).ping().worker_name == "local-0"


@pytest.mark.parametrize(
    ("fault", "steps", "reason"),
    # 2 micro-batches a step: the norm bound holds once a link has had 3 accepted gradients
    [("nan-gradients@1", 2, "NaN"), ("scaled-gradients@2", 3, "norm")],
)
def test_poisoned_gradients_are_detected_and_the_sender_named(fault: str, steps: int, reason: str) -> None:
    with LocalCluster(2, torch_threads=1, module="tests.support.hooked_executor", extra_args=["--fault", fault]) as c:
        with pytest.raises(PoisonedInputError) as info:
            train_distributed(JOB, c.addresses, steps=steps)
        # Only stage 1 sends gradients (to stage 0): it is the one reported.
        assert info.value.sender_stage == 1
        assert info.value.address == c.addresses[1]
        assert reason in info.value.reason


def test_worker_sending_nan_gradients_is_excluded_and_the_job_finishes(tmp_path: Path) -> None:
    """A real coordinator and three real workers; the middle one turns poisonous at step 5."""
    token = "poison-token"
    job_path = tmp_path / "job.toml"
    job_path.write_text(
        textwrap.dedent(f"""
        name = "poisoned"
        [model]
        name = "gpt2"
        preset = "tiny"
        [data]
        batch_size = 4
        seq_len = 16
        [train]
        steps = 16
        micro_batches = 2
        optimizer = "sgd"
        lr = 0.05
        seed = 3
        [cluster]
        min_workers = 3
        spares = 0
        [plan]
        strategy = "uniform"
        [checkpoint]
        replicate_every = 2
        [output]
        dir = "{tmp_path / "out"}"
    """)
    )
    with Fleet(tmp_path / "logs") as fleet:
        fleet.start_coordinator(
            token=token, state_dir=tmp_path / "state", heartbeat_interval_s=0.5, heartbeat_timeout_s=4.0
        )
        # Workers join one after another: the uniform plan puts them on stages in join order,
        # so the faulty worker hosts stage 1 and sends (NaN) gradients to stage 0.
        fleet.start_worker("w0", token=token)
        fleet.start_worker(
            "bad", token=token, module="tests.support.fault_worker", extra_args=["--fault", "nan-gradients@5"]
        )
        fleet.start_worker("w2", token=token)
        with CoordinatorClient(fleet.coordinator_address, token) as client:
            job_id = client.submit(load_job(job_path))
            deadline = time.monotonic() + 240
            while (s := client.status(job_id))["state"] not in ("succeeded", "failed", "cancelled"):
                assert time.monotonic() < deadline, s
                time.sleep(0.2)
            assert s["state"] == "succeeded", s
            # The job's end is recorded first; its workers are released once their stages
            # are unloaded, a moment later.
            while any((states := {w.name: w.state for w in client.workers()})[n] == "busy" for n in ("w0", "w2")):
                assert time.monotonic() < deadline, states
                time.sleep(0.2)
        records = [json.loads(line) for line in (Path(s["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
        events = [r for r in records if "event" in r]
        print("\n".join(f"{e['event']}: {e.get('message', '')}" for e in s["events"]))
        planned = next(e for e in s["events"] if e["event"] == "planned")
        assert planned["stages"][1] == "bad", planned
        excluded = [e for e in events if e["event"] == "worker_excluded"]
        assert [e["worker"] for e in excluded] == ["bad"], events
        assert excluded[0]["failed_step"] == 5 and "NaN" in excluded[0]["message"], excluded
        assert not any(e["event"] == "worker_lost" for e in events), events
        replanned = [e for e in events if e["event"] == "replanned"]
        assert replanned and "bad" not in replanned[-1]["stages"] and len(replanned[-1]["stages"]) == 2, events
        assert "bad" not in [st["worker"] for st in s["plan"]["stages"]]
        losses = {r["step"]: r["loss"] for r in records if "event" not in r}
        assert sorted(losses) == list(range(16))
        assert all(math.isfinite(v) for v in losses.values()), losses
        assert states["bad"] == "excluded" and states["w0"] == "idle" and states["w2"] == "idle", states
        # The CLI shows the same (excluded workers with --all).
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "fusion.cli.main",
                "workers",
                "--all",
                "--coordinator",
                fleet.coordinator_address,
                "--token",
                token,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=fleet.env,
            check=True,
        ).stdout
        assert re.search(r"^bad\s+\S+\s+excluded", out, re.MULTILINE), out
        from fusion.profiling import machine_id

        assert out.count(machine_id("cpu")[:8]) == 3, out  # all three share this machine, and the listing says so


# ----------------------------------------------------------------- oversized transfers
CHUNK_BYTES = 1 << 20
#: What the hostile stream would deliver if the executor kept reading: 256 MiB.
HOSTILE_CHUNKS = 256


@pytest.fixture(scope="module")
def waiting_stage() -> Iterator[tuple[LocalCluster, PipelineDriver]]:
    """Two real executors with a GPT-2 tiny job loaded; stage 1 waits for step 0's activations."""
    with LocalCluster(2, torch_threads=1, extra_args=["--chunk-bytes", str(CHUNK_BYTES)]) as c:
        model = build_job_model(JOB)
        x, y = example_micro_batch(JOB, build_job_dataset(JOB))
        captured = capture(model, (x,))
        stages = split_stages(captured.dag, uniform_assignment(captured.dag, 2))
        pool = ChannelPool(chunk_bytes=CHUNK_BYTES)
        driver = PipelineDriver(
            job_id="oversized",
            job=JOB,
            model=model,
            captured=captured,
            stages=stages,
            addresses=c.addresses,
            example_target=y,
            pool=pool,
        )
        try:
            driver.load()
            for s in stages:
                driver.clients[s.stage_idx].run_step(
                    driver.job_id, s.stage_idx, 0, JOB.train.micro_batches, epb.SCHEDULE_1F1B
                )
            yield c, driver
        finally:
            driver.close()
            pool.close()


def _hostile_send(driver: PipelineDriver, header: pb.TransferHeader) -> tuple[grpc.StatusCode, str, int]:
    """Stream ``header`` then up to 256 MiB of payload; returns (code, details, chunks the client was asked for)."""
    pulled = 0

    def chunks() -> Iterator[pb.TensorChunk]:
        nonlocal pulled
        yield pb.TensorChunk(header=header)
        block = b"\x7f" * CHUNK_BYTES
        for _ in range(HOSTILE_CHUNKS):
            pulled += 1
            yield pb.TensorChunk(data=block)
            time.sleep(0.002)  # a steady sender: the cut must come from the server, not from a burst

    channel = driver.pool.get(driver.addresses[1])
    send = channel.stream_unary(
        "/fusion.wire.Executor/Send",
        request_serializer=pb.TensorChunk.SerializeToString,
        response_deserializer=epb.SendResponse.FromString,
    )
    metadata = driver.pool.keyring.metadata(driver.addresses[1], "Send", driver.job_id)
    with pytest.raises(grpc.RpcError) as info:
        send(chunks(), timeout=60, metadata=metadata)
    return info.value.code(), info.value.details() or "", pulled


@pytest.mark.parametrize("case", ["over-limit", "over-expected-shape"])
def test_oversized_tensor_is_refused_before_its_payload_is_read(
    waiting_stage: tuple[LocalCluster, PipelineDriver], case: str
) -> None:
    cluster, driver = waiting_stage
    header = pb.TransferHeader(
        job_id=driver.job_id, stage_idx=1, src_stage_idx=0, step=0, micro_batch_idx=0, kind=pb.TRANSFER_KIND_ACTIVATION
    )
    # Every value stage 1 takes from stage 0, correctly declared but the last.
    names = [n for n, src in driver.stages[1].inputs if src == 0 and driver.dag.node(n).value.kind == "tensor"]
    for n in names[:-1]:
        meta = driver.dag.node(n).value
        header.tensors.append(tensor_meta(n, torch.zeros(meta.shape, dtype=getattr(torch, meta.dtype))))
    name = names[-1]
    if case == "over-limit":  # 16 GiB declared, above the executor's 8 GiB transfer limit
        header.tensors.append(pb.TensorMeta(name=name, dtype=pb.DTYPE_FLOAT32, shape=[4 << 30], size_bytes=16 << 30))
        words = ("above the limit",)
    else:  # 256 MiB declared for a value the plan says is a few KiB
        header.tensors.append(pb.TensorMeta(name=name, dtype=pb.DTYPE_FLOAT32, shape=[64 << 20], size_bytes=256 << 20))
        words = ("shape", name)
    worker = psutil.Process(cluster.processes[1].pid)
    rss_before = worker.memory_info().rss
    code, details, pulled = _hostile_send(driver, header)
    rss_growth = worker.memory_info().rss - rss_before
    print(
        f"{case}: {code.name} after the client produced {pulled} of {HOSTILE_CHUNKS} 1 MiB chunks; "
        f"worker RSS {rss_growth / 2**20:+.1f} MiB"
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert all(w in details for w in words), details
    # The stream is cut after the header: the client is not even asked for most of the payload
    # (HTTP/2 flow control lets a few MiB be in flight), and the worker did not buffer it.
    assert pulled < HOSTILE_CHUNKS // 8, pulled
    assert rss_growth < 32 << 20, rss_growth
    assert ExecutorClient(driver.addresses[1], driver.pool).ping().worker_name == "local-1"


def test_every_coordinator_rpc_refuses_missing_and_wrong_credentials(tmp_path: Path) -> None:
    """Job-owner calls need the token; worker calls the worker's own session, not the token."""
    token = "coordinator-token"
    service = cpb.DESCRIPTOR.services_by_name["Coordinator"]
    with Fleet(tmp_path / "logs") as fleet:
        address = fleet.start_coordinator(
            token=token, state_dir=tmp_path / "state", extra_args=["--auth-failure-burst", "1000"]
        )
        with CoordinatorClient(address, token) as owner:
            registered = owner.register("probe", "127.0.0.1:9", cpb.WorkerResources())
        channel = grpc.insecure_channel(address)
        worker_calls = {
            "Heartbeat": cpb.HeartbeatRequest(worker_id=registered.worker_id),
            "Deregister": cpb.DeregisterRequest(worker_id=registered.worker_id, reason="test"),
        }
        try:
            for method in service.methods:
                request = worker_calls.get(method.name)
                body = request.SerializeToString() if request is not None else b""
                call = channel.unary_unary(
                    f"/{service.full_name}/{method.name}", request_serializer=None, response_deserializer=None
                )
                wrong = ["", "not-the-token", token[:-1]]
                if request is not None:
                    wrong += [token, "x" * 43]  # the token is not a worker's session
                for credential in wrong:
                    metadata = ((AUTH_METADATA, credential),) if credential else ()
                    with pytest.raises(grpc.RpcError) as info:
                        call(body, timeout=10, metadata=metadata)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (
                        method.name,
                        credential,
                        info.value.details(),
                    )
            # The right credentials work (and the worker is still registered: nothing above got through).
            with CoordinatorClient(address, registered.session) as worker:
                assert worker.heartbeat(registered.worker_id)
            with CoordinatorClient(address, token) as owner:
                assert [w.state for w in owner.workers()] == ["idle"]
        finally:
            channel.close()


def test_fusion_profile_runs_through_the_coordinator(tmp_path: Path) -> None:
    """``fusion profile [--check]`` works although the CLI holds no worker key: the coordinator
    (which derives the control keys) measures, and the CLI only talks to the coordinator."""
    token = "profile-token"
    job_path = tmp_path / "job.toml"
    job_path.write_text(
        textwrap.dedent("""
        name = "profile"
        [model]
        name = "gpt2"
        preset = "tiny"
        [data]
        batch_size = 4
        seq_len = 16
        [train]
        steps = 4
        micro_batches = 2
    """)
    )
    with Fleet(tmp_path / "logs") as fleet:
        address = fleet.start_coordinator(token=token, state_dir=tmp_path / "state")
        for name in ("w0", "w1"):
            fleet.start_worker(name, token=token, wait=False)
        fleet.wait_workers(["w0", "w1"])
        with CoordinatorClient(address, token) as owner:
            workers = owner.workers()
        # What the CLI used to do, dial the executors itself, is refused: it holds no key.
        pool = ChannelPool(keyring=KeyRing())
        try:
            with pytest.raises(RemoteError) as info:
                ExecutorClient(workers[0].address, pool).ping(attempts=1)
            assert info.value.code == "UNAUTHENTICATED"
        finally:
            pool.close()

        def profile(*args: str, credential: str = token) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "fusion.cli.main",
                    "profile",
                    "--job",
                    str(job_path),
                    "--coordinator",
                    address,
                    "--token",
                    credential,
                    *args,
                ],
                capture_output=True,
                text=True,
                timeout=240,
                env=fleet.env,
                check=False,
            )

        checked = profile("--check", "--steps", "1", "--json")
        assert checked.returncode == 0, checked.stderr
        doc = json.loads(checked.stdout)
        assert [p["plan"] for p in doc["plans"]] == ["uniform/1", "uniform/2", "compute", "opfence"], doc
        assert all(p["measured_step_s"] > 0 and p["predicted_step_s"] > 0 for p in doc["plans"]), doc
        assert math.isfinite(doc["time_mape"]) and math.isfinite(doc["memory_mape"])
        measured = profile()
        assert measured.returncode == 0, measured.stderr
        assert "model gpt2 (tiny)" in measured.stdout and re.search(r"link w[01] -> w[01]: ", measured.stdout), (
            measured.stdout
        )
        refused = profile(credential="not-the-token")
        assert refused.returncode != 0 and "token" in refused.stderr, refused.stderr
        with CoordinatorClient(address, token) as owner:
            assert sorted(w.state for w in owner.workers()) == ["idle", "idle"]  # released after profiling
