"""Fetch modes against a local HTTP server: resume, checksums, credentials, Kaggle / PhysioNet / AIMI protocols."""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import os
import re
import threading
import zipfile
from pathlib import Path

import pytest

from fedsilo.config import RemoteFileParams, SourceParams
from fedsilo.data import fetch as fetch_mod
from fedsilo.data.download import DownloadError, Remote, download, public_url
from fedsilo.data.fetch import FetchError, fetch


class Server:
    """Serves ``files`` (path -> bytes) with Range support; records requests; optional Basic auth."""

    def __init__(self, files: dict[str, bytes], auth: str | None = None, ranges: bool = True, cut_at: int | None = None):
        self.files, self.auth, self.ranges, self.cut_at = files, auth, ranges, cut_at
        self.log: list[dict] = []
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):  # noqa: N802
                outer.log.append({"path": self.path, "headers": dict(self.headers)})
                if outer.auth and self.headers.get("Authorization") != outer.auth:
                    self.send_response(401)
                    self.end_headers()
                    return
                key = self.path.split("?")[0]
                if "comp=list" in self.path:
                    key = key + "?list"
                body = outer.files.get(key)
                if body is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                start = 0
                rng = self.headers.get("Range")
                if rng and outer.ranges:
                    start = int(rng.split("=")[1].rstrip("-"))
                    if start >= len(body):
                        self.send_response(416)
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                part = body[start:]
                self.send_header("Content-Length", str(len(part)))
                self.end_headers()
                if outer.cut_at is not None:
                    self.wfile.write(part[: outer.cut_at])
                    self.wfile.flush()
                    outer.cut_at = None
                    self.connection.close()
                    return
                self.wfile.write(part)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def payload() -> bytes:
    return bytes(range(256)) * 4000  # 1 MB


def test_truncated_download_resumes_with_a_range_request(tmp_path, payload, capsys):
    srv = Server({"/f.bin": payload}, cut_at=300_000)
    try:
        sha = hashlib.sha256(payload).hexdigest()
        r = Remote(f"{srv.url}/f.bin", "f.bin", f"sha256:{sha}")
        with pytest.raises(DownloadError, match="rerun to resume"):
            download(r, tmp_path)
        part = tmp_path / "f.bin.part"
        assert part.exists() and part.stat().st_size == 300_000 and not (tmp_path / "f.bin").exists()
        capsys.readouterr()
        path, verified = download(r, tmp_path)
        assert verified and path.read_bytes() == payload and not part.exists()
        assert srv.log[-1]["headers"].get("Range") == "bytes=300000-"
        # progress in a log: the bytes of the whole file (the resumed part counted from its offset) and the rate
        err = capsys.readouterr().err
        assert re.search(r"fetch f\.bin: 0\.98 MiB of 0\.98 MiB, [\d.]+ MiB/s", err), err
        download(r, tmp_path / "again", quiet=True)
        assert capsys.readouterr().err == ""
    finally:
        srv.close()


def test_server_ignoring_ranges_restarts_cleanly(tmp_path, payload):
    srv = Server({"/f.bin": payload}, ranges=False)
    try:
        (tmp_path / "f.bin.part").write_bytes(payload[:1000])
        path, _ = download(Remote(f"{srv.url}/f.bin", "f.bin", f"md5:{hashlib.md5(payload).hexdigest()}"), tmp_path)
        assert path.read_bytes() == payload
    finally:
        srv.close()


def test_a_cached_file_is_reused_only_while_it_matches_and_a_complete_part_is_finished_on_416(tmp_path, payload):
    """A cached file matching its checksum is used without a request; one that no longer matches is fetched again; a
    ``.part`` already whole gets 416 to its range request and is verified and kept, not refetched."""
    srv = Server({"/f.bin": payload})
    try:
        r = Remote(f"{srv.url}/f.bin", "f.bin", f"sha256:{hashlib.sha256(payload).hexdigest()}")
        (tmp_path / "f.bin").write_bytes(payload)
        assert download(r, tmp_path, quiet=True) == (tmp_path / "f.bin", True) and srv.log == []
        (tmp_path / "f.bin").write_bytes(b"an older release")
        path, verified = download(r, tmp_path, quiet=True)
        assert verified and path.read_bytes() == payload and len(srv.log) == 1
        path.unlink()
        (tmp_path / "f.bin.part").write_bytes(payload)
        path, verified = download(r, tmp_path, quiet=True)
        assert verified and path.read_bytes() == payload and not (tmp_path / "f.bin.part").exists()
        assert srv.log[-1]["headers"].get("Range") == f"bytes={len(payload)}-"
    finally:
        srv.close()


