"""The layers every family assembles, and the model they compose.

Layers: ``norms``, ``mlp``, ``attention`` (softmax attention and its options), ``gated_attention``, ``deltanet``
(the gated DeltaNet mixer), ``moe`` (a mixture-of-experts MLP), ``block`` (the one ``Block``), ``stack`` (blocks
scanned by period). The model: ``causal_lm`` (``CausalLM``), ``attention_inputs`` (each block kind's mask and
rotary), ``model`` (the ``Model`` protocol every loaded model follows). Beneath them: ``params`` (parameter fields
with logical axes) and ``namemap`` (checkpoint keys to parameters). Nothing here knows a family: the declarations
are ``jstd.models``."""
