"""Bad input on the wire gets a clear gRPC error, and the worker keeps serving.

A real 2-stage GPT-2 job is loaded on real executor processes; malformed, mis-shaped,
mis-addressed and oversized transfers are thrown at stage 1 while it waits for step 0.
Afterwards the same workers must still run a correct step whose loss matches PyTorch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest
import torch

from executor.client import ChannelPool, ExecutorClient
from executor.driver import PipelineDriver
from executor.transport import HEADER_ALLOWANCE_BYTES, tensor_meta
from fusion.config import JobSpec
from fusion.errors import RemoteError
from fusion.graph.export import capture
from fusion.graph.split import split_stages
from fusion.launch.executors import LocalCluster
from fusion.training import (
    build_job_dataset,
    build_job_model,
    example_micro_batch,
    job_batch,
    train_reference,
)
from fusion.wire import executor_pb2 as epb
from fusion.wire import tensor_pb2 as pb
from scheduler.baselines import uniform_assignment

JOB = JobSpec.from_dict(
    {
        "model": {"name": "gpt2", "preset": "tiny"},
        "data": {"batch_size": 4, "seq_len": 16},
        "train": {"steps": 1, "micro_batches": 2, "optimizer": "sgd", "lr": 0.1},
    }
)
CHUNK_BYTES = 1 << 20


@pytest.fixture(scope="module")
def workers() -> Iterator[LocalCluster]:
    with LocalCluster(2, torch_threads=1, extra_args=["--chunk-bytes", str(CHUNK_BYTES)]) as c:
        yield c


@pytest.fixture(scope="module")
def driver(workers: LocalCluster) -> Iterator[PipelineDriver]:
    model = build_job_model(JOB)
    x, y = example_micro_batch(JOB, build_job_dataset(JOB))
    captured = capture(model, (x,))
    stages = split_stages(captured.dag, uniform_assignment(captured.dag, 2))
    pool = ChannelPool(chunk_bytes=CHUNK_BYTES)
    d = PipelineDriver(
        job_id="bad-input",
        job=JOB,
        model=model,
        captured=captured,
        stages=stages,
        addresses=workers.addresses,
        example_target=y,
        pool=pool,
    )
    d.load()
    # Start step 0 everywhere; stage 1 now waits for micro-batch 0 from stage 0.
    for s in stages:
        d.clients[s.stage_idx].run_step(d.job_id, s.stage_idx, 0, JOB.train.micro_batches, epb.SCHEDULE_1F1B)
    yield d
    d.close()
    pool.close()


def stage1_input(driver: PipelineDriver) -> tuple[str, torch.Tensor]:
    """A tensor input of stage 1 with its expected shape and dtype."""
    spec = driver.stages[1]
    for name, _ in spec.inputs:
        meta = driver.dag.node(name).value
        if meta.kind == "tensor":
            return name, torch.zeros(meta.shape, dtype=getattr(torch, meta.dtype))
    raise AssertionError("stage 1 has no tensor input")


def auth(driver: PipelineDriver, method: str) -> tuple[tuple[str, str], ...]:
    """Credentials for a hand-made call to stage 1's worker (the executor refuses calls without)."""
    return driver.pool.keyring.metadata(driver.addresses[1], method, driver.job_id)


def activation_header(driver: PipelineDriver, **overrides: object) -> pb.TransferHeader:
    fields = {
        "job_id": driver.job_id,
        "stage_idx": 1,
        "src_stage_idx": 0,
        "step": 0,
        "micro_batch_idx": 0,
        "kind": pb.TRANSFER_KIND_ACTIVATION,
    }
    fields.update(overrides)
    return pb.TransferHeader(**fields)


def full_activation(driver: PipelineDriver, **changes: torch.Tensor) -> dict[str, torch.Tensor]:
    """All tensor inputs stage 1 takes from stage 0, correctly shaped, with some replaced."""
    out = {}
    for name, src in driver.stages[1].inputs:
        meta = driver.dag.node(name).value
        if src == 0 and meta.kind == "tensor":
            out[name] = torch.zeros(meta.shape, dtype=getattr(torch, meta.dtype))
    out.update(changes)
    return out


def expect_code(call, code: grpc.StatusCode, *words: str) -> str:
    with pytest.raises(RemoteError) as info:
        call()
    assert info.value.code == code.name, str(info.value)
    for w in words:
        assert w in str(info.value), str(info.value)
    return str(info.value)


