"""``jstd convert SRC DST`` and ``jstd export MODEL DST``: the stacked jstd checkpoint and back."""

from __future__ import annotations

import sys

from jstd.io.export import export
from jstd.io.stacked import convert
from jstd.io.hub import resolve
from jstd.io.load import load


def add_arguments(subparsers) -> None:
    """The ``convert`` and ``export`` subcommands (added once, however many registry names point here)."""
    c = subparsers.add_parser("convert", help="write a HuggingFace checkpoint as a stacked jstd checkpoint (loads "
                                              "faster; jstd.load reads both)")
    c.add_argument("src", help="a HuggingFace checkpoint folder or hub repo id (never written to)")
    c.add_argument("dst", help="the new folder (written to a temporary sibling, renamed when complete)")
    c.add_argument("--dtype", default=None, help="store the parameters in this dtype (float32, bfloat16, ...; "
                                                 "default: what jstd.load would give)")
    c.add_argument("--force", action="store_true", help="replace a non-empty DST once the new one is complete")
    c.add_argument("--quiet", action="store_true", help="no progress line")
    e = subparsers.add_parser("export", help="write a checkpoint (HuggingFace or converted) back as a HuggingFace "
                                             "folder transformers loads")
    e.add_argument("model", help="a checkpoint folder or hub repo id, HuggingFace or converted")
    e.add_argument("dst", help="the new folder")
    e.add_argument("--dtype", default=None, help="load (and so write) the parameters in this dtype")
    e.add_argument("--force", action="store_true", help="replace a non-empty DST once the new one is complete")
    e.add_argument("--quiet", action="store_true", help="no progress line")


def command(args) -> int:
    """Run ``jstd convert`` or ``jstd export``; exit status 1 with a one-line message on a bad source or
    destination."""
    try:
        if args.command == "convert":
            out = convert(args.src, args.dst, dtype=args.dtype, force=args.force, progress=not args.quiet)
        else:
            folder = resolve(args.model)
            out = export(load(folder, dtype=args.dtype), args.dst, force=args.force, files_from=folder,
                         progress=not args.quiet)
    except (OSError, ValueError) as e:
        message, prefix = " ".join(str(e).split()), f"jstd {args.command}: "
        print(message if message.startswith(prefix) else prefix + message, file=sys.stderr)
        return 1
    print(out)
    return 0
