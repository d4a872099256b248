"""Command-line entry points: ``fusion``, ``fusion-coordinator``, ``fusion-worker``."""
