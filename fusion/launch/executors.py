"""Bare executors on loopback: ``K`` ``python -m executor.server`` processes, for tests and benchmarks.

A :class:`LocalCluster` has no coordinator: the caller drives the executors itself (with a
:class:`~executor.driver.PipelineDriver`, or :func:`~fusion.launch.distributed.train_distributed`).
Each executor gets its own control key, which this process's keyring signs its calls with;
the processes run in a :class:`~fusion.launch.processes.ProcessGroup`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from executor.server import READY_PREFIX
from fusion.auth import new_key, process_keyring
from fusion.launch.processes import Child, ProcessGroup

logger = logging.getLogger(__name__)

#: How long a stopping executor gets between SIGTERM and SIGKILL.
STOP_GRACE_S = 5.0


class LocalCluster:
    """``num_workers`` executor processes on 127.0.0.1, each on a free port."""

    def __init__(
        self,
        num_workers: int,
        *,
        allow_code: bool = True,
        torch_threads: int | None = None,
        start_timeout_s: float = 120.0,
        extra_args: Sequence[str] = (),
        module: str = "executor.server",
    ) -> None:
        """``module``: what each process runs, ``python -m executor.server`` or a wrapper
        of it that takes its flags (e.g. a test's executor with hooks)."""
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self.num_workers = num_workers
        self.allow_code = allow_code
        self.torch_threads = torch_threads or max(1, (os.cpu_count() or 1) // num_workers)
        self.start_timeout_s = start_timeout_s
        self.extra_args = list(extra_args)
        self.module = module
        self.processes: list[Child] = []
        self.addresses: list[str] = []
        #: Control key of each executor (its calls are signed with it via the process keyring).
        self.control_keys: list[bytes] = []
        self._group = ProcessGroup()

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def log_path(self, worker_idx: int) -> Path:
        """Where worker ``worker_idx`` writes its log."""
        return self._group.log_path(f"worker{worker_idx}")

    def start(self) -> None:
        """Start the processes and wait until each listens; on any failure stop them all."""
        try:
            for i in range(self.num_workers):
                key = new_key()
                self.control_keys.append(key)
                key_file = self._group.log_dir / f"worker{i}.key"
                key_file.touch(mode=0o600)
                key_file.write_text(key.hex())
                args = [
                    "-m",
                    self.module,
                    "--listen",
                    "127.0.0.1:0",
                    "--name",
                    f"local-{i}",
                    "--torch-threads",
                    str(self.torch_threads),
                    "--control-key-file",
                    str(key_file),
                    *(["--allow-code"] if self.allow_code else []),
                    *self.extra_args,
                ]
                self.processes.append(self._group.spawn(f"worker{i}", args))
            # All start at once; then each is waited for in turn.
            for i in range(self.num_workers):
                m = self._group.wait_for(f"worker{i}", rf"{re.escape(READY_PREFIX)} (\d+)", self.start_timeout_s)
                self.addresses.append(f"127.0.0.1:{m.group(1)}")
                process_keyring().set_control(self.addresses[-1], self.control_keys[i])
        except BaseException:
            self.close()
            raise

    def kill(self, worker_idx: int) -> None:
        """SIGKILL one worker (fault injection for tests)."""
        proc = self.processes[worker_idx]
        proc.kill()
        proc.wait(timeout=10)

    def close(self) -> None:
        """Stop every process this cluster started: SIGTERM, then SIGKILL after a grace period."""
        self._group.close(grace_s=STOP_GRACE_S)
        for address in self.addresses:
            process_keyring().drop_control(address)
        self.processes.clear()
        self.addresses.clear()
        self.control_keys.clear()