def test_a_checksum_is_a_known_algorithm_and_hex_digits_a_prefix_of_at_least_32(tmp_path, payload):
    from fedsilo.data.download import parse_checksum

    full = hashlib.sha512(payload).hexdigest()
    assert parse_checksum(f"SHA512:{full[:32].upper()}", "f") == ("sha512", full[:32])
    for bad, says in ((f"sha512:{full[:31]}", "expected 128 hex digits"), (f"md5:{full[:33]}", "expected 32 hex digits"),
                      ("sha256:" + "g" * 64, "expected 64 hex digits"), ("crc32:" + "0" * 32, "algorithm must be one of")):
        with pytest.raises(DownloadError, match=f"^f: checksum '{bad}': {says}"):
            parse_checksum(bad, "f")
    srv = Server({"/f.bin": payload})
    try:  # a publisher's sha512 prefix verifies the whole file
        path, verified = download(Remote(f"{srv.url}/f.bin", "f.bin", f"sha512:{full[:40]}"), tmp_path, quiet=True)
        assert verified and path.read_bytes() == payload
    finally:
        srv.close()


def test_a_redirect_to_another_host_drops_the_authorization_header(tmp_path, payload):
    """Kaggle's answer redirects to signed storage: the credentials go to the host they were meant for only."""
    storage = Server({"/f.bin": payload})
    port = storage.httpd.server_address[1]

    class Redirect(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):  # noqa: N802
            host = "127.0.0.1" if self.path == "/same" else "localhost"
            self.send_response(302)
            self.send_header("Location", f"http://{host}:{port}/f.bin")
            self.end_headers()

    api = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=api.serve_forever, daemon=True).start()
    auth = {"Authorization": "Basic " + base64.b64encode(b"bob:key").decode()}
    try:
        for path, sent in (("other", None), ("same", auth["Authorization"])):
            remote = Remote(f"http://127.0.0.1:{api.server_address[1]}/{path}", f"{path}.bin")
            assert download(remote, tmp_path, headers=auth, quiet=True)[0].read_bytes() == payload
            assert storage.log[-1]["headers"].get("Authorization") == sent, path
    finally:
        api.shutdown()
        storage.close()


def test_a_cache_on_another_disk_is_copied_into_the_raw_folder(tmp_path, monkeypatch):
    """A hard link when the cache and data/ share a disk; a copy when linking fails (another file system)."""
    import errno

    from fedsilo.data.download import place

    (tmp_path / "cached.bin").write_bytes(b"verified bytes")
    place(tmp_path / "cached.bin", tmp_path / "raw" / "a" / "linked.bin")
    assert (tmp_path / "raw" / "a" / "linked.bin").stat().st_ino == (tmp_path / "cached.bin").stat().st_ino

    def cross_device(src, dst):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), None, str(dst))

    monkeypatch.setattr(os, "link", cross_device)
    place(tmp_path / "cached.bin", tmp_path / "raw" / "b" / "copied.bin")
    assert (tmp_path / "raw" / "b" / "copied.bin").read_bytes() == b"verified bytes"


def test_checksum_mismatch_names_the_file_and_leaves_nothing_in_data(tmp_path, payload, monkeypatch):
    srv = Server({"/train_32x32.mat": payload})
    monkeypatch.setenv("FEDSILO_DOWNLOAD_CACHE", str(tmp_path / "cache"))
    try:
        bad = "sha256:" + "0" * 64
        p = SourceParams(mode="download", files=(RemoteFileParams(url=f"{srv.url}/train_32x32.mat", checksum=bad),))
        out = tmp_path / "data" / "raw" / "svhn"
        with pytest.raises(FetchError, match=r"train_32x32\.mat: checksum mismatch: expected sha256:0+, got sha256:"):
            fetch("svhn", p, out)
        assert not out.exists()
        assert [x.name for x in (tmp_path / "data" / "raw").iterdir()] == []
        assert not (tmp_path / "cache" / "svhn" / "train_32x32.mat.part").exists()
    finally:
        srv.close()


