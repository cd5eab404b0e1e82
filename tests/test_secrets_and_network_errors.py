"""Issue 17, item 6 and part of item 5: no credential in any message, output, log record or file whatever fails (a bad
address, a refused connection, an unknown host, no answer, TLS, HTTP 403, a redirect to a signed address); AIMI and
PhysioNet connection errors are one line naming the source and the host, as Kaggle's; a full disk is one line saying
where, whatever wrote (a plain write, numpy, torch.save). Loopback only: no test reaches the network."""

from __future__ import annotations

import base64
import errno
import http.server
import logging
import os
import socket
import threading
from pathlib import Path

import pytest
import yaml

from fedsilo.data import download as download_mod
from fedsilo.data import fetch as fetch_mod
from fedsilo.data.download import DownloadError
from fedsilo.utils import io as io_mod
from tests.conftest import small_params

MARKER = "SECRETMARKER123"
DEV_FULL = Path("/dev/full")
needs_dev_full = pytest.mark.skipif(not (DEV_FULL.exists() and os.access(DEV_FULL, os.W_OK)), reason="no writable /dev/full")


# --------------------------------------------------------------------------- loopback servers
class Answering:
    """Answers every GET with ``status`` (a Location header for a redirect); records nothing, prints nothing."""

    def __init__(self, status: int, location: str = ""):
        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def log_error(self, *a):  # the TLS hello it cannot read, too
                pass

            def do_GET(self):  # noqa: N802
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class Silent:
    """Accepts connections (the kernel's backlog) and never answers."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]

    def close(self):
        self.sock.close()


class Nothing:
    """A loopback port nothing listens on: connecting is refused."""

    def __init__(self):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()

    def close(self):
        pass


# --------------------------------------------------------------------------- helpers
SOURCES = {  # source -> (mode, what the one-line message names)
    "chexpert": ("aimi", "AIMI container"),
    "vinbigdata": ("physionet", "PhysioNet vindr-cxr 1.0.0 SHA256SUMS.txt"),
    "rsna": ("kaggle", "rsna-pneumonia-detection-challenge.zip"),
}


def _point_at(source: str, base: str, monkeypatch) -> None:
    """Credentials set to the marker, the source's service at ``base``."""
    for var in ("KAGGLE_USERNAME", "KAGGLE_KEY", "PHYSIONET_USERNAME", "PHYSIONET_PASSWORD", "AIMI_SAS_URL"):
        monkeypatch.delenv(var, raising=False)
    if source == "chexpert":
        monkeypatch.setenv("AIMI_SAS_URL", f"{base}/chexpert?sv=2024-05-04&sr=c&sp=rl&sig={MARKER}")
    elif source == "vinbigdata":
        monkeypatch.setattr(fetch_mod, "PHYSIONET_FILES", f"{base}/files")
        monkeypatch.setenv("PHYSIONET_USERNAME", "bob")
        monkeypatch.setenv("PHYSIONET_PASSWORD", MARKER)
    else:
        monkeypatch.setattr(fetch_mod, "KAGGLE_API", f"{base}/api/v1")
        monkeypatch.setenv("KAGGLE_USERNAME", "alice")
        monkeypatch.setenv("KAGGLE_KEY", MARKER)


def _fetch_cli(tmp_path: Path, source: str, mode: str, capfd) -> tuple[int, str]:
    """``fedsilo fetch --source <source>`` with ``sources.<source>.mode: <mode>``; returns (exit code, stderr)."""
    from fedsilo.cli import main

    raw = small_params(patients=8)
    raw["sources"][source] = {"mode": mode}
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(raw))
    capfd.readouterr()
    rc = main(["--params", str(params), "--root", str(tmp_path / "root"), "fetch", "--source", source])
    out, err = capfd.readouterr()
    assert out == "", out
    return rc, err


