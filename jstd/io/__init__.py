"""Checkpoints in and out: hub/local resolution, safetensors reading and writing, name maps, loading, the converted
(stacked) layout and exporting back to HuggingFace."""
