"""The programs tests/test_multihost.py runs in each of 2 processes x 4 CPU devices, and on one device to compare.

    python multihost_check.py CASES.pkl       # as a child of tests/multihost.launch (2 processes)

CASES.pkl holds ``[(case, folder, inputs, layouts)]``. For each case and layout
every process loads the checkpoint straight onto the 2-process mesh
(``jstd.load(folder, mesh=, rules=)``) with the safetensors reader recording
every byte range it reads, then runs ``programs`` (a run with reads and
edits, a patch sweep spread over ``data``, a gradient through an edit,
generation under a steering edit) and gathers each result whole
(``process_allgather``). Each process hands back its results, and for each
layout what it read and what it holds: the byte ranges read per tensor, the
byte ranges its devices' shards need (worked out from the shardings
independently of the loader), its resident weight bytes, and whether every
shard it holds equals the single-device model's part.

``programs`` is also what the parent runs on one device: the same functions
on both sides of every comparison.
"""

from __future__ import annotations

import os
import pickle
import sys
import time

import numpy as np



def mesh_shape(layout: str) -> tuple[int, int]:
    """(data, model) of ``layout``'s mesh over every device of every process: FSDP's one axis over them all; TP's
    and FSDP_TP's model axis over each process's devices, data across the processes."""
    import jax

    devices, processes = len(jax.devices()), jax.process_count()
    return (devices, 1) if layout == "FSDP" else (processes, devices // processes)

STEER = "layers.layer_output"
start = time.time()


def say(line: str) -> None:
    print(f"{time.time() - start:6.1f}s (cpu {time.process_time():6.1f}s) {line}", flush=True)


def reads_for(model) -> tuple[str, ...]:
    """The values read besides the logits, where the model has them (each read forces its computation)."""
    wanted = ("layers.layer_output", "layers.linear_attn.states", "vision.layers.layer_output")
    return tuple(s for s in wanted if s in model.sites)


def tokens_of(inputs):
    import jstd

    return inputs.tokens if isinstance(inputs, jstd.Inputs) else inputs


def rows(inputs, r: int):
    """Row ``r`` of a token array or of a ``jstd.Inputs`` whose rows hold one image each."""
    import jstd

    if not isinstance(inputs, jstd.Inputs):
        return inputs[r:r + 1]
    cut = lambda x: None if x is None else x[r:r + 1]
    images = None if inputs.images is None else {k: cut(v) for k, v in inputs.images.items()}
    return jstd.Inputs(cut(inputs.tokens), cut(inputs.attention_mask), images, inputs.layout)


def programs(model, inputs, mesh=None, rules=None, only=None) -> dict[str, object]:
    """Every program's result as host arrays: ``run`` (logits and reads, under an ablation and a steering edit),
    ``patch_sweep`` (entries spread over the mesh's ``data`` axis), ``grad`` (of a logit difference through the
    steering edit's vector) and ``generate`` (3 greedy tokens under the steering edit). ``mesh`` None: on one
    device.

    Traced inside ``trusted()``: the inputs are known good, so the compiled programs carry no runtime check (a host
    callback), which would keep them from being compiled once a job and handed to the other process
    (``multihost.share_compiles``); the values are the same either way."""
    import jax
    import jax.numpy as jnp

    import jstd
    from jstd.core.checks import trusted

    def host(tree):
        """``tree``'s arrays as numpy: those across processes gathered whole by one program for the tree (a
        ``process_allgather`` a leaf compiles a program a shape)."""
        spread = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and not x.is_fully_addressable]
        if spread:
            whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            gathered = iter(jax.jit(lambda xs: xs, out_shardings=whole)(spread))
            tree = jax.tree.map(lambda x: next(gathered) if isinstance(x, jax.Array) and not x.is_fully_addressable
                                else x, tree)
        return jax.tree.map(lambda x: np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x), tree)

    placed = inputs if mesh is None else jstd.sharding.shard_inputs(inputs, mesh, rules)
    hidden = model.config.hidden_size
    steer = jnp.asarray(np.random.default_rng(1).normal(size=hidden).astype(np.float32))
    edits = [jstd.Add(STEER, steer, layer=1),
             jstd.zero_ablation("layers.mlp.mlp_output", layer=0, positions=[2])]
    reads = reads_for(model)
    tokens = np.asarray(tokens_of(inputs))
    a, b = int(tokens[0, 1]), int(tokens[0, 2])
    out = {}
    with trusted():
        if only is None or "run" in only:
            got = jax.jit(jstd.run, static_argnames="reads")(model, placed, edits, reads=reads)
            out["run"] = host({"logits": got.logits, **{s: got[s] for s in reads}})
        if only is None or "patch_sweep" in only:
            clean, corrupt = rows(inputs, 0), rows(inputs, 1)
            out["patch_sweep"] = host(jstd.patch_sweep(model, clean, corrupt, "layers.layer_output",
                                                       jstd.logit_difference(a, b), mesh=mesh, progress=False))
        if only is None or "grad" in only:
            def metric(vector, model, placed):  # (arrays across processes are arguments: jit refuses to close over them)
                logits = jstd.run(model, placed, [jstd.Add(STEER, vector, layer=1)]).logits
                return jnp.sum(logits[:, -1, a] - logits[:, -1, b])
            out["grad"] = host(jax.jit(jax.value_and_grad(metric))(steer, model, placed))
        if only is None or "generate" in only:
            gen = jstd.generate(model, placed, [jstd.Add(STEER, steer, layer=1)], max_new_tokens=3)
            out["generate"] = host({"tokens": gen.tokens, "logits": gen.logits})
    return out


