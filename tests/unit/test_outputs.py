"""A job's output directory: the safetensors model, atomic writes, metrics, loss plot, JSON files."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from executor.driver import StepStats
from fusion.coordinator.outputs import (
    LOSS_PLOT_FILE,
    METRICS_FILE,
    MODEL_FILE,
    PLAN_FILE,
    SUMMARY_FILE,
    JobOutputs,
    atomic_write,
    metrics_record,
    read_history,
    write_json,
)
from fusion.models import build_model
from scheduler.convergence import COST_PER_ERROR2, QUANT_COST_PER_ERROR2

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def outputs(tmp_path: Path) -> Iterator[JobOutputs]:
    out = JobOutputs(tmp_path / "job")
    yield out
    out.close()


def test_creates_the_directory(tmp_path: Path) -> None:
    out = JobOutputs(tmp_path / "a" / "b")
    out.close()
    assert (tmp_path / "a" / "b").is_dir()


# ----------------------------------------------------------------- model


def test_write_model_round_trips(outputs: JobOutputs) -> None:
    weight = torch.randn(4, 6, requires_grad=True)
    state = {
        "fc.weight": weight,
        "fc.bias": torch.randn(4, dtype=torch.float16),
        "bn.num_batches_tracked": torch.tensor(7, dtype=torch.int64),
        "emb.weight": torch.randn(3, 5, dtype=torch.bfloat16),
        "proj.weight": torch.randn(6, 4).t(),  # (4, 6), not contiguous
    }
    path = outputs.write_model(state, metadata={"job_id": "j1", "step": "10"})
    assert path == outputs.dir / MODEL_FILE
    loaded = load_file(str(path))
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name], tensor.detach()), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"job_id": "j1", "step": "10"}


def test_write_model_gpt2_tied_weights_load_strictly(outputs: JobOutputs) -> None:
    torch.manual_seed(0)
    model = build_model("gpt2", "tiny")
    state = model.state_dict()
    assert (
        state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    )  # tied: one storage, two names

    path = outputs.write_model(state)
    loaded = load_file(str(path))
    assert loaded.keys() == state.keys()  # original state_dict names, both tied names present
    assert torch.equal(loaded["lm_head.weight"], loaded["transformer.wte.weight"])

    torch.manual_seed(1)
    fresh = build_model("gpt2", "tiny")
    assert not torch.equal(fresh.transformer.wte.weight, model.transformer.wte.weight)
    fresh.load_state_dict(loaded, strict=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert fresh.lm_head.weight is fresh.transformer.wte.weight  # loading keeps the tie


def test_write_model_replaces_the_previous_model(outputs: JobOutputs) -> None:
    outputs.write_model({"w": torch.zeros(2)})
    outputs.write_model({"w": torch.ones(3)})
    assert torch.equal(load_file(str(outputs.dir / MODEL_FILE))["w"], torch.ones(3))
    assert sorted(p.name for p in outputs.dir.iterdir()) == [METRICS_FILE, MODEL_FILE]


# ----------------------------------------------------------------- atomic writes


class WriterCrashed(RuntimeError):
    pass


def crash_midway(tmp: Path) -> None:
    with open(tmp, "wb") as f:
        f.write(b"half of the new con")
        f.flush()
    raise WriterCrashed("disk full")


def test_atomic_write_keeps_the_previous_file_when_the_writer_fails(tmp_path: Path) -> None:
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"previous content")
    with pytest.raises(WriterCrashed):
        atomic_write(target, crash_midway)
    assert target.read_bytes() == b"previous content"
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # no temporary left behind


def test_atomic_write_leaves_nothing_when_there_was_no_file(tmp_path: Path) -> None:
    with pytest.raises(WriterCrashed):
        atomic_write(tmp_path / "plan.json", crash_midway)
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_keeps_the_previous_file_on_keyboard_interrupt(tmp_path: Path) -> None:
    target = tmp_path / "summary.json"
    target.write_text("{}")

    def interrupted(tmp: Path) -> None:
        tmp.write_text('{"partial": ')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, interrupted)
    assert target.read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_atomic_write_success_leaves_only_the_target(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "x.bin"
    atomic_write(target, lambda tmp: tmp.write_bytes(b"new"))
    assert target.read_bytes() == b"new"
    assert [p.name for p in target.parent.iterdir()] == ["x.bin"]


def test_whole_files_get_the_same_permissions_as_metrics(tmp_path: Path) -> None:
    old_umask = os.umask(0o022)  # the usual default; under 0o077 every file would be 0600 anyway
    try:
        outputs = JobOutputs(tmp_path)
        outputs.append_metrics({"step": 1})
        outputs.write_summary({"state": "succeeded"})
        outputs.write_model({"w": torch.zeros(2)})
        outputs.close()
    finally:
        os.umask(old_umask)
    assert (tmp_path / METRICS_FILE).stat().st_mode & 0o777 == 0o644  # what open() gives under this umask
    modes = {name: oct((tmp_path / name).stat().st_mode & 0o777) for name in (SUMMARY_FILE, MODEL_FILE)}
    assert modes == dict.fromkeys(modes, oct(0o644))


# ----------------------------------------------------------------- metrics


def test_metrics_jsonl_one_object_per_line(outputs: JobOutputs) -> None:
    records = [{"step": s, "loss": 3.0 / s, "samples_per_s": 10.0 * s, "workers": ["a", "b"]} for s in range(1, 6)]
    for r in records:
        outputs.append_metrics(r)
    # flushed at once: readable before close
    lines = (outputs.dir / METRICS_FILE).read_text().splitlines()
    assert len(lines) == len(records)
    parsed = [json.loads(line) for line in lines]
    assert all(isinstance(p, dict) for p in parsed)
    assert parsed == records


def test_metrics_jsonl_appends_across_writers(tmp_path: Path) -> None:
    first = JobOutputs(tmp_path)
    first.append_metrics({"step": 1})
    first.close()
    second = JobOutputs(tmp_path)  # e.g. the coordinator resumed the job
    second.append_metrics({"step": 2})
    second.close()
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 1}, {"step": 2}]


# ----------------------------------------------------------------- loss plot


def test_loss_plot_is_a_png(outputs: JobOutputs) -> None:
    outputs.write_loss_plot([1, 2, 3, 4], [4.0, 3.1, 2.7, 2.5], title="gpt2 tiny")
    data = (outputs.dir / LOSS_PLOT_FILE).read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 1000
    assert sorted(p.name for p in outputs.dir.iterdir()) == [LOSS_PLOT_FILE, METRICS_FILE]


def test_loss_plot_without_steps_writes_nothing(outputs: JobOutputs) -> None:
    outputs.write_loss_plot([], [], title="empty")
    assert not (outputs.dir / LOSS_PLOT_FILE).exists()


# ----------------------------------------------------------------- JSON files


def test_plan_and_summary_are_json(outputs: JobOutputs) -> None:
    plan = {
        "strategy": "uniform",
        "predicted_step_s": None,
        "planning_s": 0.01,
        "stages": [{"worker": "w-a", "nodes": ["x", "y"], "compute_s": None, "peak_memory_bytes": None}],
        "cuts": [],
    }
    summary = {"id": "j1", "state": "succeeded", "step": 5, "steps": 5, "loss": 2.5, "final_loss": 2.5}
    outputs.write_plan(plan)
    outputs.write_summary(summary)
    assert json.loads((outputs.dir / PLAN_FILE).read_text()) == plan
    assert json.loads((outputs.dir / SUMMARY_FILE).read_text()) == summary
    outputs.write_summary({**summary, "loss": 2.0})  # replaced, not appended
    assert json.loads((outputs.dir / SUMMARY_FILE).read_text())["loss"] == 2.0


def test_write_json_refuses_what_json_cannot_hold_and_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / SUMMARY_FILE
    write_json(target, {"ok": True})
    with pytest.raises(TypeError):
        write_json(target, {"tensor": object()})
    assert json.loads(target.read_text()) == {"ok": True}
    assert [p.name for p in tmp_path.iterdir()] == [SUMMARY_FILE]


def test_metrics_record_names_links_by_worker() -> None:
    stats = StepStats(
        step=3,
        loss=2.5,
        step_s=0.5,
        compute_s={0: 0.1, 1: 0.2},
        sent_bytes={(0, 1): 4000, (1, 0): 4000},
        dense_bytes={(0, 1): 16000, (1, 0): 16000},
        keep_ratios={(0, 1): 0.25},
        link_codecs={
            (0, 1): {"codec": "topk", "keep_ratio": 0.25, "bits": 0},
            (1, 0): {"codec": "quant", "keep_ratio": 1.0, "bits": 4},
        },
        compression_error={(0, 1): 0.5, (1, 0): 0.1},
    )
    tokens = torch.zeros(4, 8, dtype=torch.long)
    fits = {(0, 1): 1.25e7}
    record = metrics_record(stats, tokens, ["a", "b"], lambda s, d: fits.get((s, d)), 0.4)
    assert record["samples_per_s"] == 8.0 and record["tokens_per_s"] == 64.0
    assert record["bytes_per_link"] == {"a->b": 4000, "b->a": 4000} and record["compute_s"] == {"a": 0.1, "b": 0.2}
    assert record["link_bandwidth_bytes_per_s"] == {"a->b": 1.25e7}  # no estimate for b->a yet: left out
    assert record["compression"] == {
        "a->b": {
            "codec": "topk",
            "keep_ratio": 0.25,
            "bits": 0,
            "dense_bytes": 16000,
            "sent_bytes": 4000,
            "rel_error": 0.5,
        },
        "b->a": {
            "codec": "quant",
            "keep_ratio": 1.0,
            "bits": 4,
            "dense_bytes": 16000,
            "sent_bytes": 4000,
            "rel_error": 0.1,
        },
    }
    # Each link priced by its codec: top-k 0.5 on a->b, 4-bit quantization 0.1 on b->a.
    assert record["convergence_cost"] == pytest.approx(1 + COST_PER_ERROR2 * 0.25 + QUANT_COST_PER_ERROR2 * 0.01)
    assert record["predicted_step_s"] == 0.4
    images = torch.zeros(4, 3, 8, 8)
    plain = metrics_record(StepStats(step=0, loss=1.0, step_s=0.0), images, ["a"], lambda s, d: None, None)
    assert plain["samples_per_s"] == 0.0 and "tokens_per_s" not in plain and "compression" not in plain
    assert "predicted_step_s" not in plain
    json.dumps(record)  # a JSON line


def test_read_history_takes_the_steps_before_the_resume_point(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    path.write_text(
        "\n".join(
            [
                json.dumps({"step": 0, "loss": 3.0}),
                json.dumps({"step": 1, "loss": 2.5}),
                json.dumps({"event": "worker_lost", "step": 1, "loss": 9.0}),  # an event, not a step
                "{not json",
                json.dumps({"step": 1, "loss": 2.4}),  # a replayed step: the later record wins
                json.dumps({"step": 2, "loss": 2.0}),
                # a step finished unseen, its loss read from the loss stage's snapshot
                json.dumps({"event": "loss_from_snapshot", "step": 3, "loss": 1.8}),
            ]
        )
        + "\n"
    )
    assert read_history(path, 2) == [(0, 3.0), (1, 2.4)]
    assert read_history(path, 5) == [(0, 3.0), (1, 2.4), (2, 2.0), (3, 1.8)]
    assert read_history(tmp_path / "missing.jsonl", 5) == []
