"""The CLI's rough edges (issue 31, item 5): the workers table, one error style and exit code
per kind of error, plain-text help, the progress display and the loss plot's data."""

from __future__ import annotations

import argparse
import io
import json
import re
from pathlib import Path

import pytest

from fusion.cli.env import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_NOT_FOUND, exit_code_of, remote_message, run_cli
from fusion.cli.progress import JobProgress, describe, progress_line
from fusion.cli.workers_table import COLUMNS, format_workers, human_age, human_bytes, select_workers
from fusion.coordinator.loss_plot import EVENT_LABELS, ema, ema_span, event_markers, loss_plot_data, read_records
from fusion.coordinator.outputs import LOSS_PLOT_FILE, JobOutputs
from fusion.errors import AuthError, ConfigError, NotFoundError, RemoteError, StateError
from fusion.wire import coordinator_pb2 as cpb

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------- fusion workers


def worker(name: str, worker_id: str, state: str, *, memory_gib: float = 8.0, age_s: float = 1.0) -> cpb.WorkerInfo:
    return cpb.WorkerInfo(
        worker_id=worker_id,
        name=name,
        address=f"10.0.0.1:{5000 + len(worker_id)}",
        state=state,
        last_heartbeat_age_s=age_s,
        job_id="job-1" if state == "busy" else "",
        resources=cpb.WorkerResources(device="cpu", matmul_flops=42.5e9, memory_bytes=int(memory_gib * 2**30)),
    )


# Registration order, oldest first (as the coordinator lists them): "a" restarted twice.
FLEET = [
    worker("a", "w-a1", "gone", age_s=900),
    worker("b", "w-b1", "busy"),
    worker("a", "w-a2", "gone", age_s=300),
    worker("c", "w-c1", "excluded"),
    worker("d", "w-d1", "idle"),
    worker("a", "w-a3", "idle"),
    worker("b", "w-b1", "busy"),  # the same id listed twice
]


def test_workers_table_shows_live_workers_first_once_each() -> None:
    rows = select_workers(FLEET)
    assert [(w.name, w.worker_id, w.state) for w in rows] == [
        ("d", "w-d1", "idle"),
        ("a", "w-a3", "idle"),
        ("b", "w-b1", "busy"),
    ]


def test_workers_table_all_adds_gone_and_excluded_after_the_live_ones() -> None:
    rows = select_workers(FLEET, include_gone=True)
    assert [w.worker_id for w in rows] == ["w-d1", "w-a3", "w-b1", "w-a1", "w-a2", "w-c1"]


def test_newest_live_row_of_a_reregistered_name_is_kept() -> None:
    stale = [worker("a", "w-old", "idle", age_s=9.0), worker("a", "w-new", "idle", age_s=0.5)]
    assert [w.worker_id for w in select_workers(stale)] == ["w-new"]


def test_workers_table_has_a_header_and_the_columns() -> None:
    lines = format_workers(FLEET).splitlines()
    assert lines[0].split() == list(COLUMNS)
    assert len(lines) == 4
    a = lines[2].split()
    assert a[:4] == ["a", "w-a3", "idle", "cpu"]
    assert "42.5 GFLOP/s" in lines[2] and "8.0 GiB" in lines[2] and "1.0s ago" in lines[2]
    assert "job-1" in lines[3]
    assert "gone" not in format_workers(FLEET) and "gone" in format_workers(FLEET, include_gone=True)


def test_workers_table_with_no_live_workers_says_so() -> None:
    assert format_workers([]) == "no live workers"
    assert "--all" in format_workers([worker("a", "w1", "gone")])


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "-"), (512, "512 B"), (3 * 2**20, "3.0 MiB"), (int(15.6 * 2**30), "15.6 GiB"), (2**41, "2.0 TiB")],
)
def test_memory_in_human_units(n: int, text: str) -> None:
    assert human_bytes(n) == text


@pytest.mark.parametrize(("age", "text"), [(0.42, "0.4s ago"), (42, "42s ago"), (600, "10m ago"), (36000, "10h ago")])
def test_heartbeat_age(age: float, text: str) -> None:
    assert human_age(age) == text


# ----------------------------------------------------------------- errors and exit codes


def remote(code: str, details: str, what: str = "SubmitJob") -> RemoteError:
    return RemoteError(f"{what} on 127.0.0.1:7077 failed with {code}: {details}", code=code, peer="127.0.0.1:7077")


