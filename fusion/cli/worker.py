"""``fusion-worker``: volunteer this machine to a coordinator."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Callable

import torch

from executor.build import parse_device
from executor.hooks import ChannelFactory, StageHooks
from fusion.cli.env import add_connection_args, add_log_arg, resolve_token, run_cli, setup_logging
from fusion.errors import AuthError, ConfigError
from fusion.memory import format_bytes, gb_to_bytes
from fusion.profiling import DeviceProfile
from fusion.stop_signals import catch_stop_signals, wait_for_stop
from fusion.tls import ServerTls, set_client_ca, warn_if_exposed
from fusion.worker import Worker

logger = logging.getLogger(__name__)

READY = "fusion-worker ready"


def positive_gb(text: str) -> float:
    """``--memory-gb``'s value: a positive, finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number of GB, got {text}")
    return value


def build_parser(prog: str = "fusion-worker") -> argparse.ArgumentParser:
    """``fusion-worker``'s flags (a wrapper may add its own before parsing)."""
    p = argparse.ArgumentParser(prog=prog, description="Join a fusion coordinator and train pieces of its jobs.")
    add_connection_args(p)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument(
        "--name",
        default=f"{socket.gethostname()}-{os.getpid()}",
        help="name shown to the job owner (default: HOST-PID)",
    )
    p.add_argument(
        "--listen",
        default="127.0.0.1:0",
        help="HOST:PORT for peers to reach this worker (default: %(default)s; port 0 picks one)",
    )
    p.add_argument(
        "--advertise", default=None, help="HOST:PORT peers should dial, if not the listen address (NAT, containers)"
    )
    p.add_argument(
        "--allow-code",
        action="store_true",
        help="allow job owners' own model code (module:factory); built-in models need no flag",
    )
    p.add_argument(
        "--memory-gb",
        type=positive_gb,
        default=None,
        metavar="X",
        help="memory this worker lends, in GB (GiB): the planner never gives it a stage that needs more, and a "
        "stage that does is refused (default: what the device has free when the worker starts)",
    )
    p.add_argument(
        "--machine",
        default=None,
        metavar="LABEL",
        help="workers with the same label share compute, and the planner will not count on them computing at once "
        "(default: this kernel's boot id and the device, so worker processes on one machine's CPU share)",
    )
    p.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument(
        "--no-data-plane",
        action="store_true",
        help="send and receive tensors over the gRPC port only, with no second (data-plane) port: for a "
        "firewall or NAT that forwards one port (peers fall back to gRPC on their own when the second "
        "port is unreachable, after a connect timeout)",
    )
    p.add_argument(
        "--tls-cert",
        default=None,
        help="serve this worker's executor with TLS: certificate chain (PEM) valid for the advertised address",
    )
    p.add_argument("--tls-key", default=None, help="private key of --tls-cert (PEM)")
    p.add_argument(
        "--tls-ca",
        default=None,
        help="CA bundle that signed the coordinator's and the peers' certificates "
        "(turns TLS on for every call this worker makes)",
    )
    add_log_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_worker(build_parser().parse_args(argv))


def run_worker(
    args: argparse.Namespace,
    *,
    hooks: StageHooks | None = None,
    channel_factory: ChannelFactory | None = None,
    report: Callable[[DeviceProfile], DeviceProfile] | None = None,
) -> int:
    """Run a worker configured by ``args`` (:func:`build_parser`) until SIGINT/SIGTERM; the
    keyword arguments are :class:`fusion.worker.Worker`'s seams."""
    setup_logging(args.log_level)

    def body() -> int:
        token = resolve_token(args.token, args.token_file)
        assert token is not None
        if args.torch_threads > 0:
            torch.set_num_threads(args.torch_threads)
        try:
            parse_device(args.device)
        except ConfigError as e:
            raise ConfigError(f"--device {args.device}: {e}") from e
        tls = ServerTls.from_files(args.tls_cert, args.tls_key)
        if args.tls_ca:
            set_client_ca(args.tls_ca)
        warn_if_exposed(args.listen.rpartition(":")[0], tls, "this worker's executor")
        worker = Worker(
            coordinator=args.coordinator,
            token=token,
            name=args.name,
            listen=args.listen,
            advertise=args.advertise,
            device=args.device,
            allow_code=args.allow_code,
            tls=tls,
            machine=args.machine,
            memory_cap_bytes=None if args.memory_gb is None else gb_to_bytes(args.memory_gb),
            data_plane=not args.no_data_plane,
            hooks=hooks,
            channel_factory=channel_factory,
            report=report,
        )
        stop = catch_stop_signals()
        try:
            worker.start()
        except AuthError as e:
            worker.stop("refused")
            print(f"error: {e}", file=sys.stderr)
            return 2
        except BaseException:
            worker.stop("failed to start")
            raise
        lent = worker.profile.device_memory_bytes if worker.profile is not None else 0
        print(
            f"{READY}: {worker.name} serving on {worker.address}, joined {args.coordinator} as {worker.worker_id}, "
            f"lending {format_bytes(lent)} of memory",
            flush=True,
        )
        wait_for_stop(stop)
        print(f"fusion-worker {worker.name} leaving", flush=True)
        worker.stop("stopped by its operator")
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
