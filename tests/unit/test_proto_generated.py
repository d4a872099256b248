"""The committed fusion/wire/ code is exactly what proto/generate.py makes from proto/."""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
GENERATE = REPO_ROOT / "proto" / "generate.py"
COMMITTED = REPO_ROOT / "fusion" / "wire"
HAND_WRITTEN = {"__init__.py"}
FIX = "fusion/wire/ is stale or was edited by hand: run `python proto/generate.py` and commit the result"


def load_generate_script() -> ModuleType:
    """``proto/`` is not a package (it would clash with proto-plus), so load the script by path."""
    spec = importlib.util.spec_from_file_location("fusion_proto_generate", GENERATE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generated_files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file() and p.name not in HAND_WRITTEN}


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    pytest.importorskip(
        "grpc_tools", reason="grpc_tools (grpcio-tools, a test extra) is needed to regenerate fusion/wire/"
    )
    out = tmp_path_factory.mktemp("wire")
    load_generate_script().generate(out)
    return generated_files(out / "fusion" / "wire")


def test_every_proto_has_generated_code(regenerated: dict[str, bytes]) -> None:
    protos = sorted(p.stem for p in (REPO_ROOT / "proto" / "fusion" / "wire").glob("*.proto"))
    assert protos, "no .proto sources found"
    for stem in protos:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert f"{stem}{suffix}" in regenerated, f"{stem}{suffix} was not generated"


def test_committed_files_are_the_generated_set(regenerated: dict[str, bytes]) -> None:
    committed = generated_files(COMMITTED)
    missing = sorted(set(regenerated) - set(committed))
    extra = sorted(set(committed) - set(regenerated))
    assert not missing and not extra, f"{FIX}. Not committed: {missing}; committed but not generated: {extra}"


def test_committed_files_match_byte_for_byte(regenerated: dict[str, bytes]) -> None:
    committed = generated_files(COMMITTED)
    differ = []
    for name in sorted(set(regenerated) & set(committed)):
        if regenerated[name] != committed[name]:
            diff = difflib.unified_diff(
                committed[name].decode(errors="replace").splitlines(),
                regenerated[name].decode(errors="replace").splitlines(),
                f"committed/{name}",
                f"generated/{name}",
                lineterm="",
                n=1,
            )
            differ.append("\n".join(list(diff)[:20]))
    assert not differ, f"{FIX}.\n" + "\n\n".join(differ)