def test_official_download_list_verifies_and_records_provenance(tmp_path, payload, monkeypatch):
    """USPS's official files (torchvision's md5s): a server that returns other bytes is refused; with the real
    checksum pinned by the user for this test, the file lands and the manifest says it was verified."""
    from fedsilo.data.sources import usps

    srv = Server({"/usps.bz2": payload, "/usps.t.bz2": payload})
    monkeypatch.setattr(usps, "DOWNLOADS", [Remote(f"{srv.url}/{r.name}", r.name, r.checksum) for r in usps.DOWNLOADS])
    monkeypatch.setenv("FEDSILO_DOWNLOAD_CACHE", str(tmp_path / "cache"))
    try:
        with pytest.raises(FetchError, match=r"usps\.bz2: checksum mismatch: expected md5:ec16c51db3855ca6c91edd34d0e9b197"):
            fetch("usps", SourceParams(mode="download"), tmp_path / "raw" / "usps")
        pin = {"usps.bz2": f"sha256:{hashlib.sha256(payload).hexdigest()}", "usps.t.bz2": f"sha256:{hashlib.sha256(payload).hexdigest()}"}
        m = fetch("usps", SourceParams(mode="download", checksums=pin), tmp_path / "raw" / "usps")
        assert {d["name"]: d["verified"] for d in m["downloads"]} == {"usps.bz2": True, "usps.t.bz2": True}
        assert (tmp_path / "raw" / "usps" / "usps.t.bz2").read_bytes() == payload
    finally:
        srv.close()


def test_source_without_public_address_asks_for_files():
    with pytest.raises(FetchError, match=r"sources\.pacs\.files"):
        fetch_mod.remotes_for("pacs", SourceParams(mode="download"))


