"""Stop the command-line tools at once when a folder named ``fusion`` hides the package.

Python's path finder takes a plain folder named ``fusion`` in the current directory or on
``PYTHONPATH`` for a namespace package, and that wins over an editable install (whose
finder runs after the path finder). The submodules still import through the install, but
``fusion/__init__.py`` never runs, so the tools would fail later and far from the cause
(``cannot import name '__version__' from 'fusion' (unknown location)`` when a worker
registers). :func:`exit_if_shadowed` says which folder it is and what to do instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import fusion

#: The real package: the folder that holds this module's package.
PACKAGE_DIR = Path(__file__).resolve().parent.parent


def shadowing_folders() -> list[str]:
    """The folders imported as ``fusion`` instead of this package; empty when it is imported itself."""
    if getattr(fusion, "__file__", None) is not None:
        return []
    found = [str(Path(p).resolve()) for p in getattr(fusion, "__path__", [])]
    return [p for p in dict.fromkeys(found) if Path(p) != PACKAGE_DIR]


def exit_if_shadowed() -> None:
    """Exit with status 2 and a message naming the folder when :func:`shadowing_folders` finds one."""
    folders = shadowing_folders()
    if not folders:
        return
    parents = ", ".join(str(Path(f).parent) for f in folders)
    print(
        f"error: the folder {', '.join(folders)} hides the fusion package ({PACKAGE_DIR}): Python imports a folder "
        f"named 'fusion' in the current directory or on PYTHONPATH before an installed package. Run from another "
        f"directory, take {parents} off PYTHONPATH, or rename the folder.",
        file=sys.stderr,
    )
    raise SystemExit(2)