def test_a_remote_config_error_reads_like_a_local_one(capsys: pytest.CaptureFixture[str]) -> None:
    def local() -> int:
        raise ConfigError("job.toml: model.preset 'huge' is not one of tiny, small")

    def remote_body() -> int:
        raise remote("INVALID_ARGUMENT", "ConfigError: job.toml: model.preset 'huge' is not one of tiny, small")

    assert run_cli(local) == run_cli(remote_body) == EXIT_BAD_INPUT
    first, second = capsys.readouterr().err.splitlines()
    assert first == second == "error: job.toml: model.preset 'huge' is not one of tiny, small"


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ConfigError("x"), EXIT_BAD_INPUT),
        (remote("INVALID_ARGUMENT", "ConfigError: x"), EXIT_BAD_INPUT),
        (NotFoundError("no job 'j'"), EXIT_NOT_FOUND),
        (remote("NOT_FOUND", "NotFoundError: no job 'j'", "GetJob"), EXIT_NOT_FOUND),
        (StateError("job j already succeeded; nothing to cancel"), EXIT_FAILED),
        (remote("FAILED_PRECONDITION", "StateError: job j already succeeded; nothing to cancel"), EXIT_FAILED),
        (remote("UNAUTHENTICATED", "AuthError: wrong or missing token"), EXIT_BAD_INPUT),
        (AuthError("wrong or missing token"), EXIT_BAD_INPUT),
        (RemoteError("no coordinator at h:1 — is fusion-coordinator running?", code="UNAVAILABLE"), EXIT_FAILED),
    ],
)
def test_exit_code_per_kind_of_error(error: Exception, code: int) -> None:
    assert exit_code_of(error) == code  # type: ignore[arg-type]


def test_remote_message_drops_the_call_and_the_type() -> None:
    assert remote_message(remote("NOT_FOUND", "NotFoundError: no job 'j'")) == "no job 'j'"
    assert remote_message(remote("INTERNAL", "boom: it broke")) == "boom: it broke"
    plain = RemoteError("no coordinator at h:1 — is fusion-coordinator running?", code="UNAVAILABLE")
    assert remote_message(plain) == str(plain)


# ----------------------------------------------------------------- plain-text help


def all_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    from fusion.cli import coordinator, main, worker

    top = main.build_parser()
    out = [
        ("fusion", top),
        ("fusion-worker", worker.build_parser()),
        ("fusion-coordinator", coordinator.build_parser()),
    ]
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            out += [(f"fusion {name}", sp) for name, sp in action.choices.items()]
    return out


RST = re.compile(r"``|:(func|class|meth|mod|data|attr|ref|doc):`|\.\. [a-z]+::")


def test_every_help_is_plain_text() -> None:
    parsers = all_parsers()
    assert {"fusion demo", "fusion workers", "fusion submit"} <= {name for name, _ in parsers}
    for name, parser in parsers:
        text = parser.format_help()
        assert not RST.search(text), f"{name} --help shows reStructuredText:\n{text}"


# ----------------------------------------------------------------- progress


def running(step: int, loss: float | None = 3.25, state: str = "running") -> dict[str, object]:
    return {"state": state, "step": step, "steps": 100, "loss": loss, "samples_per_s": 12.0}


def test_describe_says_what_a_job_waits_for_or_its_phase() -> None:
    assert describe({"state": "pending", "waiting": "2 of 3 idle workers"}) == "pending: 2 of 3 idle workers"
    assert describe({"state": "planning", "phase": "probing links"}) == "planning: probing links"
    assert describe({"state": "pending"}) == "pending"  # a coordinator that does not say
    assert describe({"state": "running", "phase": "searching"}) == "running"


def test_progress_line_counts_steps_done_with_rate_and_eta() -> None:
    line = progress_line(running(5), 2.5)
    assert line == "step 5/100, loss 3.2500, 12.0 samples/s, 2.50 steps/s, ETA 00:38 (running)"
    assert progress_line({"state": "pending", "step": 0, "steps": 100, "waiting": "1 of 3"}, None) == (
        "step 0/100 (pending: 1 of 3)"
    )


def test_progress_without_a_terminal_writes_plain_lines_now_and_then() -> None:
    out = io.StringIO()
    p = JobProgress(100, stream=out, tty=False, every_s=3600)
    p.update({"state": "pending", "step": 0, "steps": 100, "waiting": "2 of 3 idle workers"})
    p.update({"state": "planning", "step": 0, "steps": 100, "phase": "profiling"})
    for step in range(1, 50):
        p.update(running(step))
    p.update(running(100, state="succeeded"))
    p.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [line.rsplit("(", 1)[1] for line in lines] == [
        "pending: 2 of 3 idle workers)",
        "planning: profiling)",
        "running)",
        "succeeded)",
    ]
    assert all(re.match(r"\[00:0\d\] step ", line) for line in lines), lines
    assert lines[2].startswith("[00:00] step 1/100") and lines[3].startswith("[00:00] step 100/100")


