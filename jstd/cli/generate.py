"""``jstd generate PATH PROMPT``: text from a prompt, streamed token by token."""

from __future__ import annotations

import sys

import jax
import numpy as np

from jstd.generate import Sampling, stream
from jstd.generate.budget import check_max_new_tokens
from jstd.io.load import load
from jstd.io.processor import load_processor


def add_arguments(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt (greedy or sampled), streaming tokens")
    p.add_argument("path", help="a checkpoint folder or hub repo id")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--max-new-tokens", type=int, default=32, help="how many tokens to generate (default 32)")
    p.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default: greedy; "
                                                                     "0: greedy)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample from the smallest set reaching this mass")
    p.add_argument("--seed", type=int, default=0, help="the sampling key's seed (default 0)")
    p.add_argument("--dtype", default=None, help="the parameters' dtype (float32, bfloat16, ...)")


def command(args) -> int:
    """``jstd generate PATH PROMPT``: prints the (tokenized, decoded) prompt, then each new token as it comes (one step at a time: the
    cache stays on the device between steps), then a newline. ``--temperature 0`` is greedy decoding, as no
    sampling option. Exit status 1 with the API's one-line message for a bad option (``--max-new-tokens 0``,
    ``--top-p 2``) before anything is loaded."""
    try:
        check_max_new_tokens(args.max_new_tokens)
        sampling = _sampling(args)
    except ValueError as e:
        print(f"jstd generate: {e}", file=sys.stderr)
        return 1
    model = load(args.path, dtype=args.dtype)
    tokenizer = load_processor(args.path)
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    ids = np.asarray(tokenizer(args.prompt, return_tensors="np")["input_ids"])
    key = jax.random.key(args.seed)
    prompt = list(ids[0])
    shown = tokenizer.decode(prompt, skip_special_tokens=True)
    sys.stdout.write(shown)
    sys.stdout.flush()
    for tokens in stream(model, ids, max_new_tokens=args.max_new_tokens, sampling=sampling, key=key):
        text = tokenizer.decode(prompt + tokens, skip_special_tokens=True)  # decoded whole: spaces as in the text
        sys.stdout.write(text[len(shown):])
        sys.stdout.flush()
        shown = text
    sys.stdout.write("\n")
    return 0


def _sampling(args) -> Sampling | None:
    """The ``Sampling`` the options ask for: None (greedy) without any, or with ``--temperature 0``; a sampling
    option alone samples at temperature 1. ValueError (``Sampling``'s) for a value out of range."""
    if args.temperature == 0:
        return None
    if all(v is None for v in (args.temperature, args.top_k, args.top_p)):
        return None
    return Sampling(1.0 if args.temperature is None else args.temperature, args.top_k, args.top_p)
