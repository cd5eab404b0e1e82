"""The fetch stage: bring one source into ``data/raw/<source>/`` exactly as it is distributed, plus a manifest.

Modes (``sources.<source>.mode``; which ones a source offers is in ``fedsilo.config.SOURCE_MODES``):

- ``download``: the official public files (``fedsilo.data.sources.<source>.DOWNLOADS``: address and published
  checksum) or the files listed under ``sources.<source>.files`` (for sources distributed through links that cannot
  be scripted: give the address of your copy and its checksum). Resumes partial files, verifies checksums, unpacks
  archives.
- ``kaggle`` (RSNA, VinBigData): the competition's ``download-all`` archive through the Kaggle API, with
  ``KAGGLE_USERNAME`` / ``KAGGLE_KEY`` from the environment; the zip's CRCs are checked, and a sha256 pinned under
  ``checksums`` is verified.
- ``physionet`` (VinDr-CXR, the DICOM release behind VinBigData): the project's files listed in its
  ``SHA256SUMS.txt`` (optionally only those matching ``include`` globs), each verified against that list, with
  ``PHYSIONET_USERNAME`` / ``PHYSIONET_PASSWORD``.
- ``aimi`` (CheXpert): the Azure container behind the signed link Stanford AIMI issues after the data-use
  agreement, read from ``AIMI_SAS_URL``; every blob (or those matching ``include``) is verified against the
  Content-MD5 the container reports.
- ``local``: a folder or ``.zip`` / ``.tar(.gz)`` archive the user already has.
- ``mirror``: the offline mirror (``fedsilo.data.mirror``) in the source's real raw layout.

Credentials are read from the environment only (:data:`CREDENTIALS`), checked before any request (a value with a
line break or control character, an ``AIMI_SAS_URL`` that is not an https address with a host and a signature: the
message names the variable, never the value) and never written or shown: every message this module raises or logs
goes through ``fedsilo.data.download.redact``. A failed connection is one line naming the source, the host and what
went wrong.

The manifest ``fedsilo_manifest.json`` lists every file with its sha256 and size, the mode, where it came from
(addresses without query strings: no credential is ever written) and, for downloads, which files were verified
against a published checksum. Everything is written to a temporary folder first and renamed into place, so a
failed fetch leaves nothing behind in ``data/``; partial downloads wait in the download cache to be resumed.
"""

from __future__ import annotations

import base64
import fnmatch
import json
import logging
import os
import shutil
import tarfile
import urllib.parse
import zipfile
from pathlib import Path
from typing import Any, Optional
from xml.etree import ElementTree

from fedsilo.config import SourceParams
from fedsilo.data.download import (
    DownloadError,
    RedactFilter,
    Remote,
    basic_auth,
    cache_dir,
    check_address,
    download,
    place,
    public_url,
    read_url,
    redact,
)
from fedsilo.utils.io import atomic_dir, canonical_hash, tree_manifest, write_json
from fedsilo.utils.progress import Progress

MANIFEST = "fedsilo_manifest.json"
KAGGLE_API = "https://www.kaggle.com/api/v1"
PHYSIONET_FILES = "https://physionet.org/files"

log = logging.getLogger("fedsilo.fetch")
log.addFilter(RedactFilter())

CREDENTIALS = {
    "kaggle": (
        ("KAGGLE_USERNAME", "KAGGLE_KEY"),
        "create an API token at https://www.kaggle.com/settings (Account > API) and accept the competition's rules on "
        "its Kaggle page",
    ),
    "physionet": (
        ("PHYSIONET_USERNAME", "PHYSIONET_PASSWORD"),
        "use your https://physionet.org account; VinDr-CXR needs credentialed access and its data use agreement signed",
    ),
    "aimi": (
        ("AIMI_SAS_URL",),
        "accept the CheXpert data-use agreement at https://stanfordaimi.azurewebsites.net/ and copy the download link "
        "(an Azure 'SAS' address) it gives you",
    ),
}


class FetchError(RuntimeError):
    """A fetch that failed; its message is redacted (``fedsilo.data.download.redact``) whatever it was built from."""

    def __init__(self, message: object) -> None:
        super().__init__(redact(message))


