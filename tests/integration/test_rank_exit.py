"""How a baseline rank ends (:func:`testbeds.bench.baselines.rank.rank_main` and
:func:`~testbeds.bench.baselines.rank.gloo_group`): a finished run exits 0 with its output
flushed, an error exits 1 with its traceback, and real gloo ranks on loopback leave cleanly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testbeds.net.testbed import stop_process_group

JOB = """name = "gpt2-tiny-exit"
[model]
name = "gpt2"
preset = "tiny"
[data]
batch_size = 4
seq_len = 8
shuffle = false
[train]
steps = 2
optimizer = "adamw"
lr = 3e-4
seed = 0
"""


def _main(body: str) -> subprocess.CompletedProcess[str]:
    code = f"from testbeds.bench.baselines.rank import rank_main\n{body}\nrank_main(run)\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_finished_run_exits_with_its_code_and_its_output_flushed() -> None:
    proc = _main("def run():\n    print('written', end='')\n    return 3")
    assert proc.returncode == 3 and proc.stdout == "written", proc


def test_an_error_exits_1_with_its_traceback() -> None:
    proc = _main("def run():\n    raise ValueError('bad rank')")
    assert proc.returncode == 1, proc
    assert "Traceback" in proc.stderr and "ValueError: bad rank" in proc.stderr, proc.stderr


def test_a_usage_error_keeps_its_message_and_exit_status() -> None:
    proc = _main("import sys\ndef run():\n    sys.exit('no job')")
    assert proc.returncode == 1 and "no job" in proc.stderr, proc


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module", ["fsdp", "pipelining"])
def test_gloo_ranks_train_and_leave_cleanly(module: str, tmp_path: Path, port: int) -> None:
    job = tmp_path / "job.toml"
    job.write_text(JOB + ("micro_batches = 2\n" if module == "pipelining" else ""))
    metrics = tmp_path / "metrics.jsonl"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", f"testbeds.bench.baselines.{module}", "--job", str(job), "--rank", str(r)]
            + ["--world-size", "2", "--master", f"127.0.0.1:{port}", "--address", "127.0.0.1"]
            + (["--metrics", str(metrics)] if r == 0 else []),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for r in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=100)[0] for p in procs]
    finally:
        for p in procs:
            stop_process_group(p)
    assert [p.returncode for p in procs] == [0, 0], outputs
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [0, 1]