def _assert_no_secret(tmp_path: Path, err: str, caplog) -> None:
    """The marker, in any form, is nowhere: not in stderr, not in a log record, not in a file under the tmp root."""
    forms = [MARKER.encode()] + [base64.b64encode(f"{u}:{MARKER}".encode()) for u in ("alice", "bob")]
    texts = [err.encode(), caplog.text.encode()] + [r.getMessage().encode() for r in caplog.records]
    texts += [p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()]
    for form in forms:
        assert not any(form in t for t in texts), form


# --------------------------------------------------------------------------- item 6 and item 5: every failure path
FAILURES = {  # kind -> (server, scheme, what stderr says)
    "refused": (Nothing, "http", "cannot connect: connection refused"),
    "no answer": (Silent, "http", "cannot connect: no answer within 0.5 s"),
    "tls": (lambda: Answering(200), "https", "cannot connect: TLS error"),
    "http 403": (lambda: Answering(403), "http", "HTTP 403 Forbidden (credentials refused or the licence"),
}


@pytest.mark.parametrize("kind", list(FAILURES))
@pytest.mark.parametrize("source", list(SOURCES))
def test_a_failed_connection_is_one_line_naming_source_and_host_and_no_secret(tmp_path, monkeypatch, capfd, caplog, source, kind):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setattr(download_mod, "TIMEOUT", 0.5)
    monkeypatch.setenv("FEDSILO_DOWNLOAD_CACHE", str(tmp_path / "cache"))
    make, scheme, says = FAILURES[kind]
    server = make()
    try:
        _point_at(source, f"{scheme}://127.0.0.1:{server.port}", monkeypatch)
        mode, what = SOURCES[source]
        rc, err = _fetch_cli(tmp_path, source, mode, capfd)
    finally:
        server.close()
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"fedsilo fetch: error: sources.{source}: {what}") and f"127.0.0.1:{server.port}" in err, err
    assert says in err, err
    assert not (tmp_path / "root" / "data" / "raw" / source).exists()
    _assert_no_secret(tmp_path, err, caplog)


@pytest.mark.parametrize("source", list(SOURCES))
def test_an_unknown_host_is_one_line_naming_it(tmp_path, monkeypatch, capfd, caplog, source):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("FEDSILO_DOWNLOAD_CACHE", str(tmp_path / "cache"))

    def no_dns(host, *a, **k):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)  # no lookup leaves the machine
    _point_at(source, "https://storage.example.invalid", monkeypatch)
    rc, err = _fetch_cli(tmp_path, source, SOURCES[source][0], capfd)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"sources.{source}: " in err and "https://storage.example.invalid/" in err and "host not found" in err, err
    _assert_no_secret(tmp_path, err, caplog)


def test_a_redirect_to_a_signed_address_is_not_quoted(tmp_path, monkeypatch, capfd, caplog):
    """Kaggle answers with a redirect to signed storage; urllib refuses a non-http one quoting its whole address."""
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("FEDSILO_DOWNLOAD_CACHE", str(tmp_path / "cache"))
    server = Answering(302, location=f"gopher://storage.example/x.zip?X-Goog-Signature={MARKER}")
    try:
        _point_at("rsna", f"http://127.0.0.1:{server.port}", monkeypatch)
        rc, err = _fetch_cli(tmp_path, "rsna", "kaggle", capfd)
    finally:
        server.close()
    assert rc == 2 and "HTTP 302" in err and "gopher://storage.example/x.zip?<redacted>" in err, err
    _assert_no_secret(tmp_path, err, caplog)


