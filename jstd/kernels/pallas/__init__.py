"""Pallas kernels (Triton on GPU, Mosaic on TPU; ``interpret=True`` anywhere)."""
