"""The torch reference harness: tiny random checkpoints and captures of every standard value."""
