"""The ``jstd`` command line: the only door from a shell (``jstd.cli.main``); each subcommand in its own module.

The demo's helpers (``INDUCTION``, the embedded induction model's folder; ``repeated_tokens``, ``word_ids``,
``head_scores``, ``copying_accuracy``, ``second_copy``) are re-exported here, where docs/recipes.md uses them."""

from jstd.cli.demo import INDUCTION, copying_accuracy, head_scores, repeated_tokens, second_copy, word_ids
from jstd.cli.main import main

__all__ = ["main", "INDUCTION", "copying_accuracy", "head_scores", "repeated_tokens", "second_copy", "word_ids"]
