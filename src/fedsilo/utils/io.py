"""Small I/O helpers: atomic writes, hashing, JSON.

Every stage writes through these so that an interrupted or failed stage never leaves a half-written file or
folder under ``data/`` or ``results/``: content goes to a temporary sibling first and is renamed into place. A process
killed with SIGKILL (or a lost machine) never reaches its cleanup, so the next write of the same path first removes
what an earlier one left (:func:`clean_stale`), and ``.dvcignore`` keeps such siblings (``.<name>.<random>[.ext].tmp``
/ ``.old``) out of DVC's hashes in the meantime.

A full disk is recognised whatever raised it (:func:`disk_full`: ``OSError`` ENOSPC from a plain write, numpy or
pandas, or the ``RuntimeError`` torch.save raises instead); an atomic write that fails on it raises
``OSError(ENOSPC)`` naming the path it was writing (not its temporary sibling), and ``fedsilo.cli.main`` turns that
into one line saying where space ran out.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional

# what torch.save raises instead of OSError when a write fails (a full disk): "[enforce fail at
# inline_container.cc:671] . unexpected pos 704 vs 598" or "... PytorchStreamWriter failed writing file data/0: file
# write failed"; the reader's errors ("PytorchStreamReader failed reading zip archive") are not write failures
_TORCH_WRITE_FAILED = re.compile(r"PytorchStreamWriter failed writing|file write failed|inline_container\.cc.*unexpected pos", re.S)


def disk_full(err: Optional[BaseException]) -> Optional[BaseException]:
    """The exception in ``err``'s chain (itself, its cause, its context) that says the disk is full, or None."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return err
        if "No space left on device" in str(err) or (isinstance(err, RuntimeError) and _TORCH_WRITE_FAILED.search(str(err))):
            return err
        err = err.__cause__ or err.__context__
    return None


def no_space_message(err: BaseException, default: Path, elsewhere: list[tuple[Path, str]] = ()) -> str:
    """Where a full disk stopped a command and what to do: the folder of the path ``err`` names (``default`` when it
    names none), its filesystem and the space left there; ``elsewhere`` maps folders to the way of moving their
    content to another disk (the first that holds the folder is said)."""
    name = getattr(err, "filename", None)
    path = Path(name if name else default).resolve()
    folder = path if path.is_dir() else path.parent
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    mount = folder
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    free = shutil.disk_usage(folder).free
    todo = next((how for where, how in elsewhere if Path(where).resolve() in (folder, *folder.parents)), "")
    return (
        f"no space left on {folder} (the filesystem mounted at {mount}, {free / 2**20:.0f} MiB free); free space there"
        + (f" or {todo}" if todo else "")
    )


def _no_space(err: BaseException, path: Path, tmp: Path) -> Optional[OSError]:
    """``OSError(ENOSPC)`` naming ``path`` when ``err`` is a full disk met while writing ``tmp`` (no file named, or
    one inside the temporary), else None (another error, or a full disk elsewhere that names its own file)."""
    full = disk_full(err)
    if full is None:
        return None
    name = getattr(full, "filename", None)
    if name and Path(name) != tmp and tmp not in Path(name).parents:
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


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
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        full = _no_space(err, path, tmp)
        if full is not None:
            raise full from err
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
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        full = _no_space(err, path, tmp)
        if full is not None:
            raise full from err
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


def tree_manifest(root: str | os.PathLike, exclude: tuple[str, ...] = (), desc: str = "", quiet: bool = True) -> dict[str, dict[str, Any]]:
    """Relative path -> {sha256, bytes} for every file below ``root`` (sorted, deterministic); with ``desc``, the
    bytes hashed shown as progress (a source of many GB is read through once more)."""
    from fedsilo.utils.progress import Progress

    root = Path(root)
    files = [(p, p.relative_to(root).as_posix()) for p in sorted(root.rglob("*")) if p.is_file()]
    files = [(p, rel, p.stat().st_size) for p, rel in files if rel not in exclude]
    out: dict[str, dict[str, Any]] = {}
    with Progress(sum(n for _, _, n in files), desc, "B", quiet=quiet or not desc) as bar:
        for p, rel, n in files:
            out[rel] = {"sha256": file_sha256(p), "bytes": n}
            bar.update(n)
    return out
