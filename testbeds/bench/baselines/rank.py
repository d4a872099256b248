"""What every baseline rank shares: its arguments, joining the gloo group, writing metrics.

A rank runs inside its testbed host's network namespace. gloo picks the network interface
from ``GLOO_SOCKET_IFNAME``; :func:`init_gloo` sets it to the interface that carries the
host's testbed address (``--address``), so that collectives cross the shaped links and not
a loopback or a default route.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Self

import psutil
import torch

from fusion.config import JobSpec, load_job
from fusion.errors import ConfigError
from testbeds.bench.baselines.profiled import read_reference
from testbeds.emulation import EMULATIONS, Slowdown, check_factor
from testbeds.net.netns import DELAY_TUN

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RankArgs:
    """One rank's command line."""

    job: JobSpec
    rank: int
    world_size: int
    master: str
    """``HOST:PORT`` of rank 0's rendezvous store."""
    address: str
    """This host's testbed address (selects gloo's interface)."""
    steps: int
    metrics: Path | None
    """Rank 0 appends one JSON line per step here."""
    torch_threads: int
    slowdown: float = 1.0
    """Testbed emulation: this rank computes as a device this many times slower
    (:class:`testbeds.emulation.Slowdown`)."""
    emulation: str = "wall"
    """What the slowdown multiplies (:data:`testbeds.emulation.EMULATIONS`)."""
    profiled: Path | None = None
    """``profile`` emulation: the benchmark's profiled seconds (:mod:`testbeds.bench.baselines.profiled`)."""

    def emulate(self, module: torch.nn.Module, profiled: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """Attach this rank's testbed emulation of a slower device to ``module`` (a factor
        of 1: none). Under ``profile`` emulation, ``profiled`` picks this rank's
        :meth:`~testbeds.emulation.Slowdown.attach` seconds from the benchmark's document
        (:mod:`testbeds.bench.baselines.profiled`)."""
        slowdown = Slowdown(self.slowdown, emulation=self.emulation)
        if not slowdown.by_profile:
            slowdown.attach(module)
            return
        if self.profiled is None:
            raise ConfigError("--emulation profile needs --profiled FILE")
        slowdown.attach(module, **profiled(read_reference(self.profiled)))


def parse_args(prog: str, description: str, argv: list[str] | None = None) -> RankArgs:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--job", required=True, help="job file (TOML)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master", required=True, help="HOST:PORT of rank 0 (the rendezvous)")
    p.add_argument("--address", required=True, help="this host's address on the testbed")
    p.add_argument("--steps", type=int, default=None, help="steps to run (default: the job's)")
    p.add_argument("--metrics", default=None, help="rank 0 writes JSON lines here")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        help="emulate a device this many times slower (default: %(default)s, none)",
    )
    p.add_argument(
        "--emulation",
        choices=EMULATIONS,
        default="wall",
        help="what --slowdown multiplies: each computation's wall time, "
        "or its profiled seconds from --profiled (default: %(default)s)",
    )
    p.add_argument("--profiled", default=None, help="with --emulation profile: the benchmark's profiled seconds (JSON)")
    a = p.parse_args(argv)
    job = load_job(a.job)
    if a.emulation == "profile" and a.slowdown > 1.0 and not a.profiled:
        p.error("--emulation profile needs --profiled FILE")
    return RankArgs(
        job=job,
        rank=a.rank,
        world_size=a.world_size,
        master=a.master,
        address=a.address,
        steps=a.steps if a.steps is not None else job.train.steps,
        metrics=Path(a.metrics) if a.metrics else None,
        torch_threads=a.torch_threads,
        slowdown=check_factor(a.slowdown),
        emulation=a.emulation,
        profiled=Path(a.profiled) if a.profiled else None,
    )


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` in this namespace, if any."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None


def init_gloo(args: RankArgs, *, timeout_s: float = 300.0) -> None:
    """Join the gloo process group of ``args.world_size`` ranks over the testbed links."""
    import datetime

    import torch.distributed as dist

    iface = interface_of(args.address)
    if iface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    torch.set_num_threads(args.torch_threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


@contextmanager
def gloo_group(args: RankArgs) -> Iterator[None]:
    """Inside: this rank is in the gloo group (:func:`init_gloo`). A body that returns waits
    for every rank (a barrier) before the group is destroyed, so that no rank tears its pairs
    down while a peer still sends on them; a body that raises destroys it at once."""
    import torch.distributed as dist

    init_gloo(args)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def rank_main(run: Callable[[], int]) -> NoReturn:
    """A rank module's ``__main__``: ``run()``, then leave the process without finalizing the
    interpreter (``os._exit``, once the output is flushed).

    gloo's worker threads can outlive :func:`~torch.distributed.destroy_process_group` and
    abort the process from a C++ destructor while the interpreter shuts down ("terminate
    called without an active exception", exit -6), after a run whose work is done and
    written; skipping the finalization leaves nothing for them to abort. A raised error is
    printed and exits 1, as Python would."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        code = run()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


#: Interfaces whose counters are not traffic onto a link: loopback, and the netns delay
#: line's TUN device (``tun`` latency mode), which every delayed packet crosses on its way
#: to ``eth0``, so counting it too would count those bytes twice.
NOT_LINKS = frozenset({"lo", DELAY_TUN})


def bytes_sent() -> int:
    """Bytes this namespace has sent onto its links (every interface but :data:`NOT_LINKS`)."""
    return sum(c.bytes_sent for name, c in psutil.net_io_counters(pernic=True).items() if name not in NOT_LINKS)


class MetricsWriter:
    """Rank 0's per-step JSON lines (``step``, ``loss``, ``step_s``, ``samples_per_s`` …)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def write_step(
        self,
        *,
        step: int,
        loss: float,
        step_s: float,
        samples: int,
        tokens: int | None,
        bytes_per_link: dict[str, int],
        peak_memory_bytes: dict[str, int] | None = None,
    ) -> None:
        """One step's record; ``tokens_per_s`` only for token batches (:func:`token_count`);
        ``peak_memory_bytes``: each rank's peak so far (:mod:`testbeds.bench.baselines.memory`)."""
        record: dict[str, Any] = {
            "step": step,
            "loss": loss,
            "step_s": step_s,
            "samples_per_s": samples / step_s,
            "bytes_per_link": bytes_per_link,
        }
        if tokens is not None:
            record["tokens_per_s"] = tokens / step_s
        if peak_memory_bytes is not None:
            record["peak_memory_bytes"] = peak_memory_bytes
        self.write(record)


def token_count(x: torch.Tensor) -> int | None:
    """Tokens in a batch of token ids (``[batch, seq]`` integers); ``None`` for other inputs."""
    return x.numel() if x.dim() == 2 and not x.is_floating_point() else None


class StepTimer:
    """Wall seconds of a step, on this rank."""

    def __enter__(self) -> Self:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
