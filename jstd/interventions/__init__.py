"""Interventions: edits, and (later) patching, steering, lens and attribution built on them."""