@pytest.fixture(autouse=True)
def still_serving(driver: PipelineDriver) -> Iterator[None]:
    yield
    for client in driver.clients:
        assert client.ping().worker_name


def test_wrong_shape(driver: PipelineDriver) -> None:
    name, t = stage1_input(driver)
    bad = full_activation(driver, **{name: torch.zeros(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype)})
    expect_code(
        lambda: driver.clients[1].send(activation_header(driver), bad), grpc.StatusCode.INVALID_ARGUMENT, "shape", name
    )


def test_wrong_dtype(driver: PipelineDriver) -> None:
    name, t = stage1_input(driver)
    bad = full_activation(driver, **{name: t.to(torch.float64)})
    expect_code(
        lambda: driver.clients[1].send(activation_header(driver), bad), grpc.StatusCode.INVALID_ARGUMENT, "dtype"
    )


def test_unknown_value_name(driver: PipelineDriver) -> None:
    bad = full_activation(driver, nonsense=torch.zeros(2))
    expect_code(
        lambda: driver.clients[1].send(activation_header(driver), bad), grpc.StatusCode.INVALID_ARGUMENT, "nonsense"
    )


def test_unknown_stage_and_job(driver: PipelineDriver) -> None:
    msg = expect_code(
        lambda: driver.clients[1].send(activation_header(driver, stage_idx=7), full_activation(driver)),
        grpc.StatusCode.NOT_FOUND,
        "stage 7",
    )
    assert "loaded" in msg
    expect_code(
        lambda: driver.clients[1].send(activation_header(driver, job_id="nope"), full_activation(driver)),
        grpc.StatusCode.NOT_FOUND,
        "nope",
    )
    expect_code(lambda: driver.clients[1].get_state("nope", 0, epb.STATE_KIND_PARAMETERS), grpc.StatusCode.NOT_FOUND)


