"""OLMo-Hybrid (``model_type`` olmo_hybrid): gated DeltaNet blocks and OLMo-3's post-norm attention blocks.

    # linear_attention blocks (DeltaNetBlock): pre-norm, as Llama
    h   = x + linear_attn(input_layernorm(x))
    out = h + mlp(post_attention_layernorm(h))
    # full_attention blocks (PostNormBlock): no input norm, post-norms
    h   = x + post_attention_layernorm(self_attn(x))
    out = h + post_feedforward_layernorm(mlp(h))
    logits = lm_head(norm(out))

``config.layer_types`` gives each block's kind (on the released checkpoints
every fourth block is ``full_attention``). Each kind's blocks are stacked in
block order (``linear_blocks``, ``attention_blocks``) and the stack runs one
repeating period of kinds per scan step (``jstd.models.stack``), so compile
time does not grow with depth; a tail that is not a whole period runs after
the scan.

The values, in the standard vocabulary:

- ``layers.linear_attn.*`` on the DeltaNet blocks (``layers_with("linear_attn")``),
  ``layers.self_attn.*`` on the attention blocks, ``layers.mlp.*`` and the
  stream sites on every block. ``attention_norm_output`` and
  ``mlp_norm_output`` exist only on the DeltaNet blocks (the attention block
  has no input norms): ``blocks_for`` says so and their stacks hold the
  DeltaNet blocks only.
- On an attention block ``attention_output`` / ``mlp_output`` are the
  post-norms' outputs (what the stream receives); on a DeltaNet block the
  mixer's / MLP's own outputs. ``layer_input + attention_output + mlp_output ==
  layer_output`` on both kinds.
- The attention's ``q_norm`` / ``k_norm`` cover the whole projection (every
  head) before the split into heads. Rotary applies only when transformers
  builds one: ``rope_parameters`` present with a non-null ``rope_theta``
  (Olmo-Hybrid-Think-SFT: ``rope_parameters`` null, which transformers fills
  with theta 10000); the released base checkpoints have none, so queries are
  q_norm's output split into heads.
- The DeltaNet's gated output norm ``o_norm`` has eps 1e-5 whatever
  ``rms_norm_eps`` says (transformers hard-codes FLA's default).
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jstd.io.namemap import Entry, linear, split, split_in, split_out
from jstd.context import Context, begin
from jstd.kernels.rope import Rotary, rotary_from_config
from jstd.models.base import Family, param, shape, stacked
from jstd.models.deltanet import DeltaNetBlock, GatedDeltaNet
from jstd.models.layers import Attention, GatedMLP, PostNormBlock, RMSNorm, stack
from jstd.models.llama import tied
from jstd.models.stack import scan_period
from jstd.sites import SITES

LINEAR, FULL = "linear_attention", "full_attention"
# transformers hard-codes the gated output norm's eps (FLA's FusedRMSNormGated default), ignoring rms_norm_eps
O_NORM_EPS = 1e-5
NORM_SITES = ("layers.attention_norm_output", "layers.mlp_norm_output")


class OlmoHybrid(Family):
    """An OLMo-Hybrid causal LM. Arrays: ``embed`` [vocab, embed]; ``linear_blocks`` stacked over the
    DeltaNet blocks, ``attention_blocks`` over the attention blocks (each in block order);
    ``final_norm``; ``lm_head`` [embed, vocab] (None when tied to ``embed``)."""

    embed: Float[Array, "vocab embed"] = param("vocab", "embed")
    linear_blocks: DeltaNetBlock = stacked()
    attention_blocks: PostNormBlock = stacked()
    final_norm: RMSNorm
    lm_head: Float[Array, "embed vocab"] | None = param("embed", "vocab")
    rotary: Rotary | None = eqx.field(static=True)

    family: ClassVar[str] = "olmo_hybrid"
    model_types: ClassVar[tuple[str, ...]] = ("olmo_hybrid",)
    sites: ClassVar[frozenset[str]] = frozenset(
        n for n, s in SITES.items()
        if s.family is None and s.host in ("model", "layers", "layers.self_attn", "layers.mlp", "layers.linear_attn")
    )

    # ---- the forward -------------------------------------------------------
    def forward(self, tokens: Int[Array, "batch seq"], tap, attention_mask=None, context: Context | None = None):
        s = tap.scope()
        positions, mask, h = begin(tokens, attention_mask, context, lambda: s("token_embeddings", self.embed[tokens]))
        # OLMo's rotary module returns float32 cos/sin whatever the model's dtype
        cos_sin = None if self.rotary is None else self.rotary.cos_sin(positions, jnp.float32)
        padding = None if attention_mask is None else attention_mask.astype(bool)
        if context is not None:
            padding = context.real()
        pasts = {}
        if context is not None and context.keys is not None:
            pasts[FULL] = (context.keys, context.values)
        if context is not None and context.states is not None:
            pasts[LINEAR] = (context.states, context.conv_inputs)
        h, block_reads = scan_period(
            h, tap, self.config.layer_types,
            {LINEAR: self.linear_blocks, FULL: self.attention_blocks},
            {LINEAR: (None, padding), FULL: (cos_sin, mask)},
            self.blocks_for, pasts, None if context is None else context.block,
        )
        normed = s("final_norm_output", self.final_norm(h))
        logits = s("logits", s("lm_head_output", self.logits_from_norm(normed)))
        return logits, {**s.records, **block_reads}

    def logits_from_norm(self, normed: Float[Array, "... hidden"]) -> Float[Array, "... vocab"]:
        """The head (nothing follows it on OLMo-Hybrid)."""
        return normed @ (self.embed.T if self.lm_head is None else self.lm_head)

    @property
    def conv_width(self) -> int:
        """The DeltaNet convolutions' width (``linear_conv_kernel_dim``)."""
        return self.linear_blocks.attn.q_conv.shape[1]

    def layers_with(self, host: str) -> tuple[int, ...]:
        kinds = self.config.layer_types
        if host == "linear_attn":
            return tuple(i for i, t in enumerate(kinds) if t == LINEAR)
        if host == "self_attn":
            return tuple(i for i, t in enumerate(kinds) if t == FULL)
        return tuple(range(len(kinds))) if host in ("mlp", "") else ()

    def blocks_for(self, site: str) -> tuple[int, ...]:
        # the attention blocks have no input norms: these two exist on the DeltaNet blocks only
        if site in NORM_SITES:
            return self.layers_with("linear_attn")
        return super().blocks_for(site)

    # ---- loading -----------------------------------------------------------
    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        kinds = tuple(hf.layer_types)
        unknown = set(kinds) - {LINEAR, FULL}
        if unknown:
            raise ValueError(f"olmo_hybrid layer_types holds {sorted(unknown)}; supported: {LINEAR}, {FULL}")
        return kinds

    @classmethod
    def builds_rotary(cls, hf) -> bool:
        """transformers' rule: a rotary embedding only with ``rope_parameters`` holding a non-null ``rope_theta``."""
        params = getattr(hf, "rope_parameters", None)
        return params is not None and params.get("rope_theta") is not None

    @classmethod
    def skeleton(cls, hf, dtype):
        c = cls.standard_config(hf)
        eps = hf.rms_norm_eps
        norm = lambda: RMSNorm.skeleton(c.hidden_size, eps, dtype, True)
        mlp = lambda: GatedMLP.skeleton(c.hidden_size, c.intermediate_size, hf.hidden_act, False, dtype)
        bias = bool(getattr(hf, "attention_bias", False))
        linear_block = DeltaNetBlock(
            norm(),
            GatedDeltaNet.skeleton(
                c.hidden_size, hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim,
                hf.linear_value_head_dim, hf.linear_conv_kernel_dim, hf.hidden_act, hf.linear_allow_neg_eigval,
                O_NORM_EPS, dtype,
            ),
            norm(),
            mlp(),
        )
        attention_block = PostNormBlock(
            Attention.skeleton(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim ** -0.5,
                               bias, bias, dtype, qk_norm_eps=eps),
            norm(),
            mlp(),
            norm(),
        )
        return cls(
            config=c,
            embed=shape(c.vocab_size, c.hidden_size, dtype=dtype),
            linear_blocks=stack(linear_block, c.layer_types.count(LINEAR)),
            attention_blocks=stack(attention_block, c.layer_types.count(FULL)),
            final_norm=norm(),
            lm_head=None if tied(hf) else shape(c.hidden_size, c.vocab_size, dtype=dtype),
            rotary=rotary_from_config(hf, c.head_dim) if cls.builds_rotary(hf) else None,
        )

    @classmethod
    def name_map(cls, hf) -> list[Entry]:
        c = cls.standard_config(hf)
        kinds = c.layer_types
        delta = tuple(i for i, t in enumerate(kinds) if t == LINEAR)
        full = tuple(i for i, t in enumerate(kinds) if t == FULL)
        # Names as stored (OLMo-core's, which transformers renames on load): attention_layer_norm is
        # input_layernorm; feedforward_layer_norm is post_attention_layernorm on both kinds: the MLP's input norm
        # on a DeltaNet block, the attention's output norm on an attention block.
        H, K = c.num_heads, c.num_kv_heads
        Hk, Hv = hf.linear_num_key_heads, hf.linear_num_value_heads
        key_dim = Hk * hf.linear_key_head_dim
        W = hf.linear_conv_kernel_dim
        L = "model.layers.{i}."
        D = L + "linear_attn."
        A = L + "self_attn."

        # The convolution of q, k and v is one depthwise conv1d in transformers; checkpoints store it in three
        # parts (q_conv1d, k_conv1d, v_conv1d: split as q|k|v in OLMo-core's files, in equal thirds when
        # transformers saved them), so the parts are concatenated and split by q|k|v channels.
        conv_parts = tuple(D + f"{x}_conv1d.weight" for x in "qkv")

        def conv(start, stop, heads):
            # [q|k|v channels, 1, width] -> [width, heads, dim]
            return lambda w: w[start:stop, 0, :].T.reshape(W, heads, -1)

        def mlp(path, blocks):
            return [
                Entry(L + "mlp.gate_proj.weight", path + ".mlp.gate", linear, blocks),
                Entry(L + "mlp.up_proj.weight", path + ".mlp.up", linear, blocks),
                Entry(L + "mlp.down_proj.weight", path + ".mlp.down", linear, blocks),
            ]

        lb, ab = "linear_blocks", "attention_blocks"
        return [
            Entry("model.embed_tokens.weight", "embed"),
            Entry("model.norm.weight", "final_norm.weight"),
            Entry("lm_head.weight", "lm_head", linear),
            # DeltaNet blocks
            Entry(L + "attention_layer_norm.weight", lb + ".attention_norm.weight", blocks=delta),
            Entry(L + "feedforward_layer_norm.weight", lb + ".mlp_norm.weight", blocks=delta),
            Entry(D + "q_proj.weight", lb + ".attn.q", split_out(Hk), delta),
            Entry(D + "k_proj.weight", lb + ".attn.k", split_out(Hk), delta),
            Entry(D + "v_proj.weight", lb + ".attn.v", split_out(Hv), delta),
            Entry(conv_parts, lb + ".attn.q_conv", conv(0, key_dim, Hk), delta),
            Entry(conv_parts, lb + ".attn.k_conv", conv(key_dim, 2 * key_dim, Hk), delta),
            Entry(conv_parts, lb + ".attn.v_conv", conv(2 * key_dim, None, Hv), delta),
            Entry(D + "a_proj.weight", lb + ".attn.a", linear, delta),
            Entry(D + "b_proj.weight", lb + ".attn.b", linear, delta),
            Entry(D + "A_log", lb + ".attn.A_log", blocks=delta),
            Entry(D + "dt_bias", lb + ".attn.dt_bias", blocks=delta),
            Entry(D + "g_proj.weight", lb + ".attn.gate", split_out(Hv), delta),
            Entry(D + "o_norm.weight", lb + ".attn.o_norm.weight", blocks=delta),
            Entry(D + "o_proj.weight", lb + ".attn.o", split_in(Hv), delta),
            *mlp(lb, delta),
            # attention blocks
            Entry(A + "q_proj.weight", ab + ".attn.q", split_out(H), full),
            Entry(A + "k_proj.weight", ab + ".attn.k", split_out(K), full),
            Entry(A + "v_proj.weight", ab + ".attn.v", split_out(K), full),
            Entry(A + "o_proj.weight", ab + ".attn.o", split_in(H), full),
            Entry(A + "q_proj.bias", ab + ".attn.q_bias", split(H), full),
            Entry(A + "k_proj.bias", ab + ".attn.k_bias", split(K), full),
            Entry(A + "v_proj.bias", ab + ".attn.v_bias", split(K), full),
            Entry(A + "o_proj.bias", ab + ".attn.o_bias", blocks=full),
            Entry(A + "q_norm.weight", ab + ".attn.q_norm.weight", blocks=full),
            Entry(A + "k_norm.weight", ab + ".attn.k_norm.weight", blocks=full),
            Entry(L + "feedforward_layer_norm.weight", ab + ".attention_post_norm.weight", blocks=full),
            Entry(L + "post_feedforward_layernorm.weight", ab + ".mlp_post_norm.weight", blocks=full),
            *mlp(ab, full),
        ]

    @classmethod
    def ignored(cls, hf) -> tuple[str, ...]:
        # multi-token-prediction heads (transformers ignores them too); rotary buffers are recomputed
        return ("mtp.*", "*rotary_emb.inv_freq") + (("lm_head.weight",) if tied(hf) else ())
