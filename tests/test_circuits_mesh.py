"""Attribution graphs on a mesh (jstd.circuits.sharding): the graph on 8 simulated CPU devices, under FSDP, TP and
FSDP_TP, equals the graph on one device, for a tiny Llama with a cross-layer transcoder (with skip; and under FSDP_TP with a
per-layer JumpReLU set). The suite's process has one device (conftest), so the 8-device checks run in one
subprocess (tests/circuits_mesh_check.py); the placement rules are checked here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec

import jstd
from jstd.circuits import load_transcoders

DATA = Path(__file__).parent / "data" / "circuit_tracer"
# the CLT under every layout; a per-layer set under the 2-D one (each layout is a compile of its own)
CASES = {"llama_clt_relu_skip": "FSDP,TP,FSDP_TP", "llama_plt_jumprelu_skip": "FSDP_TP"}
FLAGS = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false"


def test_graph_on_8_devices_equals_one_device():
    env = {**os.environ, "XLA_FLAGS": FLAGS, "JAX_PLATFORMS": "cpu"}
    script = Path(__file__).with_name("circuits_mesh_check.py")
    done = subprocess.run([sys.executable, str(script), *(f"{DATA / c}:{layouts}" for c, layouts in CASES.items())], env=env,
                          capture_output=True, text=True, timeout=900)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "all circuit mesh checks passed" in done.stdout


def test_transcoders_carry_logical_axes():
    """Features are ``mlp`` (split as the MLP's hidden units), widths ``embed``, a CLT's decoder from block l
    ``(mlp, layers, embed)``; the skip's output width has a name of its own (a name once per array)."""
    clt = jstd.logical_axes(load_transcoders(DATA / "llama_clt_relu_skip" / "transcoders"))
    assert clt.W_enc == PartitionSpec("layers", "mlp", "embed")
    assert all(d == PartitionSpec("mlp", "layers", "embed") for d in clt.W_dec) and len(clt.W_dec) == 3
    assert clt.W_skip == PartitionSpec("layers", "embed", "embed_out") and clt.threshold is None
    plt = jstd.logical_axes(load_transcoders(DATA / "llama_plt_jumprelu_skip" / "transcoders"))
    assert plt.W_dec == PartitionSpec("layers", "mlp", "embed") and plt.threshold == PartitionSpec("layers", "mlp")
    assert len(jax.tree.leaves(plt)) == 6


def test_layouts_are_checked():
    """An unknown layout, or a layout without a mesh, is refused before anything runs."""
    model = jstd.load(DATA / "llama_clt_relu_skip" / "model")
    tc = load_transcoders(DATA / "llama_clt_relu_skip" / "transcoders")
    with pytest.raises(ValueError, match="unknown layout 'FSPD'; pass one of DP, FSDP, TP, FSDP_TP"):
        jstd.attribute(model, [3, 4, 5], tc, mesh=jstd.sharding.mesh(), layout="FSPD")
    with pytest.raises(ValueError, match="layout= places the model and transcoders on a mesh: pass mesh= too"):
        jstd.attribute(model, [3, 4, 5], tc, layout="FSDP")
