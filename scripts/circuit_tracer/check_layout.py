"""Check the case folders against the layout of scripts/circuit_tracer/README.md, reading only the files (numpy +
safetensors + json, no circuit-tracer): transcoder activations recomputed from `transcoders/` and the stored MLP
inputs equal `activation_values` on exactly `active_features`; `error_vectors` = MLP outputs minus the
reconstruction (decoders, b_dec, skip with the documented transposes); Llama logit-target vectors applied to
`final_norm_output` give the demeaned logits; node counts match the adjacency.

    python scripts/circuit_tracer/check_layout.py [tests/data/circuit_tracer]
"""

import json
import sys
from pathlib import Path

import numpy as np
import yaml
from safetensors.numpy import load_file


def load_transcoders(d: Path, L: int):
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    layers = []
    for l in range(L):
        if cfg["model_kind"] == "transcoder_set":
            t = load_file(str(d / f"layer_{l}.safetensors"))
            layers.append(dict(W_enc=t["W_enc"], b_enc=t["b_enc"], b_dec=t["b_dec"], W_dec=t["W_dec"][:, None],
                               threshold=t.get("activation_function.threshold"),
                               skip=(lambda x, W=t["W_skip"]: x @ W.T) if "W_skip" in t else None))
        else:
            e = load_file(str(d / f"W_enc_{l}.safetensors"))
            w = load_file(str(d / f"W_dec_{l}.safetensors"))
            sk = load_file(str(d / "W_skip.safetensors"))["W_skip"] if (d / "W_skip.safetensors").exists() else None
            layers.append(dict(W_enc=e[f"W_enc_{l}"], b_enc=e[f"b_enc_{l}"], b_dec=e[f"b_dec_{l}"],
                               W_dec=w[f"W_dec_{l}"], threshold=e.get(f"threshold_{l}"),
                               skip=(lambda x, W=sk[l]: x @ W) if sk is not None else None))
    return cfg, layers


def check(case: Path):
    c = json.loads((case / "case.json").read_text())
    g = load_file(str(case / "graph.safetensors"))
    x, y, err = g["feature_inputs"], g["feature_outputs"], g["error_vectors"]
    L, n, d = x.shape
    cfg, tcs = load_transcoders(case / "transcoders", L)
    assert cfg["feature_input_hook"] == c["transcoders"]["feature_input_hook"]
    acts = []
    for l, t in enumerate(tcs):
        pre = x[l] @ t["W_enc"].T + t["b_enc"]
        a = pre * (pre > t["threshold"]) if t["threshold"] is not None else np.maximum(pre, 0)
        a[0] = 0  # position 0 is never a feature
        acts.append(a)
    acts = np.stack(acts)  # [L, n, F]
    idx = np.argwhere(acts != 0)
    assert np.array_equal(idx, g["active_features"]), case.name
    np.testing.assert_allclose(acts[tuple(idx.T)], g["activation_values"], rtol=1e-4, atol=1e-5)
    recon = np.stack([np.broadcast_to(t["b_dec"], (n, d)).copy() for t in tcs])
    for ls, t in enumerate(tcs):
        for k in range(t["W_dec"].shape[1]):
            recon[ls + k] += acts[ls] @ t["W_dec"][:, k]
        if t["skip"] is not None:
            recon[ls] += t["skip"](x[ls])
    expect = y - recon
    expect[:, 0] = 0
    np.testing.assert_allclose(err, expect, rtol=1e-4, atol=1e-5 * np.abs(y).max())
    # logit targets read the final-norm output at the last position with demeaned unembedding columns: without a
    # final softcap (Llama) their values are the demeaned logits
    vals = g["logit_vectors"] @ g["final_norm_output"][-1]
    if c["family"] == "llama" and c["targets"]["kind"] != "custom":
        lg = g["logits_last_tl"]
        np.testing.assert_allclose(vals, lg[g["logit_token_ids"]] - lg.mean(), rtol=1e-4, atol=1e-4)
    N = g["adjacency_matrix"].shape[0]
    assert N == len(g["selected_features"]) + L * n + n + len(g["logit_token_ids"]) == c["counts"]["n_nodes"]
    assert list(g["input_tokens"]) == c["input_tokens"] and len(g["input_tokens"]) == n
    return len(idx)


def main():
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/data/circuit_tracer")
    for case in sorted(p for p in root.iterdir() if (p / "case.json").exists()):
        print(f"{case.name}: ok ({check(case)} active features)")


if __name__ == "__main__":
    main()
