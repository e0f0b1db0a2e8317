"""Loading: hub/local resolution, safetensors streaming, name maps."""
