"""A checkpoint (HuggingFace or converted by jstd) -> a HuggingFace folder transformers loads (the same as
`jstd export MODEL DST`).

    python scripts/convert/jstd_to_hf.py MODEL DST [--dtype float32] [--force] [--quiet]

To export an edited model (a head ablated in o_proj, steering folded into a bias, ...), edit it in Python and call
`jstd.export(model, DST, files_from=MODEL)`: see jstd/io/export.py.
"""

import sys

from jstd.cli import main

if __name__ == "__main__":
    sys.exit(main(["export", *sys.argv[1:]]))