def credentials(mode: str, source: str) -> tuple[str, ...]:
    names, where = CREDENTIALS[mode]
    missing = [n for n in names if not os.environ.get(n)]
    if missing:
        raise FetchError(
            f"sources.{source}.mode={mode}: set {' and '.join(missing)} in the environment ({where}); "
            "fedsilo reads them from the environment only and never writes them"
        )
    for n in names:
        if any(ord(c) < 32 or ord(c) == 127 for c in os.environ[n]):
            raise FetchError(f"sources.{source}.mode={mode}: {n} contains a line break or control character; set it again ({where})")
    return tuple(os.environ[n] for n in names)


def _unpack(archive: Path, dest: Path, quiet: bool = False) -> None:
    """``archive`` (.zip, .tar, .tar.gz / .bz2 / .xz) unpacked into ``dest`` in one pass, its progress in the
    members' bytes; a zip member's CRC is checked as it is read (a corrupt one stops the fetch, named)."""
    from fedsilo.utils.progress import Progress

    name = archive.name.lower()
    try:
        if name.endswith(".zip"):
            with zipfile.ZipFile(archive) as z:
                members = z.infolist()
                with Progress(sum(i.file_size for i in members), f"unpack {archive.name}", "B", quiet=quiet) as bar:
                    for info in members:
                        try:
                            z.extract(info, dest)
                        except zipfile.BadZipFile as err:
                            raise FetchError(f"{archive.name}: corrupt member {info.filename} ({err})") from None
                        bar.update(info.file_size)
        elif name.endswith((".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")):
            # a compressed tar's member list is known only once read through: the bytes so far, without a total
            with tarfile.open(archive) as t, Progress(None, f"unpack {archive.name}", "B", quiet=quiet) as bar:
                for member in t:
                    t.extract(member, dest, filter="data")
                    bar.update(member.size)
        else:
            raise FetchError(f"{archive}: not a folder, .zip or .tar(.gz/.bz2/.xz) archive")
    except (zipfile.BadZipFile, tarfile.TarError, EOFError) as err:
        raise FetchError(f"{archive.name}: cannot unpack: {err}") from err


def _unpack_distributed_zips(source: str, folder: Path, quiet: bool = False) -> dict[str, dict[str, int]]:
    """Sources distributed as several archives (DomainNet's per-domain zips) are usually kept that way: unpack the
    archives a local folder holds at its top level, as download mode does, so the reader sees the unpacked layout.
    Returns each archive unpacked with its size (the manifest's ``unpacked``: the user's folder holds them, the copy
    their content)."""
    from fedsilo.data.sources import source_module
    from fedsilo.data.sources.base import is_hidden

    pattern = getattr(source_module(source), "DISTRIBUTED_ARCHIVES", "")
    unpacked: dict[str, dict[str, int]] = {}
    if not pattern:
        return unpacked
    for z in sorted(folder.glob(pattern)):
        if is_hidden(z.name):  # a Mac copy's ._clipart.zip is the AppleDouble twin of clipart.zip, not an archive
            continue
        _unpack(z, folder, quiet)
        unpacked[z.name] = {"bytes": z.stat().st_size}
        z.unlink()
    return unpacked


def check_local_layout(source: str, folder: Path, rules: Any = None) -> None:
    """Read a public source's label files in the user's own ``folder`` with its reader, before anything is copied:
    a folder of another dataset (PACS's pointed at by ``sources.office_caltech10.path``) or of the wrong level fails
    in seconds with the reader's message, not after copying a CheXpert-sized tree. ``rules``: the reader's (a chest
    X-ray dataset's ``<source>`` key; default, its defaults). Skipped where the folder still holds the source's
    distributed archives, which fetch unpacks first (DomainNet's per-domain zips)."""
    from fedsilo.config import CXRDatasetParams
    from fedsilo.data.sources import source_module
    from fedsilo.data.sources.base import LabelFileError, is_hidden

    module = source_module(source)
    pattern = getattr(module, "DISTRIBUTED_ARCHIVES", "")
    if pattern and any(not is_hidden(z.name) for z in folder.glob(pattern)):
        return
    if rules is None and source in CXRDatasetParams.model_fields:
        rules = CXRDatasetParams.model_fields[source].get_default(call_default_factory=True)
    try:
        module.read_records(folder, rules)
    except LabelFileError as err:
        raise FetchError(f"sources.{source}.path: {folder} does not hold {source} as its reader expects, so nothing was "
                         f"copied: {err}") from None


