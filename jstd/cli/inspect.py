"""``jstd inspect PATH``: a model's parameters (logical axes, shapes) and every site it serves, by host, with
layouts and sizes."""

from __future__ import annotations

import sys

import jax

from jstd.core.sites import SITES
from jstd.io.load import load
from jstd.nn.params import logical_axes
from jstd.cli.demo import ASSET


def axis_sizes(config, stack: str | None = None) -> dict[str, int]:
    """Layout axis name -> size on this model (for printing shapes); a tower's sizes for its stack's values."""
    v = config.vision
    if v is not None and (stack or "").startswith("vision"):
        sizes = {"heads": v.num_heads, "kv_heads": v.num_heads, "head_dim": v.head_dim, "qk_head_dim": v.head_dim,
                 "mlp": v.intermediate_size, "layers": v.num_layers}
    else:
        sizes = {"heads": config.num_heads, "kv_heads": config.num_kv_heads, "head_dim": config.head_dim,
                 "qk_head_dim": config.qk_head_dim, "mlp": config.intermediate_size, "layers": config.num_layers}
    sizes.update({"hidden": config.hidden_size, "embed": config.hidden_size, "vocab": config.vocab_size,
                  "experts": config.num_experts, "top_k": config.experts_per_token})
    if v is not None:
        sizes.update({"vision_hidden": v.hidden_size, "patches": v.positions, "grid": v.num_patches})
    return {k: n for k, n in sizes.items() if n is not None}


def describe(model) -> str:
    """The model tree: parameters with logical axes and shapes, and every site it serves by host."""
    lines = [f"{type(model).__name__} (model_type {model.config.model_type}): {model.config}"]
    if model.config.vision is not None:
        lines.append(f"vision tower: {model.config.vision}")
    lines += ["", "parameters:"]
    axes = logical_axes(model)
    for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(model), jax.tree.leaves(axes)):
        name = jax.tree_util.keystr(path).lstrip(".")
        dims = ", ".join(f"{a}={n}" for a, n in zip(spec, leaf.shape))
        lines.append(f"  {name:<34} [{dims}] {leaf.dtype}")
    lines += ["", "sites (layouts per block; 'layers.X' stacks the blocks that have X's host, as 'vision.layers.X' "
                  "does a tower's):"]
    hosts: dict[str, list] = {}
    for name in sorted(model.sites, key=list(SITES).index):
        hosts.setdefault(SITES[name].host, []).append(SITES[name])
    for host, sites in hosts.items():
        blocks = ""
        sizes = axis_sizes(model.config, sites[0].stack or host)
        if sites[0].per_block:
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


def add_arguments(subparsers) -> None:
    i = subparsers.add_parser("inspect", help="print a model's parameters and standard sites with layouts and shapes")
    i.add_argument("path", nargs="?", default=str(ASSET))


def command(args) -> int:
    try:
        model = load(args.path)
    except (OSError, ValueError) as e:  # a missing path, a bad checkpoint (CheckpointError), an unsupported model
        print(f"jstd inspect: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    print(describe(model))
    return 0
