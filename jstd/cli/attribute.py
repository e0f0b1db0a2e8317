"""``jstd attribute MODEL --transcoders DIR --prompt TEXT --out DIR``: the attribution graph of a prompt, pruned, as
the JSON circuit-tracer's local server and Neuronpedia read (``<slug>.json`` and ``graph-metadata.json``), and the
whole graph (``graph.safetensors`` + ``graph_meta.json``, ``jstd.circuits.Graph.load``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from jstd.circuits import attribute, load_transcoders, write_frontend
from jstd.io.load import load
from jstd.io.processor import load_processor


def add_arguments(subparsers) -> None:
    p = subparsers.add_parser("attribute", help="the attribution graph of a prompt through transcoders (circuit "
                                                "tracing), written as circuit-tracer's frontend JSON")
    p.add_argument("path", help="a checkpoint folder or hub repo id")
    p.add_argument("--transcoders", required=True, help="a circuit-tracer transcoder folder (config.yaml) or a "
                                                        "reference in its cache or the HuggingFace cache")
    p.add_argument("--prompt", required=True, help="the prompt text (a BOS is prepended as circuit-tracer does)")
    p.add_argument("--out", required=True, help="the folder to write <slug>.json, graph-metadata.json and the graph")
    p.add_argument("--slug", default=None, help="the graph's name (default: from the prompt)")
    p.add_argument("--max-n-logits", type=int, default=10)
    p.add_argument("--desired-logit-prob", type=float, default=0.95)
    p.add_argument("--max-feature-nodes", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--edges-per-row", type=int, default=None,
                   help="keep each row's N largest edges (a sparse graph: memory N per row, not the node count); "
                        "default: the dense adjacency")
    p.add_argument("--node-threshold", type=float, default=0.8)
    p.add_argument("--edge-threshold", type=float, default=0.98)
    p.add_argument("--circuit-tracer-ids", action="store_true",
                   help="write circuit-tracer's error ids (0_{layer}_{pos}, which can collide with layer-0 features)")


def command(args) -> int:
    """Exit status 1 with a one-line message for transcoders that are missing or do not fit the model."""
    try:
        transcoders = load_transcoders(args.transcoders)
        model = load(args.path)
        tokenizer = load_processor(args.path)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        graph = attribute(model, args.prompt, transcoders, max_n_logits=args.max_n_logits,
                          desired_logit_prob=args.desired_logit_prob, max_feature_nodes=args.max_feature_nodes,
                          batch_size=args.batch_size, tokenizer=tokenizer, edges_per_row=args.edges_per_row)
    except (FileNotFoundError, ValueError) as e:
        print(f"jstd attribute: {e}", file=sys.stderr)
        return 1
    slug = args.slug or (re.sub(r"[^a-z0-9]+", "-", args.prompt.lower()).strip("-")[:48] or "graph")
    out = Path(args.out)
    graph.save(out / slug)
    path = write_frontend(graph, slug, out, node_threshold=args.node_threshold, edge_threshold=args.edge_threshold,
                          scan=graph.scan or str(args.transcoders), circuit_tracer_ids=args.circuit_tracer_ids)
    print(f"{path} ({graph.n_features} features, {graph.n_logits} logit targets; graph in {out / slug})")
    return 0
