"""Where a checkpoint lives: a local folder, or a hub repo id through huggingface_hub's cache."""

from __future__ import annotations

from pathlib import Path

from jstd.io.safetensors import CheckpointError, gguf_message

PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def resolve(path_or_repo_id: str | Path) -> Path:
    """A local folder holding ``config.json``; repo ids come from the cache first (offline), then the hub.

    Raises FileNotFoundError that says what was tried, CheckpointError for a GGUF file (what to convert it with).
    """
    p = Path(path_or_repo_id).expanduser()
    if p.exists():
        gguf = [p] if p.suffix == ".gguf" else sorted(p.glob("*.gguf")) if p.is_dir() else []
        if gguf and not (p / "config.json").exists():
            raise CheckpointError(gguf_message(gguf[0]))
        if not p.is_dir():
            raise FileNotFoundError(f"{p} is a file; pass the checkpoint's folder (the one holding config.json)")
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p} has no config.json; pass a HuggingFace checkpoint folder")
        return p
    repo = str(path_or_repo_id)
    if repo.count("/") != 1 or repo.startswith((".", "/")):
        raise FileNotFoundError(f"no such folder: {p} ({repo!r} is neither a local folder nor a hub repo id like "
                                "'org/name')")
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo, allow_patterns=PATTERNS, local_files_only=True))
    except Exception:
        try:
            folder = Path(snapshot_download(repo, allow_patterns=PATTERNS))
        except Exception as e:
            raise FileNotFoundError(
                f"{repo!r} is not a local folder, not in the huggingface_hub cache, and could not be downloaded "
                f"({type(e).__name__}: {e}); download it where the network allows, or pass a local folder"
            ) from None
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"the hub repo {repo!r} has no config.json (in {folder}); jstd loads HuggingFace "
                                "checkpoints (config.json and *.safetensors): a GGUF-only repo must be converted "
                                "first (transformers' from_pretrained(..., gguf_file=...).save_pretrained(DST))")
    return folder
