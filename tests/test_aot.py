"""Deviceless compiles for TPU and GPU targets (jstd.aot, the ``aot`` extra): jstd's programs compile for a v5e:2x2
slice and for H200s, fit their chips, gather no sharded weight whole under FSDP_TP; a layout that does not fit is
refused with its numbers; the Pallas gated-delta kernel compiles with Mosaic, per shard, and its GPU kernels to
sm_90a cubins that spill no register. Skipped, with the reason, where the extra is not installed (``make aot``)."""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import pytest

def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package is absent
        return False


MISSING = [name for name in ("libtpu", "jax_plugins.xla_cuda12") if not _installed(name)]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"the aot extra is not installed (no {', '.join(MISSING)}): "
                                                       "make aot, or pip install -e '.[aot]'")

# Llama-shaped, small enough to compile in seconds, with weights above the whole-gather threshold (1M elements)
SMALL = dict(model_type="llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=4096, max_position_embeddings=512, rms_norm_eps=1e-5)
SHAPE = dict(batch=4, seq=64)
# Llava-1.5's tower widths (CLIP ViT-L: 1024 wide, MLP 4096) on 112-pixel images (64 patches), a small text model
SMALL_LLAVA = dict(model_type="llava", image_token_index=4000, projector_hidden_act="gelu", vision_feature_layer=-2,
                   vision_feature_select_strategy="default",
                   vision_config=dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096,
                                      num_hidden_layers=2, num_attention_heads=16, image_size=112, patch_size=14,
                                      hidden_act="quick_gelu"),
                   text_config={**SMALL, "num_hidden_layers": 2})


@pytest.fixture(scope="module")
def aot():
    import jstd.aot

    return jstd.aot


@pytest.fixture(scope="module")
def v5e(aot):
    return aot.target("v5e:2x2")


@pytest.fixture(scope="module")
def h200(aot):
    return aot.target("8xh200")


def test_targets(aot, v5e, h200):
    assert v5e.platform == "tpu" and v5e.chips == 4 and v5e.chip_memory == 16 << 30
    assert h200.platform == "cuda" and h200.chips == 8 and h200.devices[0].device_kind == "NVIDIA H200"
    with pytest.raises(ValueError, match="unknown target 'v9z:2x2'.*v5e:16x16"):
        aot.target("v9z:2x2")


@pytest.mark.parametrize("name", ["forward", "grad", "sweep", "generate"])
def test_programs_compile_and_fit_on_v5e(aot, v5e, name):
    report = aot.check(aot.compile(SMALL, v5e, program_name=name, layout="FSDP_TP", model_axis=2, **SHAPE))
    whole = 2 * (2 * 4096 * 1024 + 2 * (4 * 1024 * 1024 + 3 * 1024 * 4096))  # the bf16 model's bytes
    assert report.fits and report.argument_bytes < whole / 3  # split over the 4 chips, not replicated
    assert report.whole_gathers == []
    assert report.flops and report.flops > 0
    assert sum(n for n, _ in report.collectives.values()) > 0


def test_forward_on_h200(aot, h200):
    report = aot.check(aot.compile(SMALL, h200, program_name="forward", layout="FSDP_TP", **SHAPE))
    assert report.mesh == {"data": 1, "model": 8} and report.fits and report.whole_gathers == []


def test_llava_on_h200_compiles_with_cublas_products_where_triton_finds_no_tiling(aot, h200):
    """XLA:GPU's Triton GEMM emitter finds no tiling for Llava's tower MLP at 8 x 577 positions (an internal error
    at its defaults); jstd.aot compiles it with cuBLAS products instead and says so, with the flag a run needs."""
    report = aot.check(aot.compile("llava-1.5-7b", h200, program_name="forward", layout="FSDP_TP", batch=8,
                                   seq=1024, blocks=2))
    assert report.xla_options == {"xla_gpu_enable_triton_gemm": False} and report.whole_gathers == []
    assert "XLA_FLAGS='--xla_gpu_enable_triton_gemm=false'" in str(report)
    assert report.row().startswith("| forward (XLA xla_gpu_enable_triton_gemm=False) | 8xh200 |")
    # a program XLA compiles at its defaults gets none
    assert aot.compile(SMALL, h200, program_name="forward", layout="FSDP_TP", **SHAPE).xla_options == {}


