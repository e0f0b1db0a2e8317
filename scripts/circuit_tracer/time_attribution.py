"""circuit-tracer's side of issue 37's speed target: generate the benchmark case and time `attribute` on it.

    .venv-ct/bin/python scripts/circuit_tracer/time_attribution.py OUT_DIR [--batch-sizes 64 128 256 512 1024]
        [--repeats 3] [--n-prompts 16] [--threads N] [--nnsight]

Writes OUT_DIR/<case>/ in the contract layout of scripts/circuit_tracer/README.md (model/, transcoders/,
case.json, graph.safetensors, pruned.safetensors, scores.json, graph.json; not committed: the adjacency alone is
~36 MB): a 4-block, 256-wide random Llama (4 heads of 64, 2 KV heads, MLP 1024, vocab 512), a ReLU cross-layer
transcoder with 1024 features per layer reading `mlp.hook_in` and writing `mlp.hook_out`, and a 24-token prompt
(BOS + 23), its encoder biases shifted so that about 2,900 features are active (the shift is computed from the
model's own MLP inputs; the last position is checked to hold active features). Then times circuit-tracer's
`attribute` (TransformerLens backend; warm: one untimed call first) at each batch size, best of `--repeats`,
and with `--n-prompts K` also K prompts of the same length one after another (circuit-tracer has no batched
call) at the best batch size; prints one JSON object. Timings on a loaded machine are not figures: measure on a
quiet one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
import torch  # noqa: E402

NAME = "bench_llama4x256_clt1024"
TARGET_ACTIVE = 2900


def prompts(vocab, n_pos, k, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n_pos - 1,), generator=g).tolist() for _ in range(k)]


def calibrate(hf, spec, params, given):
    """Shift every layer's b_enc by one constant t so that (x_l @ W_enc_l.T + b_enc_l > 0) holds for
    TARGET_ACTIVE (layer, position >= 1, feature) triples on the benchmark prompt, x_l = the MLP input."""
    xs = []
    hooks = [layer.post_attention_layernorm.register_forward_hook(lambda m, i, o: xs.append(o[0].detach()))
             for layer in hf.model.layers]
    with torch.no_grad():
        hf(torch.tensor([[C.BOS] + given]))
    for h in hooks:
        h.remove()
    pre = torch.cat([(xs[l][1:] @ params[l]["W_enc"].T + params[l]["b_enc"]).flatten() for l in range(len(params))])
    t = float(torch.topk(pre, TARGET_ACTIVE + 1).values[-2:].mean())  # midway between the 2900th and 2901st
    for p in params:
        p["b_enc"] = p["b_enc"] - t
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[64, 128, 256, 512, 1024])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-prompts", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--nnsight", action="store_true", help="also time the nnsight backend")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    case_dir = Path(args.out) / NAME
    if case_dir.exists():
        import shutil

        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)

    ms = C.ModelSpec("llama", vocab=512, d=256, d_mlp=1024, n_layers=4, n_heads=4, n_kv=2, seed=5, lm_std=0.25)
    ts = C.TranscoderSpec("clt", "relu", False, 1024, "mlp.hook_in", "mlp.hook_out", seed=6, enc_bias=0.0,
                          dec_std=0.05)
    hf = C.build_model(ms, case_dir / "model")
    all_prompts = prompts(ms.vocab, 24, max(1, args.n_prompts))
    given = all_prompts[0]
    params = C.random_transcoder_params(ts, ms.n_layers, ms.d)
    shift = calibrate(hf, ms, params, given)
    scan = f"local/{NAME}"
    C.write_transcoders(ts, params, case_dir / "transcoders", scan, "model")
    with torch.no_grad():
        hf_logits = hf(torch.tensor([[C.BOS] + given])).logits[0, -1].float()

    tl = C.load_tl(case_dir / "model", hf, C.load_transcoders(case_dir / "transcoders", scan))
    settings = dict(max_n_logits=10, desired_logit_prob=0.95, batch_size=max(args.batch_sizes),
                    max_feature_nodes=None, update_interval=4, node_threshold=0.8, edge_threshold=0.98)

    def timed(model, bs, prompt):
        s = dict(settings, batch_size=bs)
        t0 = time.perf_counter()
        g, tg = C.run_attribute(model, prompt, s, None)
        return time.perf_counter() - t0, g, tg

    _, graph, tgt = timed(tl, settings["batch_size"], given)  # warm-up, and the stored graph
    n = len(graph.input_tokens)
    assert (graph.active_features[:, 1] == n - 1).any(), "no active feature at the last position"
    result = {
        "case": NAME,
        "backend": "transformerlens",
        "torch_threads": torch.get_num_threads(),
        "n_pos": n,
        "n_active_features": len(graph.active_features),
        "n_logits": len(graph.logit_targets),
        "n_nodes": graph.adjacency_matrix.shape[0],
        "b_enc_shift": shift,
        "seconds_by_batch_size": {},
    }
    for bs in args.batch_sizes:
        result["seconds_by_batch_size"][bs] = min(timed(tl, bs, given)[0] for _ in range(args.repeats))
    best_bs = min(result["seconds_by_batch_size"], key=result["seconds_by_batch_size"].get)
    result["best_seconds"] = result["seconds_by_batch_size"][best_bs]
    result["best_batch_size"] = best_bs
    if args.n_prompts > 1:
        t0 = time.perf_counter()
        actives = []
        for p in all_prompts:
            actives.append(len(C.run_attribute(tl, p, dict(settings, batch_size=best_bs), None)[0].active_features))
        result["n_prompts"] = len(all_prompts)
        result["n_prompts_seconds_sequential"] = time.perf_counter() - t0
        result["n_prompts_active_features"] = actives
    if args.nnsight:
        nn_model = C.load_nnsight(case_dir / "model", C.load_transcoders(case_dir / "transcoders", scan))
        timed(nn_model, best_bs, given)
        result["nnsight_seconds_at_best_batch_size"] = min(timed(nn_model, best_bs, given)[0]
                                                            for _ in range(args.repeats))
        C.free(nn_model)

    settings["batch_size"] = best_bs
    summary = C.write_case_outputs(case_dir, NAME, graph, tgt, settings,
                                   {"logits_last_hf": hf_logits}, None)
    case = C.case_record(NAME, ms, ts, scan, given, graph, settings, {"kind": "salient"}, ["transformerlens"],
                         summary, script="scripts/circuit_tracer/time_attribution.py")
    case["benchmark"] = {"prompts_given": all_prompts, "timing": result}
    (case_dir / "case.json").write_text(json.dumps(case, indent=2) + "\n")
    C.free(tl)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
