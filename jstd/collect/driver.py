"""``jstd.collect``: sites over a corpus, to disk, at forward speed and in constant memory; ``jstd collect`` on the
command line.

One compiled ``jstd.run`` per batch shape reads the sites; a writer thread moves each batch's values to the
current shard while the next batch computes; padding and filler rows never reach the disk. The steps live beside
this driver: the batches in ``batches.py``, the writer thread in ``writer.py``, the resume fingerprints and checks
in ``resume.py``; the format and its reader are in ``dataset.py``.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from jstd.collect.batches import (Batches, PositionFn, RowsMeta, bucket_lengths, corpus_batches, corpus_source,
                                  select_rows)
from jstd.collect.dataset import ActivationDataset, bfloat16_safe, sparse_names
from jstd.collect.processes import (check_batch_size, check_top, merge_parts, numbered, part_name, run_across,
                                    spanned_mesh, split_corpus)
from jstd.collect.resume import ResumeCheck, edits_key, model_key, positions_key, prepare
from jstd.collect.writer import ShardWriterThread
from jstd.core.edits import as_edits
from jstd.core.inputs import Inputs
from jstd.core.sites import SITES, SiteError, parse
from jstd.io.load import load
from jstd.io.processor import load_processor
from jstd.run import check_sites, run

SHARD_BYTES = 256 * 2**20


def collect(
    model,
    data,
    sites: str | Sequence[str],
    out_dir: str | os.PathLike,
    *,
    processor=None,
    column: str = "text",
    batch_size: int = 8,
    max_length: int = 256,
    lengths: Sequence[int] | None = None,
    positions: str | PositionFn = "all",
    edits=(),
    dtype=None,
    sparse: Sequence[str] | None = None,
    shard_bytes: int = SHARD_BYTES,
    progress: bool = True,
) -> ActivationDataset:
    """Run ``model`` over a corpus and write ``sites`` at the kept token positions to ``out_dir``; the dataset.

    model: a model from ``jstd.load``, or a checkpoint folder or repo id (loaded, with its processor).
    data: the documents, each one row: an iterable of strings (a list, a generator, a file's lines), a
        HuggingFace ``datasets.Dataset`` (any object with ``column_names``; its ``column`` is read row by row),
        a ``jstd.Inputs`` of token ids (each row a document; split into batches of ``batch_size``), or an
        iterable of ``jstd.Inputs`` (each one batch as it is: the way to collect on image prompts).
    sites: names of sites with a token axis (``layers.layer_output``, ``layers.3.mlp.mlp_neurons``,
        ``token_embeddings``, ``logits``…); each row of a site is one token position:
        ``[tokens, layers, hidden]`` for a site of every block, ``[tokens, hidden]`` for ``layers.3.X``,
        ``[tokens, layers, heads, qk_head_dim]`` for queries (the layout axes after ``batch`` and ``seq``).
    processor: the tokenizer or processor for text (default: ``jstd.load_processor`` of ``model`` when it is a
        path). Texts are tokenized with its special tokens, cut to their first ``max_length`` tokens (a
        warning counts the cut documents), left-padded to the smallest of ``lengths`` (default: powers of two
        from 16, and ``max_length``) that holds the batch's longest; the last batch is filled with copies of a
        real row. So each (batch size, length) compiles once.
    positions: ``"all"`` (every real token), ``"last"`` (each document's last token), or a function
        ``f(tokens, attention_mask) -> bool [batch, seq]`` of the batch's numpy arrays (padding is dropped
        whatever it returns).
    edits: edits applied on every batch (an ablation, a steering vector), as ``jstd.run`` takes them; their
        ``positions`` index the padded batch.
    dtype: the dtype written (``"bfloat16"``, ``jnp.float16``…; default: the model's), cast on the device.
    sparse: the sites written sparse: each vector along the site's last axis as its nonzero entries (counts,
        indices and values: ``dataset.py``; ``ActivationDataset.read`` gives them back as ``SparseRows``, or
        dense with ``dense=True``). None (the default): every dictionary's ``X.sae.latents`` among ``sites``
        (collected under ``edits=jstd.splice(...)``); ``()``: none.
    shard_bytes: the size of a shard's site tensors; the writer holds one shard and the batches in flight.

    Writes ``out_dir``: safetensors shards and ``index.json`` (``jstd/collect/dataset.py``); each shard is written
    under a temporary name and renamed when whole. A call into a folder holding an unfinished collection with
    the same settings resumes after its last complete shard (its tokens are checked to be the same); a finished
    one is checked and returned. Raises ValueError when ``out_dir`` holds other files or a collection with
    other settings or texts (naming the difference), SiteError for sites without a token axis or that the
    model lacks, and the OSError of a failed write (a full disk) after the complete shards are recorded:
    never a silently short dataset.

    Across processes (``jax.distributed``; a model whose arrays span them, as ``jstd.load(path, mesh=)`` places
    it on a pod slice): every process makes the same call into one shared folder, collects its contiguous share
    of the corpus (``data``: a list of texts, a ``datasets.Dataset`` or a ``jstd.Inputs``; ``batch_size`` rows a
    process each step) into its own part, and ``out_dir`` reads as one dataset equal, row for row, to one
    process's collection of the whole corpus; a rerun resumes every part (``jstd/collect/processes.py``).
    """
    model, path = _as_model(model)
    sites = (sites,) if isinstance(sites, str) else tuple(sites)
    layouts = _checked_layouts(model, sites, batch_size, max_length)
    sparse = _sparse_sites(sites, sparse, layouts)
    lengths = bucket_lengths(max_length, lengths)
    positions_setting = positions_key(positions)
    write_dtype = None if dtype is None else _floating(dtype)

    mesh = spanned_mesh(model)  # a model across processes: each process collects its share into its own part
    top, first = Path(out_dir), 0
    if mesh is not None:
        check_top(top)
        check_batch_size(mesh, batch_size)
        data, first = split_corpus(data, jax.process_index(), jax.process_count())
    kind, source = corpus_source(data, column)
    processor = _text_processor(kind, processor, path)
    settings = dict(sites=list(sites), positions=positions_setting, batch_size=batch_size, max_length=max_length,
                    lengths=list(lengths), dtype=write_dtype, edits=edits_key(edits), model=model_key(model),
                    data=kind, column=column if kind == "texts" else None, shard_bytes=int(shard_bytes))
    if sparse:  # (absent when none is: collections written before sparse sites resume as they were)
        settings["sparse"] = list(sparse)
    out = top
    if mesh is not None:
        out = top / part_name(jax.process_index(), jax.process_count())
        settings.update(processes=jax.process_count(), share=[jax.process_index(), first])
    index = prepare(out, settings, model, path, layouts)

    batches = corpus_batches(kind, source, processor, batch_size, max_length, lengths, model.config.vocab_size)
    check = ResumeCheck(out, index)
    writer = ShardWriterThread(out, index, sites, shard_bytes, progress and jax.process_index() == 0,
                               hasher=check.hasher, sparse=sparse)
    edits_tuple = as_edits(edits)
    try:
        if mesh is None:
            documents = _run_batches(model, batches, check, writer, sites, positions, edits_tuple, write_dtype)
        else:
            documents = run_across(model, mesh, numbered(batches, first), check, writer, sites, positions,
                                   edits_tuple, write_dtype, batch_size, _step)
        writer.finish(documents, batches.truncated)
    except BaseException:
        writer.abort()
        raise
    if mesh is not None:  # every part complete: process 0 lists them as one collection
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jstd.collect: parts written")
        if jax.process_index() == 0:
            merge_parts(top, jax.process_count())
        multihost_utils.sync_global_devices("jstd.collect: index written")
        out = top
    if batches.truncated:
        warnings.warn(f"jstd.collect: {batches.truncated} of {documents} documents were longer than "
                      f"max_length={max_length} tokens and were cut to their first {max_length}", stacklevel=2)
    return ActivationDataset(out)


def _floating(dtype) -> str:
    """``dtype``'s name, checked to be a floating dtype (ValueError: an integer one truncates activations)."""
    try:
        d = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"collect: dtype={dtype!r} is not a dtype; pass a floating one (float32, bfloat16, "
                         "float16) or None for the model's") from None
    if not jnp.issubdtype(d, jnp.floating):
        raise ValueError(f"collect: dtype={dtype!r} is not a floating dtype: activations cast to it would be "
                         "truncated; pass float32, bfloat16 or float16 (or None for the model's)")
    return str(bfloat16_safe(d))


