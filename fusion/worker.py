"""A volunteer worker: measure this machine, serve an Executor, register, heart-beat.

The worker is passive: once registered, the coordinator (and peer workers) call its
Executor service to load stages and run steps. The worker only keeps its registration
alive — heart-beating, re-registering under its name if the coordinator restarted and
forgot it or declared it gone (a laptop that slept, a link that dropped) — and
deregisters when it is stopped, so a clean leave fails no job by surprise.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

import grpc
import torch

from executor.hooks import ChannelFactory, StageHooks
from executor.server import ExecutorService, start_server
from fusion.auth import control_key
from fusion.coordinator.client import CoordinatorClient
from fusion.errors import AuthError, FusionError, RemoteError
from fusion.profiling import DeviceProfile, measure_device
from fusion.tls import ServerTls
from fusion.wire import coordinator_pb2 as cpb

logger = logging.getLogger(__name__)


def advertised_address(listen: str, bound_port: int, coordinator: str) -> str:
    """The address peers should dial: the listen host, or, for a wildcard, the local IP
    that routes to the coordinator."""
    host = listen.rpartition(":")[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        coord_host = coordinator.rpartition(":")[0].strip("[]") or "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((coord_host, 9))  # no packet is sent: this only picks the route
            host = s.getsockname()[0]
    return f"{host}:{bound_port}"


def resources_message(profile: DeviceProfile, *, allows_code: bool = False) -> cpb.WorkerResources:
    """What the worker reports at join: the resources in ``profile``, its versions, and
    whether it runs job owners' own model code (``--allow-code``)."""
    from fusion import __version__

    return cpb.WorkerResources(
        num_cores=profile.num_cores,
        memory_bytes=profile.memory_bytes,
        device=profile.device,
        device_name=profile.device_name,
        device_memory_bytes=profile.device_memory_bytes,
        matmul_flops=profile.matmul_flops,
        machine=profile.machine,
        torch_version=torch.__version__,
        fusion_version=__version__,
        allows_code=allows_code,
    )


class Worker:
    """One worker process's agent.

    Seams (:mod:`executor.hooks`): ``hooks`` and ``channel_factory`` go to its
    :class:`~executor.server.ExecutorService`; ``report`` maps the :class:`DeviceProfile`
    measured at start-up to the one reported to the coordinator (default: as measured),
    for a host that knows better than one short benchmark (e.g. a testbed standing in for
    a slower device).

    ``memory_cap_bytes`` is the memory the volunteer lends (``--memory-gb``; default: what
    the device has free at start-up): reported at join, and enforced by its executor on
    every stage it loads and every step it runs. ``data_plane``: whether its executor serves
    (and sends over) the direct tensor port (:mod:`executor.stream_server`); ``False``: tensors
    go over the gRPC port only (``--no-data-plane``).
    """

    def __init__(
        self,
        *,
        coordinator: str,
        token: str,
        name: str,
        listen: str = "127.0.0.1:0",
        advertise: str | None = None,
        device: str = "cpu",
        allow_code: bool = False,
        register_timeout_s: float = 60.0,
        tls: ServerTls | None = None,
        machine: str | None = None,
        memory_cap_bytes: int | None = None,
        data_plane: bool = True,
        hooks: StageHooks | None = None,
        channel_factory: ChannelFactory | None = None,
        report: Callable[[DeviceProfile], DeviceProfile] | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.name = name
        self.listen = listen
        self.advertise = advertise
        self.device = device
        self.allow_code = allow_code
        self.register_timeout_s = register_timeout_s
        self._token = token
        self.client = CoordinatorClient(coordinator, token)
        self.tls = tls
        self.memory_cap_bytes = memory_cap_bytes
        self.service = ExecutorService(
            worker_name=name,
            allow_code=allow_code,
            hooks=hooks,
            channel_factory=channel_factory,
            data_plane=data_plane,
        )
        self._report = report
        self.server: grpc.Server | None = None
        self.address = ""
        self.worker_id = ""
        self.heartbeat_interval_s = 2.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.profile: DeviceProfile | None = None
        self.machine = machine

    def start(self) -> None:
        """Measure, serve, register (waiting for the coordinator), start heart-beating."""
        measured = measure_device(self.device, machine=self.machine, memory_cap_bytes=self.memory_cap_bytes)
        self.profile = self._report(measured) if self._report is not None else measured
        # The executor holds its stages to what the worker reports lending.
        self.service.memory_cap_bytes = self.profile.device_memory_bytes
        self.server, port = start_server(self.service, self.listen, tls=self.tls)
        self.address = self.advertise or advertised_address(self.listen, port, self.coordinator)
        self._register(wait_s=self.register_timeout_s)
        self._thread = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
        self._thread.start()

    def _register(self, *, wait_s: float) -> None:
        assert self.profile is not None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                response = self.client.register(
                    self.name, self.address, resources_message(self.profile, allows_code=self.allow_code)
                )
                break
            except RemoteError as e:
                if e.code == "UNAUTHENTICATED":
                    raise AuthError(f"the coordinator at {self.coordinator} refused this worker: {e}") from e
                if time.monotonic() > deadline or self._stop.is_set():
                    raise
                if e.code == "FAILED_PRECONDITION":  # e.g. its name is still held by a live registration
                    logger.warning(
                        "the coordinator at %s refused this worker for now: %s; retrying", self.coordinator, e
                    )
                else:
                    logger.warning("coordinator %s not reachable yet (%s); retrying", self.coordinator, e.code)
                time.sleep(1.0)
        self.worker_id = response.worker_id
        self.heartbeat_interval_s = response.heartbeat_interval_s or 2.0
        # Later calls prove membership with the session credential, not the token; the
        # coordinator's calls to this worker's executor prove the key derived from it.
        self.client.credential = response.session
        self.service.access.set_control_key(control_key(response.session))
        logger.info(
            "registered with %s as %s (%s), serving on %s", self.coordinator, self.name, self.worker_id, self.address
        )

    def _heartbeats(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_s):
            try:
                if not self.client.heartbeat(self.worker_id):
                    # The coordinator restarted, or declared this worker gone (it was frozen or
                    # cut off past the heartbeat timeout): its jobs went on without it, so its
                    # stages are stale. They go before it registers again under its name, so a
                    # job that takes it back loads it afresh; stale sends they still had in
                    # flight are refused by their peers (a replaced placement's job key). Its
                    # snapshots stay: they are true states of their steps, which a recovery
                    # already under way may still read (the job's next unload drops them).
                    logger.warning("the coordinator no longer knows this worker; registering again")
                    for job_id in self.service.jobs():
                        self.service.unload(job_id, keep_snapshots=True)
                    self.client.credential = self._token
                    self._register(wait_s=self.register_timeout_s)
            except FusionError as e:
                logger.warning("heartbeat to %s failed: %s", self.coordinator, e)
            except Exception:
                logger.exception("heartbeat loop error; continuing")

    def stop(self, reason: str = "worker stopped") -> None:
        """Deregister (best effort), stop serving, release everything."""
        self._stop.set()
        if self.worker_id:
            try:
                self.client.deregister(self.worker_id, reason)
            except FusionError as e:
                logger.info("deregistering failed: %s", e)
        if self.server is not None:
            self.server.stop(grace=1.0).wait()
        self.service.close()
        self.client.close()
