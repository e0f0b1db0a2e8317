"""Published configs at their published sizes (2 blocks, random weights) load without a ConfigWarning and match
transformers on the logits: Gemma 2 2B, Gemma 3 1B, Mistral 7B v0.1, Qwen2.5 0.5B, OLMo-3 7B
(``tests/published_configs.py``; the suite checks the configs alone, ``tests/test_sliding_window.py``).

Each model is built by transformers from the config (float32, O(1) random weights as the conformance suite's),
saved, run by torch (eager attention) on 2 x 24 random tokens, freed, then loaded by ``jstd.load`` with every
warning an error and run on the same tokens. One model at a time: OLMo-3's 2 blocks hold 1.2 B parameters
(about 5 GB in float32). Prints a markdown table of the relative error of the logits.

``WIDE``: the families whose blocks at published width do not fit twice here, each at its published width with
what is cut said: Llama-4-Scout-17B-16E one block at a time (its chunked rotary block 0 and a NoPE block, the kind
of its block 3; a MoE block is 16 experts of 5120 x 8192: 8.5 GB in float32), DeepSeek-V3 a dense block (18432
wide) and a MoE block with 32 of its 256 experts (its 8 groups kept, 4 experts each; top-4 groups and top-8 experts
as published), both with its full-width latent attention; the vocabularies cut to 1024 rows (as the suite cuts
GPT-J's). These are built with the same O(1) random weights drawn in place (no copy of the largest tensor) and
saved under transformers' own names (its fused experts: ``save_pretrained`` would split DeepSeek's per expert,
copying them). ~10 GB in float32 each, one model in memory at a time.

    python benchmarks/published_configs.py [NAME ...]
"""

from __future__ import annotations

import gc
import json
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import common  # noqa: F401  (puts tests/ on the path)
import numpy as np


def wide() -> dict:
    """``WIDE``'s configs: name -> the published config.json cut as its module docstring says."""
    from published_text_configs import LLAMA4_SCOUT_TEXT
    from test_deepseek import V3_PUBLISHED

    small_vocab = dict(vocab_size=1024, pad_token_id=None, bos_token_id=0, eos_token_id=1)
    scout = dict(LLAMA4_SCOUT_TEXT, num_hidden_layers=1, moe_layers=[0], **small_vocab)
    v3 = {k: v for k, v in V3_PUBLISHED.items() if k != "quantization_config"}  # a bfloat16 copy's
    return {
        "Llama-4-Scout-17B-16E:rope": dict(scout, no_rope_layers=[1]),  # block 0: chunked rotary, L2 q/k norm
        "Llama-4-Scout-17B-16E:nope": dict(scout, no_rope_layers=[0]),  # block 3's kind: temperature tuning
        "DeepSeek-V3:32-experts": dict(  # a dense block, a MoE block of 32 experts in 8 groups
            v3, num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=32, **small_vocab),
    }


def randomize_in_place(model, seed: int) -> None:
    """``reference.checkpoints.randomize``'s distributions drawn in place (no transient copy of a tensor): matrices
    normal with std 1/sqrt(fan_in) (embeddings 1), norms 1 + 0.1 normal, other vectors 0.1 normal; a float buffer
    named like a bias (DeepSeek's ``e_score_correction_bias``) 0.1 normal too."""
    import math

    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers()
                                                    if "bias" in n and b.is_floating_point()]
        for name, p in tensors:
            if p.ndim >= 2:
                p.normal_(0.0, 1.0 if "embed" in name else 1.0 / math.sqrt(p.shape[-1]), generator=g)
            elif "norm" in name:
                p.normal_(1.0, 0.1, generator=g)
            else:
                p.normal_(0.0, 0.1, generator=g)


def check(name: str) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    import jstd
    import published_configs
    from reference.checkpoints import randomize

    big = wide()
    folder = Path(tempfile.mkdtemp(prefix="jstd-published-"))
    raw = big[name] if name in big else published_configs.two_blocks(name)
    (folder / "config.json").write_text(json.dumps(raw))
    config = AutoConfig.from_pretrained(folder)
    config.dtype = torch.float32
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    if name in big:
        randomize_in_place(model, 0)
        save_file(model.state_dict(), folder / "model.safetensors", metadata={"format": "pt"})
        model.config.save_pretrained(folder)
    else:
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
    shutil.rmtree(folder)
    error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    return dict(name=name, model_type=config.model_type, params=params, error=error)


def main():
    import published_configs

    names = sys.argv[1:] or list(published_configs.CONFIGS) + list(wide())
    print("| checkpoint | model_type | parameters (2 blocks unless said) | max abs logit error / max abs logit |")
    print("| --- | --- | --- | --- |")
    for name in names:
        r = check(name)
        print(f"| {r['name']} | {r['model_type']} | {r['params'] / 1e6:.0f} M | {r['error']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
