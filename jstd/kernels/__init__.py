"""Numerical kernels (plain JAX and Pallas) shared by model families."""
