"""Command-line entry points: ``fusion``, ``fusion-coordinator``, ``fusion-worker``.

Importing this package exits with a clear message when a folder named ``fusion`` hides the
real package (:mod:`fusion.cli.shadow`), before any tool fails for that reason later.
"""

from fusion.cli.shadow import exit_if_shadowed

exit_if_shadowed()
