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
from conftest import assert_close
from multihost_check import programs

HERE = Path(__file__).parent
# every layout on a text family; on the hybrid (DeltaNet), MoE and vision-language families each layout runs the
# load checks and a run with reads and edits, and the other programs are spread over the layouts (each program
# costs a compile in both processes)
ALL = ("run", "patch_sweep", "grad", "generate")
CASES_ALL = {
    "llama-gqa": {"FSDP": ALL, "TP": ALL, "FSDP_TP": ALL},
    "olmo_hybrid-rotary_grouped": {"FSDP": ("run", "grad"), "TP": ("run", "generate"), "FSDP_TP": ("run", "patch_sweep")},
    "qwen3_moe": {"FSDP": ("run", "generate"), "TP": ("run", "patch_sweep"), "FSDP_TP": ("run", "grad")},
    "llava": {"FSDP": ("run", "patch_sweep"), "TP": ("run", "grad"), "FSDP_TP": ("run", "generate")},
}
CASES = {"llama-gqa": {"FSDP": ALL}}
PROCESSES = 2
# float32 values "within 1e-6 of the logits' scale": |multi - single| <= 1e-6 * max|single| (a tenth of the
# suite's usual 1e-5 relative bound); tokens exactly
TOLERANCE = 1e-6


def inputs_for(case):
    if case.spec.wrapper:
        return case.spec.inputs(case.model, counts=(1,) * 8)[0]
    return np.random.default_rng(0).integers(0, case.model.config.vocab_size, (8, 7))


def compare(got, want, name: str) -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), (name, set(got), set(want))
        for k in want:
            compare(got[k], want[k], f"{name}.{k}")
    elif isinstance(want, (tuple, list)):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            compare(g, w, f"{name}[{i}]")
    elif np.issubdtype(np.asarray(want).dtype, np.integer):
        np.testing.assert_array_equal(got, want, err_msg=name)
    else:
        w = np.asarray(want, np.float64)
        scale = max(float(np.max(np.abs(w))), 1e-30) if w.size else 1.0
        diff = float(np.max(np.abs(np.asarray(got, np.float64) - w))) if w.size else 0.0
        assert diff <= TOLERANCE * scale, f"{name}: max |multi-process - single| {diff:.3g} > 1e-6 x scale {scale:.3g}"


def test_two_processes_equal_one(zoo, tmp_path):
    """Under FSDP, TP and FSDP_TP on 2 processes x 4 devices: each process reads only the byte ranges its shards
    need and holds only those shards (half the model under FSDP), and every program gives the single-process
    values."""
    cases, made = [], {}
    for name, layouts in CASES.items():
        case = zoo(name)
        made[name] = case
        cases.append((name, str(case.folder), inputs_for(case), layouts))
    with open(tmp_path / "cases.pkl", "wb") as f:
        pickle.dump(cases, f)
    children = multihost.start([sys.executable, str(HERE / "multihost_check.py"), str(tmp_path / "cases.pkl")],
                               PROCESSES, 4, tmp_path)
    try:  # the single-process values, computed while the processes run
        want = {}
        for name, _, inputs, layouts in cases:
            needed = tuple(sorted({p for only in layouts.values() for p in only}))
            want[name] = programs(made[name].model, inputs, only=needed)
    except BaseException:
        for c in children:
            c.kill()
        raise
    results = multihost.wait(children, timeout=600)
    for name, _, _, layouts in cases:
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
                    compare(result[name, layout, program], want[name][program], f"{name} {layout} {program} "
                            f"(process {p})")
