"""A folder named ``fusion`` on ``PYTHONPATH`` must not hide the package from the CLIs unsaid.

The tools run in a subprocess the way an editable install runs them: the repository is not
on ``sys.path``; a finder after the path finder on ``sys.meta_path`` (as setuptools'
editable finder is) maps the top-level packages to it. An empty ``fusion/`` folder on
``PYTHONPATH`` then becomes a namespace package that wins over the install.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

LAUNCHER = """
import importlib
import os
import sys
from importlib.machinery import PathFinder

ROOT = {root!r}
TOP = {{"fusion", "executor", "scheduler", "compress"}}


class EditableFinder:
    # Like setuptools' editable finder: maps the project's packages to the checkout.
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        parts = name.split(".")
        if parts[0] not in TOP:
            return None
        return PathFinder.find_spec(name, [os.path.join(ROOT, *parts[:-1])])


sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != ROOT]
for finder in [f for f in sys.meta_path if "editable" in getattr(f, "__name__", type(f).__name__).lower()]:
    sys.meta_path.remove(finder)  # an editable install of another checkout
sys.meta_path.insert(sys.meta_path.index(PathFinder) + 1, EditableFinder)
module, *sys.argv[1:] = sys.argv[1:]
sys.exit(importlib.import_module(module).main())
"""


def _run(tmp_path: Path, module: str, *args: str, shadow: bool) -> subprocess.CompletedProcess[str]:
    launcher = tmp_path / "launch.py"
    launcher.write_text(textwrap.dedent(LAUNCHER.format(root=str(REPO_ROOT))))
    site = tmp_path / "site"
    (site / "fusion").mkdir(parents=True, exist_ok=True)
    if not shadow:
        (site / "fusion").rmdir()
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONSAFEPATH": "1"}
    return subprocess.run(
        [sys.executable, str(launcher), module, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("module", ["fusion.cli.worker", "fusion.cli.coordinator", "fusion.cli.main"])
def test_cli_names_the_folder_that_hides_the_package(tmp_path: Path, module: str) -> None:
    r = _run(tmp_path, module, "--help", shadow=True)
    assert r.returncode == 2, (r.stdout, r.stderr)
    shadow = str((tmp_path / "site" / "fusion").resolve())
    assert f"error: the folder {shadow} hides the fusion package ({REPO_ROOT / 'fusion'})" in r.stderr, r.stderr
    assert f"take {tmp_path / 'site'} off PYTHONPATH" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.timeout(300)
def test_cli_runs_through_the_same_finder_without_the_folder(tmp_path: Path) -> None:
    r = _run(tmp_path, "fusion.cli.worker", "--help", shadow=False)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "--allow-code" in r.stdout