def needed_ranges(files, entry, sharding, shape) -> dict[str, set]:
    """The byte ranges of each stored tensor that this process's devices' parts of parameter ``entry`` need,
    worked out by pushing element indices through the entry's transform (independent of the loader's reads):
    ``{key: {(start, stop) bytes within the tensor}}``, runs merged."""
    needed: dict[str, set] = {}
    blocks = entry.blocks if entry.stacked else [None]
    indices = {tuple((s.start, s.stop, s.step) for s in idx)
               for idx in sharding.addressable_devices_indices_map(shape).values()}
    for row, i in enumerate(blocks):
        keys = [k.format(i=i) for k in entry.keys] if i is not None else list(entry.keys)
        shapes = [files.shape(k) for k in keys]
        stored = shapes[0] if len(keys) == 1 else (sum(s[0] for s in shapes), *shapes[0][1:])
        ids = entry.transform(np.arange(int(np.prod(stored))).reshape(stored))
        used = np.zeros(int(np.prod(stored)), bool)
        for idx in indices:
            idx = tuple(slice(*s) for s in idx)
            if i is not None:
                if not (idx[0].start or 0) <= row < (shape[0] if idx[0].stop is None else idx[0].stop):
                    continue
                idx = idx[1:]
            used[np.asarray(ids[idx]).ravel()] = True
        first = 0
        for k, s in zip(keys, shapes):
            n = int(np.prod(s))
            item = files.dtype(k).itemsize
            mask = used[first:first + n]
            first += n
            edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
            needed.setdefault(k, set()).update((int(a) * item, int(b) * item) for a, b in zip(edges[::2], edges[1::2]))
    return needed


def merged(ranges) -> set:
    out, last = [], None
    for a, b in sorted(ranges):
        if last is not None and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
        last = b
    return set(out)


def load_report(folder: str, mesh, rules) -> tuple[object, dict]:
    """The model loaded onto ``mesh`` and what this process read and holds."""
    import jax

    import jstd
    from jstd.io import safetensors
    from jstd.io.hf import plan
    from jstd.nn.namemap import at_path

    whole = jstd.load(folder)  # on this process's first device alone: the values every part must equal
    log: dict[str, list] = {}
    original = safetensors.SafetensorsFiles.read_range

    def recording(self, key, start, out, fh=None):
        log.setdefault(key, []).append((start, start + out.nbytes))
        return original(self, key, start, out, fh)

    safetensors.SafetensorsFiles.read_range = recording
    try:
        model = jstd.load(folder, mesh=mesh, rules=rules)
    finally:
        safetensors.SafetensorsFiles.read_range = original
    _, _, _, files, skeleton, entries = plan(jstd.io.hub.resolve(folder), None)
    tree = jstd.sharding.shardings(skeleton, mesh, rules)
    needed: dict[str, set] = {}
    for e in entries:
        leaf = at_path(skeleton, e.path)
        for k, r in needed_ranges(files, e, at_path(tree, e.path), tuple(leaf.shape)).items():
            needed.setdefault(k, set()).update(r)
    read = {k: merged(v) for k, v in log.items()}
    overlaps = {k: len(v) - len(set(v)) for k, v in log.items()}  # a byte range read twice
    needed = {k: merged(v) for k, v in needed.items() if v}
    resident = sum(s.data.nbytes for leaf in jax.tree.leaves(model) for s in leaf.addressable_shards)
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(whole))
    equal = all(np.array_equal(np.asarray(s.data), np.asarray(w)[s.index])
                for leaf, w in zip(jax.tree.leaves(model), jax.tree.leaves(whole)) for s in leaf.addressable_shards)
    stored = {k: int(np.prod(files.shape(k))) * files.dtype(k).itemsize for k in files.keys()}
    return model, dict(read=read, needed=needed, repeated=sum(overlaps.values()), resident=resident, total=total,
                       equal=equal, stored=stored, devices=len(jax.local_devices()))


