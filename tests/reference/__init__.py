"""The torch reference harness: tiny random checkpoints, a family's test cases built from them, and captures of every standard value."""
