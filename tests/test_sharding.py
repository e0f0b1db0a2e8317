"""Sharding (jstd.sharding, jstd.load(mesh=)): every layout on 8 simulated CPU devices gives the single-device values.

The suite's process has one device (conftest), so the 8-device checks run in one subprocess
(tests/sharded_check.py) on the zoo's checkpoints; the rest runs here.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jstd

# every rule list on Llama; the 2-D layout (FSDP_TP: every rule of FSDP and TP at once, DeltaNet heads included)
# on OLMo-Hybrid, the other text families and a wrapper (its tower shares the text model's logical names). Each
# layout costs a compile of its own on 8 devices (seconds on the suite's 2 cores), so the others run on Llama only.
LAYOUTS = {
    "llama-gqa": ("DP", "FSDP", "TP", "FSDP_TP"),
    "olmo_hybrid-rotary_grouped": ("FSDP_TP",),
    "hyperclovax-residual": ("FSDP_TP",),
    "qwen3_5_text-released": ("FSDP_TP",),
    "qwen3-0.6b": ("FSDP_TP",),  # per-head q/k norms: weights on the head_dim axis
    "gpt_neox-parallel": ("FSDP_TP",),  # parallel residual blocks, LayerNorm biases, the fused q|k|v split
    "gpt2-small": ("FSDP_TP",),  # learned positions (their own logical axis, not split)
    "bloom-560m": ("FSDP_TP",),  # ALiBi: each head's slope with its head over the model axis
    "gemma2-softcap": ("FSDP_TP",),  # sliding / full blocks alternating, soft-capped scores and logits, post-norms
    "llava": ("FSDP_TP",),
    "gemma3": ("FSDP_TP",),  # the pooling projector, bidirectional image blocks in a sharded batch
    "mixtral": ("EP",),  # experts over the model axis (4 experts on 4 devices)
}
# XLA's CPU backend at its lowest optimization level: compiles about twice as fast; both sides of every comparison
# run in that process
FLAGS = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false"


def test_every_layout_on_8_devices_equals_one_device(zoo, tmp_path):
    cases = []
    for name, layouts in LAYOUTS.items():
        case = zoo(name)
        if case.spec.wrapper:  # a row of one image each: 8 rows
            inputs = case.spec.inputs(case.model, counts=(1,) * 8)[0]
        else:
            inputs = np.random.default_rng(0).integers(0, case.model.config.vocab_size, (8, 7))
        cases.append((name, str(case.folder), inputs, layouts))
    with open(tmp_path / "cases.pkl", "wb") as f:
        pickle.dump(cases, f)
    env = {**os.environ, "XLA_FLAGS": FLAGS, "JAX_PLATFORMS": "cpu"}
    script = Path(__file__).with_name("sharded_check.py")
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "cases.pkl")], env=env, capture_output=True,
                          text=True, timeout=900)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "all sharded checks passed" in done.stdout


def test_rules_and_placement_on_one_device(zoo):
    """The rule lists are flax rule lists over "data" and "model"; on one device every layout places the model
    where jstd.shard does, with the same values; rules without a mesh and malformed rules raise."""
    case = zoo("llama-gqa")
    mesh = jstd.sharding.mesh()
    assert mesh.axis_names == ("data", "model")
    for layout, rules in jstd.sharding.LAYOUTS.items():
        assert getattr(jstd.sharding, layout) is rules
        assert {axis for _, axis in rules} <= {"data", "model"}
        assert ("batch", "data") in rules
    loaded = jstd.load(case.folder, mesh=mesh, rules=jstd.sharding.FSDP_TP)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(case.model)):
        np.testing.assert_array_equal(got, want)
    assert jax.tree.map(lambda a: a.sharding, loaded) == jax.tree.map(
        lambda a: a.sharding, jstd.shard(case.model, mesh, jstd.sharding.FSDP_TP))
    with pytest.raises(ValueError, match="pass mesh= too"):
        jstd.load(case.folder, rules=jstd.sharding.FSDP)
    with pytest.raises(TypeError, match="rule list"):
        jstd.shard(case.model, mesh, "FSDP")
    with pytest.raises(ValueError, match="needs 3 devices"):
        jstd.sharding.mesh(3, 1)