def test_a_layout_that_does_not_fit_is_refused(aot, v5e):
    """On chips of 24 MiB the replicated layout (DP) does not fit and FSDP_TP does: refused with the numbers."""
    small_chips = dataclasses.replace(v5e, chip_memory=24 << 20)
    dp = aot.compile(SMALL, small_chips, program_name="forward", layout="DP", model_axis=2, **SHAPE)
    with pytest.raises(aot.DoesNotFit, match=r"forward under DP on v5e:2x2 .* needs \d+\.\d+ GiB per chip "
                                             r"\(arguments .*a chip holds 0\.02 GiB"):
        aot.check(dp)
    assert aot.check(aot.compile(SMALL, small_chips, program_name="forward", layout="FSDP_TP", model_axis=2,
                                 **SHAPE)).fits


def test_a_program_the_compiler_refuses_is_does_not_fit(aot, v5e):
    """Far over a chip (the TPU compiler's own RESOURCE_EXHAUSTED): DoesNotFit naming the program, not a crash."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jstd.aot.report import compile_report

    replicated = NamedSharding(Mesh(v5e.devices, ("x",)), PartitionSpec())
    big = jax.ShapeDtypeStruct((1 << 31,), jnp.float32, sharding=replicated)  # 8 GiB on every chip, 3 more out
    with pytest.raises(aot.DoesNotFit, match=r"huge under DP on v5e:2x2 .*the compiler refused it.*shard more"):
        compile_report(lambda a: (a * 2, a * 3, a * 4), (big,), v5e, program="huge", layout="DP")


def test_whole_weight_gathers_are_found(aot, v5e):
    """The check's own control: a program that replicates a sharded weight is reported, by path and shape."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jstd.aot.report import compile_report
    from jstd.sharding import FSDP_TP, mesh

    m = mesh(2, 2, devices=v5e.devices)
    model = aot.abstract_model(aot.config(SMALL), m, FSDP_TP)
    whole = lambda model: jax.lax.with_sharding_constraint(model.embed, NamedSharding(m, PartitionSpec())) * 2
    report, _ = compile_report(whole, (model,), v5e, mesh=m)
    assert report.whole_gathers == ["embed [4096, 1024]"]


def test_llava_tower_is_tensor_parallel(aot, v5e):
    """A wrapper's tower and projector under FSDP_TP on v5e-256 (64 x 4, one row per data shard, 2 tower blocks and
    2 text): no weight gathered whole. The projector's weights once carried only FSDP's axis; on a 2 x 2 mesh XLA
    then moved activations instead, on 64 x 4 it gathered them whole."""
    report = aot.check(aot.compile(SMALL_LLAVA, aot.target("v5e:16x16"), program_name="forward", layout="FSDP_TP",
                                   model_axis=4, batch=64, seq=80))
    assert report.whole_gathers == []
    # the check's control on the same model: FSDP alone gathers each block's weights whole, by design
    fsdp = aot.compile(SMALL_LLAVA, v5e, program_name="forward", layout="FSDP", model_axis=2, batch=2, seq=80)
    assert any(g.startswith("vision.layers.") for g in fsdp.whole_gathers), fsdp.whole_gathers


@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
def test_pallas_kernel_compiles_with_mosaic_per_shard(aot, topology):
    """The gated-delta kernel on a 2 x 2 mesh of each TPU generation jstd targets: rows and heads split by its
    shard_map, Mosaic compiles it."""
    from jstd.aot.kernels import mosaic
    from jstd.aot.targets import target

    report, compiled = mosaic(target(topology), batch=2, seq=128, qk_heads=2, heads=4)
    assert "tpu_custom_call" in compiled.as_text() and report.fits


@pytest.mark.skipif(not _installed("triton"), reason="no triton wheel (the aot extra installs it)")
def test_pallas_kernels_compile_for_sm90a_without_spills():
    """Each kernel the gated-delta forward launches on GPUs (the split layout: UT transform, state loop, outputs),
    bfloat16 inputs, key and value heads of 128, chunks of 32, compiles with Triton to an sm_90a cubin in which
    ptxas spills no register (no stores, no loads, no stack frame)."""
    from jstd.aot.kernels import triton_cubins

    cubins = triton_cubins(seq=64, heads=1)
    assert sorted(cubins) == ["gated_delta_out", "gated_delta_state", "gated_delta_ut"]
    for name, report in cubins.items():
        assert (report["spill_stores"], report["spill_loads"], report["stack"]) == (0, 0, 0), (name, report)
        assert 0 < report["registers"] <= 255, (name, report)


