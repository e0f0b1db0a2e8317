"""``jstd aot MODEL_OR_CONFIG --target v5e:16x16 --layout FSDP_TP --program forward,grad,sweep,generate``: compile
jstd's programs for a TPU slice or GPUs without one (``jstd.aot``, the ``aot`` extra) and report bytes per chip,
FLOPs and collectives; exit status 1, with the numbers, when a program does not fit a chip."""

from __future__ import annotations

import sys


def add_arguments(sub) -> None:
    p = sub.add_parser("aot", help="compile for a TPU topology or described GPUs, no device needed; does it fit?",
                       description=__doc__)
    p.add_argument("model", help="a preset (llama-3.1-8b, qwen3.5-4b, llava-1.5-7b, gpt-oss-20b, deepseek-v2-lite), "
                                 "a config.json or a checkpoint folder (only its config.json is read)")
    p.add_argument("--target", default="v5e:16x16", help="a TPU topology (v5e:16x16, v5p:4x4x4, v6e:8x8) or GPUs "
                                                         "(8xh200); default v5e:16x16")
    p.add_argument("--layout", default="FSDP_TP", help="DP, FSDP, TP or FSDP_TP (default)")
    p.add_argument("--program", default="forward", help="comma-separated: forward, grad, sweep, generate, "
                                                      "attribute, or all")
    p.add_argument("--model-axis", type=int, default=None, help="devices on the mesh's model axis (default: 4 on "
                                                                "large slices, 8 on one 8-GPU host)")
    p.add_argument("--batch", type=int, default=8, help="rows; attribute: targets per batch (default 8)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per row (default 1024)")
    p.add_argument("--blocks", type=int, default=None, help="cut every stack to this many blocks (a quick compile)")
    p.add_argument("--new", type=int, default=16, help="tokens generate adds (default 16)")
    p.add_argument("--entries", type=int, default=None, help="a sweep chunk's entries (default: the data axis)")
    p.add_argument("--features", type=int, default=16384, help="attribute: CLT features per block (default 16384)")
    p.add_argument("--active", type=int, default=64, help="attribute: active features per block and position "
                                                          "(default 64)")
    p.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    p.add_argument("--markdown", action="store_true", help="print markdown table rows instead")


def command(args) -> int:
    import jax

    try:  # deviceless: JAX itself runs on the CPU (and the CUDA plugin registers without a driver)
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:
        pass
    import jax.numpy as jnp

    from jstd import aot

    programs = aot.PROGRAMS if args.program == "all" else tuple(p.strip() for p in args.program.split(","))
    try:
        target = aot.target(args.target)
    except (aot.AotUnavailable, ValueError) as e:
        print(f"jstd aot: {e}", file=sys.stderr)
        return 2
    status = 0
    for name in programs:
        try:
            report = aot.compile(args.model, target, program_name=name, layout=args.layout,
                                 model_axis=args.model_axis, batch=args.batch, seq=args.seq, blocks=args.blocks,
                                 dtype=jnp.dtype(args.dtype), entries=args.entries, new=args.new,
                                 features=args.features, active=args.active)
            print(report.row() if args.markdown else report, flush=True)
            aot.check(report)
        except aot.DoesNotFit as e:
            print(f"jstd aot: {e}", file=sys.stderr)
            status = 1
    return status
