"""Build the tiny random Llama checkpoint that ships as jstd's embedded default.

What it builds (HuggingFace layout, loadable offline with
``transformers.AutoTokenizer`` / ``transformers.AutoModelForCausalLM``):

* a byte-level BPE tokenizer (vocab 768) trained with the ``tokenizers`` library
  on a small English corpus that this script generates deterministically
  (templated sentences about cities, countries, colours, numbers, animals, ...).
  It is wrapped as ``transformers.PreTrainedTokenizerFast`` with Llama-3 style
  special tokens: ``<|begin_of_text|>`` (bos, prepended by the post-processor),
  ``<|end_of_text|>`` (eos) and ``<|pad|>`` (pad);
* a ``LlamaForCausalLM`` with hidden 64, intermediate 176, 4 layers, 4 query
  heads / 2 key-value heads (GQA), head_dim 16, llama3 rope scaling, tied
  embeddings, float32.  Weights are random (``torch.manual_seed(0)``) and then
  rescaled so activations are O(1): Linear ~ N(0, 1/fan_in), norm weights
  1 + 0.1 N(0, 1), embeddings N(0, 1).  Saved as a single ``model.safetensors``.

The script is deterministic and re-runnable: running it again rewrites
byte-identical files.

    python scripts/make_tiny_llama.py [--out DIR]

DIR defaults to ``jstd/assets/tiny-llama`` (relative to the repository root).
"""

from __future__ import annotations

import os

# Single-threaded BPE training so merges are found in a reproducible order.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import itertools
import json
import random
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "jstd" / "assets" / "tiny-llama"

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
VOCAB_SIZE = 768
SAMPLE_PROMPT = "The capital of France is"

# ----------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------

CAPITALS = [
    ("France", "Paris", "French", "Europe"),
    ("Germany", "Berlin", "German", "Europe"),
    ("Italy", "Rome", "Italian", "Europe"),
    ("Spain", "Madrid", "Spanish", "Europe"),
    ("Portugal", "Lisbon", "Portuguese", "Europe"),
    ("England", "London", "English", "Europe"),
    ("Ireland", "Dublin", "Irish", "Europe"),
    ("Greece", "Athens", "Greek", "Europe"),
    ("Poland", "Warsaw", "Polish", "Europe"),
    ("Russia", "Moscow", "Russian", "Europe"),
    ("Norway", "Oslo", "Norwegian", "Europe"),
    ("Sweden", "Stockholm", "Swedish", "Europe"),
    ("Japan", "Tokyo", "Japanese", "Asia"),
    ("China", "Beijing", "Chinese", "Asia"),
    ("India", "Delhi", "Indian", "Asia"),
    ("Korea", "Seoul", "Korean", "Asia"),
    ("Egypt", "Cairo", "Egyptian", "Africa"),
    ("Kenya", "Nairobi", "Kenyan", "Africa"),
    ("Canada", "Ottawa", "Canadian", "America"),
    ("Mexico", "Mexico City", "Mexican", "America"),
    ("Brazil", "Brasilia", "Brazilian", "America"),
    ("Peru", "Lima", "Peruvian", "America"),
    ("Australia", "Canberra", "Australian", "Oceania"),
]
COLOURS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple", "brown", "grey"]
THINGS = [
    ("sky", "blue"), ("grass", "green"), ("snow", "white"), ("sun", "yellow"),
    ("night", "black"), ("blood", "red"), ("orange", "orange"), ("ocean", "blue"),
    ("banana", "yellow"), ("coal", "black"), ("cloud", "white"), ("leaf", "green"),
]
ANIMALS = [
    ("dog", "barks", "house"), ("cat", "meows", "house"), ("cow", "moos", "farm"),
    ("horse", "runs", "field"), ("bird", "sings", "tree"), ("fish", "swims", "river"),
    ("lion", "roars", "savanna"), ("bee", "buzzes", "garden"), ("duck", "quacks", "pond"),
    ("sheep", "sleeps", "field"), ("mouse", "hides", "wall"), ("frog", "jumps", "pond"),
]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
           "ten", "eleven", "twelve"]