def _included(name: str, include: tuple[str, ...]) -> bool:
    return not include or any(fnmatch.fnmatch(name, pat) for pat in include)


def _pinned(params: SourceParams, name: str, default: str | None) -> str | None:
    return params.checksums.get(name, default)


def remotes_for(source: str, params: SourceParams) -> tuple[list[Remote], dict[str, str]]:
    """The files a remote mode fetches, and the request headers (credentials) to send."""
    from fedsilo.data.sources import source_module

    mod = source_module(source)
    if params.mode == "download":
        if params.files:
            for i, f in enumerate(params.files):  # a copy's address may be a signed link: checked, never shown
                check_address(f.url, f"sources.{source}.files[{i}].url", schemes=("https", "http"))
            files = [Remote(f.url, f.name or Path(urllib.parse.urlsplit(f.url).path).name, f.checksum, f.unpack) for f in params.files]
        else:
            files = list(getattr(mod, "DOWNLOADS", []))
            if not files:
                raise FetchError(
                    f"sources.{source}: no stable public address can be scripted for this source (see the README's "
                    f"data section); list the file(s) of your copy under sources.{source}.files "
                    "(url, checksum 'sha256:<hex>', unpack) or use mode 'local'"
                )
        files = [Remote(r.url, r.name, _pinned(params, r.name, r.checksum), r.unpack) for r in files if _included(r.name, params.include)]
        return files, {}
    if params.mode == "kaggle":
        user, key = credentials("kaggle", source)
        slug = mod.KAGGLE_COMPETITION
        name = f"{slug}.zip"
        url = f"{KAGGLE_API}/competitions/data/download-all/{slug}"
        return [Remote(url, name, _pinned(params, name, None), True)], basic_auth(user, key)
    if params.mode == "physionet":
        user, password = credentials("physionet", source)
        project, version = mod.PHYSIONET_PROJECT
        base = f"{PHYSIONET_FILES}/{project}/{version}"
        headers = basic_auth(user, password)
        sums_url = f"{base}/SHA256SUMS.txt"
        sums = read_url(sums_url, headers, what=f"PhysioNet {project} {version} SHA256SUMS.txt ({public_url(sums_url)})").decode()
        files = []
        for line in sums.splitlines():
            parts = line.strip().split(maxsplit=1)
            if len(parts) != 2:
                continue
            digest, rel = parts[0], parts[1].lstrip("*").lstrip("./")
            if _included(rel, params.include):
                files.append(Remote(f"{base}/{urllib.parse.quote(rel)}", rel, f"sha256:{digest}", False))
        if not files:
            raise FetchError(f"sources.{source}.include: no file of {project} {version} matches {list(params.include)}")
        return files, headers
    if params.mode == "aimi":
        (sas_url,) = credentials("aimi", source)
        check_address(sas_url, "AIMI_SAS_URL")
        if not urllib.parse.urlsplit(sas_url).query:
            raise DownloadError(
                "AIMI_SAS_URL: the address has no query string (the SAS signature after its '?'); copy the whole link "
                f"({CREDENTIALS['aimi'][1]})"
            )
        return _azure_blobs(sas_url, params), {}
    raise FetchError(f"sources.{source}.mode: {params.mode!r} is not a remote mode")  # pragma: no cover


def _azure_blobs(sas_url: str, params: SourceParams) -> list[Remote]:
    """List an Azure blob container through its SAS address; each blob carries the Content-MD5 Azure stores."""
    parts = urllib.parse.urlsplit(sas_url)
    container = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))
    sas = parts.query
    out: list[Remote] = []
    marker = ""
    while True:
        q = f"restype=container&comp=list&{sas}" + (f"&marker={urllib.parse.quote(marker)}" if marker else "")
        what = f"AIMI container {public_url(container)}"
        xml = read_url(f"{container}?{q}", what=what)
        try:
            root = ElementTree.fromstring(xml)
        except ElementTree.ParseError as err:
            raise DownloadError(f"{what}: the answer is not an Azure blob list ({err}); is AIMI_SAS_URL the link AIMI gave?") from None
        for blob in root.iter("Blob"):
            name = blob.findtext("Name") or ""
            md5 = blob.findtext("Properties/Content-MD5") or ""
            if not name or not _included(name, params.include):
                continue
            checksum = _pinned(params, name, f"md5:{base64.b64decode(md5).hex()}" if md5 else None)
            out.append(Remote(f"{container}/{urllib.parse.quote(name)}?{sas}", name, checksum, name.lower().endswith(".zip")))
        marker = root.findtext("NextMarker") or ""
        if not marker:
            break
    if not out:
        raise FetchError(f"AIMI container {public_url(container)}: no blob matches include={list(params.include)}")
    return out


