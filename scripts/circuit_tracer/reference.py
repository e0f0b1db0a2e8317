"""Reference attribution graphs from circuit-tracer 0.5.0 itself, for jstd's tests (issue 37).

    bash scripts/circuit_tracer/setup.sh            # once: .venv-ct (make circuit-tracer)
    .venv-ct/bin/python scripts/circuit_tracer/reference.py [--out tests/data/circuit_tracer] [--only CASE ...]
                                                    [--no-nnsight]

For every case: a tiny random model (HF folder, float32, eager attention) and random transcoders written in
circuit-tracer's cache layout, loaded back through circuit-tracer's loaders; `attribute` on the TransformerLens
backend (the stored graph) and on the nnsight backend (compared in backends.json); `prune_graph`,
`compute_graph_scores`, `create_graph_files`. Layout of a case folder: scripts/circuit_tracer/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402  (sets sys.path / offline env before torch and circuit_tracer)
import torch  # noqa: E402

LLAMA_HOOKS = ("mlp.hook_in", "mlp.hook_out")
GEMMA2_HOOKS = ("ln2.hook_normalized", "hook_mlp_out")

DEFAULTS = dict(
    max_n_logits=10,
    desired_logit_prob=0.95,
    batch_size=64,
    max_feature_nodes=None,
    update_interval=4,
    node_threshold=0.8,
    edge_threshold=0.98,
)


def case_list():
    def llama(**k):
        return C.ModelSpec("llama", **k)

    def gemma(**k):
        return C.ModelSpec("gemma2", **k)

    def tc(kind, act, skip, hooks=LLAMA_HOOKS, width=32, **k):
        return C.TranscoderSpec(kind, act, skip, width, hooks[0], hooks[1], **k)

    return {
        "llama_plt_relu": dict(model=llama(), tc=tc("plt", "relu", False)),
        "llama_plt_relu_skip": dict(model=llama(), tc=tc("plt", "relu", True)),
        "llama_plt_jumprelu": dict(model=llama(), tc=tc("plt", "jump_relu", False)),
        "llama_plt_jumprelu_skip": dict(model=llama(), tc=tc("plt", "jump_relu", True)),
        "llama_clt_jumprelu": dict(model=llama(), tc=tc("clt", "jump_relu", False, width=24)),
        "llama_clt_relu_skip": dict(model=llama(), tc=tc("clt", "relu", True, width=24)),
        # features visited in influence order, batch_size 8 x update_interval 4 per ranking round
        "llama_plt_relu_maxnodes": dict(model=llama(), tc=tc("plt", "relu", True),
                                        settings=dict(batch_size=8, max_feature_nodes="half")),
        "llama_targets_ids": dict(model=llama(), tc=tc("plt", "jump_relu", False), targets="ids"),
        "llama_targets_custom": dict(model=llama(), tc=tc("clt", "relu", False, width=24), targets="custom"),
        # layer-0 features 0..2 always active: their JSON ids 0_f_p collide with error nodes 0_l_p (l = f)
        "llama_plt_relu_collision": dict(model=llama(), tc=tc("plt", "relu", False, force_layer0=3)),
        "gemma2_plt_jumprelu": dict(model=gemma(), tc=tc("plt", "jump_relu", False, hooks=GEMMA2_HOOKS)),
        "gemma2_clt_relu": dict(model=gemma(), tc=tc("clt", "relu", False, hooks=GEMMA2_HOOKS, width=24)),
    }


def prompt_ids(vocab: int, n: int = 11, seed: int = 7) -> list[int]:
    """n - 1 token ids without BOS (circuit-tracer prepends <bos>=1 itself): a repeated random phrase."""
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(4, vocab, (5,), generator=g).tolist()
    return (half * 3)[: n - 1]


def make_targets(kind, hf_logits, W_U, d):
    """Custom targets from the model's own logits: 'ids' = token ids (top-1, top-3 and the least likely);
    'custom' = CustomTarget directions (logit difference of the top two tokens, and a random direction)."""
    from circuit_tracer.attribution.targets import CustomTarget

    order = torch.argsort(hf_logits, descending=True)
    if kind == "ids":
        ids = torch.tensor([int(order[0]), int(order[2]), int(order[-1])])
        return ids, {"kind": "token_ids", "token_ids": ids.tolist()}, None
    a, b = int(order[0]), int(order[1])
    g = torch.Generator().manual_seed(11)
    vecs = torch.stack([W_U[:, a] - W_U[:, b], torch.randn(d, generator=g)]).to(torch.float32)
    specs = [CustomTarget(f"logit(w{a})-logit(w{b})", 0.7, vecs[0]), CustomTarget("random-direction", 0.3, vecs[1])]
    info = {
        "kind": "custom",
        "custom": [{"token_str": s.token_str, "prob": s.prob, "vector": f"custom_target_vectors[{i}]"}
                   for i, s in enumerate(specs)],
        "note": "vectors used as given (not demeaned); virtual vocab ids vocab_size + i",
    }
    return specs, info, vecs


def run_case(name, spec, out_root: Path, nnsight: bool):
    t0 = time.time()
    case_dir = out_root / name
    if case_dir.exists():
        import shutil

        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)
    ms, ts = spec["model"], spec["tc"]
    settings = dict(DEFAULTS, **spec.get("settings", {}))
    model_dir = case_dir / "model"
    hf = C.build_model(ms, model_dir)
    scan = f"local/{name}"
    params = C.random_transcoder_params(ts, ms.n_layers, ms.d)
    C.write_transcoders(ts, params, case_dir / "transcoders", scan, "model")

    given = prompt_ids(ms.vocab)
    ids_with_bos = torch.tensor([C.BOS] + given)
    with torch.no_grad():
        hf_logits = hf(ids_with_bos[None]).logits[0, -1].float()

    # ---- TransformerLens backend (the stored graph)
    tl = C.load_tl(model_dir, hf, C.load_transcoders(case_dir / "transcoders", scan))
    with torch.no_grad():
        tl_logits = tl(ids_with_bos[None])[0, -1].float()
    tl_vs_hf = float((tl_logits - hf_logits).abs().max())
    assert tl_vs_hf < 1e-4, f"{name}: TransformerLens logits differ from HF eager by {tl_vs_hf}"
    targets, targets_info, custom_vecs = None, {"kind": "salient"}, None
    if spec.get("targets"):
        targets, targets_info, custom_vecs = make_targets(spec["targets"], hf_logits, tl.unembed_proj.detach(), ms.d)
    if settings["max_feature_nodes"] == "half":
        n_active = tl.setup_attribution(tl.ensure_tokenized(given)).activation_matrix._nnz()
        settings["max_feature_nodes"] = n_active // 2
    graph, tgt = C.run_attribute(tl, given, settings, targets)
    internals = C.tl_internals(tl, graph.input_tokens)
    n = len(graph.input_tokens)
    act = graph.active_features
    assert (act[:, 1] == n - 1).any(), f"{name}: no active feature at the last position (CIRCUIT_TRACER.md s6)"
    if settings["max_feature_nodes"] is not None:
        assert settings["max_feature_nodes"] < len(act), (settings["max_feature_nodes"], len(act))

    # ---- nnsight backend
    backends = {"stored": "transformerlens", "tl_logits_vs_hf_eager_max_abs_diff": tl_vs_hf}
    if nnsight:
        try:
            nn_model = C.load_nnsight(model_dir, C.load_transcoders(case_dir / "transcoders", scan))
            g_nn, _ = C.run_attribute(nn_model, given, settings, targets)
            backends["nnsight"] = C.compare_graphs(graph, g_nn)
            C.free(nn_model)
        except Exception as e:  # recorded, not hidden
            backends["nnsight"] = {"error": f"{type(e).__name__}: {e}"}

    extras = {"logits_last_hf": hf_logits, "logits_last_tl": tl_logits, **internals}
    summary = C.write_case_outputs(case_dir, name, graph, tgt, settings, extras, custom_vecs)
    (case_dir / "backends.json").write_text(json.dumps(backends, indent=2) + "\n")

    case = C.case_record(name, ms, ts, scan, given, graph, settings, targets_info,
                         ["transformerlens"] + (["nnsight"] if nnsight else []), summary)
    (case_dir / "case.json").write_text(json.dumps(case, indent=2) + "\n")
    C.free(tl)
    nn_info = backends.get("nnsight", {})
    print(f"{name}: n={n} active={len(act)} sel={len(graph.selected_features)} logits={len(graph.logit_targets)} "
          f"N={graph.adjacency_matrix.shape[0]} pruned={summary['n_pruned_nodes']} dup_ids={summary['json_duplicate_node_ids']} "
          f"nnsight={ {k: v for k, v in nn_info.items() if 'diff' in k or k == 'error'} } ({time.time() - t0:.1f}s)",
          flush=True)
    return case


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(C.REPO / "tests" / "data" / "circuit_tracer"))
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--no-nnsight", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cases = case_list()
    names = args.only or list(cases)
    out = Path(args.out)
    for name in names:
        run_case(name, cases[name], out, not args.no_nnsight)


if __name__ == "__main__":
    main()
