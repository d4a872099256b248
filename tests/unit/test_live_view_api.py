"""The live view's HTTP API over a real server on a free port, against a real
:class:`CoordinatorService` and its SQLite store (filled as a running job fills it).

Checked: every request without the token is refused (401, 429 past the failure budget),
the bearer token and the login cookie are accepted, unknown jobs and pages are 404 JSON
errors, the documents have their shapes, no method changes anything, malformed requests
leave the server serving, and with a certificate it speaks only TLS.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fusion.coordinator.live_view import COOKIE, LiveViewServer, start_live_view, tls_context
from fusion.coordinator.service import CoordinatorService
from fusion.coordinator.store import Store

TOKEN = "live-view-token-0123456789"
pytestmark = pytest.mark.timeout(60)


def fill_store(store: Store) -> str:
    """Two workers, a running job with a plan, three steps, a lost worker and a re-plan."""
    resources = {"device": "cpu", "matmul_flops": 2.5e10, "memory_bytes": str(8 << 30), "num_cores": 2}
    store.add_worker(worker_id="w-a", name="alpha", address="127.0.0.1:7101", resources=resources, session_hash="x")
    store.add_worker(worker_id="w-b", name="<b>beta</b>", address="127.0.0.1:7102", resources={}, session_hash="y")
    store.add_job(job_id="job-1", name="tiny", spec_json="{}", steps=10, output_dir="/tmp/out")
    store.add_job(job_id="job-2", name="later", spec_json="{}", steps=5, output_dir="/tmp/out2")
    store.transition("job-1", "planning")
    plan = {
        "strategy": "opfence",
        "predicted_step_s": 0.5,
        "micro_batches": 2,
        "schedule": "1f1b",
        "stages": [
            {"worker": "alpha", "nodes": ["a", "b"], "compute_s": 0.1, "peak_memory_bytes": 1000, "param_bytes": 10},
            {"worker": "<b>beta</b>", "nodes": ["c"], "compute_s": 0.2, "peak_memory_bytes": 2000, "param_bytes": 20},
        ],
        "cuts": [{"src_stage": 0, "dst_stage": 1, "bytes": 4096, "codec": "topk", "keep_ratio": 0.25}],
    }
    store.set_plan("job-1", plan, ["alpha", "<b>beta</b>"])
    store.transition("job-1", "running")
    for step in range(3):
        store.log("job-1", "metric", {"step": step, "loss": 2.0 - step * 0.1, "step_s": 0.5, "samples_per_s": 16.0})
    store.log("job-1", "event", {"event": "worker_lost", "message": "beta went", "worker": "beta", "failed_step": 3})
    store.log("job-1", "event", {"event": "replanned", "message": "1 stage on alpha"})
    store.set_progress("job-1", step=3, loss=1.8, samples_per_s=16.0)
    return "job-1"


@pytest.fixture
def service(tmp_path: Path) -> Iterator[CoordinatorService]:
    store = Store(tmp_path / "state.sqlite")
    svc = CoordinatorService(store=store, token=TOKEN, auth_failure_burst=3, auth_failures_per_s=0.01)
    fill_store(store)
    svc.links.set("127.0.0.1:7101", "127.0.0.1:7102", 0.002, 12.5e6)
    yield svc
    svc.close()
    store.close()


@pytest.fixture
def server(service: CoordinatorService) -> Iterator[LiveViewServer]:
    srv = start_live_view(service, "127.0.0.1", 0, token=TOKEN)
    yield srv
    srv.close()


def request(
    srv: LiveViewServer,
    method: str,
    path: str,
    *,
    token: str | None = TOKEN,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
    context: ssl.SSLContext | None = None,
) -> tuple[int, dict[str, str], bytes]:
    conn: http.client.HTTPConnection
    if context is not None:
        conn = http.client.HTTPSConnection("127.0.0.1", srv.port, timeout=10, context=context)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    all_headers = dict(headers or {})
    if token is not None:
        all_headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, body=body, headers=all_headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def get_json(srv: LiveViewServer, path: str, **kw: Any) -> tuple[int, Any]:
    code, headers, body = request(srv, "GET", path, **kw)
    assert headers["content-type"] == "application/json"
    return code, json.loads(body)


@pytest.mark.parametrize("path", ["/api/jobs", "/api/jobs/job-1", "/api/workers", "/api/links", "/api/nope"])
@pytest.mark.parametrize("token", [None, "wrong-token", ""])
def test_api_refuses_requests_without_the_token(server: LiveViewServer, path: str, token: str | None) -> None:
    code, doc = get_json(server, path, token=token)
    assert code == 401 and "token" in doc["error"]


def test_page_without_the_token_is_the_login_form(server: LiveViewServer) -> None:
    code, headers, body = request(server, "GET", "/", token=None)
    assert code == 401 and b'action="/login"' in body and b"fusion-view" not in body
    assert headers["content-type"].startswith("text/html")


def test_jobs_document(server: LiveViewServer) -> None:
    code, jobs = get_json(server, "/api/jobs")
    assert code == 200
    assert [j["id"] for j in jobs] == ["job-2", "job-1"]  # newest first
    assert all({"id", "state", "step", "steps", "loss", "waiting"} <= set(j) for j in jobs)
    running = jobs[1]
    assert (running["state"], running["step"], running["steps"], running["loss"]) == ("running", 3, 10, 1.8)
    assert jobs[0]["state"] == "pending"


def test_job_document_has_plan_curve_and_marked_events(server: LiveViewServer) -> None:
    code, doc = get_json(server, "/api/jobs/job-1")
    assert code == 200 and doc["id"] == "job-1" and doc["state"] == "running"
    assert [p["step"] for p in doc["points"]] == [0, 1, 2]
    assert [p["loss"] for p in doc["points"]] == pytest.approx([2.0, 1.9, 1.8])
    marked = {e["event"]: e["at_step"] for e in doc["events"]}
    assert marked["worker_lost"] == 3  # its failed step
    assert marked["replanned"] == 2  # the newest step before it
    plan = doc["plan"]
    assert plan["strategy"] == "opfence" and [s["nodes"] for s in plan["stages"]] == [2, 1]
    assert plan["cuts"] == [
        {
            "src_stage": 0,
            "dst_stage": 1,
            "src_worker": "alpha",
            "dst_worker": "<b>beta</b>",
            "bytes": 4096,
            "codec": "topk",
            "keep_ratio": 0.25,
        }
    ]
    assert doc["last_metric"]["step"] == 2
    # Asked again from where it ended: nothing new.
    code, again = get_json(server, f"/api/jobs/job-1?after={doc['last_seq']}")
    assert code == 200 and again["points"] == [] and again["events"] == [] and again["last_seq"] == doc["last_seq"]


def test_workers_and_links_documents(server: LiveViewServer) -> None:
    code, workers = get_json(server, "/api/workers")
    assert code == 200 and [w["name"] for w in workers] == ["<b>beta</b>", "alpha"]  # newest first
    alpha = workers[1]
    assert alpha["matmul_flops"] == 2.5e10 and alpha["memory_bytes"] == 8 << 30 and alpha["state"] == "idle"
    assert alpha["device"] == "cpu" and alpha["last_heartbeat_age_s"] >= 0
    code, links = get_json(server, "/api/links")
    assert code == 200
    assert links == [{"src": "alpha", "dst": "<b>beta</b>", "latency_s": 0.002, "bandwidth_bytes_per_s": 12.5e6}]


@pytest.mark.parametrize("path", ["/api/jobs/job-nope", "/api/jobs/job-1/extra", "/api/other", "/favicon.ico"])
def test_unknown_jobs_and_pages_are_404_json(server: LiveViewServer, path: str) -> None:
    code, doc = get_json(server, path)
    assert code == 404 and doc["error"]


def test_login_sets_an_http_only_cookie_that_serves_page_and_api(server: LiveViewServer) -> None:
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    code, _, body = request(server, "POST", "/login", token=None, headers=form, body=b"token=nope")
    assert code == 401 and b"Wrong token" in body
    code, headers, _ = request(server, "POST", "/login", token=None, headers=form, body=f"token={TOKEN}".encode())
    assert code == 303 and headers["location"] == "/"
    cookie = headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
    value = cookie.split(";")[0]
    assert value.startswith(f"{COOKIE}=")
    code, headers, page = request(server, "GET", "/", token=None, headers={"Cookie": f"other=1; {value}"})
    assert code == 200 and b'id="loss-chart"' in page
    nonce = headers["content-security-policy"].split("'nonce-")[1].split("'")[0]
    assert f'<script nonce="{nonce}">'.encode() in page
    code, jobs = get_json(server, "/api/jobs", token=None, headers={"Cookie": value})
    assert code == 200 and len(jobs) == 2
    code, _ = get_json(server, "/api/jobs", token=None, headers={"Cookie": f"{COOKIE}=forged"})
    assert code == 401


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/api/jobs"), ("PUT", "/api/jobs/job-1"), ("DELETE", "/api/jobs/job-1"), ("PATCH", "/api/workers")],
)
def test_nothing_changes_state(server: LiveViewServer, service: CoordinatorService, method: str, path: str) -> None:
    before = [(j.job_id, j.state, j.step) for j in service.store.jobs()]
    code, headers, body = request(server, method, path, body=b'{"state": "cancelled"}')
    assert code == 405 and "GET" in headers["allow"] and json.loads(body)["error"]
    assert [(j.job_id, j.state, j.step) for j in service.store.jobs()] == before
    assert get_json(server, "/api/jobs")[0] == 200


def test_malformed_requests_do_not_stop_the_server(server: LiveViewServer) -> None:
    assert get_json(server, "/api/jobs/job-1?after=-1")[0] == 400
    assert get_json(server, "/api/jobs/job-1?after=x")[0] == 400
    code, _, _ = request(server, "POST", "/login", token=None, headers={"Content-Length": "999999999"}, body=b"")
    assert code == 400
    for garbage in (
        b"\x00\xff\r\n\r\n",
        b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nBad\r\n\r\n",
    ):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(garbage)
            s.recv(1024)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5):
        pass  # connected and left without a word
    code, headers, _ = request(server, "GET", "/api/jobs", token="\u00e9\u00ff")
    assert code == 401
    assert get_json(server, "/api/jobs")[0] == 200


def test_wrong_tokens_are_rate_limited_and_a_right_one_still_served(server: LiveViewServer) -> None:
    codes = [get_json(server, "/api/jobs", token=f"guess-{i}")[0] for i in range(6)]
    assert codes[:3] == [401, 401, 401] and 429 in codes[3:]
    assert get_json(server, "/api/jobs")[0] == 200
    assert get_json(server, "/api/jobs", token=None)[0] == 401  # no credential: no guess counted


def test_serves_only_tls_with_a_certificate(service: CoordinatorService, tmp_path: Path) -> None:
    from tests.integration.test_tls import make_ca, make_server_cert

    ca_path, ca_key, ca_cert = make_ca(tmp_path, "view")
    cert, key = make_server_cert(tmp_path, ca_key, ca_cert)
    srv = start_live_view(service, "127.0.0.1", 0, token=TOKEN, tls=tls_context(cert, key))
    try:
        client = ssl.create_default_context(cafile=str(ca_path))
        code, headers, body = request(srv, "GET", "/api/jobs", context=client)
        assert code == 200 and len(json.loads(body)) == 2
        code, headers, _ = request(
            srv,
            "POST",
            "/login",
            token=None,
            context=client,
            headers={"Content-Type": "application/x-www-form-urlencoded"},
            body=f"token={TOKEN}".encode(),
        )
        assert code == 303 and "; Secure" in headers["set-cookie"]
        with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
            request(srv, "GET", "/api/jobs")  # plain HTTP to the TLS port
        assert request(srv, "GET", "/api/jobs", context=client)[0] == 200
    finally:
        srv.close()


@pytest.mark.parametrize("value", ["8080", "127.0.0.1:", "127.0.0.1:http", ":8080", "127.0.0.1:99999"])
def test_coordinator_refuses_a_malformed_http_address(tmp_path: Path, value: str, capsys: Any) -> None:
    from fusion.cli.coordinator import main

    code = main(["--http", value, "--state-dir", str(tmp_path), "--token", TOKEN])
    assert code != 0
    assert "--http must be HOST:PORT" in capsys.readouterr().err


def test_silent_connections_beyond_the_cap_are_closed(
    service: CoordinatorService, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fusion.coordinator import live_view

    monkeypatch.setattr(live_view, "MAX_CONNECTIONS", 3)
    srv = start_live_view(service, "127.0.0.1", 0, token=TOKEN)
    try:
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(3)]
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as extra:
            assert extra.recv(1) == b""  # closed without an answer
        for s in idle:
            s.close()
        deadline = time.monotonic() + 10
        while True:  # the slots free as the idle ones go
            try:
                if get_json(srv, "/api/jobs")[0] == 200:
                    break
            except ConnectionError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        srv.close()
