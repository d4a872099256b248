"""CLI environment plumbing: where the token comes from, env defaults, and exit codes."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest

from fusion.cli.env import (
    DEFAULT_COORDINATOR,
    add_connection_args,
    env_calibrate_s,
    env_coordinator,
    env_log_level,
    resolve_token,
    run_cli,
)
from fusion.errors import ConfigError, FusionError, PlanError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FUSION_TOKEN", "FUSION_COORDINATOR", "FUSION_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("from-file\n")
    return path


# ----------------------------------------------------------------- resolve_token


def test_token_flag_wins(token_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSION_TOKEN", "from-env")
    assert resolve_token("from-flag", str(token_file)) == "from-flag"


def test_token_file_beats_the_environment(token_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSION_TOKEN", "from-env")
    assert resolve_token(None, str(token_file)) == "from-file"  # surrounding whitespace stripped


def test_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSION_TOKEN", "from-env")
    assert resolve_token(None, None) == "from-env"
    assert resolve_token(None, None, required=False) == "from-env"


def test_empty_flag_falls_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSION_TOKEN", "from-env")
    assert resolve_token("", None) == "from-env"


def test_missing_token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSION_TOKEN", "from-env")  # a named file that cannot be read is an error, not a fallback
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match="cannot read token file") as info:
        resolve_token(None, str(missing))
    assert str(missing) in str(info.value)
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(ConfigError):
        resolve_token(None, str(missing), required=False)


@pytest.mark.parametrize("content", ["", "\n", "   \n\t"])
def test_empty_token_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "token"
    path.write_text(content)
    with pytest.raises(ConfigError, match="is empty") as info:
        resolve_token(None, str(path))
    assert str(path) in str(info.value)


def test_token_file_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read token file"):
        resolve_token(None, str(tmp_path))


def test_no_token_anywhere() -> None:
    with pytest.raises(ConfigError, match="FUSION_TOKEN") as info:
        resolve_token(None, None)
    assert "--token" in str(info.value) and "--token-file" in str(info.value)
    assert resolve_token(None, None, required=False) is None


def test_empty_env_token_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSION_TOKEN", "")
    assert resolve_token(None, None, required=False) is None
    with pytest.raises(ConfigError):
        resolve_token(None, None)


# ----------------------------------------------------------------- env defaults


def test_env_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_coordinator() == DEFAULT_COORDINATOR
    assert env_log_level() == "WARNING"
    monkeypatch.setenv("FUSION_COORDINATOR", "10.0.0.1:9000")
    monkeypatch.setenv("FUSION_LOG_LEVEL", "DEBUG")
    assert env_coordinator() == "10.0.0.1:9000"
    assert env_log_level() == "DEBUG"


def test_connection_args(monkeypatch: pytest.MonkeyPatch, token_file: Path) -> None:
    monkeypatch.setenv("FUSION_COORDINATOR", "10.0.0.1:9000")
    parser = argparse.ArgumentParser()
    add_connection_args(parser)
    args = parser.parse_args([])
    assert (args.coordinator, args.token, args.token_file) == ("10.0.0.1:9000", None, None)
    args = parser.parse_args(["--coordinator", "h:1", "--token-file", str(token_file)])
    assert args.coordinator == "h:1"
    assert resolve_token(args.token, args.token_file) == "from-file"


# ----------------------------------------------------------------- run_cli


def raiser(error: BaseException) -> Callable[[], int]:
    """A CLI body that raises ``error``."""

    def body() -> int:
        raise error

    return body


@pytest.mark.parametrize(
    ("body", "code", "stderr"),
    [
        (lambda: 0, 0, ""),
        (lambda: 3, 3, ""),
        (raiser(ConfigError("bad job file")), 2, "error: bad job file"),
        (raiser(PlanError("no plan fits")), 1, "error: no plan fits"),
        (raiser(FusionError("boom")), 1, "error: boom"),
        (raiser(KeyboardInterrupt()), 130, "interrupted"),
    ],
    ids=["ok", "code", "config", "plan", "fusion", "interrupt"],
)
def test_run_cli_exit_codes(
    body: Callable[[], int], code: int, stderr: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(body) == code
    err = capsys.readouterr().err
    assert err.strip() == stderr


def test_run_cli_lets_bugs_through() -> None:
    with pytest.raises(ZeroDivisionError):
        run_cli(lambda: 1 // 0)


# ----------------------------------------------------------------- calibration seconds


def test_calibrate_seconds_come_from_the_environment_or_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FUSION_CALIBRATE_S", raising=False)
    assert env_calibrate_s(3.0) == 3.0
    monkeypatch.setenv("FUSION_CALIBRATE_S", "0.5")
    assert env_calibrate_s(3.0) == 0.5
    monkeypatch.setenv("FUSION_CALIBRATE_S", "three")
    with pytest.raises(ConfigError, match="FUSION_CALIBRATE_S must be a number of seconds, got 'three'"):
        env_calibrate_s(3.0)


def test_the_coordinator_refuses_negative_calibrate_seconds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fusion.cli import coordinator

    code = coordinator.main(["--state-dir", str(tmp_path), "--token", "t", "--port", "0", "--calibrate-seconds", "-1"])
    assert code != 0
    assert "--calibrate-seconds must be >= 0, got -1.0" in capsys.readouterr().err