def _as_model(model) -> tuple[object, str | None]:
    """``(model, path)``: a checkpoint folder or repo id loaded (with its path), a model as it is (path None)."""
    if isinstance(model, (str, os.PathLike)):
        path = str(model)
        return load(path), path
    return model, None


def _checked_layouts(model, sites: tuple[str, ...], batch_size: int, max_length: int) -> dict[str, dict]:
    """Each site's ``row_layout``, after the sizes and the sites are checked (ValueError, SiteError)."""
    if not sites:
        raise ValueError("collect needs at least one site, e.g. sites=('layers.layer_output',)")
    if batch_size < 1 or max_length < 1:
        raise ValueError(f"batch_size and max_length must be positive, got {batch_size} and {max_length}")
    check_sites(model, sites, "collect")
    return {s: row_layout(model, s) for s in sites}


def _sparse_sites(sites: tuple[str, ...], sparse: Sequence[str] | None, layouts: dict[str, dict]
                  ) -> tuple[str, ...]:
    """The sites written sparse (their layouts marked with their tensors' names): ``sparse``, or every
    ``X.sae.latents`` among ``sites`` when None. ValueError for a name not among ``sites`` or a site whose rows
    have no axis to be sparse along."""
    if sparse is None:
        sparse = tuple(s for s in sites if parse(s)[0].endswith(".sae.latents"))
    sparse = (sparse,) if isinstance(sparse, str) else tuple(sparse)
    for s in sparse:
        if s not in sites:
            raise ValueError(f"collect: sparse={s!r} is not among the sites collected ({', '.join(sites)}); "
                             "name sites as in sites=")
        if len(layouts[s]["layout"]) < 2:
            raise ValueError(f"collect: {s!r} holds one number per token (layout {layouts[s]['layout']}); a sparse "
                             "site is stored along its last axis: write it dense")
        layouts[s]["sparse"] = sparse_names(s)
    return sparse


