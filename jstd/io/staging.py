"""Writing a destination safely: the checks on a destination folder, the staging folder renamed into place when
complete, an atomic single-file write, and the one progress line of a long write.

Whatever writes through these leaves its destination either as it was or complete: an interrupted run leaves
nothing at the destination (only a hidden ``.NAME.partial-PID`` folder, or a ``NAME.tmp`` file, which nothing
reads).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path


def check_destination(src: Path | None, dst: Path, force: bool, what: str) -> Path:
    """``dst`` as an absolute path, checked for ``jstd {what}`` writing from the folder ``src`` (None: no source
    folder). Raises ValueError when ``dst`` is ``src``, inside it or contains it, is not a folder, or is a
    non-empty folder and ``force`` is False."""
    dst = Path(dst).expanduser().absolute()
    if src is not None:
        s, d = src.resolve(), dst.resolve()
        if d == s or s in d.parents:
            raise ValueError(f"jstd {what}: the destination {dst} is the source folder {src} or inside it; jstd never "
                             "writes into its source: pass a folder outside it")
        if d in s.parents:
            raise ValueError(f"jstd {what}: the destination {dst} contains the source {src}; pass another folder")
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"jstd {what}: {dst} exists and is not a folder; pass a new folder")
    if dst.exists() and any(dst.iterdir()) and not force:
        raise ValueError(f"jstd {what}: {dst} exists and is not empty; pass another folder, or force=True "
                         "(--force) to replace it once the new one is complete")
    return dst


class Staging:
    """A temporary sibling of ``dst`` (``.NAME.partial-PID``), entered as a context (``with Staging(dst) as tmp``:
    the new, empty folder), renamed to ``dst`` by ``commit`` (replacing an old ``dst`` only then), removed if the
    block fails or is interrupted before that."""

    def __init__(self, dst: Path):
        self.dst = dst
        self.tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"

    def __enter__(self) -> Path:
        self.dst.parent.mkdir(parents=True, exist_ok=True)
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()
        return self.tmp

    def commit(self) -> None:
        old = None
        if self.dst.exists():
            old = self.dst.parent / f".{self.dst.name}.old-{os.getpid()}"
            os.rename(self.dst, old)
        os.rename(self.tmp, self.dst)
        if old is not None:
            shutil.rmtree(old)

    def __exit__(self, kind, value, tb):
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)
        return False


@contextlib.contextmanager
def atomic(path: Path, mode: str):
    """An open file that becomes ``path`` only when the block completes: written under ``path``'s name plus
    ``.tmp``, fsynced and renamed over ``path``; on any error the temporary file is removed and nothing changes."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
