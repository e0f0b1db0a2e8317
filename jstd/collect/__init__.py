"""Activation datasets: ``jstd.collect`` writes sites over a corpus to disk (safetensors shards and an index),
``jstd.ActivationDataset`` reads them back, memory-mapped."""

from jstd.collect.dataset import ActivationDataset
from jstd.collect.driver import collect

__all__ = ["collect", "ActivationDataset"]
