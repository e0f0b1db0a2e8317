"""The ``jstd`` command: ``demo`` (the embedded induction model), ``inspect`` (a model's sites), ``convert`` and
``export``, ``generate``, ``collect``, ``aot`` (compile for a TPU slice or GPUs without one), ``attribute``
(an attribution graph through transcoders), ``view`` (an attribution graph as a self-contained HTML page)."""

from __future__ import annotations

import argparse
import sys

from jstd.cli import aot, attribute, collect, convert, demo, generate, inspect, view

# each module: add_arguments(subparsers) adds its parser(s); command(args) -> exit status
COMMANDS = {"demo": demo, "inspect": inspect, "convert": convert, "export": convert, "generate": generate,
            "collect": collect, "aot": aot, "attribute": attribute, "view": view}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jstd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in dict.fromkeys(COMMANDS.values()):
        module.add_arguments(sub)
    args = parser.parse_args(argv)
    return COMMANDS[args.command].command(args)


if __name__ == "__main__":
    sys.exit(main())
