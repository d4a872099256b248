"""The one place where fusion reads its environment variables, and shared CLI plumbing.

- ``FUSION_COORDINATOR``: default ``--coordinator`` (HOST:PORT) for ``fusion`` and ``fusion-worker``.
- ``FUSION_TOKEN``: default ``--token``.
- ``FUSION_LOG_LEVEL``: default ``--log-level`` (``WARNING``).
- ``FUSION_TLS_CA``: default ``--tls-ca`` of ``fusion`` (CA bundle; turns TLS on).
- ``FUSION_CALIBRATE_S``: default ``--calibrate-seconds`` of ``fusion-coordinator``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from fusion.errors import AuthError, ConfigError, FusionError, NotFoundError, RemoteError

DEFAULT_COORDINATOR = "127.0.0.1:7077"


def env_coordinator() -> str:
    return os.environ.get("FUSION_COORDINATOR", DEFAULT_COORDINATOR)


def env_token() -> str | None:
    return os.environ.get("FUSION_TOKEN") or None


def env_tls_ca() -> str | None:
    return os.environ.get("FUSION_TLS_CA") or None


def env_calibrate_s(default: float) -> float:
    """``$FUSION_CALIBRATE_S`` as a number of seconds, else ``default``."""
    text = os.environ.get("FUSION_CALIBRATE_S")
    if not text:
        return default
    try:
        return float(text)
    except ValueError as e:
        raise ConfigError(f"FUSION_CALIBRATE_S must be a number of seconds, got {text!r}") from e


def env_log_level() -> str:
    return os.environ.get("FUSION_LOG_LEVEL", "WARNING")


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """``--coordinator``, ``--token`` and ``--token-file``."""
    parser.add_argument(
        "--coordinator",
        default=env_coordinator(),
        help="coordinator HOST:PORT (default: $FUSION_COORDINATOR or %(default)s)",
    )
    parser.add_argument("--token", default=None, help="the coordinator's token (default: $FUSION_TOKEN)")
    parser.add_argument("--token-file", default=None, help="read the token from this file")


def add_log_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level", default=env_log_level(), help="DEBUG, INFO, WARNING (default: $FUSION_LOG_LEVEL or WARNING)"
    )


def resolve_token(token: str | None, token_file: str | None, *, required: bool = True) -> str | None:
    """The token from ``--token``, ``--token-file`` or ``$FUSION_TOKEN``, in that order."""
    if token:
        return token
    if token_file:
        try:
            value = Path(token_file).read_text().strip()
        except OSError as e:
            raise ConfigError(f"cannot read token file {token_file}: {e}") from e
        if not value:
            raise ConfigError(f"token file {token_file} is empty")
        return value
    value = env_token()
    if value is None and required:
        raise ConfigError("no token given: pass --token, --token-file or set FUSION_TOKEN")
    return value


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


#: Exit codes of every fusion command (README "Troubleshooting").
EXIT_FAILED = 1  # a runtime failure: no coordinator, a refused request, a failed job
EXIT_BAD_INPUT = 2  # what was given is invalid (flags, job file, token), found here or by the coordinator
EXIT_NOT_FOUND = 3  # no such job
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a Unix tool whose reader went away

#: Remote errors that mean the input was bad, and that no such thing exists (gRPC code names).
_BAD_INPUT_CODES = frozenset({"INVALID_ARGUMENT", "UNAUTHENTICATED"})
_NOT_FOUND_CODES = frozenset({"NOT_FOUND"})


def remote_message(e: RemoteError) -> str:
    """The remote side's own message, without the call, the peer and the error type
    (``"SubmitJob on H:P failed with INVALID_ARGUMENT: ConfigError: x"`` -> ``"x"``)."""
    text = str(e)
    marker = f"failed with {e.code}: " if e.code else None
    if marker and marker in text:
        text = text.split(marker, 1)[1]
    head, sep, rest = text.partition(": ")
    if sep and head.isidentifier() and head.endswith("Error"):
        return rest
    return text


def exit_code_of(e: FusionError) -> int:
    """The exit code for ``e``, the same whether the problem was found here or remotely."""
    if isinstance(e, ConfigError | AuthError):
        return EXIT_BAD_INPUT
    if isinstance(e, NotFoundError):
        return EXIT_NOT_FOUND
    if isinstance(e, RemoteError):
        if e.code in _BAD_INPUT_CODES:
            return EXIT_BAD_INPUT
        if e.code in _NOT_FOUND_CODES:
            return EXIT_NOT_FOUND
    return EXIT_FAILED


def run_cli(body: Callable[[], int]) -> int:
    """Run a CLI body: a fusion error becomes one ``error: ...`` line on stderr and the exit
    code of its kind (:func:`exit_code_of`); remote errors read like local ones. A reader
    that closes the pipe (``| head``) ends the command quietly."""
    try:
        return body()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader closed the pipe (``fusion status JOB | head``): stop quietly. stdout
        # goes to /dev/null so that flushing it at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except FusionError as e:
        message = remote_message(e) if isinstance(e, RemoteError) else str(e)
        print(f"error: {message}", file=sys.stderr)
        return exit_code_of(e)
