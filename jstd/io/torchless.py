"""transformers' configuration classes in a process that has not imported torch, without importing it.

jstd reads ``config.json`` through transformers (its config classes hold the defaults and the normalisation —
rope parameters, layer types, sub-configs — that its models run with), but importing any of transformers' config
classes imports torch where torch is installed (``transformers.configuration_utils`` imports
``modeling_rope_utils``, which imports torch when it is available): some 300 MiB of a user's memory and seconds
of import for nothing jstd computes. ``transformers()`` gives a private copy of transformers that found torch
unavailable, used only inside the block and kept out of ``sys.modules`` outside it, so the user's own
``import transformers`` (with torch) is untouched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading

_LOCK = threading.RLock()
_COPY: dict = {}  # the private copy's modules (transformers and its submodules), kept between blocks
_COPY_LOGGER: dict = {}  # the "transformers" logger as the private copy configured it
_ABSENT = object()


def _transformers_module(name: str) -> bool:
    return name == "transformers" or name.startswith("transformers.")


def _logger_state(logger: logging.Logger) -> dict:
    return {"handlers": list(logger.handlers), "level": logger.level, "propagate": logger.propagate}


def _set_logger_state(logger: logging.Logger, state: dict) -> None:
    logger.handlers[:] = state["handlers"]
    logger.setLevel(state["level"])
    logger.propagate = state["propagate"]


@contextlib.contextmanager
def transformers():
    """A context yielding the ``transformers`` module to build and read configs with (and nothing that needs
    torch): the user's own where torch is already imported (it costs nothing more then); otherwise a private
    copy that sees torch as not installed, equal in every config class, default and normalisation to the
    installed transformers (its config classes read torch only to turn a ``dtype`` string into a torch dtype:
    the copy keeps the string).

    Inside the block ``sys.modules`` holds the copy's modules (so transformers' lazy imports resolve into the
    copy) and ``torch`` is marked absent; on leaving, the user's ``transformers`` modules (if any) and
    ``torch``'s entry are put back and the copy's modules kept aside for the next block, along with the
    "transformers" logger's handlers. Objects made inside may be used after the block for what needs no new
    import (attributes, ``to_dict``); anything that imports a transformers module must run inside it.
    Blocks are serialised by a lock; another thread importing torch while a block runs gets an ImportError.
    """
    if sys.modules.get("torch") is not None:  # torch is there already: transformers as the user has it
        import transformers as user

        yield user
        return
    with _LOCK:
        saved = {k: v for k, v in sys.modules.items() if _transformers_module(k)}
        torch = sys.modules.get("torch", _ABSENT)
        logger = logging.getLogger("transformers")
        outside = _logger_state(logger)
        advisory = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS", _ABSENT)
        for k in saved:
            del sys.modules[k]
        sys.modules.update(_COPY)
        sys.modules["torch"] = None  # importlib.util.find_spec("torch") is None, `import torch` raises ImportError
        if _COPY_LOGGER:
            _set_logger_state(logger, _COPY_LOGGER)
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"  # not "PyTorch was not found": that is the point
        try:
            import transformers as copy

            yield copy
        finally:
            if advisory is _ABSENT:
                os.environ.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
            else:
                os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = advisory
            _COPY_LOGGER.update(_logger_state(logger))
            _set_logger_state(logger, outside)
            _COPY.update({k: v for k, v in sys.modules.items() if _transformers_module(k)})
            for k in [k for k in sys.modules if _transformers_module(k)]:
                del sys.modules[k]
            sys.modules.update(saved)
            if torch is _ABSENT:
                sys.modules.pop("torch", None)
            else:
                sys.modules["torch"] = torch
