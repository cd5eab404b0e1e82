"""Small I/O helpers: atomic writes, hashing, JSON.

Every stage writes through these so that an interrupted or failed stage never leaves a half-written file or
folder under ``data/`` or ``results/``: content goes to a temporary sibling first and is renamed into place. A process
killed with SIGKILL (or a lost machine) never reaches its cleanup, so the next write of the same path first removes
what an earlier one left (:func:`clean_stale`), and ``.dvcignore`` keeps such siblings (``.<name>.<random>[.ext].tmp``
/ ``.old``) out of DVC's hashes in the meantime.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _tmp_sibling(path: Path, suffix: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix + ".tmp", dir=path.parent)
    os.close(fd)
    # mkstemp makes the file 0600: give it what an ordinary write would (0666 less the umask), so others' tools
    # (a shared results folder, a web server, a colleague's report script) can read results as usual
    os.chmod(name, 0o666 & ~_umask())
    return Path(name)


def _stale_pattern(path: Path) -> re.Pattern[str]:
    # tempfile's random part is [a-z0-9_]; atomic_file adds the path's own suffix before ".tmp"
    ext = re.escape(path.suffix) if path.suffix else ""
    return re.compile(rf"^\.{re.escape(path.name)}\.[a-z0-9_]+(?:{ext})?\.(?:tmp|old)$")


def clean_stale(path: str | os.PathLike) -> list[Path]:
    """Remove the temporaries an interrupted atomic write of ``path`` left beside it; return what was removed.

    Only siblings named by this module for exactly this path match (``.seed1.*`` never matches ``seed10``'s)."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    pattern = _stale_pattern(path)
    removed = []
    for p in path.parent.iterdir():
        if pattern.match(p.name):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path; on success rename it to ``path``, on error delete it."""
    path = Path(path)
    clean_stale(path)
    tmp = _tmp_sibling(path, path.suffix)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary folder; on success it replaces ``path`` whole, on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700, as for files above
    try:
        yield tmp
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.replace(path, old / "x")
            try:
                os.replace(tmp, path)
            except BaseException:
                os.replace(old / "x", path)  # the previous result goes back where it was
                shutil.rmtree(old, ignore_errors=True)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    import numpy as np

    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o)}")


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


def file_digest(path: str | os.PathLike, algo: str = "sha256", chunk: int = 1 << 20) -> str:
    """Hex digest of a file, read in chunks (any hashlib algorithm: md5, sha1, sha256, sha512)."""
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    return file_digest(path, "sha256")


def canonical_hash(obj: Any) -> str:
    """sha256 of the canonical JSON form of ``obj`` (sorted keys), used for params hashes."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_json_default).encode()
    return hashlib.sha256(blob).hexdigest()


def tree_manifest(root: str | os.PathLike, exclude: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Relative path -> {sha256, bytes} for every file below ``root`` (sorted, deterministic)."""
    root = Path(root)
    out: dict[str, dict[str, Any]] = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            rel = p.relative_to(root).as_posix()
            if rel in exclude:
                continue
            out[rel] = {"sha256": file_sha256(p), "bytes": p.stat().st_size}
    return out
