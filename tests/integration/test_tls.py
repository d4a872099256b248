"""TLS round trip: a coordinator and two workers that all serve TLS, and clients that must use it.

A throwaway CA signs one certificate for 127.0.0.1/localhost that every server presents.
The job owner's CLI (``--tls-ca``) submits a GPT-2 tiny job that runs to success: the
coordinator calls the workers' executors over TLS, the workers send each other
activations and gradients over TLS. A plain-text client, and a TLS client that trusts
another CA, are refused by the coordinator and by a worker's executor alike.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fusion.launch import Fleet
from fusion.wire import coordinator_pb2 as cpb
from fusion.wire import executor_pb2 as epb

TOKEN = "tls-token"
pytestmark = pytest.mark.timeout(300)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(directory: Path, label: str) -> tuple[Path, ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA (P-256, valid for a day); returns its PEM path, key and certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"fusion test CA {label}"))
        .issuer_name(_name(f"fusion test CA {label}"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    path = directory / f"ca-{label}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, key, cert


def make_server_cert(
    directory: Path, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate
) -> tuple[Path, Path]:
    """A server certificate for 127.0.0.1 and localhost signed by the CA; returns (cert, key) paths."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = directory / "server.pem", directory / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_path.chmod(0o600)
    return cert_path, key_path


def _list_jobs(channel: grpc.Channel) -> grpc.StatusCode:
    stub = channel.unary_unary(
        "/fusion.wire.Coordinator/ListJobs",
        request_serializer=cpb.ListJobsRequest.SerializeToString,
        response_deserializer=cpb.ListJobsResponse.FromString,
    )
    try:
        stub(cpb.ListJobsRequest(), timeout=5, metadata=(("fusion-auth", TOKEN),))
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _ping(channel: grpc.Channel) -> grpc.StatusCode:
    stub = channel.unary_unary(
        "/fusion.wire.Executor/Ping",
        request_serializer=epb.PingRequest.SerializeToString,
        response_deserializer=epb.PingResponse.FromString,
    )
    try:
        stub(epb.PingRequest(), timeout=5)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_tls_round_trip_and_plain_text_refused(tmp_path: Path) -> None:
    ca_path, ca_key, ca_cert = make_ca(tmp_path, "good")
    other_ca, _, _ = make_ca(tmp_path, "other")
    cert, key = make_server_cert(tmp_path, ca_key, ca_cert)
    tls = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca_path)]
    job = tmp_path / "job.toml"
    job.write_text(
        textwrap.dedent(f"""
        name = "tls"
        [model]
        name = "gpt2"
        preset = "tiny"
        [data]
        batch_size = 4
        seq_len = 16
        [train]
        steps = 6
        micro_batches = 2
        [cluster]
        min_workers = 2
        [plan]
        strategy = "uniform"
        [output]
        dir = "{tmp_path / "out"}"
    """)
    )
    with Fleet(tmp_path / "logs") as fleet:
        address = fleet.start_coordinator(token=TOKEN, state_dir=tmp_path / "state", extra_args=tls)
        for name in ("w0", "w1"):
            fleet.start_worker(name, token=TOKEN, extra_args=tls, wait=False)
        fleet.wait_workers(["w0", "w1"])

        env = {**fleet.env, "FUSION_COORDINATOR": address, "FUSION_TOKEN": TOKEN}
        env.pop("FUSION_TLS_CA", None)

        def cli(*args: str, ca: Path | None = ca_path) -> subprocess.CompletedProcess[str]:
            extra = ["--tls-ca", str(ca)] if ca is not None else []
            return subprocess.run(
                [sys.executable, "-m", "fusion.cli.main", *args, *extra],
                capture_output=True,
                text=True,
                env=env,
                timeout=120,
                check=False,
            )

        submitted = cli("submit", str(job))
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.split()[-1]
        deadline = time.monotonic() + 200
        while True:
            r = cli("status", job_id, "--json")
            assert r.returncode == 0, r.stderr
            status = json.loads(r.stdout)
            if status["state"] in ("succeeded", "failed", "cancelled"):
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.5)
        assert status["state"] == "succeeded", status
        assert status["step"] == 6 and len(status["plan"]["stages"]) == 2, status
        assert (Path(status["output_dir"]) / "model.safetensors").exists()

        # The CLI without the CA (plain text) and with another CA is refused.
        plain = cli("jobs", ca=None)
        assert plain.returncode != 0 and job_id not in plain.stdout, plain.stdout
        wrong = cli("jobs", ca=other_ca)
        assert wrong.returncode != 0 and job_id not in wrong.stdout, wrong.stdout
        assert job_id in cli("jobs").stdout

        # The same, with raw channels, on the coordinator and on a worker's executor.
        workers = cli("workers").stdout.split()
        worker_address = next(w for w in workers if w.startswith("127.0.0.1:") and w != address)
        good = grpc.ssl_channel_credentials(root_certificates=ca_path.read_bytes())
        bad = grpc.ssl_channel_credentials(root_certificates=other_ca.read_bytes())
        with grpc.secure_channel(address, good) as ch:
            assert _list_jobs(ch) == grpc.StatusCode.OK
        for target, probe in ((address, _list_jobs), (worker_address, _ping)):
            with grpc.insecure_channel(target) as ch:
                assert probe(ch) == grpc.StatusCode.UNAVAILABLE, target
            with grpc.secure_channel(target, bad) as ch:
                assert probe(ch) == grpc.StatusCode.UNAVAILABLE, target
        # Over TLS the executor answers, and still demands its own credential.
        with grpc.secure_channel(worker_address, good) as ch:
            assert _ping(ch) == grpc.StatusCode.UNAUTHENTICATED