def test_float32_products_on_tpu_need_the_highest_precision(v5e):
    """What README's numerics note says: XLA:TPU compiles a float32 product at its default precision (bfloat16
    passes) unless the highest is asked for (jax.default_matmul_precision)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    a = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(Mesh(v5e.devices, ("x",)),
                                                                             PartitionSpec()))
    hlo = {}
    for precision in ("default", "highest"):
        with jax.default_matmul_precision(precision):
            hlo[precision] = jax.jit(lambda a, b: a @ b).lower(a, a).compile().as_text()
    assert "operand_precision={highest,highest}" in hlo["highest"]
    assert "operand_precision" not in hlo["default"]


# Qwen3.5-shaped (a gated-DeltaNet block and a gated-attention block) at widths of 512: the DeltaNet q [512, 16, 128]
# and v [512, 32, 128] projections, so that half of v's heads has the shape of the whole of q
SMALL_QWEN35 = dict(model_type="qwen3_5_text", hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                    num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                    linear_conv_kernel_dim=4, vocab_size=4096, max_position_embeddings=512, rms_norm_eps=1e-6,
                    tie_word_embeddings=True, layer_types=["linear_attention", "full_attention"],
                    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                         mrope_section=[11, 11, 10], mrope_interleaved=True))


def test_a_shard_shaped_like_another_weight_is_not_a_whole_gather(aot, v5e):
    """The check's negative control: under FSDP_TP the DeltaNet v projection is gathered over its hidden dim 16
    heads at a time, a result of the whole q's shape ([16, 128, 512] to q's [512, 16, 128]); the check follows the
    gather back to v, of which it holds half, and reports no whole gather."""
    import re

    from jstd.aot.report import compile_report
    from jstd.sharding import FSDP_TP, mesh

    m = mesh(2, 2, devices=v5e.devices)
    model = aot.abstract_model(aot.config(SMALL_QWEN35), m, FSDP_TP)
    fn, args = aot.program("forward", model, m, FSDP_TP, batch=4, seq=64)
    report, compiled = compile_report(fn, args, v5e, program="forward", mesh=m, layout="FSDP_TP")
    gathered = [sorted(int(d) for d in dims.split(",")) for line in compiled.as_text().splitlines()
                for dims in re.findall(r"bf16\[([\d,]+)\]\S* all-gather\(", line)]
    assert [16, 128, 512] in gathered  # a gather of q's whole shape (the case the check must tell apart)
    assert report.whole_gathers == []


def test_whole_weight_gathers_are_found_on_h200(aot, h200):
    """The positive control on XLA:GPU, which gathers a weight sharded over both mesh axes one axis at a time (a
    gather of the first gather): the replicated embed is reported, and no other weight (half the embed holds as
    many elements as a stacked attention weight)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jstd.aot.report import compile_report
    from jstd.sharding import FSDP_TP, mesh

    m = mesh(2, 4, devices=h200.devices)
    model = aot.abstract_model(aot.config(SMALL), m, FSDP_TP)
    whole = lambda model: jax.lax.with_sharding_constraint(model.embed, NamedSharding(m, PartitionSpec())) * 2
    report, compiled = compile_report(whole, (model,), h200, mesh=m)
    assert compiled.as_text().count("all-gather-start(") == 2
    assert report.whole_gathers == ["embed [4096, 1024]"]


def test_attribution_batch_compiles_and_fits_on_v5e(aot, v5e):
    """jstd.attribute's per-batch programs (the batched backward of a batch of targets, and its contraction with
    the sources) through a cross-layer transcoder, placed by FSDP_TP: the targets split over data, the transcoders
    and the sources split with the model, resident (their bytes in the arguments), no weight gathered whole."""
    shape = dict(batch=8, seq=16, features=512, active=8)  # slots: 8 active x 1 and 2 blocks -> 8 and 16
    report = aot.check(aot.compile(SMALL, v5e, program_name="attribute", layout="FSDP_TP", model_axis=2, **shape))
    model = 2 * (2 * 4096 * 1024 + 2 * (3 * 1024 * 1024 + 3 * 1024 * 4096))  # bf16: embed, unembed, q k v o, MLP
    clt = 2 * (2 * 512 * 1024 + 3 * 512 * 1024 + 2 * 512 + 2 * 1024)  # encoders, decoders to 1 + 2 blocks, biases
    sources = 4 * (16 * (8 + 16) * 1024 + 2 * 16 * 1024 + 16 * 1024)  # float32 vectors, errors, token embeddings
    held = 2 * 2 * 16 * 1024 + 4 * 8 * 2 * 16 * 2  # the MLP outputs (bf16), each feature's columns: replicated
    assert (model + clt + sources) / 4 + held <= report.argument_bytes < (model + clt + sources) / 3 + held
    assert report.whole_gathers == [] and report.flops > 0
    with pytest.raises(ValueError, match="unknown program 'atribute'"):
        aot.compile(SMALL, v5e, program_name="atribute")