@pytest.mark.parametrize("value, says", [
    (f"https://account.blob.core.windows.net/chexpert?sv=2024&sig={MARKER} x", "contains a space, line break or control character"),
    (f"https://account.blob.core.windows.net/chexpert?sv=2024&sig={MARKER}\n", "AIMI_SAS_URL contains a line break or control character"),
    (f"https://account.blob.core.windows.net/chexpert?sv=2024&sig={MARKER}\u00a0", "contains a space, line break or control character"),
    (f"https://account.blob.core.windows.net/chexpert?sv=2024&sig={MARKER}\u200b", "not ASCII"),
    (f"“https://account.blob.core.windows.net/chexpert?sig={MARKER}”", "not ASCII"),
    (f"sv=2024&sig={MARKER}", "must be an address starting with https://"),
    (f"http://account.blob.core.windows.net/chexpert?sig={MARKER}", "must be an address starting with https://"),
    (f"https:///chexpert?sig={MARKER}", "has no host name"),
    (f"https://account.blob.core.windows.net:x{MARKER}/chexpert?sig={MARKER}", "port of the address is not a number"),
    ("https://account.blob.core.windows.net/chexpert", "has no query string (the SAS signature"),
])
def test_a_bad_aimi_address_is_refused_naming_the_variable_never_its_value(tmp_path, monkeypatch, capfd, caplog, value, says):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("FEDSILO_DOWNLOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("AIMI_SAS_URL", value)
    rc, err = _fetch_cli(tmp_path, "chexpert", "aimi", capfd)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "AIMI_SAS_URL" in err and says in err, err
    assert "account.blob" not in err  # not even the public part of the value
    _assert_no_secret(tmp_path, err, caplog)


def test_a_bad_file_address_in_params_names_its_key(tmp_path):
    from fedsilo.config import RemoteFileParams, SourceParams

    params = SourceParams(mode="download", files=(RemoteFileParams(url=f"https://host.example/a.zip?sig={MARKER}\r\n"),))
    with pytest.raises(fetch_mod.FetchError, match=r"sources\.pacs\.files\[0\]\.url: contains a space") as info:
        fetch_mod.fetch("pacs", params, tmp_path / "raw" / "pacs")
    assert MARKER not in str(info.value)


def test_redact_removes_every_form_of_a_credential(monkeypatch):
    monkeypatch.setenv("AIMI_SAS_URL", f"https://a.blob.core.windows.net/c?sv=2024&sig={MARKER}%2Bx")
    monkeypatch.setenv("PHYSIONET_USERNAME", "bob")
    monkeypatch.setenv("PHYSIONET_PASSWORD", "pw with spaces")
    token = base64.b64encode(b"bob:pw with spaces").decode()
    text = download_mod.redact(
        f"'/c?restype=container&comp=list&sv=2024&sig={MARKER}+x' https://u:p4ss@h.example/x?token=abc "
        f"Authorization: Basic {token} {{'Authorization': 'Bearer abcdefgh12345'}} password=pw with spaces sig {MARKER}+x"
    )
    for secret in (MARKER, "p4ss", token, "abcdefgh12345", "pw with spaces", "token=abc"):
        assert secret not in text, (secret, text)
    assert "https://h.example/x?<redacted>" in text
    assert download_mod.redact("sources.x: HTTP 404 Not Found") == "sources.x: HTTP 404 Not Found"  # a plain message is untouched
    assert str(DownloadError(f"x?sig={MARKER}")) == "x?<redacted>"


def test_redact_removes_a_bare_basic_token_and_a_secret_that_holds_another(monkeypatch):
    """The Basic token built from a credential is removed where an error quotes it alone; of two credentials one of
    which contains the other, the longer goes whole (none of it left beside the shorter one's mark)."""
    monkeypatch.setenv("KAGGLE_USERNAME", "alice")
    monkeypatch.setenv("KAGGLE_KEY", "k3y-0f-alice")
    monkeypatch.setenv("PHYSIONET_PASSWORD", "k3y-0f-alice-and-bob")
    token = base64.b64encode(b"alice:k3y-0f-alice").decode()
    assert download_mod.redact(f"headers sent: {token}") == "headers sent: <redacted>"
    assert download_mod.redact("login k3y-0f-alice-and-bob / k3y-0f-alice") == "login <redacted> / <redacted>"


def test_check_address_takes_https_and_plain_http_on_loopback_only():
    download_mod.check_address("https://a.blob.core.windows.net/c?sig=x", "V")
    download_mod.check_address("http://127.0.0.1:8080/c?sig=x", "V")
    with pytest.raises(DownloadError, match="^V: must be an address starting with https://$"):
        download_mod.check_address("http://10.0.0.1/c?sig=x", "V")


# --------------------------------------------------------------------------- item 5: a full disk
def _torch_save_to_full_disk(obj):
    import torch

    torch.save({"w": torch.zeros(64, 64)}, DEV_FULL)


def _numpy_save_to_full_disk(obj):
    import numpy as np

    with open(DEV_FULL, "wb") as f:
        np.save(f, np.zeros((64, 64)))


def _plain_write_to_full_disk(obj):
    with open(DEV_FULL, "w") as f:
        f.write("x" * 10)


def _raise(err):
    def writer(*a):
        raise err

    return writer


WRITERS = {
    "OSError ENOSPC": _raise(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))),
    "torch enforce fail": _raise(RuntimeError("[enforce fail at inline_container.cc:671] . unexpected pos 704 vs 598")),
    "torch file write failed": _raise(RuntimeError("[enforce fail at inline_container.cc:471] . PytorchStreamWriter failed writing file data/0: file write failed")),
    "torch.save on /dev/full": pytest.param(_torch_save_to_full_disk, marks=needs_dev_full),
    "numpy on /dev/full": pytest.param(_numpy_save_to_full_disk, marks=needs_dev_full),
    "plain write on /dev/full": pytest.param(_plain_write_to_full_disk, marks=needs_dev_full),
}


