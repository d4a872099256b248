"""Generate the Python gRPC code in fusion/wire/ from the .proto sources in proto/.

Run from anywhere: ``python proto/generate.py [--out DIR]``. The sources live under
``proto/fusion/wire/`` so that generated modules import each other as
``fusion.wire.*``. A test regenerates into a temporary folder and fails on any difference,
so run this after every change to a .proto file and commit the result.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent


def proto_files() -> list[Path]:
    """Every .proto source, sorted so generation is deterministic."""
    return sorted((PROTO_ROOT / "fusion" / "wire").glob("*.proto"))


def generate(out_dir: Path) -> None:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` under ``out_dir/fusion/wire``."""
    from grpc_tools import protoc  # test extra; only needed to regenerate

    out_dir.mkdir(parents=True, exist_ok=True)
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed for {files}")


def main() -> None:
    """Command-line entry: regenerate into the repository (or ``--out``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="root to write fusion/wire/ under")
    generate(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
