"""A sharded jstd run and patching sweep on one host or many (a TPU pod slice, several GPU hosts).

One process per host, each running this same script:

    # one machine (GPUs, or CPU devices simulated for a try-out)
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/multihost.py MODEL

    # a TPU pod slice: on every host at once (jax.distributed finds the others itself)
    gcloud compute tpus tpu-vm ssh NAME --worker=all --command "python scripts/multihost.py MODEL --distributed"

    # GPU hosts without a cluster manager: say who is who
    python scripts/multihost.py MODEL --distributed --coordinator HOST0:1234 --processes 2 --process-id 0   # host 0
    python scripts/multihost.py MODEL --distributed --coordinator HOST0:1234 --processes 2 --process-id 1   # host 1

MODEL: a local checkpoint folder or hub id (every host reads it: a shared disk
or a copy on each). Each host places only its own devices' shards as the
checkpoint streams. Prints, on process 0, the next-token logit difference of
a prompt and a patching sweep over the mesh's ``data`` axis.
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="checkpoint folder or hub repo id")
    parser.add_argument("--layout", default="FSDP", choices=("DP", "FSDP", "TP", "FSDP_TP"))
    parser.add_argument("--model-axis", type=int, default=1, help="devices on the mesh's 'model' axis (TP)")
    parser.add_argument("--distributed", action="store_true", help="jax.distributed.initialize() first")
    parser.add_argument("--coordinator", help="HOST:PORT of process 0 (where no cluster manager says it)")
    parser.add_argument("--processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds to reach the coordinator and for every process to join (then a clear error)")
    parser.add_argument("--save", help="process 0 writes the results here (.npz: logit differences, the grid)")
    args = parser.parse_args()

    import jax
    import numpy as np

    import jstd

    if args.distributed:  # before anything touches a device
        jstd.sharding.initialize(args.coordinator, args.processes, args.process_id, timeout=args.timeout)

    mesh = jstd.sharding.mesh(model=args.model_axis)  # every device of every host
    rules = jstd.sharding.LAYOUTS[args.layout]
    model = jstd.load(args.model, mesh=mesh, rules=rules)
    main_process = jax.process_index() == 0
    if main_process:
        print(f"{jax.process_count()} process(es), {len(jax.devices())} devices, mesh {dict(mesh.shape)}, "
              f"layout {args.layout}")

    rows = mesh.shape["data"]  # one prompt a row of the data axis (same ids on every host)
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (rows, 16))
    inputs = jstd.sharding.shard_inputs(tokens, mesh, rules)
    out = jax.jit(jstd.run)(model, inputs)
    diff = out.logits[:, -1, 1] - out.logits[:, -1, 2]  # a global array: fetch it replicated before printing
    diff = jax.jit(lambda x: x, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))(diff)
    if main_process:
        print("logit difference per row:", np.asarray(diff.addressable_data(0)))

    grid = jstd.patch_sweep(model, tokens[:1], tokens[1:2] if rows > 1 else tokens[:1, ::-1], "layers.layer_output",
                            jstd.logit_difference(1, 2), mesh=mesh, progress=main_process)
    if main_process:
        print("patching grid [layers, positions]:", grid.shape, "max", float(np.max(np.asarray(grid))))
        if args.save:
            np.savez(args.save, difference=np.asarray(diff.addressable_data(0)), grid=np.asarray(grid))


if __name__ == "__main__":
    main()