def _text_processor(kind: str, processor, path: str | None):
    """The processor to tokenize texts with: the one given, else the model path's (ValueError without a path)."""
    if kind == "texts" and processor is None:
        if path is None:
            raise ValueError("collect on texts needs the tokenizer: pass processor=jstd.load_processor(path), "
                             "or give the model as its path")
        processor = load_processor(path)
    return processor


def _run_batches(model, batches: Batches, check: ResumeCheck, writer: ShardWriterThread, sites: tuple[str, ...],
                 positions: str | PositionFn, edits: tuple, dtype: str | None) -> int:
    """Each batch run and its kept rows handed to ``writer``, but for the rows the folder holds already (only
    checked, by ``check``); the documents read. Raises ``check``'s ValueError and the writer's errors."""
    documents = 0
    last = positions == "last"
    for batch in batches:
        documents = batch.documents
        take, rows = select_rows(batch, positions)
        drop = check.written(rows.token)
        if drop is None:  # rows of complete shards: only their tokens are checked
            continue
        if len(rows.token) - drop == 0:
            writer.count(batch)
            continue
        index_arg = jnp.asarray(batch.last) if last else None
        values = _step(model, batch.inputs, edits, index_arg, sites=sites, last=last, dtype=dtype)
        writer.put((values, take[drop:], RowsMeta(*(a[drop:] for a in rows)), batch))
    check.finish()
    return documents


def row_layout(model, site: str) -> dict:
    """How ``site``'s value becomes rows: its layout with ``tokens`` first, the block indices, and the axes."""
    base, index = parse(site)
    spec = SITES[base]
    stacked = spec.per_block and index is None
    axes = row_layout_axes(site)
    if "batch" not in axes or "seq" not in axes:
        why = ("a value per image or patch, not per token position" if "images" in axes or "image_tokens" in axes
               else "a value per key position as well: its rows would be as wide as each padded batch"
               if "query" in axes else "no token axis")
        raise SiteError(f"collect keeps one row per token position; {site!r} has layout {spec.layout}: {why}. "
                        "Collect a site with batch and seq axes, or read this one with jstd.run")
    rest = [a for a in axes if a not in ("batch", "seq")]
    blocks = list(model.blocks_for(base)) if stacked else ([index % model.depth(spec.stack)] if spec.per_block else [])
    return dict(layout=["tokens"] + rest, blocks=blocks, axes=list(axes))


@functools.partial(jax.jit, static_argnames=("sites", "last", "dtype"))
def _step(model, inputs: Inputs, edits: tuple, last_index: Int[Array, "batch"] | None, *, sites: tuple[str, ...],
          last: bool, dtype: str | None) -> dict[str, Array]:
    """Each site as ``[batch·seq, …]`` rows (``[batch, …]`` at ``last_index`` when ``last``), in ``dtype``."""
    out = run(model, inputs, edits, reads=sites)
    values = {}
    for s in sites:
        axes = row_layout_axes(s)
        v = out[s]
        v = jnp.transpose(v, [axes.index("batch"), axes.index("seq")]
                          + [i for i, a in enumerate(axes) if a not in ("batch", "seq")])
        if last:
            v = v[jnp.arange(v.shape[0]), last_index]
        else:
            v = v.reshape((-1,) + v.shape[2:])
        values[s] = v if dtype is None else v.astype(dtype)
    return values


def row_layout_axes(site: str) -> tuple[str, ...]:
    """The axes of ``site``'s value as ``jstd.run`` reads it: its layout, after ``layers`` for every block's."""
    base, index = parse(site)
    spec = SITES[base]
    return (("layers",) if spec.per_block and index is None else ()) + spec.layout

