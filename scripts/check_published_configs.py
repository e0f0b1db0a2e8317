"""Run released checkpoints' configurations (``tests/published_text_configs.py``: published widths, heads,
head_dim, rope and windows, 2 blocks) with random weights in jstd and in transformers, and compare the logits.

    python scripts/check_published_configs.py [--only gemma] [--vocab N] [--seq 16]

For each config: a random float32 checkpoint (``tests/reference/checkpoints.randomize``) is saved to a temporary
folder, loaded by ``jstd.load`` with ``ConfigWarning`` raised as an error, and both models run the same random
tokens; the line printed gives the largest logit difference relative to the logits' scale. ``--vocab`` shrinks the
vocabulary (the one size this changes) where memory is short: Gemma's 256000 x 2048 embedding is 2 GB in float32
on each side. Slow (minutes, gigabytes); never part of the test suite (which reads these configs without weights:
``tests/test_text_families.py``).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))


def check(repo: str, config: dict, vocab: int | None, seq: int) -> float:
    import jax
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import jstd
    from reference.checkpoints import randomize

    config = dict(config, **({"vocab_size": vocab} if vocab else {}))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(config))
        hf = AutoConfig.from_pretrained(folder)
        hf.dtype = torch.float32
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf, attn_implementation="eager").eval()
        randomize(model, 0)
        model.save_pretrained(folder)
        tokens = np.random.default_rng(0).integers(0, hf.vocab_size, (2, seq))
        with torch.no_grad():
            want = model(torch.as_tensor(tokens)).logits.numpy()
        del model
        gc.collect()
        with warnings.catch_warnings():
            warnings.simplefilter("error", jstd.ConfigWarning)
            ours = jstd.load(folder, dtype=np.float32)
        got = np.asarray(jax.jit(jstd.run)(ours, tokens).logits)
    return float(np.abs(got - want).max() / np.abs(want).max())


def main(argv=None) -> int:
    from published_text_configs import PUBLISHED

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the repos whose name contains this")
    parser.add_argument("--vocab", type=int, help="vocabulary size to use instead of the published one")
    parser.add_argument("--seq", type=int, default=16)
    args = parser.parse_args(argv)
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    worst = 0.0
    for repo, config in PUBLISHED.items():
        if args.only and args.only.lower() not in repo.lower():
            continue
        start = time.perf_counter()
        err = check(repo, config, args.vocab, args.seq)
        worst = max(worst, err)
        print(f"{repo:40s} max |logit diff| / max |logit| = {err:.2e}   ({time.perf_counter() - start:.0f} s)",
              flush=True)
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
