"""Where a checkpoint lives: a local folder, or a hub repo id through huggingface_hub's cache."""

from __future__ import annotations

from pathlib import Path

PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def resolve(path_or_repo_id: str | Path) -> Path:
    """A local folder holding ``config.json``; repo ids come from the cache first (offline), then the hub.

    Raises FileNotFoundError that says what was tried.
    """
    p = Path(path_or_repo_id).expanduser()
    if p.exists():
        if not p.is_dir():
            raise FileNotFoundError(f"{p} is a file; pass the checkpoint's folder (the one holding config.json)")
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p} has no config.json; pass a HuggingFace checkpoint folder")
        return p
    repo = str(path_or_repo_id)
    if repo.count("/") != 1 or repo.startswith((".", "/")):
        raise FileNotFoundError(f"{repo!r} is neither a local folder nor a hub repo id like 'org/name'")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, allow_patterns=PATTERNS, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo, allow_patterns=PATTERNS))
    except Exception as e:
        raise FileNotFoundError(
            f"{repo!r} is not a local folder, not in the huggingface_hub cache, and could not be downloaded "
            f"({type(e).__name__}: {e}); download it where the network allows, or pass a local folder"
        ) from None