def _fetch_remote(source: str, params: SourceParams, tmp: Path, root: Path, quiet: bool = False) -> dict[str, Any]:
    try:
        files, headers = remotes_for(source, params)
    except DownloadError as err:  # a listing (PhysioNet's SHA256SUMS.txt, AIMI's container) or an address check
        raise FetchError(f"sources.{source}: {err}") from None
    cache = cache_dir(root) / source
    report = []
    for r in files:
        try:
            path, verified = download(r, cache, headers, quiet=quiet)
        except DownloadError as err:
            raise FetchError(f"sources.{source}: {err}") from None
        if not verified:
            log.warning(
                "%s: no published checksum; recorded its sha256 in the manifest. Pin it under sources.%s.checksums "
                "to have later fetches verified.", r.name, source,
            )
        if r.unpack:
            try:
                _unpack(path, tmp, quiet)
            except FetchError as err:
                if verified:
                    raise
                raise FetchError(
                    f"sources.{source}: {err}. The file had no checksum to be verified against: if the server sent a web "
                    f"page (a quota or confirmation page) instead of the archive, delete {path}, download the archive "
                    f"yourself and use mode 'local', or pin its checksum under sources.{source}.checksums"
                ) from None
        else:
            place(path, tmp / r.name)
        report.append({"name": r.name, "url": public_url(r.url), "verified": verified, "checksum": r.checksum})
    return {"downloads": report}


def copy_tree(src: Path, dst: Path, desc: str, quiet: bool) -> None:
    """Every file below ``src`` (symbolic links followed, as ``shutil.copytree(symlinks=False)`` follows them) copied
    to the same place below ``dst`` with its times, showing the bytes copied (a hospital's export can take hours)."""
    files: list[tuple[Path, Path, int]] = []
    real_of: dict[Path, str] = {}  # each folder walked (top-down: its parents come first) -> its real path

    def unreadable(err: OSError) -> None:
        from fedsilo.data.sources.base import is_hidden

        rel = Path(str(err.filename)).relative_to(src) if str(err.filename).startswith(str(src)) else Path(str(err.filename))
        if any(is_hidden(part) for part in rel.parts):  # a Mac drive's .Trashes, .Spotlight-V100: no reader looks there
            return
        raise FetchError(f"{err.filename}: cannot list this folder ({err.strerror}); its files would be left out of the "
                         "copy: give the account that fetches read access, or move the folder out of path")

    for folder, dirs, names in os.walk(src, followlinks=True, onerror=unreadable):
        here = Path(folder)
        real_of[here] = real = os.path.realpath(folder)
        for up in here.relative_to(src).parents:  # a linked folder leading back up the tree would never end
            if real_of[src / up] == real:
                raise FetchError(f"{folder}: a symbolic link loop (it is {src / up} again); remove the link, or point "
                                 "path at a folder without one")
        dirs.sort()
        rel = Path(folder).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in sorted(names):
            f = Path(folder) / name
            try:
                size = f.stat().st_size
            except OSError as err:  # a link to a file that is gone, a file removed while listed
                raise FetchError(f"{f}: cannot read it ({err.strerror}); remove it (a broken link?) or restore what it points to") from None
            files.append((f, dst / rel / name, size))
    bar = Progress(sum(n for _, _, n in files), desc, "B", quiet=quiet)
    for f, target, size in files:
        shutil.copy2(f, target)
        bar.update(size)
    bar.close()


