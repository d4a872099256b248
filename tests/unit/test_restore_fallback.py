"""A snapshot read falls back over its holders, then leaves the restore point to be chosen again."""

from __future__ import annotations

import pytest

from fusion.coordinator.restore import Holdings, choose_restore_point, from_holders
from fusion.errors import CheckpointError, RemoteError


def test_a_failing_holder_is_struck_and_the_next_copy_is_read() -> None:
    held: Holdings = {("k", 8): ["leaver:1", "buddy:2"], ("k", 4): ["buddy:2"]}
    tried: list[str] = []
    warned: list[tuple[str, str]] = []

    def read(address: str) -> str:
        tried.append(address)
        if address == "leaver:1":
            raise RemoteError("GetSnapshot failed with UNAUTHENTICATED: wrong job credential", code="UNAUTHENTICATED")
        return f"state from {address}"

    assert from_holders(held, "k", 8, read, lambda a, r: warned.append((a, r))) == "state from buddy:2"
    assert tried == ["leaver:1", "buddy:2"]
    assert warned and warned[0][0] == "leaver:1" and "UNAUTHENTICATED" in warned[0][1]
    assert held[("k", 8)] == ["buddy:2"]


def test_no_holder_left_raises_and_the_point_falls_back_to_an_older_step() -> None:
    held: Holdings = {("a", 8): ["w1:1"], ("b", 8): ["w2:1"], ("a", 4): ["w2:1"], ("b", 4): ["w1:1"]}

    def read(address: str) -> str:
        raise RemoteError(f"{address} is gone", code="UNAVAILABLE")

    with pytest.raises(CheckpointError, match="no worker could serve the snapshot of stage a at step 8"):
        from_holders(held, "a", 8, read, lambda a, r: None)
    assert ("a", 8) not in held
    point = choose_restore_point(["a", "b"], held, [])
    assert (point.source, point.step) == ("snapshots", 4)
