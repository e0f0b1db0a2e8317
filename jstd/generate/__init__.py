"""``jstd.generate``: jitted decoding with the same edits at every step, over a preallocated cache.

    gen = jstd.generate(model, inputs, edits, max_new_tokens=32)      # greedy
    gen.tokens                                                       # [batch, prompt + new]
    gen.logits                                                       # [batch, new, vocab]: each step's raw logits

One prefill (``jstd.run`` on the prompt, images included, reading what a cache
keeps) and then one token per step in a ``lax.while_loop``: each step is the
model's forward on the new token of every row with a ``jstd.Context`` holding
the prompt-plus-new-tokens cache, preallocated once (softmax blocks: keys and
values ``[blocks, batch, kv_heads, prompt + new, head_dim]``, written at the
step's position; DeltaNet blocks: the recurrent state and the convolution's
last inputs, replaced each step; the one-token step runs the recurrent
gated-delta kernel). Decoding never recomputes the prefix, and every step has
the same cost whatever its position: the cache has its final length from the
start (entries at or after the step's position are masked). On the CPU the
loop runs the blocks unrolled, each over views of its own rows of the stacked
weights (``cache.stepper``), so a step reads every weight once, where it lies.

The contract: *each step's logits equal ``jstd.run`` on the whole sequence so
far with the same edits* (the prompt's padding mask followed by ones). An
edit's ``positions`` are absolute positions in the growing sequence (the
padded prompt's indices, then ``prompt + i`` for new token ``i``); an edit
without ``positions`` applies at every position, new ones included, so a
steering vector added at ``layers.layer_output`` steers every generated token.
Edits at the tower, the projector and the image features (``vision.*``,
``projector.*``) apply in the prefill (the image is only there).

``jax.jit`` and ``jax.vmap`` work: ``max_new_tokens`` and ``reads`` are
static; the edits' arrays (traced ``layer`` included), the sampling numbers,
the key and the EOS ids are values, so a sweep of steering strengths is one
``vmap`` over ``generate``.

The parts: ``loop`` (``generate``, its checks and the ``while_loop``),
``cache`` (``Cache``, ``prefill``, ``decode``, the model as the loop steps it),
``sampling`` (``Sampling``, choosing tokens), ``streaming`` (``stream``: one
jitted step per call, for the command line).
"""

from jstd.generate.cache import Cache, decode, prefill
from jstd.generate.loop import Generation, generate
from jstd.generate.sampling import Sampling
from jstd.generate.streaming import stream

__all__ = ["generate", "Generation", "Sampling", "stream", "Cache", "prefill", "decode"]
