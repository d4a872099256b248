"""A baseline rank killed by a signal makes the benchmark run that system again, and says
so; a rank's own error, or a third crash, still fails. (``run_ranks`` itself is
exercised for real in tests/testbed/test_bench.py.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from fusion.config import JobSpec
from fusion.errors import FusionError
from testbeds.bench import rank_runs as bench

JOB = JobSpec.from_toml(
    'name = "retry"\n[model]\nname = "gpt2"\npreset = "tiny"\n'
    "[data]\nbatch_size = 8\nseq_len = 16\n[train]\nsteps = 2\n"
)
RECORDS = [{"step": 0, "step_s": 1.0, "loss": 2.0, "samples_per_s": 8.0, "bytes_per_link": {"0->1": 10.0}}]


def fake_ranks(failures: list[Exception]):
    calls: list[str] = []

    def run_ranks(tb, module, spec_file, hosts, **kwargs):
        calls.append(module)
        if failures:
            raise failures.pop(0)
        return [dict(r) for r in RECORDS]

    return run_ranks, calls


@pytest.mark.parametrize("system", ["ddp", "pipelining"])
def test_a_crashed_rank_runs_the_system_again(system: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_ranks, calls = fake_ranks(
        [bench.RankCrashed("testbeds.bench.baselines.x rank 2 exited with -6: terminate called")]
    )
    monkeypatch.setattr(bench, "run_ranks", run_ranks)
    run = bench.run_baseline(SimpleNamespace(hosts=["a", "b"]), system, JOB, steps=2, workdir=tmp_path, timeout_s=10)
    assert len(calls) == 2
    assert run.records and run.records[0]["bytes_per_link"] == {"a->b": 10.0}
    assert "run again after a crash (testbeds.bench.baselines.x rank 2 exited with -6" in run.note


def test_two_crashes_are_run_again_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_ranks, calls = fake_ranks(
        [bench.RankCrashed("rank 0 exited with -6"), bench.RankCrashed("rank 0 exited with -6")]
    )
    monkeypatch.setattr(bench, "run_ranks", run_ranks)
    run = bench.run_baseline(SimpleNamespace(hosts=["a", "b"]), "ddp", JOB, steps=2, workdir=tmp_path, timeout_s=10)
    assert len(calls) == bench.RANK_TRIES == 3 and run.records
    assert run.note == "run again after 2 crashes (rank 0 exited with -6)"


def test_a_third_crash_or_a_ranks_own_error_is_not_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tb = SimpleNamespace(hosts=["a", "b"])
    run_ranks, calls = fake_ranks([bench.RankCrashed(f"rank 0 exited with -{n}") for n in (6, 6, 11)])
    monkeypatch.setattr(bench, "run_ranks", run_ranks)
    with pytest.raises(bench.RankCrashed, match="-11"):
        bench.run_baseline(tb, "ddp", JOB, steps=2, workdir=tmp_path, timeout_s=10)
    run_ranks, calls = fake_ranks([FusionError("rank 1 exited with 1: ValueError")])
    monkeypatch.setattr(bench, "run_ranks", run_ranks)
    with pytest.raises(FusionError, match="exited with 1"):
        bench.run_baseline(tb, "ddp", JOB, steps=2, workdir=tmp_path, timeout_s=10)
    assert len(calls) == 1


class ScriptedHosts:
    """A testbed stand-in whose hosts run a given Python script per rank in place of the
    baseline module (real processes, real exit codes and logs)."""

    def __init__(self, scripts: list[str]) -> None:
        self.hosts = [f"h{i}" for i in range(len(scripts))]
        self.scripts = scripts

    def address(self, host: str) -> str:
        return "127.0.0.1"

    def free_port(self, host: str) -> int:
        return 1

    def spawn(self, host: str, argv: list[str], **popen_kwargs):
        import subprocess
        import sys

        script = self.scripts[self.hosts.index(host)]
        return subprocess.Popen([sys.executable, "-c", script], start_new_session=True, **popen_kwargs)


LOST_PEER_LINE = "torch.distributed.DistNetworkError: Connection reset by peer"
LOST_PEER = f"import sys; print('step 0'); sys.exit({LOST_PEER_LINE!r})"
OWN_ERROR = "import sys; print('step 0'); sys.exit('ValueError: shapes (2, 3) and (4,) do not match')"


@pytest.mark.parametrize(
    ("script", "error", "cause"),
    [
        (LOST_PEER, bench.RankCrashed, LOST_PEER_LINE),  # its peer failed it: run again
        (OWN_ERROR, FusionError, "ValueError: shapes (2, 3) and (4,) do not match"),  # its own error: fails
    ],
)
def test_a_failed_rank_names_its_cause_and_only_a_lost_peer_is_a_crash(
    script: str, error: type[FusionError], cause: str, tmp_path: Path
) -> None:
    tb = ScriptedHosts([script, "import time; time.sleep(30)"])
    module = "testbeds.bench.baselines.fsdp"
    with pytest.raises(FusionError) as caught:
        bench.run_ranks(tb, module, tmp_path / "job.toml", tb.hosts, steps=1, workdir=tmp_path, timeout_s=20)
    assert type(caught.value) is error
    assert str(caught.value).splitlines()[0] == f"{module} rank 0 exited with 1: {cause}"
    assert "[rank 1, exit " in str(caught.value)  # every rank's log tail follows
