"""Single-domain sources (CIFAR-10/100, Fashion-MNIST, EMNIST ByClass, CINIC-10): mirrors in the real raw layouts,
the readers, harmonize (shape, channels, labels, pixels), the official download list, corrupt files and bad labels,
and params validation. No network: downloads go to a local HTTP server."""

from __future__ import annotations

import copy
import gzip
import hashlib
import http.server
import io
import os
import pickle
import shutil
import tarfile
import threading
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import pytest
import yaml

from fedsilo.config import (
    ConfigError,
    LabelSkewSplit,
    MirrorParams,
    SingleDomainDatasetParams,
    SourceParams,
    parse_params,
)
from fedsilo.data import fetch as fetch_mod
from fedsilo.data.download import Remote
from fedsilo.data.fetch import FetchError, fetch
from fedsilo.data.harmonize import harmonize_dataset
from fedsilo.data.sources import source_module
from fedsilo.data.sources.base import LabelFileError
from tests.conftest import SAMPLES, small_params

PER_CLASS = 3
SOURCES = ("cifar10", "cifar100", "fmnist", "emnist", "cinic10")
DOMAIN = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100", "fmnist": "Fashion-MNIST", "emnist": "EMNIST", "cinic10": "CINIC-10"}
NUM_CLASSES = {"cifar10": 10, "cifar100": 100, "fmnist": 10, "emnist": 62, "cinic10": 10}
SUBSETS = {"cifar10": ("test", "train"), "cifar100": ("test", "train"), "fmnist": ("test", "train"), "emnist": ("test", "train"), "cinic10": ("test", "train", "val")}
NATIVE = {"cifar10": (32, 3), "cifar100": (32, 3), "fmnist": (28, 1), "emnist": (28, 1), "cinic10": (32, 3)}
LAYOUT = {
    "cifar10": ["cifar-10-batches-py/" + n for n in ("batches.meta", "data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "readme.html", "test_batch")],
    "cifar100": ["cifar-100-python/" + n for n in ("file.txt~", "meta", "test", "train")],
    "fmnist": [f"FashionMNIST/raw/{p}-{k}-ubyte.gz" for p in ("t10k", "train") for k in ("images-idx3", "labels-idx1")],
    "emnist": ["gzip/emnist-byclass-mapping.txt"] + [f"gzip/emnist-byclass-{p}-{k}-ubyte.gz" for p in ("test", "train") for k in ("images-idx3", "labels-idx1")],
}


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("single") / "raw"
    for s in SOURCES:
        fetch(s, SourceParams(mirror=MirrorParams(per_class=PER_CLASS)), root / s)
    return root


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != "fedsilo_manifest.json")


def _load_pickle(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f, encoding="latin1")  # as torchvision reads the CIFAR batches


def _idx(path: Path) -> np.ndarray:
    data = gzip.decompress(path.read_bytes())
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(dims)


# --------------------------------------------------------------------------- mirror layout and readers
@pytest.mark.parametrize("source", SOURCES)
def test_mirror_writes_the_real_layout_and_the_reader_reads_it(raw, source):
    files = _files(raw / source)
    if source == "cinic10":
        assert {f.split("/")[0] for f in files} == {"train", "valid", "test"} and all(f.endswith(".png") for f in files)
        assert len(files) == 3 * 10 * PER_CLASS and len({f.split("/")[1] for f in files}) == 10
    else:
        assert files == LAYOUT[source]
    rec = source_module(source).read_records(raw / source)
    n = NUM_CLASSES[source]
    assert list(rec["domain"].unique()) == [DOMAIN[source]]
    assert tuple(sorted(rec["subset"].unique())) == SUBSETS[source]
    counts = rec.groupby(["subset", "label"]).size()
    assert (counts == PER_CLASS).all() and len(counts) == n * len(SUBSETS[source])
    assert sorted(rec["label"].unique()) == list(range(n))
    assert rec["id"].is_unique and (rec["excluded"] == "").all()


def test_cifar_files_are_the_pickles_torchvision_reads(raw):
    """The real format: Python pickles with 'data' N x 3072 uint8 and 'labels' (CIFAR-10) / 'fine_labels' (CIFAR-100),
    the class names in batches.meta / meta; the reader's labels are those of the pickles, row by row."""
    c10 = raw / "cifar10" / "cifar-10-batches-py"
    meta = _load_pickle(c10 / "batches.meta")
    assert meta["label_names"][:3] == ["airplane", "automobile", "bird"] and meta["num_vis"] == 3072
    rec = source_module("cifar10").read_records(raw / "cifar10")
    for name in ("data_batch_1", "data_batch_5", "test_batch"):
        b = _load_pickle(c10 / name)
        assert b["data"].dtype == np.uint8 and b["data"].shape == (len(b["labels"]), 3072) and isinstance(b["labels"], list)
        mine = rec[rec["path"].str.startswith(f"cifar-10-batches-py/{name}#")]
        assert mine["label"].tolist() == b["labels"]
    c100 = raw / "cifar100" / "cifar-100-python"
    b = _load_pickle(c100 / "train")
    assert set(b) >= {"data", "fine_labels", "coarse_labels", "filenames", "batch_label"}
    assert len(_load_pickle(c100 / "meta")["fine_label_names"]) == 100
    rec = source_module("cifar100").read_records(raw / "cifar100")
    assert rec.loc[rec["subset"] == "train", "label"].tolist() == b["fine_labels"]


def test_idx_files_have_mnist_magic_numbers(raw):
    for folder, stem in ((raw / "fmnist" / "FashionMNIST" / "raw", "t10k"), (raw / "emnist" / "gzip", "emnist-byclass-test")):
        img = gzip.decompress((folder / f"{stem}-images-idx3-ubyte.gz").read_bytes())
        lab = gzip.decompress((folder / f"{stem}-labels-idx1-ubyte.gz").read_bytes())
        assert int.from_bytes(img[:4], "big") == 2051 and int.from_bytes(lab[:4], "big") == 2049
        assert int.from_bytes(img[4:8], "big") == int.from_bytes(lab[4:8], "big")
        assert img[8:16] == (28).to_bytes(4, "big") * 2


# --------------------------------------------------------------------------- harmonize
def _source_pixels(raw: Path, source: str, path: str) -> np.ndarray:
    """The row's pixels read straight from the raw file, independently of the readers (H x W x C, upright)."""
    container, _, row = path.rpartition("#")
    if source in ("cifar10", "cifar100"):
        return _load_pickle(raw / source / container)["data"][int(row)].reshape(3, 32, 32).transpose(1, 2, 0)
    if source in ("fmnist", "emnist"):
        img = _idx(raw / source / container)[int(row)]
        return (img.T if source == "emnist" else img)[:, :, None]  # EMNIST stores every image transposed
    return cv2.imread(str(raw / source / path), cv2.IMREAD_COLOR)[:, :, ::-1]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("size", ["native", 16])
def test_harmonize_keeps_channels_labels_and_pixels(raw, tmp_path, source, size):
    edge, channels = NATIVE[source]
    px = edge if size == "native" else size
    card = harmonize_dataset(SingleDomainDatasetParams(kind=source, image_size=px, workers=1), raw, tmp_path / source)
    images = np.load(tmp_path / source / "images.npy")
    table = pd.read_parquet(tmp_path / source / "records.parquet")
    assert images.shape == (NUM_CLASSES[source] * PER_CLASS * len(SUBSETS[source]), px, px, channels)
    assert card["image_shape"] == [px, px, channels] and len(card["classes"]) == NUM_CLASSES[source]
    assert card["domains"][DOMAIN[source]]["by_class"] == {c: PER_CLASS * len(SUBSETS[source]) for c in card["classes"]}
    rec = source_module(source).read_records(raw / source).set_index("path")
    for i in (0, 7, len(table) - 1):
        r = table.iloc[i]
        assert r["label"] == rec.loc[r["source_path"], "label"]
        src = _source_pixels(raw, source, r["source_path"])
        want = src if px == edge else cv2.resize(src, (px, px), interpolation=cv2.INTER_AREA).reshape(px, px, channels)
        np.testing.assert_array_equal(images[i], want)


def test_class_names_come_from_the_distribution(raw, tmp_path):
    card = harmonize_dataset(SingleDomainDatasetParams(kind="cifar100", workers=1), raw, tmp_path / "c100")
    assert card["classes"][:3] == ["apple", "aquarium_fish", "baby"] and card["classes"][-1] == "worm"
    card = harmonize_dataset(SingleDomainDatasetParams(kind="emnist", image_size=28, workers=1), raw, tmp_path / "em")
    assert card["classes"][:11] == list("0123456789A") and card["classes"][-1] == "z"
    # a copy whose meta names its classes differently: the meta wins; a meta with the wrong count is refused
    shutil.copytree(raw / "cifar10", tmp_path / "raw" / "cifar10")
    meta_path = tmp_path / "raw" / "cifar10" / "cifar-10-batches-py" / "batches.meta"
    meta = _load_pickle(meta_path)
    meta["label_names"] = [f"c{k}" for k in range(10)]
    meta_path.write_bytes(pickle.dumps(meta, protocol=2))
    assert harmonize_dataset(SingleDomainDatasetParams(kind="cifar10", workers=1), tmp_path / "raw", tmp_path / "c10")["classes"][0] == "c0"
    meta["label_names"] = meta["label_names"][:9]
    meta_path.write_bytes(pickle.dumps(meta, protocol=2))
    with pytest.raises(LabelFileError, match=r"batches\.meta: label_names has 9 names"):
        source_module("cifar10").read_records(tmp_path / "raw" / "cifar10")
    meta_path.unlink()  # no meta: CIFAR-10's published names
    assert source_module("cifar10").classes(tmp_path / "raw" / "cifar10")[-1] == "truck"


def test_channels_rgb_replicates_grey(raw, tmp_path):
    harmonize_dataset(SingleDomainDatasetParams(kind="fmnist", image_size=28, channels="rgb", workers=1), raw, tmp_path / "f")
    img = np.load(tmp_path / "f" / "images.npy")
    assert img.shape[-1] == 3 and (img[..., 0] == img[..., 2]).all() and img.std() > 10


def test_label_skew_split_pools_the_single_domain(raw, tmp_path):
    from fedsilo.data.splits import make_split

    harmonize_dataset(SingleDomainDatasetParams(kind="cifar100", workers=1), raw, tmp_path / "c100")
    rec = pd.read_parquet(tmp_path / "c100" / "records.parquet")
    split = make_split(rec, LabelSkewSplit(protocol="label_skew", clients=10, scheme="pathological", classes_per_client=5), seed=0)
    assert split["num_classes"] == 100 and len(split["clients"]) == 10
    for c in split["clients"]:
        assert len(set(rec.loc[c["train"] + c["test"], "label"])) <= 5


# --------------------------------------------------------------------------- downloads
OFFICIAL = {
    "cifar10": [("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "md5:c58f30108f718f92721af3b95e74349a")],
    "cifar100": [("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz", "md5:eb9058c3a382ffc7106e4002c42a8d85")],
    "fmnist": [
        ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/train-images-idx3-ubyte.gz", "md5:8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
        ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/train-labels-idx1-ubyte.gz", "md5:25c81989df183df01b3e8a0aad5dffbe"),
        ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/t10k-images-idx3-ubyte.gz", "md5:bef4ecab320f06d8554ea6380940ec79"),
        ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/t10k-labels-idx1-ubyte.gz", "md5:bb300cfdad3c16e7a12a480ee83cd310"),
    ],
    "emnist": [("https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip", "md5:58c8d27c78d21e728a6bc7b3cc06412e")],
    "cinic10": [("https://datashare.ed.ac.uk/bitstream/handle/10283/3192/CINIC-10.tar.gz", None)],
}


@pytest.mark.parametrize("source", SOURCES)
def test_download_list_names_the_official_addresses_and_checksums(source):
    files, headers = fetch_mod.remotes_for(source, SourceParams(mode="download"))
    assert [(r.url, r.checksum) for r in files] == OFFICIAL[source] and headers == {}
    assert all(r.unpack for r in files) == (source != "fmnist")
    if source == "cinic10":  # no published checksum: the user's pin is what gets verified
        pin = "sha256:" + "a" * 64
        (r,) = fetch_mod.remotes_for(source, SourceParams(mode="download", checksums={"CINIC-10.tar.gz": pin}))[0]
        assert r.checksum == pin


class _Server:
    def __init__(self, files: dict[str, bytes]):
        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):  # noqa: N802
                body = files.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


def _tar_gz(folder: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for p in sorted(folder.rglob("*")):
            if p.is_file() and p.name != "fedsilo_manifest.json":
                t.add(p, arcname=p.relative_to(folder).as_posix())
    return buf.getvalue()


def test_download_verifies_unpacks_and_reads(raw, tmp_path, monkeypatch, caplog):
    """CIFAR-10's archive: other bytes than the published md5 are refused naming the file and both digests, nothing
    lands in data/; the mirror's archive with its checksum pinned lands verified and reads. CINIC-10 (no published
    checksum) lands unverified with a warning that says how to pin it."""
    from fedsilo.data.sources import cifar10, cinic10

    c10, cinic = _tar_gz(raw / "cifar10"), _tar_gz(raw / "cinic10")
    srv = _Server({"/cifar-10-python.tar.gz": c10, "/CINIC-10.tar.gz": cinic})
    monkeypatch.setattr(cifar10, "DOWNLOADS", [Remote(f"{srv.url}/{r.name}", r.name, r.checksum, r.unpack) for r in cifar10.DOWNLOADS])
    monkeypatch.setattr(cinic10, "DOWNLOADS", [Remote(f"{srv.url}/{r.name}", r.name, r.checksum, r.unpack) for r in cinic10.DOWNLOADS])
    monkeypatch.setenv("FEDSILO_DOWNLOAD_CACHE", str(tmp_path / "cache"))
    try:
        out = tmp_path / "data" / "raw" / "cifar10"
        with pytest.raises(FetchError, match=r"cifar-10-python\.tar\.gz: checksum mismatch: expected md5:c58f30108f718f92721af3b95e74349a, got md5:"):
            fetch("cifar10", SourceParams(mode="download"), out)
        assert not out.exists() and list((tmp_path / "data" / "raw").iterdir()) == []
        pin = {"cifar-10-python.tar.gz": f"sha256:{hashlib.sha256(c10).hexdigest()}"}
        m = fetch("cifar10", SourceParams(mode="download", checksums=pin), out)
        assert m["downloads"][0]["verified"] is True and m["downloads"][0]["url"].endswith("/cifar-10-python.tar.gz")
        assert not (out / "cifar-10-python.tar.gz").exists()  # unpacked, the archive itself stays in the cache
        assert len(source_module("cifar10").read_records(out)) == 2 * 10 * PER_CLASS
        with caplog.at_level("WARNING", logger="fedsilo.fetch"):
            m = fetch("cinic10", SourceParams(mode="download"), tmp_path / "data" / "raw" / "cinic10")
        assert m["downloads"][0]["verified"] is False and "sources.cinic10.checksums" in caplog.text
        assert len(source_module("cinic10").read_records(tmp_path / "data" / "raw" / "cinic10")) == 3 * 10 * PER_CLASS
    finally:
        srv.close()


def test_local_mode_reads_the_distributed_archive_or_a_bare_folder(raw, tmp_path):
    (tmp_path / "cifar-100-python.tar.gz").write_bytes(_tar_gz(raw / "cifar100"))
    fetch("cifar100", SourceParams(mode="local", path=str(tmp_path / "cifar-100-python.tar.gz")), tmp_path / "raw" / "cifar100")
    assert len(source_module("cifar100").read_records(tmp_path / "raw" / "cifar100")) == 2 * 100 * PER_CLASS
    # the batches copied straight into a folder of another name (no cifar-10-batches-py/ level)
    shutil.copytree(raw / "cifar10" / "cifar-10-batches-py", tmp_path / "my_cifar")
    fetch("cifar10", SourceParams(mode="local", path=str(tmp_path / "my_cifar")), tmp_path / "raw" / "cifar10")
    assert len(source_module("cifar10").read_records(tmp_path / "raw" / "cifar10")) == 2 * 10 * PER_CLASS


# --------------------------------------------------------------------------- bad input
def _copy(raw: Path, source: str, tmp_path: Path) -> Path:
    shutil.copytree(raw / source, tmp_path / "raw" / source)
    return tmp_path / "raw"


@pytest.mark.parametrize(
    "source, file, pattern",
    [
        ("cifar10", "cifar-10-batches-py/data_batch_2", r"data_batch_2: cannot read as a CIFAR python pickle"),
        ("cifar100", "cifar-100-python/test", r"cifar-100-python/test: cannot read as a CIFAR python pickle"),
        ("fmnist", "FashionMNIST/raw/train-images-idx3-ubyte.gz", r"train-images-idx3-ubyte\.gz: cannot read"),
        ("emnist", "gzip/emnist-byclass-test-labels-idx1-ubyte.gz", r"emnist-byclass-test-labels-idx1-ubyte\.gz: cannot read"),
    ],
)
def test_corrupt_file_is_named_and_nothing_is_half_written(raw, tmp_path, source, file, pattern):
    root = _copy(raw, source, tmp_path)
    f = root / source / file
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # an interrupted copy
    out = tmp_path / "harmonized" / source
    with pytest.raises(LabelFileError, match=pattern):
        harmonize_dataset(SingleDomainDatasetParams(kind=source, workers=1), root, out)
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


def test_corrupt_archive_fails_fetch_naming_it(raw, tmp_path):
    archive = tmp_path / "cifar-10-python.tar.gz"
    archive.write_bytes(_tar_gz(raw / "cifar10")[:5000])
    out = tmp_path / "raw" / "cifar10"
    with pytest.raises(FetchError, match=r"cifar-10-python\.tar\.gz: cannot unpack"):
        fetch("cifar10", SourceParams(mode="local", path=str(archive)), out)
    assert list((tmp_path / "raw").iterdir()) == []


def test_truncated_cifar_rows_and_missing_keys_are_named(raw, tmp_path):
    root = _copy(raw, "cifar10", tmp_path)
    f = root / "cifar10" / "cifar-10-batches-py" / "data_batch_3"
    b = _load_pickle(f)
    f.write_bytes(pickle.dumps({**b, "data": b["data"][:, :3000]}, protocol=2))
    with pytest.raises(LabelFileError, match=r"data_batch_3: 'data' is uint8 \(\d+, 3000\), expected uint8 N x 3072"):
        source_module("cifar10").read_records(root / "cifar10")
    f.write_bytes(pickle.dumps({k: v for k, v in b.items() if k != "labels"}, protocol=2))
    with pytest.raises(LabelFileError, match=r"data_batch_3: missing key 'labels'"):
        source_module("cifar10").read_records(root / "cifar10")


@pytest.mark.parametrize("source, n", [("cifar10", 10), ("cifar100", 100), ("fmnist", 10), ("emnist", 62)])
def test_label_outside_the_classes_is_refused(raw, tmp_path, source, n):
    root = _copy(raw, source, tmp_path)
    if source in ("cifar10", "cifar100"):
        key, name = ("labels", "cifar-10-batches-py/data_batch_1") if source == "cifar10" else ("fine_labels", "cifar-100-python/train")
        f = root / source / name
        b = _load_pickle(f)
        b[key][4] = n
        f.write_bytes(pickle.dumps(b, protocol=2))
    else:
        name = "FashionMNIST/raw/train-labels-idx1-ubyte.gz" if source == "fmnist" else "gzip/emnist-byclass-train-labels-idx1-ubyte.gz"
        f = root / source / name
        data = bytearray(gzip.decompress(f.read_bytes()))
        data[8 + 4] = n
        f.write_bytes(gzip.compress(bytes(data)))
    with pytest.raises(LabelFileError, match=rf"{name}: label {n} at row 4 is not one of the {n} classes \(0-{n - 1}\)"):
        harmonize_dataset(SingleDomainDatasetParams(kind=source, workers=1), root, tmp_path / "h")
    assert not (tmp_path / "h").exists()


def test_pickle_that_would_run_code_is_refused(raw, tmp_path):
    root = _copy(raw, "cifar10", tmp_path)

    class Evil:  # os.system, not print: a Ray session earlier in the same worker leaves builtins.print replaced
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (root / "cifar10" / "cifar-10-batches-py" / "test_batch").write_bytes(pickle.dumps({"data": Evil(), "labels": []}, protocol=2))
    with pytest.raises(LabelFileError, match=r"test_batch: cannot read as a CIFAR python pickle: UnpicklingError: refusing to load (posix|nt)\.system"):
        source_module("cifar10").read_records(root / "cifar10")


def test_other_releases_and_empty_folders_get_a_clear_message(tmp_path):
    (tmp_path / "c10" / "cifar-10-batches-bin").mkdir(parents=True)
    (tmp_path / "c10" / "cifar-10-batches-bin" / "data_batch_1.bin").write_bytes(b"\0" * 3073)
    with pytest.raises(LabelFileError, match=r"binary version .* reads the python version \(cifar-10-python\.tar\.gz\)"):
        source_module("cifar10").read_records(tmp_path / "c10")
    (tmp_path / "empty").mkdir()
    for source, pattern in (
        ("cifar100", r"no CIFAR-100 files"), ("fmnist", r"no Fashion-MNIST files"), ("emnist", r"no EMNIST ByClass files"), ("cinic10", r"no CINIC-10 folders"),
    ):
        with pytest.raises(LabelFileError, match=pattern):
            source_module(source).read_records(tmp_path / "empty")


def test_cinic_unknown_class_folder_is_named(raw, tmp_path):
    root = _copy(raw, "cinic10", tmp_path)
    shutil.copytree(root / "cinic10" / "train" / "cat", root / "cinic10" / "train" / "kitten")
    with pytest.raises(LabelFileError, match=r"train/kitten: class folder 'kitten' is not a class of this dataset"):
        source_module("cinic10").read_records(root / "cinic10")


# --------------------------------------------------------------------------- params
def _with_single_domain(raw_params: dict) -> dict:
    p = copy.deepcopy(raw_params)
    p["sources"].update({s: {"mode": "mirror", "mirror": {"per_class": 2, "seed": 0}} for s in SOURCES})
    p["datasets"].update({f"{s}_x": {"kind": s, "image_size": 28 if s in ("fmnist", "emnist") else 32} for s in SOURCES})
    return p


def test_check_params_accepts_the_new_kinds_and_names_bad_keys(tmp_path, capsys):
    from fedsilo.cli import main

    raw_params = _with_single_domain(small_params())
    p = parse_params(raw_params)
    assert {p.datasets[f"{s}_x"].kind for s in SOURCES} == set(SOURCES)
    assert p.datasets["fmnist_x"].channels == "native" and p.datasets["cifar10_x"].source_list == ("cifar10",)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw_params))
    assert main(["--params", str(tmp_path / "params.yaml"), "check-params"]) == 0
    for edit, key in (
        (lambda d: d["datasets"]["fmnist_x"].update(channels="grey"), "datasets.fmnist_x.channels"),
        (lambda d: d["datasets"]["cifar10_x"].update(sources=["cifar100"]), "'cifar100' is not a source of cifar10"),
        (lambda d: d["sources"]["cinic10"].update(mode="kaggle"), "sources.cinic10.mode: 'kaggle' is not offered by cinic10"),
        (lambda d: d["datasets"].update(digits5_x={"kind": "digits5", "channels": "native"}), "datasets.digits5_x.channels: unknown key"),
        (lambda d: d["datasets"].update(c11={"kind": "cifar11"}), "datasets.c11"),
    ):
        bad = copy.deepcopy(raw_params)
        edit(bad)
        with pytest.raises(ConfigError) as err:
            parse_params(bad)
        assert key in str(err.value)


def test_root_params_define_the_new_sources_and_datasets_without_building_them():
    from tests.conftest import REPO

    root = yaml.safe_load((REPO / "params.yaml").read_text())
    p = parse_params(root)
    for s in SOURCES:
        assert p.sources[s].mode == "mirror" and p.sources[s].mirror.per_class <= 4
        # EMNIST is fetched for pFedDIL's Digit-10 (digit10 is built); the other sources are declared only
        assert (s in p.pipeline.sources) == (s == "emnist"), s
    shapes = {"cifar10_32": 32, "cifar100_32": 32, "fmnist_28": 28, "emnist_28": 28, "cinic10_32": 32}
    for name, px in shapes.items():
        assert p.datasets[name].image_size == px and name not in p.pipeline.datasets


# --------------------------------------------------------------------------- real files (skip when absent)
REAL = {  # the distributions' published sizes: (train, test) images per class, or total for EMNIST ByClass
    "cifar10": {"train": 5000, "test": 1000},
    "cifar100": {"train": 500, "test": 100},
    "fmnist": {"train": 6000, "test": 1000},
    "cinic10": {"train": 9000, "val": 9000, "test": 9000},
}


@pytest.mark.parametrize("source", SOURCES)
def test_real_copy_counts_and_pixels(source):
    folder = SAMPLES / source
    if not folder.exists():
        pytest.skip(f"{folder} absent (put a real copy of {source} there to check the reader on it)")
    rec = source_module(source).read_records(folder)
    counts = rec.groupby(["subset", "label"]).size()
    if source == "emnist":
        assert rec.groupby("subset").size().to_dict() == {"train": 697932, "test": 116323}
    else:
        for subset, n in REAL[source].items():
            if subset in counts.index.get_level_values(0):
                assert (counts[subset] == n).all() and len(counts[subset]) == NUM_CLASSES[source]
    first = rec.iloc[0]
    img = source_module(source).load_container(folder, first["path"].rpartition("#")[0])[0] if first["reader"] == "array" else None
    if img is not None:
        assert img.shape[:2] == (NATIVE[source][0],) * 2 and img.std() > 0


def test_real_fashion_mnist_label_files():
    """The label files alone (the zalandoresearch/fashion-mnist repository ships them; its image files are too large
    for most snapshots): torchvision's md5s, 6,000 / 1,000 images per class, every label a class."""
    from fedsilo.data.sources import fmnist
    from fedsilo.data.sources.benchmark import array_records, read_idx

    folder = SAMPLES / "fmnist"
    hits = sorted(folder.rglob("*-labels-idx1-ubyte.gz")) if folder.exists() else []
    if not hits:
        pytest.skip(f"{folder} has no Fashion-MNIST label files")
    md5 = {Path(r.name).name: r.checksum for r in fmnist.DOWNLOADS}
    for f in hits:
        assert f"md5:{hashlib.md5(f.read_bytes()).hexdigest()}" == md5[f.name]
        y = read_idx(f)
        assert np.bincount(y).tolist() == [6000 if f.name.startswith("train") else 1000] * 10
        assert len(array_records(f.name, y, "", "x", classes=fmnist.CLASSES)) == len(y)