@pytest.mark.parametrize(
    "source,mode,names",
    [("rsna", "kaggle", "KAGGLE_USERNAME and KAGGLE_KEY"), ("vinbigdata", "physionet", "PHYSIONET_USERNAME and PHYSIONET_PASSWORD"), ("chexpert", "aimi", "AIMI_SAS_URL")],
)
def test_missing_credentials_say_what_to_set(tmp_path, monkeypatch, source, mode, names):
    for var in ("KAGGLE_USERNAME", "KAGGLE_KEY", "PHYSIONET_USERNAME", "PHYSIONET_PASSWORD", "AIMI_SAS_URL"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(FetchError, match=f"set {names} in the environment"):
        fetch(source, SourceParams(mode=mode), tmp_path / source)
    assert not (tmp_path / source).exists()


def _zip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return buf.getvalue()


def _all_text(root: Path) -> str:
    return "\n".join(p.read_bytes().decode("latin-1") for p in root.rglob("*") if p.is_file())


def test_kaggle_mode_sends_credentials_unpacks_and_writes_no_secret(tmp_path, monkeypatch):
    blob = _zip({"stage_2_train_labels.csv": b"patientId,x,y,width,height,Target\n", "stage_2_train_images/a.dcm": b"x"})
    user, key = "alice", "s3cr3t-kaggle-key"
    srv = Server({"/api/v1/competitions/data/download-all/rsna-pneumonia-detection-challenge": blob}, auth="Basic " + base64.b64encode(f"{user}:{key}".encode()).decode())
    monkeypatch.setattr(fetch_mod, "KAGGLE_API", srv.url + "/api/v1")
    monkeypatch.setenv("KAGGLE_USERNAME", user)
    monkeypatch.setenv("KAGGLE_KEY", key)
    monkeypatch.setenv("FEDSILO_DOWNLOAD_CACHE", str(tmp_path / "cache"))
    try:
        m = fetch("rsna", SourceParams(mode="kaggle"), tmp_path / "raw" / "rsna")
        assert (tmp_path / "raw" / "rsna" / "stage_2_train_images" / "a.dcm").read_bytes() == b"x"
        assert m["downloads"][0]["verified"] is False  # Kaggle publishes no checksum: recorded, not claimed
        assert key not in _all_text(tmp_path) and base64.b64encode(f"{user}:{key}".encode()).decode() not in _all_text(tmp_path)
    finally:
        srv.close()


def test_physionet_mode_verifies_every_file_against_sha256sums(tmp_path, monkeypatch):
    files = {"annotations/annotations_train.csv": b"image_id,rad_id,class_name\n", "train/abc.dicom": b"DICM" * 10}
    sums = "".join(f"{hashlib.sha256(v).hexdigest()} {k}\n" for k, v in files.items())
    served = {f"/files/vindr-cxr/1.0.0/{k}": v for k, v in files.items()}
    served["/files/vindr-cxr/1.0.0/SHA256SUMS.txt"] = sums.encode()
    srv = Server(served, auth="Basic " + base64.b64encode(b"bob:pw-physionet").decode())
    monkeypatch.setattr(fetch_mod, "PHYSIONET_FILES", srv.url + "/files")
    monkeypatch.setenv("PHYSIONET_USERNAME", "bob")
    monkeypatch.setenv("PHYSIONET_PASSWORD", "pw-physionet")
    monkeypatch.setenv("FEDSILO_DOWNLOAD_CACHE", str(tmp_path / "cache"))
    try:
        m = fetch("vinbigdata", SourceParams(mode="physionet", include=("annotations/*",)), tmp_path / "raw" / "vin")
        assert [d["name"] for d in m["downloads"]] == ["annotations/annotations_train.csv"] and m["downloads"][0]["verified"]
        served["/files/vindr-cxr/1.0.0/train/abc.dicom"] = b"tampered"
        with pytest.raises(FetchError, match=r"train/abc\.dicom: checksum mismatch"):
            fetch("vinbigdata", SourceParams(mode="physionet"), tmp_path / "raw" / "vin2")
        assert "pw-physionet" not in _all_text(tmp_path)
    finally:
        srv.close()


def test_aimi_mode_lists_the_container_and_checks_content_md5(tmp_path, monkeypatch):
    blob = _zip({"CheXpert-v1.0-small/train.csv": b"Path\n"})
    md5 = base64.b64encode(hashlib.md5(blob).digest()).decode()
    listing = (
        "<?xml version='1.0' encoding='utf-8'?><EnumerationResults><Blobs>"
        f"<Blob><Name>CheXpert-v1.0-small.zip</Name><Properties><Content-MD5>{md5}</Content-MD5></Properties></Blob>"
        "<Blob><Name>README.txt</Name><Properties></Properties></Blob>"
        "</Blobs><NextMarker /></EnumerationResults>"
    ).encode()
    srv = Server({"/chexpert?list": listing, "/chexpert/CheXpert-v1.0-small.zip": blob})
    secret = "sv=2024&sig=TOPSECRETSIGNATURE"
    monkeypatch.setenv("AIMI_SAS_URL", f"{srv.url}/chexpert?{secret}")
    monkeypatch.setenv("FEDSILO_DOWNLOAD_CACHE", str(tmp_path / "cache"))
    try:
        m = fetch("chexpert", SourceParams(mode="aimi", include=("*.zip",)), tmp_path / "raw" / "chexpert")
        assert (tmp_path / "raw" / "chexpert" / "CheXpert-v1.0-small" / "train.csv").exists()
        assert m["downloads"][0]["verified"] is True
        assert all("sig=TOPSECRETSIGNATURE" in e["path"] for e in srv.log)  # the signature went to the server ...
        assert "TOPSECRETSIGNATURE" not in _all_text(tmp_path)  # ... and nowhere else
    finally:
        srv.close()


def test_public_url_drops_query_and_user_info():
    assert public_url("https://u:p@host.example:8443/a/b.zip?sig=x&se=y") == "https://host.example:8443/a/b.zip"


def test_corrupt_archive_in_local_mode_fails_naming_it(tmp_path):
    bad = tmp_path / "PACS.zip"
    good = _zip({"PACS/photo/dog/a.jpg": b"x" * 100})
    bad.write_bytes(good[:-30])
    with pytest.raises(FetchError, match=r"PACS\.zip"):
        fetch("pacs", SourceParams(mode="local", path=str(bad)), tmp_path / "raw" / "pacs")
    assert not (tmp_path / "raw" / "pacs").exists()


def test_a_local_folder_is_copied_whole_with_its_times_and_linked_folders_showing_the_bytes(tmp_path, capsys):
    """mode local with a folder: every file (a linked folder's too, as copytree follows links) lands at its place
    with its modification time, and the copy shows its progress in bytes (a hospital export can take hours)."""
    import os as _os

    src = tmp_path / "export"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "x.png").write_bytes(b"\x89PNG" + bytes(3000))
    (src / "labels.csv").write_text("path,label\n")
    _os.utime(src / "labels.csv", (1_600_000_000, 1_600_000_000))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "y.png").write_bytes(b"\x89PNG" + bytes(10))
    (src / "linked").symlink_to(tmp_path / "elsewhere")
    manifest = fetch("site", SourceParams(mode="local", reader="image_folder", path=str(src)), tmp_path / "raw" / "site", quiet=False)
    out = tmp_path / "raw" / "site"
    assert set(manifest["files"]) == {"a/b/x.png", "labels.csv", "linked/y.png"}
    assert (out / "linked" / "y.png").is_file() and not (out / "linked").is_symlink()
    assert (out / "a" / "b" / "x.png").read_bytes() == (src / "a" / "b" / "x.png").read_bytes()
    assert (out / "labels.csv").stat().st_mtime == 1_600_000_000
    assert "fetch site:" in capsys.readouterr().err
    # a linked folder leading back up the tree is refused by name, and nothing is left behind
    (src / "a" / "up").symlink_to(src)
    with pytest.raises(FetchError, match=r"a/up: a symbolic link loop \(it is .*export again\)"):
        fetch("site2", SourceParams(mode="local", reader="image_folder", path=str(src)), tmp_path / "raw" / "site2", quiet=True)
    assert not (tmp_path / "raw" / "site2").exists()