def test_progress_on_a_terminal_is_a_bar_with_loss() -> None:
    out = io.StringIO()
    p = JobProgress(100, stream=out, tty=True)
    p.update({"state": "planning", "step": 0, "steps": 100, "phase": "searching"})
    p.update(running(7))
    p.update(running(3))  # rewound by a restore
    p.close()
    text = out.getvalue()
    assert "planning: searching" in text and "7/100" in text and "3/100" in text and "loss=3.2500" in text


# ----------------------------------------------------------------- loss.png


def test_ema_starts_at_the_first_value_and_follows() -> None:
    assert ema([4.0, 4.0, 4.0], 5) == [4.0, 4.0, 4.0]
    smoothed = ema([4.0, 2.0], 3)
    assert smoothed == [4.0, 3.0]
    assert ema_span(10) == 2 and ema_span(300) == 30 and ema_span(10_000) == 50


RECORDS = [
    {"step": 0, "loss": 5.0},
    {"step": 1, "loss": 4.0},
    {"event": "replan_considered", "message": "keeping the plan"},
    {"step": 2, "loss": 3.5},
    {"event": "worker_lost", "worker": "w1", "failed_step": 3},
    {"event": "replaced", "message": "stage 1 on w2"},
    {"event": "resumed_at_step", "step": 2},
    {"step": 2, "loss": 3.6},
    {"event": "replanned", "message": "uniform: 2 stage(s)"},
]


def test_events_are_marked_at_the_steps_done_when_they_happened() -> None:
    assert event_markers(RECORDS) == [(3, "lost w1"), (3, "replaced"), (3, "resumed"), (3, "re-plan")]
    assert "replan_considered" not in EVENT_LABELS


def test_loss_plot_data_counts_steps_done_and_smooths() -> None:
    data = loss_plot_data([0, 1, 2], [5.0, 4.0, 3.0], RECORDS)
    assert data.steps == [1, 2, 3]
    assert data.losses == [5.0, 4.0, 3.0]
    assert data.smoothed[0] == 5.0 and 3.0 < data.smoothed[-1] < 5.0
    assert data.smoothing == "EMA, span 2 steps"
    assert data.markers[0] == (3, "lost w1")


def test_loss_png_is_written_with_the_events(tmp_path: Path) -> None:
    outputs = JobOutputs(tmp_path / "job")
    for rec in RECORDS:
        outputs.append_metrics(rec)
    records = read_records(outputs.dir / "metrics.jsonl")
    assert records == [json.loads(json.dumps(r)) for r in RECORDS]
    outputs.write_loss_plot([0, 1, 2], [5.0, 4.0, 3.6], "demo (job-1)", records=records)
    data = (outputs.dir / LOSS_PLOT_FILE).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    outputs.close()


# ----------------------------------------------------------------- unreachable coordinator


@pytest.mark.parametrize(
    ("details", "expected"),
    [
        (
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote "
            "host: Connection refused",
            "no coordinator at h:1 — is fusion-coordinator running?",
        ),
        (
            "errors resolving nosuch.invalid:1: [field:hostname lookup error:Domain name not found]",
            "no coordinator at h:1 — is fusion-coordinator running?",
        ),
        (
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls handshake failed "
            "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: WRONG_VERSION_NUMBER",
            "TLS handshake with the coordinator at h:1 failed",
        ),
        (
            "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed",
            "if it serves TLS, pass --tls-ca",
        ),
    ],
    ids=["refused", "dns", "tls-handshake", "plain-to-tls"],
)
def test_an_unreachable_coordinator_is_named_in_one_line(details: str, expected: str) -> None:
    from fusion.coordinator.client import _unreachable_message

    message = _unreachable_message(remote("UNAVAILABLE", details, "ListJobs"), "h:1")
    assert message is not None and expected in message and "\n" not in message
    assert _unreachable_message(remote("UNAVAILABLE", "StageError: stage 1 is restarting"), "h:1") is None
    assert _unreachable_message(remote("INVALID_ARGUMENT", "Connection refused"), "h:1") is None


def test_the_demos_closing_losses_skip_the_events_between_steps(tmp_path: Path) -> None:
    """``metrics.jsonl`` holds the job's events beside its steps (a compression note at
    planning, a recovery); the demo's closing line averages the last steps' losses, a redone
    step's last and a loss read from a snapshot, and reads past the other events."""
    from fusion.cli.demo import _last_losses

    rows = [
        {"event": "compression", "message": "nothing compressed"},
        {"step": 0, "loss": 4.0},
        {"step": 1, "loss": 3.0},
        {"event": "resumed_at_step", "message": "resumed at step 1", "step": 1},
        {"step": 1, "loss": 2.5},
        {"event": "loss_from_snapshot", "message": "...", "step": 2, "loss": 2.0},
        {"step": 3, "loss": 1.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _last_losses(tmp_path, 3) == [2.5, 2.0, 1.5]
    assert _last_losses(tmp_path / "missing", 2) == []