def fetch(source: str, params: SourceParams, out_dir: Path, root: Path = Path("."), quiet: bool = False,
          rules: Any = None) -> dict:
    """Fetch ``source`` into ``out_dir``; ``root`` (the repository root) holds the download cache unless
    ``$FEDSILO_DOWNLOAD_CACHE`` is set. A local folder of a public source is read by its reader first
    (:func:`check_local_layout`, with ``rules``), so a wrong folder is refused before the copy."""
    from fedsilo.data.mirror import mirror_writer
    from fedsilo.utils.locks import beside, held

    out_dir = Path(out_dir)
    # a second fetch of the same source (two terminals, `dvc repro` beside a command) would remove this one's copy
    # in progress as an interrupted write's leftover: refused at once, naming who fetches
    with held(beside(out_dir), lambda who: FetchError(f"{source}: already being fetched into {out_dir} by {who}; wait for "
                                                      "it to end or stop it, then fetch again")):
        return _fetch(source, params, out_dir, root, quiet, rules, mirror_writer)


def _fetch(source: str, params: SourceParams, out_dir: Path, root: Path, quiet: bool, rules: Any, mirror_writer: Any) -> dict:
    extra: dict[str, Any] = {}
    with atomic_dir(out_dir) as tmp:
        if params.mode == "mirror":
            if params.reader is not None:  # a source of your own: its reader's mirror, drawn under the source's name
                mirror_writer(params.reader)(tmp, params.mirror, name=source)
            else:
                mirror_writer(source)(tmp, params.mirror)
            origin = f"offline mirror (seed {params.mirror.seed})"
        elif params.mode == "local":
            src = Path(params.path or "").expanduser()
            if not src.exists():
                raise FetchError(f"sources.{source}.path: {src} does not exist")
            if src.is_dir():
                if params.reader is None:  # a public source: its reader checks the folder before the copy
                    check_local_layout(source, src, rules)
                copy_tree(src, tmp, f"fetch {source}", quiet)
                if params.reader is None:  # a public source distributed as zips inside its folder
                    unpacked = _unpack_distributed_zips(source, tmp, quiet)
                    extra = {"unpacked": unpacked} if unpacked else {}
            else:
                _unpack(src, tmp, quiet)
            origin = str(src.resolve())
        else:
            extra = _fetch_remote(source, params, tmp, root, quiet)
            origin = f"{params.mode}: " + ", ".join(d["url"] for d in extra["downloads"][:3]) + (" ..." if len(extra["downloads"]) > 3 else "")
        files = tree_manifest(tmp, exclude=(MANIFEST,), desc=f"hash {source}", quiet=quiet)
        if not files:
            raise FetchError(f"{source}: fetch produced no files")
        manifest = {"source": source, "mode": params.mode, "origin": origin, "files": files, **extra}
        write_json(tmp / MANIFEST, manifest)
    return manifest


def manifest_files(raw_dir: Path) -> Optional[dict[str, dict[str, Any]]]:
    """What fetch's manifest in a source's folder records of every file it fetched (relative path -> sha256 and
    bytes), or None where the folder has no manifest (not fetched: a folder read in place)."""
    path = Path(raw_dir) / MANIFEST
    return json.loads(path.read_text())["files"] if path.is_file() else None


def files_fingerprint(files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One source's part of a dataset's fingerprint: its files' count, bytes and the sha256 of their manifest entries
    (:func:`fedsilo.utils.io.canonical_hash` of relative path -> sha256 and bytes)."""
    return {"files": len(files), "bytes": int(sum(f["bytes"] for f in files.values())), "sha256": canonical_hash(files)}


def sources_fingerprint(dataset: str, sources: tuple[str, ...], raw_root: Path) -> dict[str, Any]:
    """The content of one dataset's raw sources, as their fetch manifests record it (relative path, sha256 and size
    of every file; not where they were fetched from, so a moved copy of the same files changes nothing).

    dvc.yaml's ``fingerprint@<dataset>`` stage writes this for every dataset after any fetch; ``harmonize@<dataset>``
    depends on it instead of on all of ``data/raw``, so re-fetching PACS re-harmonizes PACS only."""
    out: dict[str, Any] = {"dataset": dataset, "sources": {}}
    for s in sources:
        files = manifest_files(Path(raw_root) / s)
        if files is None:
            raise FetchError(f"{Path(raw_root) / s / MANIFEST}: missing; fetch the source first (`fedsilo fetch --source {s}`, "
                             f"or `dvc repro fetch@{s}` once it is in pipeline.sources)")
        out["sources"][s] = files_fingerprint(files)
    return out