def test_a_folder_the_fetching_account_cannot_list_fails_the_fetch_by_name(tmp_path, monkeypatch):
    """os.walk skips a folder it cannot list unless told otherwise: the copy would silently lack a patient's images."""
    src = tmp_path / "export"
    (src / "patient7").mkdir(parents=True)
    (src / "a.png").write_bytes(b"x")
    real_walk = fetch_mod.os.walk

    def walk(top, **kw):
        kw["onerror"](PermissionError(13, "Permission denied", str(src / "patient7")))  # as scandir reports it
        yield from real_walk(top, **kw)

    monkeypatch.setattr(fetch_mod.os, "walk", walk)
    with pytest.raises(FetchError, match=r"patient7: cannot list this folder \(Permission denied\)"):
        fetch("site", SourceParams(mode="local", reader="image_folder", path=str(src)), tmp_path / "raw" / "site", quiet=True)
    assert not (tmp_path / "raw" / "site").exists()

    def walk_mac_drive(top, **kw):  # a Mac-formatted drive's root-only .Trashes: no reader looks there
        kw["onerror"](PermissionError(13, "Permission denied", str(src / ".Trashes")))
        yield from real_walk(top, **kw)

    monkeypatch.setattr(fetch_mod.os, "walk", walk_mac_drive)
    manifest = fetch("site", SourceParams(mode="local", reader="image_folder", path=str(src)), tmp_path / "raw" / "site", quiet=True)
    assert set(manifest["files"]) == {"a.png"}


