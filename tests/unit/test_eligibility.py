"""Which workers can run a job's own model code: from registration, and from a failed build."""

from __future__ import annotations

from fusion.config import JobSpec
from fusion.coordinator.eligibility import code_failure, code_refusal
from fusion.coordinator.store import WorkerRow
from fusion.errors import RemoteError, StageError


def _worker(name: str, *, allows_code: bool) -> WorkerRow:
    resources = {"device": "cpu", **({"allows_code": True} if allows_code else {})}  # proto3 JSON drops false
    return WorkerRow(
        worker_id=f"id-{name}",
        name=name,
        address=f"{name}.example:7000",
        resources=resources,
        session_hash="",
        state="busy",
        job_id="job",
        registered_at=0.0,
        last_heartbeat=0.0,
    )


def _spec(name: str) -> JobSpec:
    return JobSpec.from_toml(f'[model]\nname = "{name}"\n[data]\nname = "shapes"\n')


def test_a_worker_without_allow_code_is_refused_only_for_code() -> None:
    plain, coder = _worker("plain", allows_code=False), _worker("coder", allows_code=True)
    own = _spec("pkg.mod:make")
    assert code_refusal(own, plain) == (
        "it was started without --allow-code, and this job's model is code (pkg.mod:make)"
    )
    assert code_refusal(own, coder) is None
    assert code_refusal(_spec("gpt2"), plain) is None


def test_a_failed_build_names_the_worker_and_its_error() -> None:
    w = _worker("w1", allows_code=True)
    own = _spec("pkg.mod:make")
    error = RemoteError(
        f"LoadStage on {w.address} failed with INVALID_ARGUMENT: ConfigError: cannot import module 'pkg.mod' "
        "for model factory 'pkg.mod:make': No module named 'pkg'",
        code="INVALID_ARGUMENT",
        peer=w.address,
    )
    found = code_failure(own, error, [_worker("w0", allows_code=True), w])
    assert found is not None
    worker, reason = found
    assert worker is w
    assert reason == (
        "it cannot build this job's model (pkg.mod:make): cannot import module 'pkg.mod' for model factory "
        "'pkg.mod:make': No module named 'pkg'"
    )


def test_other_failures_are_not_code_failures() -> None:
    w = _worker("w1", allows_code=True)
    own = _spec("pkg.mod:make")
    unrelated = RemoteError(
        f"LoadStage on {w.address} failed with UNAVAILABLE: gone", code="UNAVAILABLE", peer=w.address
    )
    assert code_failure(own, unrelated, [w]) is None
    assert code_failure(own, StageError("model factory 'pkg.mod:make'"), [w]) is None
    builtin_error = RemoteError("cannot import module for model factory 'gpt2'", peer=w.address)
    assert code_failure(_spec("gpt2"), builtin_error, [w]) is None
    elsewhere = RemoteError("cannot import module for model factory 'pkg.mod:make'", peer="10.0.0.1:1")
    assert code_failure(own, elsewhere, [w]) is None
