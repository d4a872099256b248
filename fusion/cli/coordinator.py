"""``fusion-coordinator``: the long-running service workers join and jobs are submitted to.

It binds its port and answers ``fusion status`` from its state file at once, then loads
the service (torch, the planner: the slow part of a start) and serves everything
(:mod:`fusion.coordinator.serving`); it prints that it listens once it serves everything.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fusion.cli.env import (
    add_log_arg,
    env_calibrate_s,
    resolve_token,
    run_cli,
    setup_logging,
)
from fusion.coordinator.serving import open_server, requeue_after_restart, starting_handler
from fusion.coordinator.store import Store
from fusion.errors import ConfigError
from fusion.stop_signals import catch_stop_signals, wait_for_stop
from fusion.tls import ServerTls, set_client_ca, warn_if_exposed

if TYPE_CHECKING:
    from executor.hooks import ChannelFactory
    from fusion.coordinator.service import CoordinatorService

logger = logging.getLogger(__name__)

LISTENING = "fusion-coordinator listening on"
LIVE_VIEW = "fusion-coordinator live view on"
STATE_DB = "coordinator.sqlite"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fusion-coordinator", description="Run a fusion coordinator: workers join it, jobs are submitted to it."
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: %(default)s; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=7077, help="port (0 picks a free one; default: %(default)s)")
    p.add_argument(
        "--token",
        default=None,
        help="token workers and job owners must present (default: $FUSION_TOKEN, else generated)",
    )
    p.add_argument("--token-file", default=None, help="read the token from this file")
    p.add_argument(
        "--state-dir",
        default="./fusion-state",
        help="where the SQLite state (and a generated token) live (default: %(default)s)",
    )
    p.add_argument(
        "--heartbeat-interval", type=float, default=2.0, help="seconds between worker heartbeats (default: %(default)s)"
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        help="seconds without a heartbeat before a worker is declared gone (default: %(default)s)",
    )
    p.add_argument(
        "--calibrate-seconds",
        type=float,
        default=None,
        help="compute seconds the executor calibration measures per model before planning "
        "(default: $FUSION_CALIBRATE_S, else the planner's minimum)",
    )
    p.add_argument("--device", default="cpu", help="device stages run on (cpu, cuda, cuda:N; default: %(default)s)")
    p.add_argument("--tls-cert", default=None, help="serve TLS with this certificate chain (PEM)")
    p.add_argument("--tls-key", default=None, help="private key of --tls-cert (PEM)")
    p.add_argument(
        "--tls-ca", default=None, help="CA bundle that signed the workers' executor certificates (TLS to workers)"
    )
    p.add_argument(
        "--register-burst",
        type=float,
        default=32.0,
        help="registrations one IP may make at once (default: %(default)s)",
    )
    p.add_argument(
        "--registers-per-s",
        type=float,
        default=2.0,
        help="sustained registrations per second per IP (default: %(default)s)",
    )
    p.add_argument(
        "--auth-failure-burst",
        type=float,
        default=30.0,
        help="failed authentications per IP before its failing calls are refused for a while; "
        "calls with a valid credential are always served (default: %(default)s)",
    )
    p.add_argument(
        "--auth-failures-per-s",
        type=float,
        default=0.5,
        help="failed authentications per second per IP tolerated after the burst (default: %(default)s)",
    )
    p.add_argument(
        "--http",
        default=None,
        metavar="HOST:PORT",
        help="also serve the read-only live view (web page and JSON API) here; it asks for the token, "
        "and uses HTTPS with --tls-cert/--tls-key (PORT 0 picks a free one)",
    )
    add_log_arg(p)
    return p


def _http_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--http must be HOST:PORT (e.g. 127.0.0.1:8080), got {text!r}")
    return host, int(port)


def _token(args: argparse.Namespace, state_dir: Path) -> str:
    token = resolve_token(args.token, args.token_file, required=False)
    if token:
        return token
    path = state_dir / "token"
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    print(f"generated a token in {path} (pass it to workers with --token-file)", flush=True)
    return token


def _load_service(
    args: argparse.Namespace, store: Store, token: str, channel_factory: ChannelFactory | None
) -> CoordinatorService:
    """Import the service (the slow part of a start) and build it."""
    from fusion.coordinator.planning import CALIBRATE_MIN_S
    from fusion.coordinator.service import CoordinatorService

    calibrate_s = env_calibrate_s(CALIBRATE_MIN_S) if args.calibrate_seconds is None else args.calibrate_seconds
    if not calibrate_s >= 0:
        raise ConfigError(f"--calibrate-seconds must be >= 0, got {calibrate_s}")
    return CoordinatorService(
        store=store,
        token=token,
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_timeout_s=args.heartbeat_timeout,
        device=args.device,
        calibrate_s=calibrate_s,
        register_burst=args.register_burst,
        registers_per_s=args.registers_per_s,
        auth_failure_burst=args.auth_failure_burst,
        auth_failures_per_s=args.auth_failures_per_s,
        channel_factory=channel_factory,
    )


def main(
    argv: list[str] | None = None,
    *,
    channel_factory: ChannelFactory | None = None,
    channels: Callable[[], ChannelFactory | None] | None = None,
) -> int:
    """``fusion-coordinator``; ``channel_factory`` is how it dials workers (:mod:`executor.hooks`),
    or ``channels`` builds it once status is answered (building one may import torch)."""
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)

    def body() -> int:
        state_dir = Path(args.state_dir).expanduser().resolve()
        state_dir.mkdir(parents=True, exist_ok=True)
        token = _token(args, state_dir)
        tls = ServerTls.from_files(args.tls_cert, args.tls_key)
        if args.tls_ca:
            set_client_ca(args.tls_ca)
        warn_if_exposed(args.host, tls, "the coordinator")
        if args.port < 0 or args.port > 65535:
            raise ConfigError(f"--port must be in 0..65535, got {args.port}")
        http = _http_address(args.http) if args.http else None
        if args.calibrate_seconds is not None and not args.calibrate_seconds >= 0:
            raise ConfigError(f"--calibrate-seconds must be >= 0, got {args.calibrate_seconds}")
        store = Store(state_dir / STATE_DB)
        requeue_after_restart(store)  # before the first answer: no job shows as running that nothing runs
        try:
            server, port, board = open_server(starting_handler(store, token), args.host, args.port, tls=tls)
        except OSError as e:
            store.close()
            raise ConfigError(f"cannot listen on {args.host}:{args.port}: {e}") from e
        try:
            service = _load_service(args, store, token, channel_factory or (channels() if channels else None))
        except BaseException:
            server.stop(grace=0)
            store.close()
            raise
        from fusion.coordinator.live_view import start_live_view, tls_context
        from fusion.coordinator.service import coordinator_handler

        board.ready(coordinator_handler(service))
        service.start()
        view = None
        if http is not None:
            warn_if_exposed(http[0], tls, "the live view")
            try:
                view = start_live_view(
                    service, *http, token=token, tls=tls_context(args.tls_cert, args.tls_key) if tls else None
                )
            except OSError as e:
                server.stop(grace=0)
                service.close()
                raise ConfigError(f"cannot serve the live view on {args.http}: {e}") from e
            scheme = "https" if tls else "http"
            print(f"{LIVE_VIEW} {scheme}://{http[0]}:{view.port}/ (sign in with the token)", flush=True)
        stop = catch_stop_signals()
        print(f"{LISTENING} {args.host}:{port} (state: {state_dir})", flush=True)
        wait_for_stop(stop)
        print("fusion-coordinator stopping", flush=True)
        if view is not None:
            view.close()
        server.stop(grace=2.0)
        service.close()
        store.close()
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