def test_an_archive_unpacks_in_one_pass_with_its_progress_and_a_corrupt_member_is_named(tmp_path, capsys):
    """A zip is read once (each member's CRC checked as it is extracted, where it was tested in a pass of its own
    first) and a tar member by member, each with a progress line in the members' bytes; the fetched tree's hashing
    shows its own; a member whose bytes changed stops the unpack naming it."""
    import tarfile

    from fedsilo.data.fetch import _unpack
    from fedsilo.utils.io import tree_manifest

    files = {"a/x.txt": b"PAYLOAD-A" * 100, "b.txt": b"PAYLOAD-B" * 100}
    good = tmp_path / "good.zip"
    with zipfile.ZipFile(good, "w", zipfile.ZIP_STORED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    tgz = tmp_path / "good.tar.gz"
    with tarfile.open(tgz, "w:gz") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    for archive in (good, tgz):
        out = tmp_path / archive.name.replace(".", "_")
        capsys.readouterr()
        _unpack(archive, out, quiet=False)
        assert {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
        if archive is good:  # a total known up front: a line when it is reached
            assert f"unpack {archive.name}" in capsys.readouterr().err
    capsys.readouterr()
    manifest = tree_manifest(tmp_path / "good_zip", desc="hash good", quiet=False)
    assert set(manifest) == set(files) and "hash good" in capsys.readouterr().err
    assert tree_manifest(tmp_path / "good_zip") == manifest and capsys.readouterr().err == ""
    blob = bytearray(good.read_bytes())
    at = bytes(blob).index(b"PAYLOAD-B")
    blob[at] ^= 0xFF  # one byte of b.txt's stored data
    bad = tmp_path / "bad.zip"
    bad.write_bytes(bytes(blob))
    with pytest.raises(FetchError, match=r"bad\.zip: corrupt member b\.txt \(Bad CRC-32"):
        _unpack(bad, tmp_path / "bad_out", quiet=True)


def test_a_second_fetch_or_harmonize_of_the_same_folder_is_refused_and_leaves_the_first_ones_work(tmp_path):
    """Two fetches (or harmonizes) of one folder at once: the second removed the first's copy in progress as an
    interrupted write's leftover, and the first failed on a file gone from under it ([Errno 2]). The second is now
    refused at once, naming who holds the folder; the first's temporary folder is left alone."""
    import os

    from fedsilo.data.harmonize import HarmonizeError, harmonize_dataset
    from fedsilo.utils.locks import beside, held

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.png").write_bytes(b"x")
    out = tmp_path / "data" / "raw" / "mine"
    out.parent.mkdir(parents=True)
    working = out.parent / ".mine.k3x9q0.tmp"  # the first fetch's copy in progress
    working.mkdir()
    with held(beside(out), RuntimeError):  # the first fetch holds the folder
        with pytest.raises(FetchError, match=rf"mine: already being fetched into {re.escape(str(out))} by pid {os.getpid()} on "):
            fetch("mine", SourceParams(mode="local", path=str(tmp_path / "src")), out, tmp_path, quiet=True)
    assert working.is_dir() and not out.exists()
    # free again: the fetch runs (and removes the leftover of a fetch that is over), a lock file a killed fetch left
    # behind is taken over, and the lock file is gone once the fetch is done
    beside(out).write_text("pid 1 on a-machine-that-died")
    fetch("mine", SourceParams(mode="local", path=str(tmp_path / "src"), reader="image_folder"), out, tmp_path, quiet=True)
    assert (out / "a.png").exists() and not working.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["mine"]
    harmonized = tmp_path / "data" / "harmonized" / "mine_64"
    with held(beside(harmonized), RuntimeError):
        with pytest.raises(HarmonizeError, match=r"mine_64: already being harmonized into .* by pid \d+ on "):
            harmonize_dataset(None, tmp_path / "data" / "raw", harmonized, quiet=True)


def test_a_lock_file_removed_by_its_holder_as_another_opened_it_is_opened_again(tmp_path, monkeypatch):
    """held() removes its file while still holding it; a process that had opened the file just before finds, once it
    has the lock, that the path is another file (or none), and opens the path again, so that two processes never hold
    locks on two files of one path."""
    import fedsilo.utils.locks as locks

    path = tmp_path / ".out.lock"
    opened: list[int] = []
    real_open = open

    def opening(p, mode="r", *a, **k):  # the first open is of a file its holder removes right after
        fh = real_open(p, mode, *a, **k)
        opened.append(os.fstat(fh.fileno()).st_ino)
        if len(opened) == 1:
            os.unlink(p)
        return fh

    monkeypatch.setattr(locks, "open", opening, raising=False)
    with locks.held(path, RuntimeError):
        assert path.exists() and len(opened) == 2 and path.stat().st_ino == opened[1]
        assert locks.holder(path) == f"pid {os.getpid()} on {__import__('socket').gethostname()}"
    assert not path.exists() and locks.holder(path) is None


def test_a_lock_file_left_by_a_killed_holder_names_the_new_holder_only(tmp_path):
    """A lock file a killed fetch left behind holds its ``pid N on host``; the next holder writes its own over it
    (the file is opened to append: without the truncation the refusal named both, the dead one first). The lock
    file is hidden beside the folder it guards (``.<name>.lock``), and no clean-up of that folder's temporaries
    removes it."""
    import socket

    from fedsilo.utils.io import clean_stale
    from fedsilo.utils.locks import beside, held, holder

    out = tmp_path / "data" / "raw" / "mine"
    assert beside(out) == tmp_path / "data" / "raw" / ".mine.lock"
    out.parent.mkdir(parents=True)
    beside(out).write_text("pid 1 on a-machine-that-died, a longer line than ours")
    with held(beside(out), RuntimeError):
        assert holder(beside(out)) == f"pid {os.getpid()} on {socket.gethostname()}"
        assert clean_stale(out) == [] and beside(out).exists()


def _fetched_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A folder of one's own (two files at its top, an image below) fetched with ``mode: local``: (folder, raw root)."""
    site = tmp_path / "site"
    (site / "images").mkdir(parents=True)
    (site / "images" / "a.png").write_bytes(b"x")
    (site / "labels.csv").write_text("path,label\nimages/a.png,0\n")
    (site / "readme.txt").write_text("the export of 2026-01\n")
    fetch("mine", SourceParams(mode="local", path=str(site), reader="image_folder"), tmp_path / "raw" / "mine", quiet=True)
    return site, tmp_path / "raw"


def test_a_file_edited_with_its_old_time_kept_or_removed_since_the_fetch_is_named(tmp_path):
    """edited_since_fetch: a file of another size counts as changed even where its time was kept (`cp -p`,
    `rsync -t` of an older export), a file removed from the folder is named, and more than three changes are cut
    to three and '...'."""
    from fedsilo.data.harmonize import edited_since_fetch

    site, raw = _fetched_folder(tmp_path)
    assert edited_since_fetch(raw, ["mine"]) == []
    before = (site / "labels.csv").stat()
    (site / "labels.csv").write_text("path,label\nimages/a.png,1\nimages/b.png,0\n")
    os.utime(site / "labels.csv", ns=(before.st_atime_ns, before.st_mtime_ns - 10**9))  # older than the fetch
    assert edited_since_fetch(raw, ["mine"]) == [
        f"mine: {site} differs from its fetched copy (labels.csv changed): harmonize read the copy, {raw / 'mine'}; fetch "
        "again to take the change (`fedsilo fetch --source mine`, or `dvc repro -f fetch@mine`)"]
    (site / "readme.txt").unlink()
    assert "(labels.csv changed, readme.txt removed)" in edited_since_fetch(raw, ["mine"])[0]
    for name in ("x.csv", "y.csv"):
        (site / name).write_text("new\n")
    assert "(labels.csv changed, x.csv added, y.csv added, ...)" in edited_since_fetch(raw, ["mine"])[0]


def test_what_a_fetch_manifest_says_is_read_only_from_a_manifest_that_reads(tmp_path):
    """fetched_from and fetched_copy_note: a mirror's copy needs no note (there is no folder of the user's to
    correct); a manifest that is not JSON, or JSON but not an object, is no manifest (left out, no note), not an
    error."""
    import json

    from fedsilo.data.fetch import MANIFEST
    from fedsilo.data.harmonize import fetched_copy_note, fetched_from

    for src, text in (("mirrored", json.dumps({"mode": "mirror", "origin": "offline mirror (seed 0)"})),
                      ("cut", '{"mode": "local", "ori'), ("listed", "[1, 2]")):
        (tmp_path / src).mkdir()
        (tmp_path / src / MANIFEST).write_text(text)
        assert fetched_copy_note(tmp_path / src, src) == ""
    assert fetched_from(tmp_path, ["mirrored", "cut", "listed"]) == {"mirrored": {"mode": "mirror", "origin": "offline mirror (seed 0)"}}


def test_a_lock_taken_before_its_holder_wrote_its_name_is_refused_naming_another_process(tmp_path):
    """Between taking the lock and writing ``pid N on host`` in it the file is empty: a second fetch then is refused
    naming 'another process', not an empty name."""
    import fcntl

    from fedsilo.utils.locks import held

    path = tmp_path / ".out.lock"
    with open(path, "a+") as first:
        fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(FetchError, match=r"^held by another process$"):
            with held(path, lambda who: FetchError(f"held by {who}")):
                pass
