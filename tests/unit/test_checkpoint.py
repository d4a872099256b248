"""fusion.checkpoint: stage state round trips, snapshots and their checks, durable files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fusion.checkpoint import (
    Assembler,
    CheckpointDir,
    SnapshotStore,
    capture_volatile,
    capture_weights,
    make_snapshot,
    merge_states,
    model_state,
    restore_state,
    stage_key,
    stage_subset,
)
from fusion.checkpoint.snapshot import chunks_of, decode, encode, read_metadata
from fusion.coordinator.restore import choose_restore_point
from fusion.errors import CheckpointError, NotFoundError


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.norm = torch.nn.BatchNorm1d(3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(x)))


def trained(seed: int = 0, steps: int = 3) -> tuple[Tied, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = Tied()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    for _ in range(steps):
        x = torch.randint(0, 5, (8,))
        torch.nn.functional.cross_entropy(m(x), x).backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def full_state(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {**capture_weights(m, opt), **capture_volatile(m)}


def test_restore_reproduces_training_exactly() -> None:
    m, opt = trained()
    state = full_state(m, opt)
    fresh, fresh_opt = trained(seed=1, steps=0)
    restore_state(fresh, fresh_opt, state)
    for a, b in ((m, opt), (fresh, fresh_opt)):
        torch.manual_seed(5)
        x = torch.randint(0, 5, (8,))
        torch.nn.functional.cross_entropy(a(x), x).backward()
        b.step()
    for (n, p), (_, q) in zip(m.state_dict().items(), fresh.state_dict().items(), strict=False):
        assert torch.equal(p, q), n


def test_state_has_optimizer_buffers_and_rng_and_is_a_copy() -> None:
    m, opt = trained()
    state = full_state(m, opt)
    assert {
        "param/emb.weight",
        "param/norm.running_mean",
        "optim/emb.weight/exp_avg",
        "optim/emb.weight/step",
        "rng/cpu",
    } <= set(state)
    with torch.no_grad():
        m.emb.weight.add_(1.0)
    assert not torch.equal(state["param/emb.weight"], m.emb.weight)


def test_restore_refuses_missing_or_mismatched_tensors() -> None:
    m, opt = trained()
    state = full_state(m, opt)
    del state["param/norm.running_var"]
    with pytest.raises(CheckpointError, match="lacks"):
        restore_state(m, opt, state)
    state = full_state(m, opt)
    state["param/norm.weight"] = torch.zeros(4)
    with pytest.raises(CheckpointError, match="norm.weight"):
        restore_state(m, opt, state)


def test_merge_and_split_follow_canonical_names() -> None:
    a = {
        "param/emb.weight": torch.ones(2),
        "optim/emb.weight/exp_avg": torch.full((2,), 2.0),
        "rng/cpu": torch.zeros(3, dtype=torch.uint8),
    }
    b = {
        "param/head.weight": torch.ones(2),
        "optim/head.weight/exp_avg": torch.full((2,), 2.0),
        "param/x.bias": torch.zeros(1),
        "residual/k": torch.ones(1),
    }
    canonical = {"head.weight": "emb.weight"}.get
    whole = merge_states([a, b], lambda n: canonical(n) or n)
    assert set(whole) == {"param/emb.weight", "optim/emb.weight/exp_avg", "param/x.bias"}
    part = stage_subset(whole, ["head.weight", "x.bias"], lambda n: canonical(n) or n)
    assert set(part) == {"param/head.weight", "optim/head.weight/exp_avg", "param/x.bias"}
    assert set(model_state({"w": torch.ones(1)})) == {"param/w"}


def test_snapshot_round_trip_with_shared_tensors() -> None:
    t = torch.arange(6.0)
    snap = make_snapshot("job", 1, "k", 10, {"param/a": t, "param/b": t, "optim/a/step": torch.tensor(3.0)})
    got = snap.tensors()
    assert torch.equal(got["param/a"], t) and torch.equal(got["param/b"], t) and got["optim/a/step"].item() == 3.0


def test_flipped_byte_is_never_loaded() -> None:
    data, sha = encode({"param/a": torch.arange(100.0)})
    bad = bytearray(data)
    bad[-7] ^= 0x01
    with pytest.raises(CheckpointError, match="corrupt"):
        decode(bytes(bad), sha)
    with pytest.raises(CheckpointError, match="not a valid safetensors"):
        junk = b"\xff" * 64
        import hashlib

        decode(junk, hashlib.sha256(junk).hexdigest())


def test_the_loss_stage_snapshot_carries_its_step_loss_through_a_replica() -> None:
    """The loss of the step before a snapshot's label travels in its (checksummed) metadata,
    so a buddy's replica, reassembled from chunks, still says it; a snapshot without one,
    or with a value that is not a finite number, says nothing."""
    snap = make_snapshot("j", 1, "k", 8, {"param/a": torch.ones(3)}, step_loss=2.718281828459045)
    assert read_metadata(snap.data)["step"] == "8"
    asm = Assembler("j", 1, "k", 8, snap.size_bytes, snap.sha256, replica=True)
    for piece in chunks_of(snap.data, 7):
        asm.add(bytes(piece))
    replica = asm.finish()
    assert replica.step_loss == snap.step_loss == 2.718281828459045
    assert make_snapshot("j", 0, "k", 8, {"param/a": torch.ones(3)}).step_loss is None
    assert make_snapshot("j", 1, "k", 8, {"param/a": torch.ones(3)}, step_loss=float("nan")).step_loss is None


def header_of(header: object) -> bytes:
    """A safetensors header with this JSON and no tensors."""
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"\x01", "no safetensors header"),
        ((1 << 40).to_bytes(8, "little") + b"{}", "declares"),
        ((4).to_bytes(8, "little") + b"{nop", "not JSON"),
        ((2).to_bytes(8, "little") + b"[]", "not a map of strings"),
        (header_of({"__metadata__": {"step": 3}}), "not a map of strings"),
        ((200_000).to_bytes(8, "little") + b"[" * 100_000 + b"]" * 100_000, "not JSON: RecursionError"),
    ],
    ids=["short", "oversized", "not-json", "not-a-map", "non-string-values", "nested-too-deep"],
)
def test_a_snapshot_header_that_is_not_one_is_refused_by_name(data: bytes, words: str) -> None:
    with pytest.raises(CheckpointError, match=words):
        read_metadata(data)


def test_assembler_refuses_short_long_and_corrupt_streams() -> None:
    snap = make_snapshot("job", 0, "k", 4, {"param/a": torch.arange(1000.0)})
    info = ("job", 0, "k", 4, snap.size_bytes, snap.sha256)

    a = Assembler(*info, replica=True)
    a.add(snap.data[:100])
    with pytest.raises(CheckpointError, match="incomplete"):
        a.finish()

    a = Assembler(*info, replica=True)
    with pytest.raises(CheckpointError, match="more than"):
        a.add(snap.data + b"x")

    a = Assembler(*info, replica=True)
    a.add(snap.data[:-1] + bytes([snap.data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="corrupt"):
        a.finish()

    with pytest.raises(CheckpointError, match="limit"):
        Assembler("job", 0, "k", 4, 1 << 40, snap.sha256, replica=True, max_bytes=1 << 30)

    a = Assembler(*info, replica=True)
    for i in range(0, snap.size_bytes, 333):
        a.add(snap.data[i : i + 333])
    got = a.finish()
    assert got.replica and got.sha256 == snap.sha256


def test_store_keeps_the_newest_per_stage_and_drops_jobs() -> None:
    store = SnapshotStore(keep=2)
    for step in (4, 8, 12):
        store.put(make_snapshot("j", 0, "k0", step, {"param/a": torch.ones(1)}))
    store.put(make_snapshot("j", 1, "k1", 4, {"param/a": torch.ones(1)}))
    store.put(make_snapshot("other", 0, "k0", 4, {"param/a": torch.ones(1)}))
    assert sorted((s.stage_key, s.step) for s in store.list("j")) == [("k0", 8), ("k0", 12), ("k1", 4)]
    with pytest.raises(NotFoundError, match="held steps: \\[8, 12\\]"):
        store.get("j", "k0", 4)
    import dataclasses

    for step in (4, 8):  # replicas: only the newest complete one is kept
        store.put(dataclasses.replace(make_snapshot("j", 2, "k2", step, {"param/a": torch.ones(1)}), replica=True))
    assert [s.step for s in store.list("j") if s.stage_key == "k2"] == [8]
    # A restore source pushed for an older step is kept (it is about to be used), and own
    # snapshots are not evicted by replicas of the same stage.
    store.put(dataclasses.replace(make_snapshot("j", 2, "k2", 4, {"param/a": torch.ones(1)}), replica=True))
    store.put(make_snapshot("j", 2, "k2", 12, {"param/a": torch.ones(1)}))
    assert sorted(s.step for s in store.list("j") if s.stage_key == "k2") == [4, 8, 12]
    assert store.get("j", "k2", 4).replica and not store.get("j", "k2", 12).replica
    store.drop_job("j")
    assert store.list("j") == [] and len(store.list("other")) == 1


def test_stage_key_depends_on_nodes_and_graph_only() -> None:
    assert stage_key(["a", "b"], "g") == stage_key(["b", "a"], "g")
    assert stage_key(["a", "b"], "g") != stage_key(["a"], "g") != stage_key(["a"], "h")


def test_durable_dir_keeps_k_and_detects_corruption(tmp_path: Path) -> None:
    d = CheckpointDir(tmp_path / "ck", keep=2)
    for step in (10, 20, 30):
        d.write(step, {"param/w": torch.full((4,), float(step))}, {"job_id": "j"})
    assert [c.step for c in d.list()] == [20, 30]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "ckpt-000000020.json",
        "ckpt-000000020.safetensors",
        "ckpt-000000030.json",
        "ckpt-000000030.safetensors",
    ]
    latest = d.latest()
    assert latest is not None and d.load(latest)["param/w"][0].item() == 30.0
    # A flipped byte: refused, and the newest valid one is used instead.
    raw = bytearray(latest.path.read_bytes())
    raw[-3] ^= 0x10
    latest.path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupt"):
        d.load(latest)
    skipped = []
    found = d.load_latest_valid(on_skip=lambda c, e: skipped.append(c.step))
    assert found is not None and found[0].step == 20 and skipped == [30]


def test_durable_write_in_progress_is_invisible(tmp_path: Path) -> None:
    d = CheckpointDir(tmp_path, keep=3)
    d.write(5, {"param/w": torch.ones(2)})
    # A crash mid-write leaves a temp file and possibly a blob without its record: neither counts.
    (tmp_path / "ckpt-000000009.safetensors.tmp").write_bytes(b"partial")
    (tmp_path / "ckpt-000000010.safetensors").write_bytes(b"no record yet")
    (tmp_path / "ckpt-000000011.json").write_text(
        json.dumps({"step": 11, "sha256": "0" * 64, "size_bytes": 1, "file": "missing"})
    )
    assert [c.step for c in d.list()] == [5]


def test_restore_point_prefers_the_newest_complete_source(tmp_path: Path) -> None:
    d = CheckpointDir(tmp_path, keep=3)
    ck = d.write(8, {"param/w": torch.ones(1)})
    held = {("a", 12): ["w1"], ("b", 12): ["w2"], ("a", 16): ["w1"]}  # b's step-16 snapshot was lost
    p = choose_restore_point(["a", "b"], held, [ck])
    assert (p.step, p.source) == (12, "snapshots")
    p = choose_restore_point(["a", "b", "c"], held, [ck])  # no snapshot of c anywhere: disk
    assert (p.step, p.source) == (8, "durable")
    p = choose_restore_point(["a", "b", "c"], held, [])
    assert (p.step, p.source) == (0, "initial")
    p = choose_restore_point(["a", "b"], held, [ck], at_most=10)
    assert (p.step, p.source) == (8, "durable")
