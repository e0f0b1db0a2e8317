"""The 8-device checks of tests/test_sharding.py, run in a process of its own (8 simulated CPU devices).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python sharded_check.py CASES.pkl

CASES.pkl holds ``[(case, folder, inputs, layouts)]``. For each case the model
is loaded on one device and, for each layout, loaded straight onto a mesh
(``jstd.load(folder, mesh=, rules=)``); the sharded run on row-split inputs
must give the single-device logits and values (``READS``; 1e-5), and its
parameters must sit where ``jstd.shard`` puts them; under data parallelism the
compiled run gathers nothing (the token-range check keeps the rows split).
Then, on the first case, patch sweeps and a vmapped ablation sweep over a mesh
axis give the unsharded grids. Prints one line per check and exits 1 on
the first failure.
"""

from __future__ import annotations

import os
import pickle
import sys
import time

assert "--xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", ""), "run with 8 simulated devices"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
sys.path.insert(0, os.path.dirname(__file__))

import jstd  # noqa: E402
from conftest import assert_close  # noqa: E402

MESHES = {"DP": (8, 1), "FSDP": (8, 1), "TP": (2, 4), "FSDP_TP": (2, 4), "EP": (2, 4)}
run = jax.jit(jstd.run, static_argnames="reads")
start = time.time()


def say(line: str) -> None:
    print(f"{time.time() - start:6.1f}s {line}", flush=True)


# the values compared besides the logits, where the model has them: the stream, the explicit attention path's
# probabilities, the MLP's hidden units, DeltaNet's states, a tower's stream (each read forces its computation)
READS = ("layers.layer_output", "layers.self_attn.attention_probabilities", "layers.mlp.mlp_activation",
         "layers.linear_attn.states", "vision.layers.layer_output")


def check_layouts(case: str, folder: str, inputs, layouts) -> None:
    model = jstd.load(folder)
    reads = tuple(s for s in READS if s in model.sites)
    want = run(model, inputs, reads=reads)
    for layout in layouts:
        mesh = jstd.sharding.mesh(*MESHES[layout])
        rules = jstd.sharding.LAYOUTS[layout]
        sharded = jstd.load(folder, mesh=mesh, rules=rules)
        placed = jax.tree.map(lambda a: a.sharding, sharded)
        expected = jstd.sharding.shardings(model, mesh, rules)
        assert placed == expected, f"{case} {layout}: jstd.load placed parameters elsewhere than jstd.shard"
        assert jax.tree.map(lambda a: a.sharding, jstd.shard(model, mesh, rules)) == expected
        split = [p for p in jax.tree.leaves(placed) if any(a is not None for a in p.spec)]
        assert layout == "DP" or split, f"{case} {layout}: no parameter is split"
        check_rules_followed(case, layout, model, placed, dict(rules), dict(zip(mesh.axis_names, mesh.devices.shape)))
        rows = jstd.sharding.shard_inputs(inputs, mesh, rules)
        compiled = run.lower(sharded, rows, reads=reads).compile()
        got = compiled(sharded, rows)
        if got.logits is not None:
            assert_close(got.logits, want.logits, 1e-5, f"{case} {layout} logits")
        for site in reads:
            assert_close(got[site], want[site], 1e-5, f"{case} {layout} {site}")
        say(f"ok {case} {layout}: logits and {', '.join(reads)} equal the single device's; {len(split)} parameters split")
        if layout == "DP" and not isinstance(inputs, jstd.Inputs):
            check_rows_kept(compiled, got, sharded, inputs)


def check_rules_followed(case, layout, model, placed, rules: dict, sizes: dict) -> None:
    """Each parameter axis is split over the mesh axis its logical name's rule gives, unless that mesh axis is taken
    by an earlier axis of the same parameter or does not divide the axis' size (then it is whole)."""
    specs = jax.tree.leaves(jstd.logical_axes(model), is_leaf=lambda x: isinstance(x, PartitionSpec))
    for names, sharding, leaf in zip(specs, jax.tree.leaves(placed), jax.tree.leaves(model)):
        used, want = set(), []
        for name, dim in zip(names, leaf.shape):
            axis = rules.get(name)
            ok = axis is not None and axis not in used and dim % sizes[axis] == 0 and sizes[axis] > 1
            want.append(axis if ok else None)
            used |= {axis} if ok else set()
        got = list(sharding.spec) + [None] * (len(names) - len(sharding.spec))
        got = [None if sizes.get(a, 1) == 1 else a for a in got]
        assert got == want, f"{case} {layout}: a parameter with axes {tuple(names)} {leaf.shape} is split {got}, not {want}"


def check_rows_kept(compiled, out, model, tokens) -> None:
    """Data parallel: the token-range check (and everything else) keeps the rows split: no gather in the compiled
    run, the logits split by rows; an out-of-range id among row-split tokens still raises."""
    text = compiled.as_text()
    assert "all-gather" not in text, "the data-parallel run gathers something: " + next(
        line for line in text.splitlines() if "all-gather" in line)
    assert out.logits.sharding.spec == PartitionSpec("data"), out.logits.sharding
    mesh = out.logits.sharding.mesh
    bad = jstd.sharding.shard_inputs(np.where(np.arange(tokens.size).reshape(tokens.shape) == 13, 10**6, tokens), mesh)
    try:
        jstd.run(model, bad)
    except ValueError as error:
        assert "token ids must lie in" in str(error), error
    else:
        raise AssertionError("an out-of-range token id among row-split tokens did not raise")
    say("ok DP: no gather in the compiled run, logits split by rows, an out-of-range id raises")


def check_sweeps(folder: str, tokens) -> None:
    """A patch sweep (the resumed kind: 7 positions x 3 blocks, chunks of 5 rounded up to 8) and a vmapped
    head-ablation sweep spread over the 8 devices equal the same sweeps on one device."""
    model = jstd.load(folder)
    mesh = jstd.sharding.mesh(8, 1)
    clean, corrupt = tokens[:1], tokens[1:2]
    metric = jstd.logit_difference(int(tokens[0, 1]), int(tokens[0, 2]))
    site = "layers.layer_output"
    want = jstd.patch_sweep(model, clean, corrupt, site, metric, progress=False, chunk_size=5)
    got = jstd.patch_sweep(model, clean, corrupt, site, metric, progress=False, chunk_size=5, mesh=mesh)
    assert_close(got, want, 1e-5, f"patch_sweep {site}")
    say(f"ok patch_sweep at {site} over 8 devices: grid {tuple(want.shape)} equals the unsharded one")

    def ablated(layer, head):
        edit = jstd.zero_ablation("layers.self_attn.attention_head_outputs", layer=layer, heads=head)
        return jstd.run(model, clean, [edit]).logits[0, -1]

    layers, heads = (a.ravel() for a in np.meshgrid(np.arange(model.config.num_layers),
                                                     np.arange(model.config.num_heads), indexing="ij"))
    want = jax.jit(jax.vmap(ablated))(layers, heads)
    got = jstd.sharding.sweep(ablated, layers, heads, mesh=mesh)  # 12 entries: padded to 16, 2 a device
    assert_close(got, want, 1e-5, "vmapped ablation sweep")
    say(f"ok vmapped head-ablation sweep over 8 devices: {len(layers)} entries equal the unsharded vmap")


def main(path: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    with open(path, "rb") as f:
        cases = pickle.load(f)
    for case, folder, inputs, layouts in cases:
        check_layouts(case, folder, inputs, layouts)
    _, folder, inputs, _ = cases[0]
    check_sweeps(folder, np.asarray(inputs))
    say("all sharded checks passed")


if __name__ == "__main__":
    main(sys.argv[1])
