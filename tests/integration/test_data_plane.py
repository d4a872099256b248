"""Stage-to-stage tensors over the direct data plane (executor/frames.py): real worker
processes train exactly like one process, and the traffic really took the data plane; a
worker without it is reached over gRPC."""

from __future__ import annotations

import socket
from pathlib import Path

import psutil
import pytest

from fusion.config import JobSpec
from fusion.coordinator.client import CoordinatorClient
from fusion.launch import Fleet
from fusion.launch.executors import LocalCluster
from fusion.tls import set_client_ca
from tests.integration.test_tls import make_ca, make_server_cert
from tests.support.parity import assert_parity

pytestmark = pytest.mark.timeout(600)

GPT2 = {"model": {"name": "gpt2", "preset": "tiny"}, "data": {"batch_size": 8, "seq_len": 16}}


def job(**train: object) -> JobSpec:
    return JobSpec.from_dict({**GPT2, "train": {"steps": 1, "optimizer": "sgd", "lr": 0.1, **train}})


def listening_ports(pid: int) -> set[int]:
    return {c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def data_links(cluster: LocalCluster, path: str | None = None) -> set[tuple[int, int]]:
    """(i, j) for every open data connection from worker i to worker j over ``path``
    (``"tcp"``, ``"unix"``; default both): a TCP connection to a data port of j (a listening
    port of j that is not its gRPC port), or a connection j accepted on its local Unix socket
    (executor/local_socket.py). The kernel does not show who opened a Unix connection; with
    two workers (all these tests run), it is the other one."""
    grpc_ports = {int(a.rpartition(":")[2]) for a in cluster.addresses}
    data_ports = {port: j for j, p in enumerate(cluster.processes) for port in listening_ports(p.pid) - grpc_ports}
    links = set()
    for i, p in enumerate(cluster.processes):
        if path in (None, "tcp"):
            for c in psutil.Process(p.pid).net_connections("tcp"):
                if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port in data_ports:
                    links.add((i, data_ports[c.raddr.port]))
        if path in (None, "unix"):
            names = [c.laddr for c in psutil.Process(p.pid).net_connections("unix")]
            if sum(str(n).startswith("@fusion-data/") for n in names) > 1:  # the listener and accepted ones
                assert len(cluster.processes) == 2, "a local link's sender is only known with two workers"
                links.add((1 - i, i))
    return links


def test_parity_over_the_data_plane() -> None:
    with LocalCluster(2, torch_threads=1) as cluster:
        # Several steps and micro-batches: the first transfer to each peer goes over gRPC
        # (its answer names the data port), the rest over the data plane, both ways.
        assert_parity(job(micro_batches=4, schedule="1f1b", steps=3), cluster.addresses, steps=3)
        # Co-located workers: the data plane took their local path, not TCP.
        assert data_links(cluster, "unix") == {(0, 1), (1, 0)} and data_links(cluster, "tcp") == set()


def test_paced_sends_take_the_data_plane() -> None:
    with LocalCluster(2, torch_threads=1) as cluster:
        links = {(0, 1): 50e6, (1, 0): 50e6}  # several transfers in flight per destination
        assert_parity(job(micro_batches=4, steps=2), cluster.addresses, steps=2, link_bytes_per_s=links)
        assert data_links(cluster) == {(0, 1), (1, 0)}


def test_a_worker_without_the_data_plane_is_reached_over_grpc() -> None:
    with LocalCluster(2, torch_threads=1, extra_args=["--no-data-plane"]) as cluster:
        assert_parity(job(micro_batches=2, steps=2), cluster.addresses, steps=2)
        assert data_links(cluster) == set()
        assert all(len(listening_ports(p.pid)) == 1 for p in cluster.processes)


def test_fusion_worker_no_data_plane_serves_only_its_grpc_port(tmp_path: Path) -> None:
    """``fusion-worker --no-data-plane`` (a volunteer whose firewall forwards one port) opens
    no second port; a worker without the flag listens on its gRPC port and its data plane."""
    token = "no-data-plane-token-01"
    with Fleet(tmp_path / "logs") as fleet:
        fleet.start_coordinator(token=token, state_dir=tmp_path / "state")
        procs = {
            "plain": fleet.start_worker("plain", token=token),
            "grpc-only": fleet.start_worker("grpc-only", token=token, extra_args=["--no-data-plane"]),
        }
        client = CoordinatorClient(fleet.coordinator_address, token)
        try:
            grpc_ports = {w.name: int(w.address.rpartition(":")[2]) for w in client.workers()}
        finally:
            client.close()
        assert listening_ports(procs["grpc-only"].pid) == {grpc_ports["grpc-only"]}
        plain = listening_ports(procs["plain"].pid)
        assert grpc_ports["plain"] in plain and len(plain) == 2


def test_tls_workers_use_a_tls_data_plane(tmp_path: Path) -> None:
    ca, ca_key, ca_cert = make_ca(tmp_path, "dp")
    cert, key = make_server_cert(tmp_path, ca_key, ca_cert)
    tls = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca)]
    set_client_ca(ca)  # this process (the driver) reaches the workers over TLS too
    try:
        with LocalCluster(2, torch_threads=1, extra_args=tls) as cluster:
            assert_parity(job(micro_batches=2, steps=2), cluster.addresses, steps=2)
            assert data_links(cluster) == {(0, 1), (1, 0)}
            # The data port speaks only TLS: a plain frame is not answered.
            port = next(
                iter(listening_ports(cluster.processes[0].pid) - {int(cluster.addresses[0].rpartition(":")[2])})
            )
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"FSND" + bytes(200))
                s.settimeout(10)
                try:
                    answer = s.recv(64)
                except OSError:
                    answer = b""
                assert not answer.startswith(b"FSNR")
    finally:
        set_client_ca(None)


