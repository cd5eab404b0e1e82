"""HTTP(S) downloads with checksum verification and resume of a partial file.

A file is downloaded into a cache folder outside ``data/`` (``$FEDSILO_DOWNLOAD_CACHE``, default
``.fedsilo_cache/downloads`` in the repository root) as ``<name>.part``. An interrupted download keeps its ``.part``
file; the next attempt asks the server for the remaining bytes (``Range: bytes=<size>-``) and appends them, or starts
over when the server ignores ranges. Only a complete file whose checksum matches is renamed to ``<name>``; a
mismatch deletes the partial file and raises :class:`DownloadError` naming the file, the expected and the actual
digest. ``data/raw/<source>/`` is written from verified cache files only, so nothing half-downloaded ever lands there.

Checksums are written ``"<algorithm>:<hex>"`` (md5, sha1, sha256, sha512). A hex string shorter than the full digest is
a prefix (some publishers record sha512 prefixes); it must be at least 32 hex digits.

Credentials (Kaggle key, PhysioNet password, a signed AIMI address) are passed in as request headers or a URL and are
never written: :func:`public_url` strips the query string before an address is logged or stored in a manifest, and
an ``Authorization`` header is not forwarded when a redirect leaves the original host.
"""

from __future__ import annotations

import base64
import logging
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fedsilo.utils.io import file_digest

log = logging.getLogger("fedsilo.download")

ALGORITHMS = {"md5": 32, "sha1": 40, "sha256": 64, "sha512": 128}
CHUNK = 1 << 20


class DownloadError(RuntimeError):
    pass


@dataclass(frozen=True)
class Remote:
    """One file to download: its address, the name it gets, its checksum (or None) and whether it is an archive to
    unpack into the raw folder (else it is placed at ``name``, which may contain sub-folders)."""

    url: str
    name: str
    checksum: Optional[str] = None
    unpack: bool = False


def parse_checksum(spec: str, what: str) -> tuple[str, str]:
    algo, _, digest = spec.partition(":")
    algo = algo.lower().strip()
    digest = digest.lower().strip()
    if algo not in ALGORITHMS:
        raise DownloadError(f"{what}: checksum {spec!r}: algorithm must be one of {', '.join(ALGORITHMS)} ('sha256:<hex>')")
    if not digest or any(c not in "0123456789abcdef" for c in digest) or not (32 <= len(digest) <= ALGORITHMS[algo]):
        raise DownloadError(f"{what}: checksum {spec!r}: expected {ALGORITHMS[algo]} hex digits (or a prefix of >= 32)")
    return algo, digest


def checksum_matches(path: Path, spec: str, what: str) -> tuple[bool, str]:
    algo, digest = parse_checksum(spec, what)
    actual = file_digest(path, algo)
    return actual.startswith(digest), f"{algo}:{actual}"


def public_url(url: str) -> str:
    """The address without query string or user info: safe to log and to store."""
    p = urllib.parse.urlsplit(url)
    netloc = p.hostname or ""
    if p.port:
        netloc += f":{p.port}"
    return urllib.parse.urlunsplit((p.scheme, netloc, p.path, "", ""))


def basic_auth(user: str, secret: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{secret}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def cache_dir(root: Path | None = None) -> Path:
    env = os.environ.get("FEDSILO_DOWNLOAD_CACHE")
    return Path(env) if env else Path(root or ".") / ".fedsilo_cache" / "downloads"


class _SameHostAuthRedirect(urllib.request.HTTPRedirectHandler):
    """Follow redirects; drop the Authorization header when the redirect goes to another host (e.g. Kaggle's signed
    storage links), as browsers and requests do."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib signature
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).hostname != urllib.parse.urlsplit(req.full_url).hostname:
            for key in list(new.headers):
                if key.lower() == "authorization":
                    del new.headers[key]
        return new


_OPENER = urllib.request.build_opener(_SameHostAuthRedirect)


def open_url(url: str, headers: dict[str, str] | None = None, timeout: float = 60.0):
    req = urllib.request.Request(url, headers={"User-Agent": "fedsilo", **(headers or {})})
    return _OPENER.open(req, timeout=timeout)


def read_url(url: str, headers: dict[str, str] | None = None, what: str = "") -> bytes:
    try:
        with open_url(url, headers) as r:
            return r.read()
    except urllib.error.HTTPError as err:
        raise DownloadError(_http_message(err, what or public_url(url))) from None
    except (urllib.error.URLError, OSError) as err:
        raise DownloadError(f"{what or public_url(url)}: cannot connect: {getattr(err, 'reason', err)}") from None


def _http_message(err: urllib.error.HTTPError, what: str) -> str:
    hint = ""
    if err.code in (401, 403):
        hint = " (credentials refused or the licence/data-use agreement is not accepted for this account)"
    return f"{what}: HTTP {err.code} {err.reason}{hint}"


def download(remote: Remote, cache: Path, headers: dict[str, str] | None = None, timeout: float = 60.0) -> tuple[Path, bool]:
    """Download ``remote`` into ``cache`` (resuming a partial file), verify it, return (path, verified).

    ``verified`` is False only when no checksum is known for the file; the caller records that in the manifest."""
    cache = Path(cache)
    final = cache / remote.name
    part = cache / (remote.name + ".part")
    final.parent.mkdir(parents=True, exist_ok=True)
    what = f"{remote.name} ({public_url(remote.url)})"
    if remote.checksum:
        parse_checksum(remote.checksum, remote.name)
    if final.exists():
        if remote.checksum is None:
            return final, False
        ok, _ = checksum_matches(final, remote.checksum, remote.name)
        if ok:
            return final, True
        final.unlink()  # a cached file that no longer matches: fetch it again
    have = part.stat().st_size if part.exists() else 0
    req_headers = dict(headers or {})
    if have:
        req_headers["Range"] = f"bytes={have}-"
    try:
        resp = open_url(remote.url, req_headers, timeout)
    except urllib.error.HTTPError as err:
        if err.code == 416 and have:  # nothing left to fetch: the partial file is complete
            resp = None
        else:
            raise DownloadError(_http_message(err, what)) from None
    except (urllib.error.URLError, OSError) as err:
        raise DownloadError(f"{what}: cannot connect: {getattr(err, 'reason', err)} (the .part file is kept; rerun to resume)") from None
    if resp is not None:
        with resp:
            status = getattr(resp, "status", 200)
            mode = "ab" if (have and status == 206) else "wb"
            if have and status != 206:
                log.info("%s: server ignored the range request; downloading from the start", remote.name)
            total = resp.headers.get("Content-Length")
            received = 0
            try:
                with open(part, mode) as f:
                    while True:
                        b = resp.read(CHUNK)
                        if not b:
                            break
                        f.write(b)
                        received += len(b)
            except OSError as err:
                raise DownloadError(f"{what}: interrupted after {received} bytes: {err} (rerun to resume)") from None
            if total is not None and received < int(total):
                raise DownloadError(f"{what}: connection closed after {received} of {total} bytes (rerun to resume)")
    if remote.checksum:
        ok, actual = checksum_matches(part, remote.checksum, remote.name)
        if not ok:
            part.unlink()
            raise DownloadError(
                f"{remote.name}: checksum mismatch: expected {remote.checksum}, got {actual} "
                f"(from {public_url(remote.url)}; the partial file was deleted)"
            )
    os.replace(part, final)
    return final, remote.checksum is not None


def place(file: Path, dest: Path) -> None:
    """Put a verified cache file into the raw folder: a hard link when possible, else a copy."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(file, dest)
    except OSError:
        shutil.copy2(file, dest)
