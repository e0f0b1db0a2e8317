"""The ``jstd`` command line: the only door from a shell (``jstd.cli.main``); each subcommand in its own module."""

from jstd.cli.main import main

__all__ = ["main"]
