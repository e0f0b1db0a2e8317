"""The ``jstd`` command: ``jstd demo`` runs the embedded model; ``jstd inspect PATH`` prints a model's sites."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ASSET = Path(__file__).parent / "assets" / "tiny-llama"


def axis_sizes(config) -> dict[str, int]:
    """Layout axis name -> size on this model (for printing shapes)."""
    return {
        "hidden": config.hidden_size, "embed": config.hidden_size, "heads": config.num_heads,
        "kv_heads": config.num_kv_heads, "head_dim": config.head_dim, "qk_head_dim": config.qk_head_dim,
        "vocab": config.vocab_size, "mlp": config.intermediate_size, "layers": config.num_layers,
    }


def describe(model) -> str:
    """The model tree: parameters with logical axes and shapes, and every site it serves by host."""
    import jax

    from jstd.models.base import logical_axes
    from jstd.sites import SITES

    sizes = axis_sizes(model.config)
    lines = [f"{type(model).__name__} (model_type {model.config.model_type}): {model.config}", "", "parameters:"]
    axes = logical_axes(model)
    for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(model), jax.tree.leaves(axes)):
        name = jax.tree_util.keystr(path).lstrip(".")
        dims = ", ".join(f"{a}={n}" for a, n in zip(spec, leaf.shape))
        lines.append(f"  {name:<34} [{dims}] {leaf.dtype}")
    lines += ["", "sites (layouts per block; 'layers.X' stacks the blocks that have X's host):"]
    hosts: dict[str, list] = {}
    for name in sorted(model.sites, key=list(SITES).index):
        hosts.setdefault(SITES[name].host, []).append(SITES[name])
    for host, sites in hosts.items():
        blocks = ""
        if host.startswith("layers"):
            blocks = f"  × {len(model.blocks_for(sites[0].name))} blocks"
        lines.append(f"  {host}{blocks}")
        for s in sites:
            shape = ", ".join(f"{a}" + (f"={sizes[a]}" if a in sizes else "") for a in s.layout)
            ro = "" if s.editable else "  (read-only)"
            only = ""
            if s.per_block and model.blocks_for(s.name) != model.blocks_for(sites[0].name):
                only = f"  (blocks {', '.join(map(str, model.blocks_for(s.name)))} only)"
            lines.append(f"    {s.name.rsplit('.', 1)[-1]:<26} [{shape}]{ro}{only}")
            lines.append(f"      {s.meaning}")
    return "\n".join(lines)


def demo(path=ASSET, prompt="The capital of France is") -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jstd

    model = jstd.load(path)
    tok = jstd.load_processor(path)
    ids = tok(prompt, return_tensors="np")["input_ids"]
    print(f"model: {path} ({type(model).__name__}: {model.config.num_layers} blocks, hidden {model.config.hidden_size})")
    print(f"prompt: {prompt!r} -> {ids.shape[1]} tokens {ids[0].tolist()}")

    reads = ("token_embeddings", "layers.layer_input", "layers.self_attn.attention_output", "layers.mlp.mlp_output",
             "layers.layer_output", "layers.1.self_attn.attention_probabilities", "layers.mlp.mlp_neurons",
             "next_token_probs")
    run = jax.jit(jstd.run, static_argnames="reads")
    out = run(model, ids, reads=reads)

    def top(probs, k=5):
        order = np.argsort(-np.asarray(probs))[:k]
        return ", ".join(f"{tok.decode([int(i)])!r} {float(probs[i]):.3f}" for i in order)

    print(f"\ntop next tokens: {top(out['next_token_probs'][0])}")
    print("\nstandard values read:")
    for site in reads:
        print(f"  {site:<44} {tuple(out[site].shape)}")
    x, a, m, y = (out[s] for s in ("layers.layer_input", "layers.self_attn.attention_output",
                                    "layers.mlp.mlp_output", "layers.layer_output"))
    print(f"\nblock identity layer_input + attention_output + mlp_output == layer_output: "
          f"max |diff| {float(jnp.abs(x + a + m - y).max()):.2e} over {y.shape[0]} blocks")
    lens = jstd.project_on_vocab(model, y[:, 0, -1])
    print("logit lens at the last position, top token per block: "
          + ", ".join(repr(tok.decode([int(i)])) for i in np.argmax(lens, -1)))

    edit = jstd.Zero("layers.mlp.mlp_output", layer=model.config.num_layers - 1)
    edited = run(model, ids, [edit], reads=("next_token_probs",))
    p, q = out["next_token_probs"][0], edited["next_token_probs"][0]
    kl = float(jnp.sum(p * (jnp.log(p) - jnp.log(q))))
    print(f"\nedit: jstd.Zero('layers.mlp.mlp_output', layer={edit.layer}) (ablate the last block's MLP)")
    print(f"  top next tokens now: {top(q)}")
    print(f"  KL(clean || edited) = {kl:.4f}, max |Δlogit| = {float(jnp.abs(edited.logits - out.logits).max()):.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jstd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the embedded tiny Llama: top tokens, values, identity, an edit")
    d.add_argument("--model", default=str(ASSET), help="a checkpoint folder or repo id (default: the embedded one)")
    d.add_argument("--prompt", default="The capital of France is")
    i = sub.add_parser("inspect", help="print a model's parameters and standard sites with layouts and shapes")
    i.add_argument("path", nargs="?", default=str(ASSET))
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo(args.model, args.prompt)
    else:
        import jstd

        print(describe(jstd.load(args.path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
