"""Train the induction demo model that ships as ``jstd/assets/induction-llama`` (what ``jstd demo`` runs).

The task has a known circuit: each training row is ``<|begin_of_text|>``
followed by 64 random words in which one random stretch of ``n`` words
(n = 4..32, starting anywhere) is immediately repeated. The second copy is
predictable only by *induction*: find the previous occurrence of the current
word and copy the word that followed it (the period varies, so copying from a
fixed offset does not work). With the defaults (seed 0) the model copies at
~0.96 after a phase change near step 2000. Its circuit is a lagged induction
circuit: a block-0 head attends 10 tokens back (where the textbook circuit has
a previous-token head, lag 1), and three block-1 heads attend to the position
10 after the current word's previous occurrence. ``jstd demo`` finds both by
their attention scores and checks them by ablation.

How it is built, all in jstd:

1. a word-level tokenizer (the special tokens of the embedded tiny Llama, then
   ``WORDS`` below: 256 ids) and a Llama config (2 blocks, hidden 64, 4 heads
   of 16, MLP 256, untied head, rope theta 10000, float32) are written in
   HuggingFace layout, with random weights (numpy, seeded) under HF names;
2. that checkpoint is loaded with ``jstd.load``; the loss is the next-token
   cross entropy of ``jstd.run(model, tokens).logits``, differentiated with
   ``jax.grad`` with respect to the model's arrays (``eqx.partition``), and
   trained with optax (AdamW, warm-up then cosine decay, gradient clipping);
   the training rows are drawn with ``jax.random`` inside the compiled loop;
3. the trained arrays are written back under the HF names (the inverse of the
   Llama name map in ``jstd/models/llama.py``) to ``model.safetensors``;
   the script checks that ``jstd.load`` gives back the very same arrays and,
   when torch is installed, that transformers' ``LlamaForCausalLM`` computes the
   same logits.

Deterministic: fixed seeds, no host randomness; rerunning on the same
platform and versions rewrites the same files. It takes about 1.5 minutes on
2 CPU cores:

    .venv/bin/python scripts/train_induction.py [--out DIR] [--steps N]

DIR defaults to ``jstd/assets/induction-llama`` (relative to the repository root).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "jstd" / "assets" / "induction-llama"

BOS, EOS, PAD, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|unk|>"
SPECIALS = [BOS, EOS, PAD, UNK]
WORDS = list(dict.fromkeys("""
the of and to in is was it for on as with by at from this that not but or are be
have has had one two three four five six seven eight nine ten capital france paris
italy rome spain madrid city country river sea lake hill mountain forest field garden
tree leaf flower grass rock sand stone water fire wind rain snow sun moon star sky
cloud day night morning evening week month year time red blue green yellow black white
orange purple brown grey dog cat cow horse bird fish lion bee duck sheep mouse frog
bear wolf fox deer owl goat pig apple bread cheese milk tea coffee soup rice cake egg
salt sugar honey butter lemon house door window room table chair bed lamp book pen
paper cup plate box bag key clock ship boat car train bus road bridge town village
school market shop bank park museum church castle tower farm king queen child friend
mother father sister brother teacher doctor farmer baker sailor cook walk run jump
swim sing read write play sleep eat drink cold warm hot big small old new happy sad
fast slow left right up down near far open close music song story game ball kite drum
bell ring coin map letter name word gold silver iron glass wood cloth shoe hat coat
sat went came saw made took gave found said told knew kept left lost
here there then now when where who what why how all some many few nest
""".split()))
VOCAB = SPECIALS + WORDS
VOCAB_SIZE = len(VOCAB)
FIRST_WORD = len(SPECIALS)

SEQ = 64            # words per training row (after <|begin_of_text|>)
PERIODS = (4, 32)   # the repeated stretch has n words, n in [4, 32]
SEED = 0


# ----------------------------------------------------------------------------
# Checkpoint in HuggingFace layout
# ----------------------------------------------------------------------------


def write_tokenizer(out: Path):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   unk_token=UNK, model_max_length=256, clean_up_tokenization_spaces=False)
    fast.save_pretrained(out)


def config_dict() -> dict:
    return dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, hidden_act="silu",
        max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, dtype="float32",
    )


def write_config(out: Path):
    from transformers import LlamaConfig

    LlamaConfig(**config_dict()).save_pretrained(out)


def random_weights(seed: int = SEED) -> dict[str, np.ndarray]:
    """Initial weights under HF names: N(0, 0.02) matrices (transformers' init), unit norm weights."""
    c = config_dict()
    e, f, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = c["num_attention_heads"] * c["head_dim"]
    rng = np.random.default_rng(seed)
    w = lambda *shape: (0.02 * rng.standard_normal(shape)).astype(np.float32)
    t = {"model.embed_tokens.weight": w(c["vocab_size"], e), "model.norm.weight": np.ones(e, np.float32),
         "lm_head.weight": w(c["vocab_size"], e)}
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = np.ones(e, np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(e, np.float32)
        for name in ("q", "k", "v"):
            t[p + f"self_attn.{name}_proj.weight"] = w(hd, e)
        t[p + "self_attn.o_proj.weight"] = w(e, hd)
        t[p + "mlp.gate_proj.weight"] = w(f, e)
        t[p + "mlp.up_proj.weight"] = w(f, e)
        t[p + "mlp.down_proj.weight"] = w(e, f)
    return t


def hf_weights(model) -> dict[str, np.ndarray]:
    """A jstd Llama's arrays under HuggingFace names: the inverse of ``Llama.name_map`` (no biases)."""
    b = model.layers.slots[0]
    a = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))
    t = {"model.embed_tokens.weight": a(model.embed), "model.norm.weight": a(model.final_norm.weight)}
    if model.lm_head is not None:
        t["lm_head.weight"] = a(np.asarray(model.lm_head).T)                      # [embed, vocab] -> [vocab, embed]
    for i in range(model.config.num_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = a(b.attention_norm.weight[i])
        t[p + "post_attention_layernorm.weight"] = a(b.mlp_norm.weight[i])
        for name, w in (("q", b.attn.q), ("k", b.attn.k), ("v", b.attn.v)):   # [embed, heads, dim] -> [heads*dim, embed]
            w = np.asarray(w[i])
            t[p + f"self_attn.{name}_proj.weight"] = a(w.transpose(1, 2, 0).reshape(-1, w.shape[0]))
        o = np.asarray(b.attn.o[i])                                             # [heads, dim, embed] -> [embed, heads*dim]
        t[p + "self_attn.o_proj.weight"] = a(o.transpose(2, 0, 1).reshape(o.shape[2], -1))
        for name, w in (("gate", b.mlp.gate), ("up", b.mlp.up), ("down", b.mlp.down)):
            t[p + f"mlp.{name}_proj.weight"] = a(np.asarray(w[i]).T)           # [in, out] -> [out, in]
    return t


def save_weights(tensors: dict[str, np.ndarray], out: Path):
    from safetensors.numpy import save_file

    save_file(dict(sorted(tensors.items())), out / "model.safetensors", metadata={"format": "pt"})


# ----------------------------------------------------------------------------
# Data and training
# ----------------------------------------------------------------------------


def repeated_rows(key, batch: int, seq: int = SEQ, periods=PERIODS):
    """[batch, 1 + seq] rows: bos, then random words with one stretch of n words repeated right after itself.

    Returns (tokens, period, start): the second copy occupies positions
    ``1 + start + n .. 1 + start + 2n - 1`` of the row.
    """
    import jax
    import jax.numpy as jnp

    k1, k2, k3 = jax.random.split(key, 3)
    words = jax.random.randint(k1, (batch, seq), FIRST_WORD, VOCAB_SIZE)
    n = jax.random.randint(k2, (batch, 1), periods[0], periods[1] + 1)
    start = jnp.floor(jax.random.uniform(k3, (batch, 1)) * (seq - 2 * n + 1)).astype(jnp.int32)
    i = jnp.arange(seq)[None]
    second = (i >= start + n) & (i < start + 2 * n)
    words = jnp.take_along_axis(words, jnp.where(second, i - n, i), axis=1)
    tokens = jnp.concatenate([jnp.zeros((batch, 1), words.dtype), words], axis=1)
    return tokens, n[:, 0], start[:, 0]


def demo_rows(rng: np.random.Generator, batch: int, period: int) -> np.ndarray:
    """[batch, 1 + 2·period]: bos, then ``period`` random words, then the same words again (what the demo uses)."""
    words = rng.integers(FIRST_WORD, VOCAB_SIZE, (batch, period))
    return np.concatenate([np.zeros((batch, 1), np.int64), words, words], axis=1).astype(np.int32)


def copying_accuracy(logits, tokens, period: int) -> float:
    """Top-1 accuracy on the second copy's words 2..n (the ones induction can predict) of ``demo_rows``."""
    preds = np.argmax(np.asarray(logits), -1)
    pos = np.arange(period + 1, 2 * period)            # positions predicting tokens period+2 .. 2·period
    return float(np.mean(preds[:, pos] == np.asarray(tokens)[:, pos + 1]))


def train(model, *, steps: int, batch: int, lr: float, seed: int = SEED, log_every: int = 100):
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import jstd

    params, static = eqx.partition(model, eqx.is_inexact_array)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(200, steps // 10), steps, lr / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))

    def loss_fn(params, tokens):
        logits = jstd.run(eqx.combine(params, static), tokens).logits[:, :-1]
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))

    @jax.jit
    def chunk(params, state, key):
        def step(carry, k):
            params, state = carry
            tokens, _, _ = repeated_rows(k, batch)
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
            updates, state = optimizer.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), loss

        (params, state), losses = jax.lax.scan(step, (params, state), jax.random.split(key, log_every))
        return params, state, losses

    rows = demo_rows(np.random.default_rng(seed + 1), 64, 20)
    logits = jax.jit(lambda params: jstd.run(eqx.combine(params, static), rows).logits)
    state = optimizer.init(params)
    key = jax.random.key(seed)
    t0 = time.time()
    for done in range(0, steps, log_every):
        key, sub = jax.random.split(key)
        params, state, losses = chunk(params, state, sub)
        acc = copying_accuracy(logits(params), rows, 20)
        print(f"step {done + log_every:5d}  loss {float(losses.mean()):.4f}  copying {acc:.3f}  ({time.time() - t0:.0f} s)",
              flush=True)
    return eqx.combine(params, static)


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    out: Path = args.out

    import jax

    import jstd

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    write_tokenizer(out)
    write_config(out)
    save_weights(random_weights(), out)

    model = jstd.load(out)                                  # the random checkpoint, loaded by jstd
    model = train(model, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed)
    save_weights(hf_weights(model), out)

    # ---- verification -------------------------------------------------------
    reloaded = jstd.load(out)
    same = jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), model, reloaded)
    assert all(jax.tree.leaves(same)), "reloaded arrays differ from the trained ones"
    rows = demo_rows(np.random.default_rng(1), 64, 20)
    logits = np.asarray(jstd.run(reloaded, rows).logits)
    print(f"copying accuracy (second copy of 20 repeated words, 64 rows): {copying_accuracy(logits, rows, 20):.3f}")
    from jstd.cli import head_scores

    rows24 = demo_rows(np.random.default_rng(2), 64, 24)
    probs = jstd.run(reloaded, rows24, reads=("layers.self_attn.attention_probabilities",))
    lag, lag_scores, induction = head_scores(probs["layers.self_attn.attention_probabilities"], 24)
    np.set_printoptions(precision=2, suppress=True)
    print(f"lag {lag}: attention to q-{lag} [block, head]:\n{lag_scores}\n"
          f"induction (to {lag} after the previous occurrence) [block, head]:\n{induction}")
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        print("torch not installed: skipped the transformers parity check")
    else:
        hf = AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            ref = hf(torch.tensor(rows, dtype=torch.long)).logits.numpy()
        err = float(np.abs(ref - logits).max())
        assert err < 1e-3, f"transformers' logits differ from jstd's by {err}"
        print(f"transformers LlamaForCausalLM gives the same logits (max |diff| {err:.1e})")
    tok = jstd.load_processor(out)
    print("tokenizer:", tok("The cat sat near the river")["input_ids"], "->", repr(tok.decode(rows[0, :8])))
    print("config:", json.dumps(json.loads((out / "config.json").read_text()), sort_keys=True))
    for p in sorted(out.iterdir()):
        print(f"{p.stat().st_size:>9}  {p.name}")


if __name__ == "__main__":
    main()
