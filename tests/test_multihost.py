"""The multi-host path with real processes: 2 processes x 4 CPU devices on 127.0.0.1, collectives over gloo.

Each check starts its processes with tests/multihost.py (a free loopback port, a deadline, every child killed on a
failure and the failed one's output shown). tests/multihost_check.py is the program the processes run; its
``programs`` run here too, on this process's one device, for the values to compare with.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

import multihost
from reference.cases import Case

HERE = Path(__file__).parent
# every family loads under every layout (what each process reads and holds, checked in all 12); the four programs
# (a compile each, and a trace in both processes) run once a family, spread so that every layout runs each of them
# on some family and every family runs something under every layout: every (family, program) and every (layout,
# program) pair, 16 programs in all
CASES = {
    "llama-gqa": {"FSDP": ("run", "patch_sweep"), "TP": ("grad",), "FSDP_TP": ("generate",)},
    "olmo_hybrid-rotary_grouped": {"FSDP": ("grad",), "TP": ("generate",), "FSDP_TP": ("run", "patch_sweep")},
    "qwen3_moe": {"FSDP": ("generate",), "TP": ("run", "patch_sweep"), "FSDP_TP": ("grad",)},
    "llava": {"FSDP": ("run",), "TP": ("patch_sweep",), "FSDP_TP": ("grad", "generate")},
}
# OLMo-Hybrid's case with one DeltaNet slot (LA LA: a period of two scanned twice; each DeltaNet slot compiles its
# kernel in every program), at hidden size 64: DeltaNet's convolutions, decays and output norm have no embed axis and
# stay whole under FSDP, on each of a process's 4 devices (12% of the weights at the zoo's 32, 6% at 64, nothing at
# published sizes)
WIDER = {"olmo_hybrid-rotary_grouped": dict(hidden_size=64)}
PROCESSES = 2
# float32: logits, and what is computed from them (patching grids of logit differences, the differentiated
# metric), within 1e-6 of the logits' scale (max |logits|; measured: at most 9.4e-7), 3e-6 on the DeltaNet family
# (measured: 1.7e-6 under FSDP: the sharded projections sum in another order and the state recurrence carries the
# rounding along); the values read inside the model and the gradients within 1e-5 of their own scale (the suite's
# float32 bound; measured: at most 2.2e-6); token ids exactly
TOLERANCE = 1e-6
COLLECT_TOLERANCE = 3e-6  # measured 1.3e-6 of the scale (an activation's, ~36) between the two programs
DELTANET_TOLERANCE = {"olmo_hybrid-rotary_grouped": 3e-6}
READS_TOLERANCE = 1e-5


def inputs_for(case):
    if case.spec.wrapper:
        return case.spec.inputs(case.model, counts=(1,) * 8)[0]
    return np.random.default_rng(0).integers(0, case.model.config.vocab_size, (8, 7))


def built(name: str, folder):
    """The zoo's case ``name`` (``WIDER``'s sizes where given) made in ``folder`` and loaded, without a torch
    reference (the single process's values are the reference here)."""
    import families
    import jstd
    import olmo_hybrid_cases

    spec = families.CASES[name]
    config = olmo_hybrid_cases.config(name.split("-", 1)[1], **WIDER[name]) if name in WIDER else spec.config()
    folder = spec.make(config, folder, seed=spec.seed)
    return Case(name, folder, jstd.load(folder), None, spec)


def compare(got, want, name: str, scale: float | None = None, tolerance: float = TOLERANCE) -> None:
    """``got`` equals ``want`` (nested dicts and tuples of arrays): integers exactly, floats within ``tolerance``
    of ``scale`` (default: each array's own largest magnitude)."""
    if isinstance(want, dict):
        assert set(got) == set(want), (name, set(got), set(want))
        for k in want:
            compare(got[k], want[k], f"{name}.{k}", scale, tolerance)
    elif isinstance(want, (tuple, list)):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            compare(g, w, f"{name}[{i}]", scale, tolerance)
    elif np.issubdtype(np.asarray(want).dtype, np.integer):
        np.testing.assert_array_equal(got, want, err_msg=name)
    else:
        w = np.asarray(want, np.float64)
        scale = scale or (max(float(np.max(np.abs(w))), 1e-30) if w.size else 1.0)
        diff = float(np.max(np.abs(np.asarray(got, np.float64) - w))) if w.size else 0.0
        assert diff <= tolerance * scale, (f"{name}: max |multi-process - single| {diff:.3g} > {tolerance:g} x scale "
                                           f"{scale:.3g}")


def test_two_processes_equal_one(tmp_path):
    """Under FSDP, TP and FSDP_TP on 2 processes x 4 devices: each process reads only the byte ranges its shards
    need and holds only those shards (half the model under FSDP), and every program gives the single-process
    values (computed by a process of its own on one device, while the job runs)."""
    cases = []
    for name, layouts in CASES.items():
        case = built(name, tmp_path / name)
        cases.append((name, str(case.folder), inputs_for(case), layouts))
    with open(tmp_path / "cases.pkl", "wb") as f:
        pickle.dump(cases, f)
    check = [sys.executable, str(HERE / "multihost_check.py")]
    children = multihost.start(check + [str(tmp_path / "cases.pkl")], PROCESSES, 4, tmp_path)
    try:
        (want,) = multihost.launch(check + ["single", str(tmp_path / "cases.pkl")], 1, 1, timeout=600,
                                   workdir=tmp_path / "single")
    except BaseException:
        for c in children:
            c.kill()
        raise
    results = multihost.wait(children, timeout=600)
    print("".join(line for line in (tmp_path / "log-0.txt").read_text().splitlines(True) if line[:1] == " "))
    errors = []  # every mismatch, not only the first
    for name, _, _, layouts in cases:
        logits = float(np.max(np.abs(want[name]["run"]["logits"])))
        tolerance = DELTANET_TOLERANCE.get(name, TOLERANCE)
        for layout, only in layouts.items():
            for p, result in enumerate(results):
                load = result[name, layout, "load"]
                assert load["equal"], f"{name} {layout}: process {p} holds shards unequal to the model's parts"
                assert load["read"] == load["needed"], (
                    f"{name} {layout}: process {p} read other byte ranges than its shards need: "
                    f"{ {k: (load['read'].get(k), load['needed'].get(k)) for k in set(load['read']) | set(load['needed']) if load['read'].get(k) != load['needed'].get(k)} }")
                assert load["repeated"] == 0, f"{name} {layout}: process {p} read {load['repeated']} ranges twice"
                if layout == "FSDP":
                    share = load["resident"] / load["total"]
                    assert share <= 1 / PROCESSES + 0.05, f"{name} FSDP: process {p} holds {share:.1%} of the weights"
                for program in only:
                    got, expected, what = result[name, layout, program], want[name][program], f"{name} {layout} {program} (process {p})"
                    try:
                        if program == "run":
                            compare(got["logits"], expected["logits"], what + " logits", logits, tolerance)
                            compare({k: v for k, v in got.items() if k != "logits"},
                                    {k: v for k, v in expected.items() if k != "logits"}, what, None, READS_TOLERANCE)
                        elif program == "grad":
                            compare(got[0], expected[0], what + " metric", logits * 8, tolerance)  # (8 rows' sum)
                            compare(got[1], expected[1], what + " gradient", None, READS_TOLERANCE)
                        else:  # generate's tokens and logits, patch_sweep's grid of logit differences
                            compare(got, expected, what, logits, tolerance)
                    except AssertionError as e:
                        errors.append(str(e).splitlines()[0])
    assert not errors, "\n".join(errors)


INDUCTION = Path(__file__).parents[1] / "jstd" / "assets" / "induction-llama"


def test_collect_across_processes_resumes_after_a_kill(tmp_path):
    """jstd.collect with the model across 2 processes, process 1 SIGKILLed mid-run (after its second shard), then
    the job rerun: each process collects its share of the corpus into its part, resumed where it stopped, and the
    folder reads as one dataset equal row for row to one process's collection (no row lost or repeated)."""
    import jstd
    from multihost_check import COLLECT, COLLECT_SITES, KILL_AFTER, corpus

    argv = [sys.executable, str(HERE / "multihost_check.py"), "collect", str(INDUCTION)]
    out = tmp_path / "collected"
    cache = tmp_path / "cache"  # (the rerun reads the programs the killed run compiled)
    children = multihost.start(argv + [str(out)], PROCESSES, 4, tmp_path / "run-killed", env={KILL_AFTER: "2"},
                               cache=cache)
    try:  # one process's collection, while the processes run
        model, tok = jstd.load(INDUCTION), jstd.load_processor(INDUCTION)
        want = jstd.collect(model, corpus(tok), COLLECT_SITES, tmp_path / "single", processor=tok, **COLLECT)
    except BaseException:
        for c in children:
            c.kill()
        raise
    with pytest.raises(AssertionError, match="process 1 of 2 exited with -9"):  # SIGKILL: the harness kills 0 too
        multihost.wait(children, timeout=300)
    parts = [jstd.ActivationDataset(out / f"part-0000{p}-of-00002", partial=True) for p in range(PROCESSES)]
    assert not parts[1].index["complete"] and len(parts[1].index["shards"]) >= 2, parts[1].index["shards"]
    assert not (out / "index.json").exists()
    multihost.launch(argv + [str(out)], PROCESSES, 4, timeout=300, workdir=tmp_path / "run-rerun", cache=cache)
    got = jstd.ActivationDataset(out)
    assert_same_rows(got, want)  # no row lost or repeated, every value the single process's
    assert [s["file"].split("/")[0] for s in got.index["shards"]] == sorted(s["file"].split("/")[0]
                                                                            for s in got.index["shards"])


def assert_same_rows(got, want) -> None:
    assert len(got) == len(want) and got.index["complete"]
    for name in ("document", "position", "token"):
        np.testing.assert_array_equal(getattr(got.rows, name), getattr(want.rows, name), err_msg=name)
    for site in want.sites:
        # (the single collection is this process's program, the parts two processes': a few roundings apart)
        compare(got.read(site), want.read(site), f"collect {site}", tolerance=COLLECT_TOLERANCE)


def test_script_on_two_processes(tmp_path):
    """scripts/multihost.py as documented for GPU hosts (--distributed --coordinator --processes --process-id), on
    2 processes x 4 devices under FSDP_TP: process 0's logit differences and patching grid are one process's."""
    import jax
    import jstd

    saved = tmp_path / "results.npz"
    script = HERE.parent / "scripts" / "multihost.py"
    multihost.launch([sys.executable, str(script), str(INDUCTION), "--layout", "FSDP_TP", "--model-axis", "2",
                      "--distributed", "--coordinator", "{coordinator}", "--processes", "{processes}",
                      "--process-id", "{process_id}", "--timeout", "60", "--save", str(saved)],
                     PROCESSES, 4, timeout=300, workdir=tmp_path)
    got = np.load(saved)
    model = jstd.load(INDUCTION)
    rows = 4  # the script's prompts: one a row of the data axis (8 devices / model axis 2)
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (rows, 16))
    logits = jax.jit(jstd.run)(model, tokens).logits
    scale = float(np.max(np.abs(logits)))  # (differences of logits: within 1e-6 of the logits' scale)
    compare(got["difference"], np.asarray(logits[:, -1, 1] - logits[:, -1, 2]), "script logit difference", scale)
    grid = jstd.patch_sweep(model, tokens[:1], tokens[1:2], "layers.layer_output", jstd.logit_difference(1, 2),
                            progress=False)
    compare(got["grid"], np.asarray(grid), "script patching grid", scale)


