"""Python children forked from a warm interpreter, torch already imported.

Every fusion process (``fusion-coordinator``, ``fusion-worker``, an executor) imports torch
before it does anything, and on a small machine that takes seconds of CPU: ``import torch``
about 2 s, and the first optimizer pulls in ``torch._dynamo``, about 1.5 s more. A launcher
that starts many processes on one machine (``fusion demo``, a test suite) pays that once per
process. A :class:`ForkServer` pays it once: it starts one interpreter
(:func:`main`) that imports torch and ``torch._dynamo`` and then
waits; each :meth:`ForkServer.spawn` has it fork a child that runs ``python -m MODULE ARGS``
as a fresh interpreter would, in its own session, with the caller's environment, working
directory and import path, stdin from ``/dev/null`` and stdout and stderr appended to a log.

Why forking here is sound: the server forks from its only thread, before anything has
started a thread pool, a gRPC channel or a CUDA context (it imports nothing else); each
child resets the signal handlers the server set and re-seeds Python's ``random`` (the
interpreter's own at-fork hook). What differs from a fresh interpreter: the child's
``/proc/PID/cmdline`` is the server's, its hash seed is the server's, and environment
variables read only at interpreter or torch start-up (``PYTHONHASHSEED``,
``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES``) are the server's. Launchers pass
``--torch-threads`` and ``--device`` as flags, which the child applies itself.

The protocol runs over a socket pair the caller created and the server inherited, so no
other process can reach it: one request per child, a JSON line (module, args, environment,
working directory, log path) sent with one end of a fresh socket pair for that child. The
server answers on the child's socket with ``pid N``, and when it has reaped the child with
``exit CODE`` (negative: killed by that signal, as :attr:`subprocess.Popen.returncode`).
:class:`ForkedChild` reads that socket: it offers the part of :class:`subprocess.Popen` the
launchers use (``pid``, ``poll``, ``wait``, ``returncode``, signals).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from fusion.errors import FusionError

#: What the server imports before it serves: the seconds every child is spared.
PRELOAD = ("torch", "torch._dynamo")
#: The longest request the server reads (module, args and a whole environment).
MAX_REQUEST_BYTES = 1 << 20
#: What the server prints on its stdout once it has preloaded and serves.
READY = "forkserver ready"
#: How the server starts (not ``-m``: the package imports this module before runpy would).
_SERVER_MAIN = "import sys; from fusion.launch.forkserver import main; main(sys.argv[1:])"


class ForkedChild:
    """A child the fork server started: ``pid``, ``poll()``, ``wait()``, ``returncode``,
    ``terminate()``, ``kill()``, ``send_signal()`` as on :class:`subprocess.Popen`.

    Its exit code comes from the server, which reaped it. If the server itself is gone, the
    code cannot be known: once the pid is gone the child reads as killed (``-SIGKILL``).
    """

    def __init__(self, pid: int, status: socket.socket, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._status = status
        self._buffer = b""
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        """The exit code once the child has exited, else None (does not block)."""
        return self._read(timeout_s=0.0)

    def wait(self, timeout: float | None = None) -> int:
        """Block until the child exits (:class:`subprocess.TimeoutExpired` after ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            code = self._read(timeout_s=1.0 if left is None else min(left, 1.0))
            if code is not None:
                return code
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` unless the child has already been reaped (its pid may be reused)."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, *, timeout_s: float) -> int | None:
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            ready, _, _ = select.select([self._status], [], [], timeout_s)
            if not ready:
                return None
            chunk = self._status.recv(4096)
            self._buffer += chunk
            for line in self._buffer.decode(errors="replace").splitlines():
                if line.startswith("exit "):
                    self.returncode = int(line.split()[1])
            if self.returncode is None and not chunk:  # the server is gone without a word
                if _running(self.pid):
                    return None
                self.returncode = -signal.SIGKILL
            if self.returncode is not None:
                self._status.close()
            return self.returncode


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no longer does: its parent is gone or has not reaped it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


class ForkServer:
    """A warm interpreter that forks the children of this process (see the module doc).

    Started on first use by :meth:`spawn`; :meth:`close` (or this process's exit) stops it.
    Children it started keep running after it stops; their launcher stops them by pid.
    """

    def __init__(self, *, start_timeout_s: float = 120.0) -> None:
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def spawn(
        self,
        module: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str],
        log: str | Path,
        cwd: str | Path | None = None,
    ) -> ForkedChild:
        """Fork ``python -m module ARGS`` with ``env`` in ``cwd``, its output appended to ``log``."""
        request = json.dumps(
            {"module": module, "args": list(args), "env": dict(env), "cwd": str(cwd or os.getcwd()), "log": str(log)}
        ).encode()
        if len(request) + 1 > MAX_REQUEST_BYTES:
            raise FusionError(f"a fork request of {len(request)} bytes is over {MAX_REQUEST_BYTES}")
        with self._lock:
            control = self._ensure_started(env)
            mine, theirs = socket.socketpair()
            try:
                socket.send_fds(control, [request + b"\n"], [theirs.fileno()])
            except OSError as e:
                mine.close()
                raise FusionError(f"the fork server (pid {self.pid}) is gone: {e}") from e
            finally:
                theirs.close()
        ready, _, _ = select.select([mine], [], [], self.start_timeout_s)
        first = mine.recv(64).decode(errors="replace") if ready else ""
        if not first.startswith("pid "):
            mine.close()
            raise FusionError(f"the fork server did not start python -m {module}: {first.strip() or 'no answer'}")
        pid_line, _, rest = first.partition("\n")
        child = ForkedChild(int(pid_line.split()[1]), mine, [sys.executable, "-m", module, *args])
        child._buffer = rest.encode()
        return child

    def _ensure_started(self, env: Mapping[str, str]) -> socket.socket:
        if self._control is not None and self._proc is not None and self._proc.poll() is None:
            return self._control
        self.close()
        ours, server_end = socket.socketpair()
        proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER_MAIN, str(server_end.fileno())],
            pass_fds=[server_end.fileno()],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        server_end.close()
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], self.start_timeout_s)
        line = proc.stdout.readline().decode(errors="replace") if ready else ""
        if not line.startswith(READY):
            proc.kill()
            proc.wait()
            ours.close()
            raise FusionError(f"the fork server did not start: {line.strip() or 'no answer'}")
        proc.stdout.close()
        self._proc, self._control = proc, ours
        return ours

    def close(self) -> None:
        """Stop the server (its children run on)."""
        if self._control is not None:
            self._control.close()  # the server exits when its control socket closes
            self._control = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


# The server side: :func:`main` with the socket's FD.


def _serve(control: socket.socket) -> None:
    """Fork a child per request until the control socket closes; report each child's pid
    and, once reaped, its exit code on that child's own socket."""
    base_path = [p for p in sys.path[1:] if p not in _pythonpath(os.environ)]
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake-up fd hears it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller's Ctrl-C is the caller's
    statuses: dict[int, socket.socket] = {}
    buffer, pending = b"", []  # a request's bytes may come in pieces; its socket with the first
    while True:
        ready, _, _ = select.select([control, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(statuses)
        if control not in ready:
            continue
        data, fds, _, _ = socket.recv_fds(control, MAX_REQUEST_BYTES, 4)
        if not data:
            return  # the caller closed its end: its children run on without us
        buffer += data
        pending += [socket.socket(fileno=fd) for fd in fds]
        while b"\n" in buffer and pending:
            line, _, buffer = buffer.partition(b"\n")
            status = pending.pop(0)
            try:
                request = json.loads(line)
            except ValueError as e:
                status.sendall(f"error: a malformed request: {e}\n".encode())
                status.close()
                continue
            pid = os.fork()
            if pid == 0:
                for s in (control, status, *pending, *statuses.values()):
                    s.close()
                os.close(wake_r)
                os.close(wake_w)
                _run_child(request, base_path)  # never returns
            statuses[pid] = status
            status.sendall(f"pid {pid}\n".encode())
        _reap(statuses)


def _reap(statuses: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock = statuses.pop(pid, None)
        if sock is not None:
            try:
                sock.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass  # its launcher has let it go
            sock.close()


def _pythonpath(env: Mapping[str, str]) -> list[str]:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _run_child(request: dict[str, object], base_path: list[str]) -> None:
    """Become ``python -m MODULE ARGS`` (in the forked child); exits the process."""
    import io
    import runpy
    import traceback

    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()
    env = {str(k): str(v) for k, v in dict(request["env"]).items()}  # type: ignore[call-overload]
    log = os.open(str(request["log"]), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    # PYTHONUNBUFFERED, as every launcher asks: each write reaches the log at once.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True, errors="backslashreplace"
    )
    os.chdir(str(request["cwd"]))
    os.environ.clear()
    os.environ.update(env)
    # As ``python -m`` would: the working directory first, then PYTHONPATH, then the rest.
    sys.path[:] = list(dict.fromkeys([os.getcwd(), *_pythonpath(env), *base_path]))
    module = str(request["module"])
    sys.argv = ["-m", *[str(a) for a in request["args"]]]  # type: ignore[attr-defined]
    code: int = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    raise SystemExit(code)  # unwinds to the interpreter: threads joined, atexit run


def main(argv: Sequence[str] | None = None) -> None:
    """The server: preload, say ready, serve on socket FD (the one argument)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1 or not argv[0].isdigit():
        raise SystemExit("usage: forkserver FD (a socket its launcher passed)")
    control = socket.socket(fileno=int(argv[0]))
    for name in PRELOAD:
        __import__(name)
    if threading.active_count() != 1:
        raise SystemExit(f"forkserver: preloading started threads ({threading.enumerate()}); forking is unsafe")
    if sys.modules["torch"].cuda.is_initialized():  # a forked child could not use CUDA
        raise SystemExit("forkserver: preloading initialised CUDA; forked children could not use it")
    print(READY, flush=True)
    _serve(control)
