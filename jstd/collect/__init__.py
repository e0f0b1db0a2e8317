"""Activation datasets: ``jstd.collect`` writes sites over a corpus to disk (safetensors shards and an index),
``jstd.ActivationDataset`` reads them back, memory-mapped (a sparse site's rows as ``SparseRows``)."""

from jstd.collect.dataset import ActivationDataset, SparseRows
from jstd.collect.driver import collect

__all__ = ["collect", "ActivationDataset", "SparseRows"]
