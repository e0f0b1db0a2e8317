"""Ahead-of-time compilation for TPU slices and GPUs without a device: does a program compile and fit?

    import jstd.aot
    report = jstd.aot.compile("llama-3.1-8b", "v5e:16x16", program="forward", layout="FSDP_TP", model_axis=4)
    print(report)               # bytes per chip against the chip's memory, FLOPs, collectives, whole-weight gathers
    jstd.aot.check(report)      # DoesNotFit, with the numbers, when it does not fit

The model is built from its config alone (``abstract.config``: a preset, a config.json, a checkpoint folder; no
weight is read), each parameter a ``jax.ShapeDtypeStruct`` with the sharding ``jstd.load(..., mesh=, rules=)``
would give it; the program (``programs.PROGRAMS``: forward, grad, sweep, generate, attribute) is lowered on abstract inputs
and compiled by the target's own compiler (``targets.target``: libtpu for ``v5e:16x16``, XLA:GPU and ptxas for
``8xh200``), from the ``aot`` extra: ``pip install 'jstd[aot]'``. The CLI: ``jstd aot``.
"""

from __future__ import annotations

import jax.numpy as jnp

from jstd.aot.abstract import PRESETS, abstract_model, abstract_transcoders, config
from jstd.aot.programs import PROGRAMS, program
from jstd.aot.report import DoesNotFit, Report, check, compile_report
from jstd.aot.targets import AotUnavailable, Target, target
from jstd.sharding import LAYOUTS, mesh as make_mesh

__all__ = ["compile", "check", "config", "abstract_model", "abstract_transcoders", "program", "target", "default_model_axis", "Report",
           "Target", "DoesNotFit", "AotUnavailable", "PRESETS", "PROGRAMS"]


def default_model_axis(chips: int) -> int:
    """The ``model`` axis ``compile`` picks: 8 on one 8-GPU host, 4 on larger slices, 2 on 2-7 chips."""
    if chips == 8:
        return 8
    return 4 if chips % 4 == 0 and chips > 8 else (2 if chips % 2 == 0 else 1)


def compile(source, target_name: str | Target, *, program_name: str = "forward", layout: str = "FSDP_TP",
            model_axis: int | None = None, batch: int = 8, seq: int = 1024, blocks: int | None = None,
            dtype=jnp.bfloat16, entries: int | None = None, new: int = 16, features: int = 16384, active: int = 64,
            slots: int | None = None) -> Report:
    """The ``Report`` of ``program_name`` for the model of ``source`` (``config``) compiled on ``target_name``
    (``target``) under ``layout`` (a ``jstd.sharding.LAYOUTS`` name) on a (data, model) mesh with ``model_axis``
    devices on ``model`` (default ``default_model_axis``). ``attribute``: ``batch`` targets, a cross-layer
    transcoder of ``features`` per block, ``active`` features per block and position (``programs``).

    Raises ValueError for an unknown layout, program or target, a model axis that does not divide the chips;
    AotUnavailable where the target's compiler is not installed.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: pass one of {', '.join(LAYOUTS)}")
    t = target_name if isinstance(target_name, Target) else target(target_name)
    model_axis = default_model_axis(t.chips) if model_axis is None else model_axis
    if model_axis < 1 or t.chips % model_axis:
        raise ValueError(f"model_axis={model_axis} does not divide {t.name}'s {t.chips} chips")
    mesh = make_mesh(t.chips // model_axis, model_axis, devices=t.devices)
    rules = LAYOUTS[layout]
    model = abstract_model(config(source, blocks=blocks), mesh, rules, dtype=dtype)
    fn, args = program(program_name, model, mesh, rules, batch=batch, seq=seq, entries=entries, new=new,
                       features=features, active=active, slots=slots)
    # the attribute program's transcoders stay on the chips though it reads only their shapes
    report, _ = compile_report(fn, args, t, program=program_name, mesh=mesh, layout=layout,
                               keep_unused=program_name == "attribute")
    return report
