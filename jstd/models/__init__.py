"""Families, by the ``model_type`` they serve."""

from jstd.models.hyperclovax import HyperCLOVAX
from jstd.models.llama import Llama
from jstd.models.olmo_hybrid import OlmoHybrid

FAMILIES = {t: f for f in (Llama, HyperCLOVAX, OlmoHybrid) for t in f.model_types}