def test_unreachable_coordinator_is_a_clear_error_in_time():
    """A process that cannot reach the coordinator raises ConnectionError naming it within the timeout, before
    jax.distributed is touched (JAX alone aborts the process with a gRPC deadline, or waits)."""
    import time

    import jstd

    port = multihost.free_port()  # nobody listens there
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"could not reach the coordinator at 127.0.0.1:{port} within 2 s"):
        jstd.sharding.initialize(f"127.0.0.1:{port}", 2, 1, timeout=2)
    assert time.monotonic() - start < 10
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        jstd.sharding.initialize("127.0.0.1", 2, 1, timeout=1)


def test_a_part_reads_only_its_byte_ranges(tmp_path):
    """fill_part (what jstd.load reads for one device's part on a mesh): for every transform kind the name maps use
    (a transpose, heads split out or in, a fused tensor's rows, parts stored as two tensors), each part equals the
    transformed tensor's part, and the reads cover exactly the bytes that part needs, each once."""
    import ml_dtypes

    from jstd.io import safetensors
    from jstd.io.buffers import Scratch, fill_part
    from jstd.nn.namemap import Entry, linear, split_in, split_out

    rng = np.random.default_rng(0)
    tensors = {"w": rng.normal(size=(12, 16)).astype(np.float32), "a": rng.normal(size=(4, 16)).astype(np.float32),
               "b": rng.normal(size=(8, 16)).astype(np.float32),
               "h": rng.normal(size=(12, 16)).astype(ml_dtypes.bfloat16)}
    with open(tmp_path / "model.safetensors", "wb") as f:
        safetensors.write_tensors(f, tensors)
    files = safetensors.SafetensorsFiles(tmp_path)
    whole = np.concatenate([tensors["a"], tensors["b"]])
    cases = [(Entry("w", "w", linear), ["w"], tensors["w"]), (Entry("w", "w", split_out(4)), ["w"], tensors["w"]),
             (Entry("w", "w", split_in(4)), ["w"], tensors["w"]), (Entry("w", "w", lambda w: w[4:10]), ["w"], tensors["w"]),
             (Entry(("a", "b"), "ab", linear), ["a", "b"], whole), (Entry("h", "h", linear), ["h"], tensors["h"]),
             (Entry("w", "w", lambda w: w * 2), ["w"], tensors["w"])]  # a computed transform: read whole
    log = []
    original = safetensors.SafetensorsFiles.read_range

    def recording(self, key, start, out, fh=None):
        log.append((key, start, start + out.nbytes))
        return original(self, key, start, out, fh)

    for entry, keys, stored in cases:
        want = entry.transform(stored)
        for index in [(slice(0, want.shape[0] // 2),), (slice(None), slice(1, 3)), (slice(2, 3),) * want.ndim]:
            out = np.empty(want[index].shape, np.float32)
            log.clear()
            safetensors.SafetensorsFiles.read_range = recording
            try:
                fill_part(files, entry, keys, want.shape, index, out, Scratch())
            finally:
                safetensors.SafetensorsFiles.read_range = original
            np.testing.assert_array_equal(out, want[index].astype(np.float32))
            ids = entry.transform(np.arange(stored.size).reshape(stored.shape))
            computed = not np.shares_memory(entry.transform(stored), stored)
            need = np.zeros(stored.size, bool)
            if not computed:
                need[np.asarray(ids[index]).ravel()] = True
            got = np.zeros(stored.size, int)
            item, first = stored.dtype.itemsize, {k: sum(tensors[j].size for j in keys[:keys.index(k)]) for k in keys}
            for key, a, b in log:
                got[first[key] + a // item:first[key] + b // item] += 1
            expected = np.ones(stored.size, int) if computed else need.astype(int)
            np.testing.assert_array_equal(got, expected, err_msg=f"{entry.path} {index}: bytes read")
