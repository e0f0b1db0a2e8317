"""HuggingFace checkpoint -> stacked jstd checkpoint (the same as `jstd convert SRC DST`).

    python scripts/convert/hf_to_jstd.py SRC DST [--dtype bfloat16] [--force] [--quiet]

SRC: a HuggingFace folder or hub repo id (never written to). DST: the new folder, written to a temporary sibling
and renamed when complete. `jstd.load(DST)` then reads it with no name map and no transform. See
jstd/io/stacked.py for the layout.
"""

import sys

from jstd.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
