"""The fetch stage: bring one source into ``data/raw/<source>/`` exactly as it is distributed, plus a manifest.

Modes implemented here:
- ``mirror``: write the offline mirror (``fedsilo.data.mirror``) in the source's real raw layout;
- ``local``: copy a folder the user already has, or unpack a ``.zip`` / ``.tar(.gz)`` archive they downloaded.

The manifest ``fedsilo_manifest.json`` lists every file with its sha256 and size, the mode and where it came from.
Everything is written to a temporary folder first and renamed into place, so a failed fetch leaves nothing behind.
"""

from __future__ import annotations

import shutil
import tarfile
import zipfile
from pathlib import Path

from fedsilo.config import SourceParams
from fedsilo.utils.io import atomic_dir, tree_manifest, write_json

MANIFEST = "fedsilo_manifest.json"


class FetchError(RuntimeError):
    pass


def _unpack(archive: Path, dest: Path) -> None:
    name = archive.name.lower()
    try:
        if name.endswith(".zip"):
            with zipfile.ZipFile(archive) as z:
                bad = z.testzip()
                if bad is not None:
                    raise FetchError(f"{archive}: corrupt member {bad}")
                z.extractall(dest)
        elif name.endswith((".tar", ".tar.gz", ".tgz")):
            with tarfile.open(archive) as t:
                t.extractall(dest, filter="data")
        else:
            raise FetchError(f"{archive}: not a folder, .zip or .tar(.gz) archive")
    except (zipfile.BadZipFile, tarfile.TarError, EOFError) as err:
        raise FetchError(f"{archive}: cannot unpack: {err}") from err


def fetch(source: str, params: SourceParams, out_dir: Path) -> dict:
    from fedsilo.data.mirror import mirror_writer

    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        if params.mode == "mirror":
            mirror_writer(source)(tmp, params.mirror)
            origin = f"offline mirror (seed {params.mirror.seed}, {params.mirror.patients} patients)"
        elif params.mode == "local":
            src = Path(params.path or "").expanduser()
            if not src.exists():
                raise FetchError(f"sources.{source}.path: {src} does not exist")
            if src.is_dir():
                shutil.copytree(src, tmp, dirs_exist_ok=True, symlinks=False)
            else:
                _unpack(src, tmp)
            origin = str(src.resolve())
        else:  # pragma: no cover - config validation rejects other modes
            raise FetchError(f"sources.{source}.mode: {params.mode!r} is not supported")
        files = tree_manifest(tmp, exclude=(MANIFEST,))
        if not files:
            raise FetchError(f"{source}: fetch produced no files")
        manifest = {"source": source, "mode": params.mode, "origin": origin, "files": files}
        write_json(tmp / MANIFEST, manifest)
    return manifest
