"""Published configs at their published sizes (2 blocks, random weights) load without a ConfigWarning and match
transformers on the logits: Gemma 2 2B, Gemma 3 1B, Mistral 7B v0.1, Qwen2.5 0.5B, OLMo-3 7B
(``tests/published_configs.py``; the suite checks the configs alone, ``tests/test_sliding_window.py``).

Each model is built by transformers from the config (float32, O(1) random weights as the conformance suite's),
saved, run by torch (eager attention) on 2 x 24 random tokens, freed, then loaded by ``jstd.load`` with every
warning an error and run on the same tokens. One model at a time: OLMo-3's 2 blocks hold 1.2 B parameters
(about 5 GB in float32). Prints a markdown table of the relative error of the logits.

    python benchmarks/published_configs.py [NAME ...]
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import warnings
from pathlib import Path

import common  # noqa: F401  (puts tests/ on the path)
import numpy as np


def check(name: str) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import jstd
    import published_configs
    from reference.checkpoints import randomize

    folder = Path(tempfile.mkdtemp(prefix=f"jstd-{name}-"))
    (folder / "config.json").write_text(json.dumps(published_configs.two_blocks(name)))
    config = AutoConfig.from_pretrained(folder)
    config.dtype = torch.float32
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    randomize(model, 0)
    model.save_pretrained(folder)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 24))
    with torch.no_grad():
        want = model(input_ids=torch.as_tensor(tokens)).logits.numpy()
    params = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a ConfigWarning (or any other) fails the check
        ours = jstd.load(folder, dtype="float32")
    got = np.asarray(jstd.run(ours, tokens).logits)
    del ours
    gc.collect()
    error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    return dict(name=name, model_type=config.model_type, params=params, error=error)


def main():
    import published_configs

    names = sys.argv[1:] or list(published_configs.CONFIGS)
    print("| checkpoint | model_type | parameters (2 blocks) | max abs logit error / max abs logit |")
    print("| --- | --- | --- | --- |")
    for name in names:
        r = check(name)
        print(f"| {r['name']} | {r['model_type']} | {r['params'] / 1e6:.0f} M | {r['error']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
