"""Families, by the ``model_type`` they serve."""

from jstd.models.llama import Llama

FAMILIES = {t: f for f in (Llama,) for t in f.model_types}
