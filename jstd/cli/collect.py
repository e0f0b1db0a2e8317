"""``jstd collect PATH --sites ... --texts FILE | --dataset DIR --out DIR``: sites over a corpus, to disk."""

from __future__ import annotations

import sys
from pathlib import Path

from jstd.collect.driver import SHARD_BYTES, collect
from jstd.core.sites import SiteError


def add_arguments(subparsers):
    p = subparsers.add_parser("collect", help="collect sites over a corpus to disk (safetensors shards + index.json)")
    p.add_argument("path", help="a checkpoint folder or repo id")
    p.add_argument("--sites", nargs="+", required=True, metavar="SITE",
                   help="sites with a token axis, e.g. layers.layer_output layers.3.mlp.mlp_neurons")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--texts", metavar="FILE", help="a text file, one document per line")
    src.add_argument("--dataset", metavar="DIR", help="a datasets.Dataset saved with save_to_disk (needs datasets)")
    p.add_argument("--column", default="text", help="the dataset's text column (default: text)")
    p.add_argument("--split", default=None, help="the split of a saved DatasetDict (train, test…)")
    p.add_argument("--out", required=True, metavar="DIR", help="the output folder (new, empty, or one to resume)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=256, help="documents are cut to their first N tokens")
    p.add_argument("--positions", choices=("all", "last"), default="all")
    p.add_argument("--dtype", default=None, help="dtype written (float32, bfloat16, float16; default: the model's)")
    p.add_argument("--shard-mb", type=float, default=SHARD_BYTES / 2**20, help="shard size in MiB (default 256)")
    return p


def command(args) -> int:
    if args.texts is not None:
        texts_path = Path(args.texts)
        if not texts_path.is_file():
            print(f"jstd collect: no such file: {texts_path}", file=sys.stderr)
            return 1
        handle = open(texts_path, encoding="utf-8")
        data = (line.rstrip("\n") for line in handle)
    else:
        try:
            from datasets import load_from_disk
        except ImportError:
            print("jstd collect: --dataset needs the datasets package (pip install datasets); or write the texts "
                  "one per line and pass --texts FILE", file=sys.stderr)
            return 1
        handle, data = None, load_from_disk(args.dataset)
        if args.split is not None:
            data = data[args.split]
    try:
        ds = collect(args.path, data, args.sites, args.out, column=args.column, batch_size=args.batch_size,
                     max_length=args.max_length, positions=args.positions, dtype=args.dtype,
                     shard_bytes=int(args.shard_mb * 2**20))
    except (OSError, ValueError, TypeError, SiteError) as e:
        print(f"jstd collect: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    finally:
        if handle is not None:
            handle.close()
    print(ds)
    return 0