@pytest.mark.parametrize("writer", list(WRITERS.values()), ids=list(WRITERS))
def test_a_full_disk_is_one_line_saying_where(tmp_path, monkeypatch, capfd, writer):
    from fedsilo.data import mirror

    monkeypatch.setattr(mirror, "mirror_writer", lambda source: lambda out, params: writer(out))
    rc, err = _fetch_cli(tmp_path, "chexpert", "mirror", capfd)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    raw = (tmp_path / "root" / "data" / "raw").resolve()
    assert err.startswith(f"fedsilo fetch: error: no space left on {raw} (the filesystem mounted at "), err
    assert "MiB free); free space there or point --root elsewhere" in err and "inline_container" not in err, err
    assert not [p for p in raw.iterdir()]  # the temporary folder is gone


def test_a_full_download_cache_says_so_and_names_fedsilo_download_cache(tmp_path, monkeypatch, capfd):
    from fedsilo.data import download

    class Zip(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"PK\x03\x04")

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Zip)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setenv("FEDSILO_DOWNLOAD_CACHE", str(tmp_path / "cache"))
    real_open = open
    monkeypatch.setattr(download, "open", lambda path, mode: _FullFile(real_open(path, mode)), raising=False)
    try:
        _point_at("rsna", f"http://127.0.0.1:{httpd.server_address[1]}", monkeypatch)
        rc, err = _fetch_cli(tmp_path, "rsna", "kaggle", capfd)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"no space left on {(tmp_path / 'cache' / 'rsna').resolve()} " in err and "set FEDSILO_DOWNLOAD_CACHE" in err, err


class _FullFile:
    """A file whose writes fail as on a full disk."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def write(self, b):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_an_atomic_write_on_a_full_disk_names_its_path_not_its_temporary(tmp_path):
    target = tmp_path / "state" / "quick" / "fedavg" / "seed0" / "checkpoint.pt"
    with pytest.raises(OSError) as info:
        with io_mod.atomic_file(target):
            raise RuntimeError("[enforce fail at inline_container.cc:671] . unexpected pos 704 vs 598")
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(target)
    assert list(target.parent.iterdir()) == []
    with pytest.raises(RuntimeError, match="PytorchStreamReader"):  # a reader's error is not a full disk
        with io_mod.atomic_file(target):
            raise RuntimeError("[enforce fail at inline_container.cc:145] . PytorchStreamReader failed reading zip archive")
    assert io_mod.disk_full(ValueError("x")) is None


def test_another_error_still_raises(tmp_path, monkeypatch, capfd):
    from fedsilo.data import mirror

    monkeypatch.setattr(mirror, "mirror_writer", lambda source: _raise(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        _fetch_cli(tmp_path, "chexpert", "mirror", capfd)
