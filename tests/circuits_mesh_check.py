"""The 8-device checks of tests/test_circuits_mesh.py, run in a process of its own (8 simulated CPU devices).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python circuits_mesh_check.py CASE_DIR:LAYOUT,LAYOUT ...

For each case (a folder of tests/data/circuit_tracer: a tiny model, its transcoders, a prompt) the graph on one
device and the graph on a mesh of 8 under each layout named (``jstd.attribute(..., mesh=, layout=)``) must hold the same
active features, logit targets and every adjacency entry within 1e-5 of the matrix's largest; the transcoders must
sit where their logical axes put them (features over ``model``, widths over ``data``) and each batch of targets
be split over ``data``. Prints one line per check and exits 1 on the first failure.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

assert "--xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", ""), "run with 8 simulated devices"

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import jstd  # noqa: E402
from jstd.circuits import attribute, load_transcoders  # noqa: E402
from jstd.circuits import replacement  # noqa: E402

MESHES = {"FSDP": (8, 1), "TP": (2, 4), "FSDP_TP": (2, 4)}
start = time.time()


def say(line: str) -> None:
    print(f"{time.time() - start:6.1f}s {line}", flush=True)


def spy_on_targets():
    """Record the sharding of every batch of targets ``target_gradients`` (the batched backward) receives."""
    seen, inner = [], replacement.target_gradients

    def spy(model, tokens, tc, layers, positions, vectors, *rest, **kw):
        seen.append(getattr(vectors, "sharding", None))  # one device: host arrays (sharding.place_targets)
        return inner(model, tokens, tc, layers, positions, vectors, *rest, **kw)

    sys.modules["jstd.circuits.attribute"].target_gradients = spy  # the module (jstd.circuits.attribute: the function)
    return seen


def check(folder: Path, layouts, seen: list) -> None:
    spec = json.loads((folder / "case.json").read_text())
    model, tok = jstd.load(folder / "model"), jstd.load_processor(folder / "model")
    tc = load_transcoders(folder / "transcoders")
    batch = 32  # several batches of targets (the last one padded), one program
    want = attribute(model, spec["prompt_ids_given"], tc, tokenizer=tok, batch_size=batch)
    scale = np.abs(want.adjacency).max()
    for layout in layouts:
        data, width = MESHES[layout]
        mesh = jstd.sharding.mesh(data, width)
        seen.clear()
        got = attribute(model, spec["prompt_ids_given"], tc, tokenizer=tok, batch_size=batch, mesh=mesh,
                        layout=layout)
        np.testing.assert_array_equal(got.active_features, want.active_features)
        np.testing.assert_array_equal(got.logit_token_ids, want.logit_token_ids)
        err = np.abs(got.adjacency - want.adjacency).max() / scale
        assert err <= 1e-5, f"{folder.name} {layout}: adjacency differs by {err:.2e} of its largest entry"
        assert seen and all(s.spec[0] == "data" and s.mesh.shape["data"] == data for s in seen), seen
        placed = jstd.shard(tc, mesh, jstd.sharding.LAYOUTS[layout])
        enc = placed.W_enc.sharding.spec
        want_spec = {"FSDP": (None, None, "data"), "TP": (None, "model"), "FSDP_TP": (None, "model", "data")}[layout]
        assert tuple(enc) == want_spec, f"{layout}: W_enc split {enc}, not {want_spec}"
        dec = placed.W_dec[0] if tc.cross_layer else placed.W_dec
        say(f"ok {folder.name} {layout} on {data}x{width}: {got.n_features} features, {len(seen)} batches of "
            f"targets split over data; adjacency within {err:.1e} of the 1-device graph's largest entry; W_enc "
            f"{tuple(enc)}, W_dec {tuple(dec.sharding.spec)}")


def main(folders) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    seen = spy_on_targets()
    for arg in folders:  # FOLDER:LAYOUT,LAYOUT
        folder, layouts = arg.split(":")
        check(Path(folder), layouts.split(","), seen)
    say("all circuit mesh checks passed")


if __name__ == "__main__":
    main(sys.argv[1:])