def test_frames_of_a_replaced_placement_are_refused_as_stale() -> None:
    """As ``test_freeze_thaw``'s gRPC case: the executor names an old placement's frames stale
    without counting them as failed authentications, and refuses unknown keys."""
    import torch

    from executor.access import ExecutorAccess
    from executor.server import ExecutorService, start_server
    from executor.stream_client import DataPlaneClient
    from fusion.auth import KeyRing, new_key, wrap_job_key
    from fusion.errors import RemoteError
    from fusion.wire import tensor_pb2 as pb

    control = new_key()
    service = ExecutorService(worker_name="w3", access=ExecutorAccess(keyring=KeyRing(), control_key=control))
    server, port = start_server(service, "127.0.0.1:0")
    old_key, current = new_key(), new_key()
    service.access.add_job("job-1", wrap_job_key(control, old_key))
    service.access.add_job("job-1", wrap_job_key(control, current))  # the re-plan's LoadStage

    def send(key: bytes) -> RemoteError:
        ring = KeyRing()
        ring.set_job("job-1", key)
        client = DataPlaneClient(ring)
        client.learn(f"127.0.0.1:{port}", service.data_port)
        header = pb.TransferHeader(
            job_id="job-1", stage_idx=2, src_stage_idx=1, step=5, kind=pb.TRANSFER_KIND_ACTIVATION
        )
        try:
            with pytest.raises(RemoteError) as info:
                client.send(f"127.0.0.1:{port}", header, {"h": torch.zeros(2, 3)})
        finally:
            client.close()
        return info.value

    try:
        stale = send(old_key)
        assert stale.code == "FAILED_PRECONDITION" and "placement that was replaced" in str(stale), stale
        assert send(current).code == "NOT_FOUND"  # the current key passes; no stage 2 is loaded here
        assert send(new_key()).code == "UNAUTHENTICATED"
        assert service.data_listener is not None and service.data_listener.num_refused == 3
    finally:
        server.stop(grace=None).wait()
        service.close()
