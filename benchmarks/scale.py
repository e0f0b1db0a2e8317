"""Sharded loading on 8 simulated CPU devices: per-device parameter memory under FSDP and the host memory of the load.

The checkpoint: the random Llama of SmolLM-135M's shape that benchmarks/load.py
builds (float32, about 540 MB; ``--small`` builds a 4-block one of hidden 256
for a quick check). One fresh process per side, with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``: imports, the backend
and transformers' config parsing first, then ``jstd.load(folder, mesh=8 x 1,
rules=jstd.sharding.FSDP)`` alone.

- Per-device parameter memory: the bytes of each device's shards
  (``addressable_shards``), the largest device against 1/8 of the model.
- Host memory of the load: the simulated devices live in host memory, so the
  host's own share is the peak resident set added by the load (``VmHWM``,
  reset before it) minus what the devices hold at the end; against the
  largest tensor of the checkpoint plus 10% of the model. The unsharded load
  is measured the same way for comparison (its devices hold the whole model).

    python benchmarks/scale.py [--small]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import load as load_bench  # noqa: E402  (the checkpoint builder and memory probes of benchmarks/load.py)

SMALL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
             vocab_size=8192, tie_word_embeddings=False, max_position_embeddings=256, rms_norm_eps=1e-5, head_dim=64)

SIDE = load_bench.MEMORY + """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np
import jstd
from jstd.io.hf import hf_config
from jstd.io.safetensors import SafetensorsFiles
folder = {folder!r}
jax.devices()
hf_config(__import__("pathlib").Path(folder))  # transformers imported and the config parsed before the baseline
files = SafetensorsFiles(__import__("pathlib").Path(folder))
largest = max(int(np.prod(files.shape(k))) * files.dtype(k).itemsize for k in files.keys())
mesh = jstd.sharding.mesh(8, 1) if {sharded} else None
rules = jstd.sharding.FSDP if {sharded} else None
base = current()
reset_peak()
t = time.perf_counter()
model = jax.block_until_ready(jstd.load(folder, mesh=mesh, rules=rules))
seconds = time.perf_counter() - t
top = peak()
per_device = {{}}
for leaf in jax.tree.leaves(model):
    for shard in leaf.addressable_shards:
        per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
model_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(model))
print(json.dumps(dict(seconds=seconds, added=top - base, devices=sum(per_device.values()),
                      per_device=max(per_device.values()), model=model_bytes, largest=largest)))
"""


def side(folder: Path, sharded: bool) -> dict:
    code = SIDE.format(folder=str(folder), sharded=sharded)
    return common.run_json(code)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="a 4-block model of hidden 256 (a quick check)")
    args = parser.parse_args()
    root = Path(tempfile.gettempdir()) / "jstd-bench"
    if args.small:
        folder = root / "scale-small"
        if not (folder / "config.json").exists():
            subprocess.run([sys.executable, "-c", load_bench.BUILD.format(size=SMALL), str(folder)], check=True)
    else:
        folder = load_bench.checkpoint(root / "smollm-135m")
    load_bench.checkpoint  # the page cache warm: read the file once
    for f in folder.glob("*.safetensors"):
        f.read_bytes()
    sharded, whole = side(folder, True), side(folder, False)
    mib = lambda b: f"{b / 2**20:.1f} MiB"
    model, largest = sharded["model"], sharded["largest"]
    host = sharded["added"] - sharded["devices"]
    rows = [
        ("per-device parameters, FSDP on 8 devices", "≤ 1/8 of the model + 5%",
         f"{sharded['per_device'] / model:.4f} of the model", f"{mib(sharded['per_device'])} of {mib(model)}"),
        ("sharded load, host memory (peak added − device shards)", "≤ largest tensor + 10% of the model",
         f"{host / (largest + 0.1 * model):.2f}× of the bound",
         f"{mib(host)}; largest tensor {mib(largest)}, bound {mib(largest + 0.1 * model)}; {sharded['seconds']:.2f} s"),
        ("unsharded load, host memory (peak added − device)", "—", f"{(whole['added'] - whole['devices']) / model:.2f}× of the model",
         f"{mib(whole['added'] - whole['devices'])}; peak added {mib(whole['added'])}; {whole['seconds']:.2f} s"),
    ]
    print(f"checkpoint: {folder.name}, {mib(model)} float32\n")
    print("| figure | target | measured | detail |\n| --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
