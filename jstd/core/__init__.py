"""The vocabulary and the mechanism every layer shares: sites, edits, taps, contexts, inputs, sizes, checks and
the jit split. Imports only ``jstd.kernels``."""