COLLECT_SITES = ("layers.layer_output", "layers.1.mlp.mlp_neurons")
COLLECT = dict(batch_size=4, max_length=24, lengths=(12, 24), shard_bytes=30_000, progress=False)
KILL_AFTER = "JSTD_TEST_KILL_AFTER_SHARDS"  # process 1 SIGKILLs itself once its part lists this many shards


def corpus(tok, documents: int = 30) -> list[str]:
    """Texts of varied lengths (an empty one, some cut to ``max_length``)."""
    rng = np.random.default_rng(0)
    words = [tok.decode([i]) for i in range(10, 200)]
    return [" ".join(rng.choice(words, int(n))) for n in rng.integers(0, 30, documents)]


def kept(tokens, mask):
    """Every real position (collect's positions function): process 1 SIGKILLs itself here mid-run when told to."""
    import signal

    import jax

    after = int(os.environ.get(KILL_AFTER, "0"))
    if after and jax.process_index() == 1:
        import glob
        import json

        for index in glob.glob(os.path.join(os.environ["JSTD_TEST_OUT"], "part-00001-*", "index.json")):
            with open(index) as f:
                if len(json.load(f)["shards"]) >= after:
                    os.kill(os.getpid(), signal.SIGKILL)
    return mask.astype(bool)


def collect_main(folder: str, out: str) -> None:
    """Both processes collect ``corpus`` on the model loaded across them (FSDP) into ``out``."""
    import multihost

    multihost.join()
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    import jstd

    mesh = jstd.sharding.mesh(*mesh_shape("FSDP"))
    model = jstd.load(folder, mesh=mesh, rules=jstd.sharding.FSDP)
    tok = jstd.load_processor(folder)
    os.environ["JSTD_TEST_OUT"] = out
    ds = jstd.collect(model, corpus(tok), COLLECT_SITES, out, processor=tok, positions=kept, **COLLECT)
    multihost.finish(len(ds))
    say("collected")


def main(path: str) -> None:
    import multihost

    multihost.join()
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    import jstd

    assert jax.process_count() == 2 and len(jax.devices()) == 2 * len(jax.local_devices()), jax.devices()
    with open(path, "rb") as f:
        cases = pickle.load(f)
    results = {}
    for case, folder, inputs, layouts in cases:
        for layout, only in layouts.items():
            mesh = jstd.sharding.mesh(*mesh_shape(layout))
            rules = jstd.sharding.LAYOUTS[layout]
            model, report = load_report(folder, mesh, rules)
            results[case, layout, "load"] = report
            say(f"{case} {layout}: loaded; read {sum(b - a for r in report['read'].values() for a, b in r)} of "
                f"{sum(report['stored'].values())} bytes, holds {report['resident']} of {report['total']}")
            for program, value in programs(model, inputs, mesh, rules, only).items():
                results[case, layout, program] = value
                say(f"{case} {layout}: {program} done")
            jax.clear_caches()
    multihost.finish(results)
    say("done")


def single_main(path: str) -> None:
    """The single-process values: every program each case runs under some layout, on this process's one device
    (a process of its own, compiling with the job's XLA flags, while the job runs)."""
    import multihost

    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    import jstd

    with open(path, "rb") as f:
        cases = pickle.load(f)
    want = {}
    for case, folder, inputs, layouts in cases:
        needed = tuple(sorted({p for only in layouts.values() for p in only} | {"run"}))
        want[case] = programs(jstd.load(folder), inputs, only=needed)
        say(f"{case}: single-process values")
        jax.clear_caches()
    multihost.finish(want)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    if sys.argv[1] == "collect":
        collect_main(*sys.argv[2:])
    elif sys.argv[1] == "single":
        single_main(sys.argv[2])
    else:
        main(sys.argv[1])