def test_unknown_micro_batch_and_stale_step(driver: PipelineDriver) -> None:
    expect_code(
        lambda: driver.clients[1].send(activation_header(driver, micro_batch_idx=99), full_activation(driver)),
        grpc.StatusCode.NOT_FOUND,
        "micro-batch 99",
    )
    expect_code(
        lambda: driver.clients[1].send(activation_header(driver, step=5), full_activation(driver)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "step 5",
    )


def test_wrong_source_and_kind(driver: PipelineDriver) -> None:
    expect_code(
        lambda: driver.clients[1].send(activation_header(driver, src_stage_idx=3), full_activation(driver)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "stage 3",
    )
    expect_code(
        lambda: driver.clients[0].send(
            activation_header(driver, stage_idx=0, kind=pb.TRANSFER_KIND_TARGET, src_stage_idx=-1),
            {"@target": torch.zeros(2, 16, dtype=torch.int64)},
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "loss",
    )


def unlimited_channel(driver: PipelineDriver) -> grpc.Channel:
    """A channel to stage 1's worker that sends messages of any size (the pool's own channels
    refuse to send past the limit, so only this one reaches the server's)."""
    return grpc.insecure_channel(driver.addresses[1], options=[("grpc.max_send_message_length", -1)])


def test_oversized_message(driver: PipelineDriver) -> None:
    channel = unlimited_channel(driver)
    send = channel.stream_unary(
        "/fusion.wire.Executor/Send",
        request_serializer=pb.TensorChunk.SerializeToString,
        response_deserializer=epb.SendResponse.FromString,
    )
    header = activation_header(driver)
    name, _ = stage1_input(driver)
    header.tensors.append(
        pb.TensorMeta(name=name, dtype=pb.DTYPE_UINT8, shape=[CHUNK_BYTES * 3], size_bytes=CHUNK_BYTES * 3)
    )
    chunk = pb.TensorChunk(header=header, data=b"\0" * (CHUNK_BYTES + HEADER_ALLOWANCE_BYTES + 1))
    with pytest.raises(grpc.RpcError) as info:
        send(iter([chunk]), timeout=30, metadata=auth(driver, "Send"))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # A header that declares more than the limit is refused before any payload is read.
    huge = activation_header(driver)
    huge.tensors.append(pb.TensorMeta(name=name, dtype=pb.DTYPE_FLOAT32, shape=[1 << 40], size_bytes=4 << 40))
    with pytest.raises(grpc.RpcError) as info:
        send(iter([pb.TensorChunk(header=huge)]), timeout=30, metadata=auth(driver, "Send"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "limit" in info.value.details()
    channel.close()


def test_malformed_bytes(driver: PipelineDriver) -> None:
    channel = driver.pool.get(driver.addresses[1])
    for method in ("Send", "SetState"):
        raw = channel.stream_unary(
            f"/fusion.wire.Executor/{method}", request_serializer=None, response_deserializer=None
        )
        with pytest.raises(grpc.RpcError) as info:
            raw(iter([b"\xff\xfe\x00garbage", b"\x0a\xff\xff\xff\xff"]), timeout=30, metadata=auth(driver, method))
        assert info.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    unary = channel.unary_unary("/fusion.wire.Executor/LoadStage", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError):
        unary(b"\x12\xff\xff\xff", timeout=30, metadata=auth(driver, "LoadStage"))
    # Truncated transfer: the header promises more bytes than arrive.
    header = activation_header(driver)
    header.tensors.extend(tensor_meta(n, t) for n, t in full_activation(driver).items())
    send = channel.stream_unary(
        "/fusion.wire.Executor/Send",
        request_serializer=pb.TensorChunk.SerializeToString,
        response_deserializer=epb.SendResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as info:
        send(iter([pb.TensorChunk(header=header, data=b"\0" * 3)]), timeout=30, metadata=auth(driver, "Send"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "declared" in info.value.details()


def test_bad_single_messages(driver: PipelineDriver) -> None:
    """The unary paths (a transfer in one message) refuse what the streams refuse."""
    channel = driver.pool.get(driver.addresses[1])
    for method in ("SendWhole", "ProbeWhole"):
        raw = channel.unary_unary(
            f"/fusion.wire.Executor/{method}", request_serializer=None, response_deserializer=None
        )
        with pytest.raises(grpc.RpcError) as info:
            raw(b"\x0a\xff\xff\xff\xff", timeout=30, metadata=auth(driver, method))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "malformed" in info.value.details()
    send = channel.unary_unary(
        "/fusion.wire.Executor/SendWhole",
        request_serializer=pb.TensorChunk.SerializeToString,
        response_deserializer=epb.SendResponse.FromString,
    )
    header = activation_header(driver)
    header.tensors.extend(tensor_meta(n, t) for n, t in full_activation(driver).items())
    with pytest.raises(grpc.RpcError) as info:  # the header promises more bytes than the message has
        send(pb.TensorChunk(header=header, data=b"\0" * 3), timeout=30, metadata=auth(driver, "SendWhole"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "declared" in info.value.details()
    with (
        unlimited_channel(driver) as unlimited,
        pytest.raises(grpc.RpcError) as info,
    ):  # over the server's message limit
        big = unlimited.unary_unary(
            "/fusion.wire.Executor/SendWhole",
            request_serializer=pb.TensorChunk.SerializeToString,
            response_deserializer=epb.SendResponse.FromString,
        )
        big(
            pb.TensorChunk(header=header, data=b"\0" * (CHUNK_BYTES + HEADER_ALLOWANCE_BYTES + 1)),
            timeout=30,
            metadata=auth(driver, "SendWhole"),
        )
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    other = activation_header(driver, job_id="another-job")
    with pytest.raises(grpc.RpcError) as info:  # a job's key reaches only its own job
        send(pb.TensorChunk(header=other), timeout=30, metadata=auth(driver, "SendWhole"))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:  # a credential signed for Send does not open SendWhole
        send(pb.TensorChunk(header=header), timeout=30, metadata=auth(driver, "Send"))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_transfer_over_one_chunk_streams_and_is_checked(driver: PipelineDriver) -> None:
    """Past the chunk size a transfer goes as a stream; it is validated the same way."""
    big = torch.zeros(CHUNK_BYTES // 4 + 1)
    expect_code(
        lambda: driver.clients[1].send(activation_header(driver), full_activation(driver, nonsense=big)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "nonsense",
    )


def test_malformed_compressed_tensor(driver: PipelineDriver) -> None:
    """Garbage under a top-k codec is refused as a compression error; nothing crashes."""
    channel = driver.pool.get(driver.addresses[1])
    send = channel.stream_unary(
        "/fusion.wire.Executor/Send",
        request_serializer=pb.TensorChunk.SerializeToString,
        response_deserializer=epb.SendResponse.FromString,
    )
    header = activation_header(driver)
    payload = b""
    for n, t in full_activation(driver).items():
        meta = tensor_meta(n, t)
        if t.is_floating_point():
            meta.codec = pb.CODEC_TOPK
            meta.size_bytes = 64
            payload += bytes(range(64))
        else:
            payload += t.numpy().tobytes()
        header.tensors.append(meta)
    with pytest.raises(grpc.RpcError) as info:
        send(iter([pb.TensorChunk(header=header, data=payload)]), timeout=30, metadata=auth(driver, "Send"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "CompressionError" in info.value.details()


def test_bad_tied_gradients(driver: PipelineDriver) -> None:
    """GPT-2's embedding (stage 0) and head (stage 1) are one tied parameter."""
    tied = lambda **kw: activation_header(driver, kind=pb.TRANSFER_KIND_TIED_GRADIENT, **kw)  # noqa: E731
    head = torch.zeros(256, 32)
    send = driver.clients[1].send
    expect_code(
        lambda: send(tied(), {"transformer.wte.weight": torch.zeros(255, 32)}),
        grpc.StatusCode.INVALID_ARGUMENT,
        "shape",
    )
    expect_code(
        lambda: send(tied(), {"transformer.wte.weight": head.double()}), grpc.StatusCode.INVALID_ARGUMENT, "dtype"
    )
    expect_code(lambda: send(tied(), {"lm_head.bias": head}), grpc.StatusCode.INVALID_ARGUMENT, "must be exactly")
    expect_code(
        lambda: send(tied(src_stage_idx=5), {"transformer.wte.weight": head}),
        grpc.StatusCode.INVALID_ARGUMENT,
        "shares no tied parameter with stage 5",
    )
    # Step 0 is still running: its tied gradients cannot be exchanged yet.
    expect_code(
        lambda: driver.clients[1].sync_tied(driver.job_id, 1, 0, 10.0),
        grpc.StatusCode.FAILED_PRECONDITION,
        "has not finished",
    )


def test_bad_state_and_load_requests(driver: PipelineDriver) -> None:
    client = driver.clients[0]
    expect_code(
        lambda: client.set_state(driver.job_id, 0, pb.TRANSFER_KIND_PARAMETER, {"no.such.weight": torch.zeros(2)}),
        grpc.StatusCode.NOT_FOUND,
        "no.such.weight",
    )
    name = next(n for n, _ in driver.model.named_parameters() if n.startswith("transformer.wpe"))
    expect_code(
        lambda: client.set_state(driver.job_id, 0, pb.TRANSFER_KIND_PARAMETER, {name: torch.zeros(3)}),
        grpc.StatusCode.INVALID_ARGUMENT,
        name,
    )
    request = driver.load_request(driver.stages[0])
    request.job_id = "bad-load"
    request.model.kwargs_json = "{not json"
    expect_code(lambda: client.load_stage(request), grpc.StatusCode.INVALID_ARGUMENT, "JSON")
    request = driver.load_request(driver.stages[0])
    request.job_id = "bad-load"
    request.nodes.append("no_such_node")
    expect_code(lambda: client.load_stage(request), grpc.StatusCode.INVALID_ARGUMENT, "no_such_node")
    request = driver.load_request(driver.stages[0])
    request.job_id = "bad-load"
    request.graph_fingerprint = "0000"
    expect_code(lambda: client.load_stage(request), grpc.StatusCode.FAILED_PRECONDITION, "fingerprint")
    request = driver.load_request(driver.stages[0])
    request.job_id = "bad-load"
    request.model.kwargs_json = json.dumps({"n_layer": "two"})
    expect_code(lambda: client.load_stage(request), grpc.StatusCode.INVALID_ARGUMENT)


def test_user_code_needs_allow_code() -> None:
    with LocalCluster(1, allow_code=False, torch_threads=1) as c:
        pool = ChannelPool()
        request = epb.LoadStageRequest(job_id="j", model=epb.ModelSpec(name="tests.support.models:control_flow_net"))
        expect_code(
            lambda: ExecutorClient(c.addresses[0], pool).load_stage(request),
            grpc.StatusCode.UNAUTHENTICATED,
            "--allow-code",
        )
        pool.close()


def test_zz_correct_step_after_bad_input(driver: PipelineDriver) -> None:
    """Runs last in this module: the same workers still train correctly."""
    for client in driver.clients:
        client.abort(driver.job_id, "test: abandon step 0")
    for s in driver.stages:
        with pytest.raises(RemoteError):
            driver.clients[s.stage_idx].wait_step(driver.job_id, s.stage_idx, 0, 10.0)
    x, y = job_batch(JOB, build_job_dataset(JOB), 0)
    stats = driver.forward_backward(1, (x,), y)
    ref = train_reference(JOB, steps=1)
    assert stats.loss == pytest.approx(ref.losses[0], rel=1e-5)
