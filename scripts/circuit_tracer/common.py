"""Shared pieces of the circuit-tracer reference scripts (run with .venv-ct/bin/python, see setup.sh).

Builds tiny random Hugging Face models and random transcoders *locally*, writes them in the on-disk layouts that
circuit-tracer 0.5.0 reads (HF folder; circuit-tracer's transcoder cache layout), loads them back through
circuit-tracer's own loaders, runs its `attribute`, `prune_graph`, `compute_graph_scores` and `create_graph_files`,
and writes one case folder in the contract layout of scripts/circuit_tracer/README.md. Every value written under
`graph.safetensors`, `pruned.safetensors`, `scores.json`, `graph.json` is circuit-tracer's own output.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_NNSIGHT = REPO / ".venv-ct" / "nnsight061"
if _NNSIGHT.is_dir() and str(_NNSIGHT) not in sys.path:
    sys.path.insert(0, str(_NNSIGHT))  # nnsight 0.6.1 + astor + IPython/socketio stubs (setup.sh)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import yaml  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

PAD, BOS, EOS, UNK = 0, 1, 2, 3


# ----------------------------------------------------------------------------------------------------------- models
@dataclasses.dataclass
class ModelSpec:
    family: str  # "llama" | "gemma2"
    vocab: int = 128
    d: int = 32
    d_mlp: int = 64
    n_layers: int = 3
    n_heads: int = 4
    n_kv: int = 2
    seed: int = 0
    sliding_window: int = 4  # gemma2 only
    attn_softcap: float = 8.0  # gemma2 only
    final_softcap: float = 10.0  # gemma2 only
    lm_std: float = 1.0  # Llama unembedding std (logits' spread)


def build_tokenizer(vocab: int):
    """A word-level tokenizer: <pad>=0, <bos>=1, <eos>=2, <unk>=3, then w4 .. w{vocab-1}."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<bos>", "<eos>", "<unk>"] + [f"w{i}" for i in range(4, vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def build_model(spec: ModelSpec, out: Path):
    """Random float32 model saved with save_pretrained (+ tokenizer) in `out`; returns the HF model (eager)."""
    import transformers

    torch.manual_seed(spec.seed)
    common = dict(
        vocab_size=spec.vocab,
        hidden_size=spec.d,
        intermediate_size=spec.d_mlp,
        num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        torch_dtype="float32",
    )
    if spec.family == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0)
        model = transformers.LlamaForCausalLM(cfg)
    elif spec.family == "gemma2":
        head_dim = spec.d // spec.n_heads
        cfg = transformers.Gemma2Config(
            **common,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=spec.sliding_window,
            attn_logit_softcapping=spec.attn_softcap,
            final_logit_softcapping=spec.final_softcap,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            rope_theta=10000.0,
        )
        model = transformers.Gemma2ForCausalLM(cfg)
    else:
        raise ValueError(spec.family)
    g = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm gains (Gemma stores w with scale 1 + w)
                base = 0.0 if spec.family == "gemma2" else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                std = 1.0 if spec.family == "llama" else 0.6  # gemma2: tied, so this is the unembedding too
                p.copy_(std * torch.randn(p.shape, generator=g))
            elif "lm_head" in name:
                p.copy_(spec.lm_std * torch.randn(p.shape, generator=g))
            else:
                gain = 2.0 if ("q_proj" in name or "k_proj" in name) else 1.0
                p.copy_(gain / math.sqrt(p.shape[1]) * torch.randn(p.shape, generator=g))
    model.config._attn_implementation = "eager"
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    # keep the folder loadable with any attention implementation; circuit-tracer forces eager itself
    cfgj = json.loads((out / "config.json").read_text())
    cfgj.pop("_attn_implementation_autoset", None)
    (out / "config.json").write_text(json.dumps(cfgj, indent=2, sort_keys=True) + "\n")
    build_tokenizer(spec.vocab).save_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    return model


def tl_config(model_dir: Path, hf_cfg):
    """The HookedTransformerConfig TransformerLens 3.2.1 would build for this HF config (its LlamaForCausalLM
    branch; its gemma-2-2b dict with this model's sizes, caps, window and layer types). TL's from_pretrained
    refuses local folders, so the steps of `TransformerLensReplacementModel.from_pretrained_and_transcoders` are
    replayed by hand in `load_tl` (CIRCUIT_TRACER.md section 4.3)."""
    from transformer_lens import HookedTransformerConfig

    arch = hf_cfg.architectures[0]
    n_kv = hf_cfg.num_key_value_heads if hf_cfg.num_key_value_heads != hf_cfg.num_attention_heads else None
    if arch == "LlamaForCausalLM":
        d_head = hf_cfg.hidden_size // hf_cfg.num_attention_heads
        d = dict(
            d_model=hf_cfg.hidden_size,
            d_head=d_head,
            n_heads=hf_cfg.num_attention_heads,
            d_mlp=hf_cfg.intermediate_size,
            n_layers=hf_cfg.num_hidden_layers,
            n_ctx=hf_cfg.max_position_embeddings,
            eps=hf_cfg.rms_norm_eps,
            d_vocab=hf_cfg.vocab_size,
            act_fn=hf_cfg.hidden_act,
            n_key_value_heads=n_kv,
            normalization_type="RMS",
            positional_embedding_type="rotary",
            rotary_adjacent_pairs=False,
            rotary_dim=d_head,
            rotary_base=hf_cfg.rope_theta,
            final_rms=True,
            gated_mlp=True,
        )
    elif arch == "Gemma2ForCausalLM":
        d = dict(
            d_model=hf_cfg.hidden_size,
            d_head=hf_cfg.head_dim,
            n_heads=hf_cfg.num_attention_heads,
            d_mlp=hf_cfg.intermediate_size,
            n_layers=hf_cfg.num_hidden_layers,
            n_ctx=hf_cfg.max_position_embeddings,
            eps=hf_cfg.rms_norm_eps,
            d_vocab=hf_cfg.vocab_size,
            act_fn="gelu_pytorch_tanh",
            initializer_range=0.02,
            normalization_type="RMS",
            rotary_base=hf_cfg.rope_theta,
            positional_embedding_type="rotary",
            use_attn_scale=True,
            attn_scale=math.sqrt(hf_cfg.query_pre_attn_scalar),
            n_key_value_heads=n_kv,
            window_size=hf_cfg.sliding_window,
            use_local_attn=True,
            attn_types=["local" if t == "sliding_attention" else "global" for t in hf_cfg.layer_types],
            attn_scores_soft_cap=hf_cfg.attn_logit_softcapping,
            output_logits_soft_cap=hf_cfg.final_logit_softcapping,
            gated_mlp=True,
            final_rms=True,
            use_normalization_before_and_after=True,
        )
    else:
        raise ValueError(arch)
    d.update(
        original_architecture=arch,
        tokenizer_name=str(model_dir),
        model_name=model_dir.name,
        init_weights=False,
        device="cpu",
        n_devices=1,
        dtype=torch.float32,
        default_prepend_bos=True,
        from_checkpoint=False,
    )
    return HookedTransformerConfig.from_dict(d)


def load_tl(model_dir: Path, hf_model, transcoders):
    """circuit-tracer's TransformerLens replacement model, built exactly as `from_pretrained_and_transcoders`
    does (fold_ln=False, center_writing_weights=False, center_unembed=False, the other defaults)."""
    from transformer_lens import loading_from_pretrained as loading

    from circuit_tracer.replacement_model.replacement_model_transformerlens import TransformerLensReplacementModel

    cfg = tl_config(model_dir, hf_model.config)
    state_dict = loading.get_pretrained_state_dict(str(model_dir), cfg, hf_model, dtype=torch.float32)
    model = TransformerLensReplacementModel(cfg, None, move_to_device=False, default_padding_side="right")
    model.load_and_process_state_dict(
        state_dict,
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=True,
        refactor_factored_attn_matrices=False,
    )
    model.move_model_modules_to_device()
    model._configure_replacement_model(transcoders)
    return model


def load_nnsight(model_dir: Path, transcoders):
    from circuit_tracer import ReplacementModel

    return ReplacementModel.from_pretrained_and_transcoders(
        model_name=str(model_dir), transcoders=transcoders, backend="nnsight", device=torch.device("cpu")
    )


# ------------------------------------------------------------------------------------------------------ transcoders
@dataclasses.dataclass
class TranscoderSpec:
    kind: str  # "plt" | "clt"
    act: str  # "relu" | "jump_relu"
    skip: bool
    width: int
    input_hook: str
    output_hook: str
    seed: int = 1
    enc_bias: float | None = None  # ReLU: mean b_enc; JumpReLU: mean b_enc (threshold ~0.9)
    dec_std: float = 0.3
    force_layer0: int = 0  # make layer-0 features 0..force_layer0-1 always active (JSON id collision case)


def random_transcoder_params(spec: TranscoderSpec, n_layers: int, d: int):
    """Random parameters, per layer l: W_enc [F, d], b_enc [F], b_dec [d], threshold [F] (JumpReLU),
    W_dec [F, d] (PLT) or [F, L - l, d] (CLT), W_skip [d, d] (skip(x) = x @ W_skip.T for a PLT, x @ W_skip for a
    CLT)."""
    g = torch.Generator().manual_seed(spec.seed)
    F = spec.width
    relu = spec.act == "relu"
    b0 = spec.enc_bias if spec.enc_bias is not None else (-1.2 if relu else -0.3)
    layers = []
    for l in range(n_layers):
        p = {
            "W_enc": torch.randn(F, d, generator=g) / math.sqrt(d),
            "b_enc": b0 + 0.2 * torch.randn(F, generator=g),
            "b_dec": 0.1 * torch.randn(d, generator=g),
        }
        if l == 0 and spec.force_layer0:
            p["b_enc"][: spec.force_layer0] = 3.0
        if not relu:
            p["threshold"] = 0.9 + 0.2 * torch.rand(F, generator=g)
        if spec.kind == "plt":
            p["W_dec"] = spec.dec_std * torch.randn(F, d, generator=g)
        else:
            p["W_dec"] = spec.dec_std * torch.randn(F, n_layers - l, d, generator=g)
        if spec.skip:
            p["W_skip"] = 0.5 / math.sqrt(d) * torch.randn(d, d, generator=g)
        layers.append(p)
    return layers


def write_transcoders(spec: TranscoderSpec, params, out: Path, scan: str, model_dir_name: str):
    """Write the transcoders with circuit-tracer's own writers (`SingleLayerTranscoder.to_safetensors`,
    `CrossLayerTranscoder.to_safetensors`) in its cache layout, plus config.yaml. A CLT's W_skip is not part of
    circuit-tracer's format: it is written apart, as W_skip.safetensors {"W_skip": [L, d, d]}."""
    import torch.nn.functional as Fn

    from circuit_tracer.transcoder.activation_functions import JumpReLU
    from circuit_tracer.transcoder.cross_layer_transcoder import CrossLayerTranscoder
    from circuit_tracer.transcoder.single_layer_transcoder import SingleLayerTranscoder

    out.mkdir(parents=True, exist_ok=True)
    L = len(params)
    F, d = params[0]["W_enc"].shape
    cpu = torch.device("cpu")
    if spec.kind == "plt":
        for l, p in enumerate(params):
            act = JumpReLU(p["threshold"].clone(), 0.1) if "threshold" in p else Fn.relu
            tc = SingleLayerTranscoder(d, F, act, l, skip_connection=spec.skip, device=cpu, dtype=torch.float32)
            with torch.no_grad():
                for k in ("W_enc", "W_dec", "b_enc", "b_dec") + (("W_skip",) if spec.skip else ()):
                    getattr(tc, k).copy_(p[k])
            tc.to_safetensors(str(out / f"layer_{l}.safetensors"))
        kind = "transcoder_set"
    else:
        clt = CrossLayerTranscoder(
            L, F, d, activation_function=spec.act, skip_connection=False, lazy_decoder=False,
            feature_input_hook=spec.input_hook, feature_output_hook=spec.output_hook, scan=scan,
            device=cpu, dtype=torch.float32,
        )
        with torch.no_grad():
            for l, p in enumerate(params):
                clt.W_enc[l].copy_(p["W_enc"])
                clt.b_enc[l].copy_(p["b_enc"])
                clt.b_dec[l].copy_(p["b_dec"])
                clt.W_dec[l].copy_(p["W_dec"])
                if spec.act == "jump_relu":
                    clt.activation_function.threshold[l, 0].copy_(p["threshold"])
        clt.to_safetensors(str(out))
        if spec.skip:
            save_file({"W_skip": torch.stack([p["W_skip"] for p in params]).contiguous()},
                      str(out / "W_skip.safetensors"))
        kind = "cross_layer_transcoder"
    config = {
        "model_kind": kind,
        "model_name": model_dir_name,
        "feature_input_hook": spec.input_hook,
        "feature_output_hook": spec.output_hook,
        "scan": scan,
    }
    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def load_transcoders(tc_dir: Path, ref: str):
    """Load through circuit-tracer's own cache loader (`load_transcoder_from_hub`, no network): a temporary
    cache dir whose `<ref>` entry links to `tc_dir`. A CLT W_skip.safetensors is attached in memory."""
    from safetensors.torch import load_file

    from circuit_tracer.utils.hf_utils import load_transcoder_from_hub

    with tempfile.TemporaryDirectory() as cache:
        link = Path(cache) / ref
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(tc_dir.resolve(), target_is_directory=True)
        tcs, _ = load_transcoder_from_hub(
            ref, device=torch.device("cpu"), dtype=torch.float32, cache_dir=cache,
            lazy_encoder=False, lazy_decoder=False,
        )
    skip = tc_dir / "W_skip.safetensors"
    if skip.exists():  # CLT skip: circuit-tracer has no file format for it, in memory only
        tcs.W_skip = torch.nn.Parameter(load_file(str(skip))["W_skip"].to(torch.float32), requires_grad=False)
        tcs.skip_connection = True
    return tcs


# ------------------------------------------------------------------------------------------------------- attribute
class _TargetsRecorder:
    """Wraps circuit-tracer's AttributionTargets in attribute.py to keep the instance it builds (its demeaned
    logit vectors are then saved as they were used)."""

    last = None

    def __enter__(self):
        import circuit_tracer.attribution.attribute as A

        self._mod, self._orig = A, A.AttributionTargets
        rec = self

        class Recording(self._orig):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                rec.last = self

        A.AttributionTargets = Recording
        return self

    def __exit__(self, *exc):
        self._mod.AttributionTargets = self._orig


def run_attribute(model, prompt_ids, settings, targets=None):
    from circuit_tracer import attribute

    with _TargetsRecorder() as rec:
        graph = attribute(
            prompt_ids,
            model,
            attribution_targets=targets,
            max_n_logits=settings["max_n_logits"],
            desired_logit_prob=settings["desired_logit_prob"],
            batch_size=settings["batch_size"],
            max_feature_nodes=settings["max_feature_nodes"],
            update_interval=settings["update_interval"],
        )
    return graph, rec.last


def tl_internals(model, input_tokens):
    """circuit-tracer's own intermediate values on its TransformerLens model, for debugging a re-implementation:
    `feature_inputs` [L, n, d] (x at blocks.l.<feature_input_hook>), `feature_outputs` [L, n, d] (y at
    blocks.l.<feature_output_hook>), and from its `setup_attribution` context `error_vectors` [L, n, d]
    (y - reconstruction, position 0 zeroed) and `token_vectors` [n, d] (W_E[tokens], Gemma's sqrt(d) included);
    `final_norm_output` [n, d] (ln_final of the last block's output, with its gain: logit targets read it)."""
    ins = [f"blocks.{l}.{model.feature_input_hook}" for l in range(model.cfg.n_layers)]
    outs = [f"blocks.{l}.{model.original_feature_output_hook}" for l in range(model.cfg.n_layers)]
    last = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
    with torch.no_grad():
        _, cache = model.run_with_cache(input_tokens[None],
                                        names_filter=lambda n: n in ins or n in outs or n == last)
        ctx = model.setup_attribution(input_tokens)
        final = model.ln_final(cache[last])[0]  # what circuit-tracer's run_forward_pass caches for logit targets
    return {
        "final_norm_output": final,
        "feature_inputs": torch.stack([cache[n][0] for n in ins]),
        "feature_outputs": torch.stack([cache[n][0] for n in outs]),
        "error_vectors": ctx.error_vectors,
        "token_vectors": ctx.token_vectors,
    }


def compare_graphs(a, b):
    """Agreement of two circuit-tracer Graphs (TL vs nnsight)."""
    out = {
        "same_input_tokens": bool(torch.equal(a.input_tokens.cpu(), b.input_tokens.cpu())),
        "same_active_features": bool(torch.equal(a.active_features, b.active_features)),
        "same_selected_features": bool(torch.equal(a.selected_features, b.selected_features)),
        "same_logit_targets": [t.vocab_idx for t in a.logit_targets] == [t.vocab_idx for t in b.logit_targets],
    }
    if out["same_active_features"]:
        out["activation_values_max_abs_diff"] = float((a.activation_values - b.activation_values).abs().max())
    if out["same_logit_targets"]:
        out["logit_probabilities_max_abs_diff"] = float(
            (a.logit_probabilities - b.logit_probabilities).abs().max())
    if a.adjacency_matrix.shape == b.adjacency_matrix.shape:
        diff = (a.adjacency_matrix - b.adjacency_matrix).abs()
        scale = a.adjacency_matrix.abs().max()
        out["adjacency_max_abs"] = float(scale)
        out["adjacency_max_abs_diff"] = float(diff.max())
        out["adjacency_max_rel_diff"] = float(diff.max() / scale)  # relative to the matrix's largest entry
        nz = a.adjacency_matrix.abs() > 1e-3 * scale
        out["adjacency_max_entrywise_rel_diff_above_1e-3"] = float(
            (diff[nz] / a.adjacency_matrix.abs()[nz]).max()) if nz.any() else 0.0
    return out


def graph_tensors(graph, targets, custom_vectors=None):
    t = {
        "adjacency_matrix": graph.adjacency_matrix,
        "active_features": graph.active_features,
        "activation_values": graph.activation_values,
        "selected_features": graph.selected_features,
        "logit_token_ids": graph.logit_token_ids,
        "logit_probabilities": graph.logit_probabilities,
        "input_tokens": graph.input_tokens,
        "logit_vectors": targets.logit_vectors,
    }
    if custom_vectors is not None:
        t["custom_target_vectors"] = custom_vectors
    return {k: v.detach().cpu().contiguous() for k, v in t.items()}


def write_case_outputs(case_dir: Path, slug: str, graph, targets, settings, extras: dict, custom_vectors=None):
    """graph.safetensors, pruned.safetensors, scores.json, graph.json + graph-metadata.json."""
    from circuit_tracer.graph import compute_graph_scores, prune_graph
    from circuit_tracer.utils.create_graph_files import create_graph_files

    tensors = graph_tensors(graph, targets, custom_vectors)
    tensors.update({k: v.detach().cpu().contiguous() for k, v in extras.items()})
    save_file(tensors, str(case_dir / "graph.safetensors"))
    pr = prune_graph(graph, settings["node_threshold"], settings["edge_threshold"])
    save_file(
        {"node_mask": pr.node_mask.contiguous(), "edge_mask": pr.edge_mask.contiguous(),
         "cumulative_scores": pr.cumulative_scores.contiguous()},
        str(case_dir / "pruned.safetensors"),
    )
    replacement, completeness = compute_graph_scores(graph)
    (case_dir / "scores.json").write_text(
        json.dumps({"replacement_score": replacement, "completeness_score": completeness}, indent=2) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        create_graph_files(graph, slug, tmp, node_threshold=settings["node_threshold"],
                           edge_threshold=settings["edge_threshold"])
        shutil.copy(Path(tmp) / f"{slug}.json", case_dir / "graph.json")
        shutil.copy(Path(tmp) / "graph-metadata.json", case_dir / "graph-metadata.json")
    nodes = json.loads((case_dir / "graph.json").read_text())["nodes"]
    ids = [n["node_id"] for n in nodes]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    return {
        "n_pruned_nodes": int(pr.node_mask.sum()),
        "n_pruned_edges": int(pr.edge_mask.sum()),
        "json_nodes": len(nodes),
        "json_duplicate_node_ids": dup,
        "replacement_score": replacement,
        "completeness_score": completeness,
    }


def free(model):
    """TransformerLensReplacementModel.__del__ can raise at interpreter exit; drop models explicitly."""
    try:
        del model
    except Exception:
        pass
    import gc

    gc.collect()


def case_record(name, ms, ts, scan, given, graph, settings, targets_info, backends, summary,
                script="scripts/circuit_tracer/reference.py"):
    """case.json of the contract layout (scripts/circuit_tracer/README.md)."""
    from importlib.metadata import version

    return {
        "name": name,
        "generated_by": {
            "script": script,
            "circuit-tracer": version("circuit-tracer"),
            "transformer-lens": version("transformer-lens"),
            "transformers": version("transformers"),
            "torch": torch.__version__,
        },
        "family": ms.family,
        "model": {k: getattr(ms, k) for k in ("vocab", "d", "d_mlp", "n_layers", "n_heads", "n_kv", "seed")}
        | ({"sliding_window": ms.sliding_window, "attn_logit_softcapping": ms.attn_softcap,
            "final_logit_softcapping": ms.final_softcap} if ms.family == "gemma2" else {}),
        "transcoders": {
            "kind": ts.kind,
            "activation": ts.act,
            "skip": ts.skip,
            "skip_in_memory_only": ts.kind == "clt" and ts.skip,
            "width": ts.width,
            "feature_input_hook": ts.input_hook,
            "feature_output_hook": ts.output_hook,
            "scan": scan,
        },
        "prompt_ids_given": given,
        "input_tokens": graph.input_tokens.tolist(),
        "input_string": graph.input_string,
        "zero_positions": [0],
        "settings": settings,
        "targets": targets_info,
        "logit_targets": [{"token_str": t.token_str, "vocab_idx": t.vocab_idx} for t in graph.logit_targets],
        "vocab_size": graph.vocab_size,
        "slug": name,
        "backends": backends,
        "counts": {
            "n_pos": len(graph.input_tokens),
            "n_active_features": len(graph.active_features),
            "n_selected_features": len(graph.selected_features),
            "n_logits": len(graph.logit_targets),
            "n_nodes": graph.adjacency_matrix.shape[0],
        },
        "summary": summary,
    }