NAMES = ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Mary", "John"]
PLACES = ["the park", "the market", "school", "the library", "the station", "the beach",
          "the museum", "work", "the garden", "the city"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
FIXED = [
    "Once upon a time, there was a little girl who lived in a village near the forest.",
    "The quick brown fox jumps over the lazy dog.",
    "Water boils at one hundred degrees and freezes at zero degrees.",
    "There are seven days in a week and twelve months in a year.",
    "The Eiffel Tower is in Paris, and the Colosseum is in Rome.",
    "The moon goes around the earth, and the earth goes around the sun.",
    "I think that the answer is yes, but I am not sure.",
    "Hello! How are you today? I am fine, thank you.",
    "She said: \"Let's go home, it is getting late.\"",
    "In the morning we drink coffee; in the evening we drink tea.",
    "The first letter of the alphabet is A, and the last letter is Z.",
    "Question: What is two plus two? Answer: four.",
    "def add(a, b):\n    return a + b\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 100, 1000, 2024.",
]


def build_corpus() -> list[str]:
    """A few hundred varied, deterministic English sentences."""
    lines: list[str] = list(FIXED)
    for country, city, adj, continent in CAPITALS:
        lines += [
            f"The capital of {country} is {city}.",
            f"{city} is the capital city of {country}.",
            f"{country} is a country in {continent}.",
            f"People in {country} speak {adj}, and the {adj} people love {city}.",
            f"Q: What is the capital of {country}? A: {city}.",
            f"Last year we travelled to {country} and visited {city}.",
        ]
    for thing, colour in THINGS:
        lines += [
            f"The colour of the {thing} is {colour}.",
            f"The {thing} is {colour}.",
            f"Look at the {thing}: it is {colour} today.",
        ]
    for a, b in itertools.combinations(COLOURS, 2):
        lines.append(f"If you mix {a} and {b}, you get a new colour.")
    for animal, verb, home in ANIMALS:
        lines += [
            f"The {animal} {verb}.",
            f"A {animal} lives in the {home}.",
            f"The little {animal} was happy because it was a sunny day.",
            f"I saw a {animal} near the {home}, and the {animal} saw me.",
        ]
    for i, n in enumerate(NUMBERS):
        lines.append(f"The number {n} is written as {i}.")
        if i + 1 < len(NUMBERS):
            lines.append(f"After {n} comes {NUMBERS[i + 1]}.")
        for j in range(1, 4):
            if i + j < len(NUMBERS):
                lines.append(f"{n.capitalize()} plus {NUMBERS[j]} is {NUMBERS[i + j]}.")
    rng = random.Random(0)
    for _ in range(150):
        name, place, day = rng.choice(NAMES), rng.choice(PLACES), rng.choice(DAYS)
        other, colour = rng.choice(NAMES), rng.choice(COLOURS)
        animal = rng.choice(ANIMALS)[0]
        lines.append(rng.choice([
            f"On {day}, {name} went to {place} with {other}.",
            f"{name} has a {colour} {animal} and {other} has a {animal} too.",
            f"{name} likes the colour {colour}, but {other} does not.",
            f"When {name} came back from {place}, it was {day} evening.",
            f"{name} told {other} a story about a {animal} that lived in {place}.",
        ]))
    return lines


# ----------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------


def build_tokenizer(corpus: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


# ----------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------


def build_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    vocab = len(tokenizer)
    vocab = (vocab + 7) // 8 * 8
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                if name == "lm_head":  # tied to embed_tokens
                    continue
                module.weight.normal_(0.0, module.in_features ** -0.5)
            elif isinstance(module, torch.nn.Embedding):
                module.weight.normal_(0.0, 1.0)
            elif type(module).__name__.endswith("RMSNorm"):
                module.weight.copy_(1.0 + 0.1 * torch.randn_like(module.weight))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    args = parser.parse_args()
    out: Path = args.out

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    corpus = build_corpus()
    tokenizer = build_tokenizer(corpus)
    tokenizer.save_pretrained(out)
    model = build_model(tokenizer)
    model.save_pretrained(out, safe_serialization=True)

    # ---- verification -------------------------------------------------------
    tok2 = AutoTokenizer.from_pretrained(out)
    enc = tok2(SAMPLE_PROMPT)
    ids = enc["input_ids"]
    assert ids[0] == tok2.bos_token_id, ids
    assert tok2.decode(ids, skip_special_tokens=True) == SAMPLE_PROMPT
    assert tok2.decode(ids) == BOS + SAMPLE_PROMPT

    model2 = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model2(torch.tensor([ids])).logits[0, -1]
        ref = model(torch.tensor([ids])).logits[0, -1]
    assert torch.equal(logits, ref), "reloaded model differs"
    top = torch.topk(logits, 5)

    print(f"corpus: {len(corpus)} lines")
    print(f"tokenizer: len={len(tok2)} bos={tok2.bos_token_id} eos={tok2.eos_token_id} "
          f"pad={tok2.pad_token_id}")
    print(f"prompt {SAMPLE_PROMPT!r} -> ids {ids}")
    print(f"  tokens {tok2.convert_ids_to_tokens(ids)}")
    print("top-5 next tokens:")
    for v, i in zip(top.values.tolist(), top.indices.tolist()):
        print(f"  {i:5d} {tok2.decode([i])!r:>14} logit={v:.3f}")
    n_params = sum(p.numel() for p in model2.parameters())
    print(f"params: {n_params}")
    cfg = json.loads((out / "config.json").read_text())
    print("config:", json.dumps(cfg, indent=1, sort_keys=True))
    for p in sorted(out.iterdir()):
        print(f"{p.stat().st_size:>9}  {p.name}")


if __name__ == "__main__":
    main()
