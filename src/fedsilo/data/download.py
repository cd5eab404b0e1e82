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
never written or shown: :func:`public_url` strips the query string before an address is logged or stored in a
manifest; :func:`redact` is applied to every message this module and ``fedsilo.data.fetch`` raise or log (their
errors redact themselves, a filter their loggers' records), removing query strings, user info, ``Authorization``
values and the value of every credential variable (:data:`SECRET_VARIABLES`) in whatever form an underlying error
quotes it; an ``Authorization`` header is not forwarded when a redirect leaves the original host. An address that
carries a credential is checked by :func:`check_address` before any request, naming the variable, never its value.

A connection that fails (unknown host, refused, no answer within :data:`TIMEOUT` seconds, TLS) is one line naming the
file or listing, the address without its query string and what went wrong (:func:`network_reason`).
"""

from __future__ import annotations

import base64
import errno
import http.client
import logging
import os
import re
import shutil
import socket
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fedsilo.utils.io import file_digest
from fedsilo.utils.progress import Progress

ALGORITHMS = {"md5": 32, "sha1": 40, "sha256": 64, "sha512": 128}
CHUNK = 1 << 20
TIMEOUT = 60.0  # seconds without an answer before a request fails

# the environment variables that hold a credential (fedsilo.data.fetch.CREDENTIALS says where each comes from), and
# the (user, secret) pairs sent as HTTP Basic: redact() removes their values and the Basic token built from them
SECRET_VARIABLES = ("KAGGLE_KEY", "PHYSIONET_PASSWORD", "AIMI_SAS_URL")
BASIC_AUTH_VARIABLES = (("KAGGLE_USERNAME", "KAGGLE_KEY"), ("PHYSIONET_USERNAME", "PHYSIONET_PASSWORD"))
REDACTED = "<redacted>"

_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@'\"<>]+@")
_QUERY = re.compile(r"\?(?=[^\s'\"<>]*=)[^\s'\"<>]+")
_NAMED = re.compile(
    r"(?i)\b(proxy-authorization|authorization|x-api-key|api[_-]?key|access[_-]?token|password|passwd|secret|sig|signature)"
    r"(['\"]?\s*[:=]\s*['\"]?)(?:(?:basic|bearer|token)\s+)?[^\s'\",;&}]+"
)
_SCHEME_TOKEN = re.compile(r"\b(Basic|Bearer)\s+[A-Za-z0-9+/=._~-]{8,}")


def _secret_values() -> list[str]:
    """The credential values of this environment, in the forms a message could quote them, longest first."""
    found: set[str] = set()
    for var in SECRET_VARIABLES:
        value = os.environ.get(var, "")
        if "://" in value and "?" in value:  # a signed address: its query string is the secret, not its host
            query = value.split("?", 1)[1]
            found.update({query, urllib.parse.unquote(query)})
            for pair in query.split("&"):
                v = pair.partition("=")[2]
                found.update(x for x in (v, urllib.parse.unquote(v)) if len(x) >= 8)
        elif value:
            found.add(value)
    for user_var, secret_var in BASIC_AUTH_VARIABLES:
        secret = os.environ.get(secret_var, "")
        if secret:
            found.add(basic_auth(os.environ.get(user_var, ""), secret)["Authorization"].split()[1])
    return sorted((v for v in found if len(v) >= 4), key=len, reverse=True)


def redact(text: object) -> str:
    """``text`` with nothing secret left: credential values from the environment, query strings (``?a=b...``), user
    info of addresses, ``Authorization`` / token / password / signature values. The one helper every message of
    the fetch layer goes through."""
    text = str(text)
    for value in _secret_values():
        text = text.replace(value, REDACTED)
    text = _USERINFO.sub(r"\1", text)
    text = _QUERY.sub("?" + REDACTED, text)
    text = _NAMED.sub(lambda m: m.group(1) + m.group(2) + REDACTED, text)
    return _SCHEME_TOKEN.sub(lambda m: f"{m.group(1)} {REDACTED}", text)


class DownloadError(RuntimeError):
    """A download that failed; its message is redacted (:func:`redact`) and one line whatever it was built from (a
    server's reason phrase, urllib's multi-line redirect-loop text)."""

    def __init__(self, message: object) -> None:
        super().__init__(" ".join(redact(message).split()))


class RedactFilter(logging.Filter):
    """Redacts every record of the logger it is attached to (the fetch layer's)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = redact(record.getMessage()), None
        return True


log = logging.getLogger("fedsilo.download")
log.addFilter(RedactFilter())


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


def check_address(url: str, what: str, schemes: tuple[str, ...] = ("https",)) -> None:
    """Refuse an address before any request is made with it: whitespace or a control character (a line break copied
    with it), a character that is not ASCII (a typographic quote), a scheme other than ``schemes`` (plain http is
    also accepted for a loopback host: a local test server or proxy), no host, a bad port. The message names ``what``
    (the variable or key the address came from) and never the value: the address may carry a signature."""
    if any(c.isspace() or ord(c) < 32 or 127 <= ord(c) < 160 for c in url):
        raise DownloadError(f"{what}: contains a space, line break or control character; copy the address again")
    if not url.isascii():
        raise DownloadError(f"{what}: contains a character that is not ASCII (a typographic quote?); copy the address again")
    p = urllib.parse.urlsplit(url)
    try:
        host, _ = p.hostname, p.port
    except ValueError:
        raise DownloadError(f"{what}: the port of the address is not a number") from None
    loopback = host in ("localhost", "127.0.0.1", "::1")
    if p.scheme.lower() not in schemes and not (p.scheme.lower() == "http" and loopback):
        raise DownloadError(f"{what}: must be an address starting with {' or '.join(s + '://' for s in schemes)}")
    if not host:
        raise DownloadError(f"{what}: the address has no host name")


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


def network_reason(err: BaseException, timeout: float | None = None) -> str:
    """What went wrong with a connection, in words: unknown host, refused, no answer, TLS; never an address."""
    reason = err.reason if isinstance(err, urllib.error.URLError) and isinstance(err.reason, BaseException) else err
    if isinstance(reason, socket.gaierror):
        return "host not found (DNS lookup failed: check the address, the network and any https_proxy)"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused (is the address right and the service up?)"
    if isinstance(reason, TimeoutError):
        return f"no answer within {timeout or TIMEOUT:g} s (check the network and any https_proxy)"
    if isinstance(reason, ssl.SSLCertVerificationError):
        return f"TLS certificate not accepted ({redact(reason.verify_message or reason.reason)})"
    if isinstance(reason, ssl.SSLError):
        return f"TLS error ({redact(reason.reason or reason)})"
    if isinstance(reason, ConnectionResetError):
        return "connection reset by the server"
    if isinstance(reason, http.client.HTTPException):
        return f"malformed answer from the server ({type(reason).__name__})"
    return redact(getattr(err, "reason", err))


def open_url(url: str, headers: dict[str, str] | None = None, timeout: float | None = None):
    req = urllib.request.Request(url, headers={"User-Agent": "fedsilo", **(headers or {})})
    return _OPENER.open(req, timeout=timeout or TIMEOUT)


def read_url(url: str, headers: dict[str, str] | None = None, what: str = "") -> bytes:
    what = what or public_url(url)
    try:
        with open_url(url, headers) as r:
            return r.read()
    except urllib.error.HTTPError as err:
        raise DownloadError(_http_message(err, what)) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
        raise DownloadError(f"{what}: cannot connect: {network_reason(err)}") from None
    except ValueError as err:  # http.client.InvalidURL, urllib's "unknown url type": they quote the whole address
        raise DownloadError(f"{what}: invalid address ({type(err).__name__})") from None


def _http_message(err: urllib.error.HTTPError, what: str) -> str:
    hint = ""
    if err.code in (401, 403):
        hint = " (credentials refused or the licence/data-use agreement is not accepted for this account)"
    return f"{what}: HTTP {err.code} {redact(err.reason)}{hint}"


def download(remote: Remote, cache: Path, headers: dict[str, str] | None = None, timeout: float | None = None,
             quiet: bool = False) -> tuple[Path, bool]:
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
    except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
        kept = " (the .part file is kept; rerun to resume)" if have else ""
        raise DownloadError(f"{what}: cannot connect: {network_reason(err, timeout)}{kept}") from None
    except ValueError as err:  # http.client.InvalidURL, urllib's "unknown url type": they quote the whole address
        raise DownloadError(f"{what}: invalid address ({type(err).__name__})") from None
    if resp is not None:
        with resp:
            status = getattr(resp, "status", 200)
            mode = "ab" if (have and status == 206) else "wb"
            if have and status != 206:
                log.info("%s: server ignored the range request; downloading from the start", remote.name)
            total = resp.headers.get("Content-Length")
            received = 0
            start = have if mode == "ab" else 0
            bar = Progress(start + int(total) if total is not None else None, f"fetch {remote.name}", "B", quiet=quiet, initial=start)
            try:
                with bar, open(part, mode) as f:
                    while True:
                        b = resp.read(CHUNK)
                        if not b:
                            break
                        f.write(b)
                        received += len(b)
                        bar.update(len(b))
            except OSError as err:
                if err.errno == errno.ENOSPC:  # not the network: the cache's disk is full (cli.main says where)
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(part)) from None
                raise DownloadError(f"{what}: interrupted after {received} bytes: {network_reason(err, timeout)} (rerun to resume)") from None
            except http.client.HTTPException as err:
                raise DownloadError(f"{what}: interrupted after {received} bytes: {network_reason(err, timeout)} (rerun to resume)") from None
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
