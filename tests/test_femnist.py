"""FEMNIST (LEAF) as a source and its natural partition, one client per writer (FedeCouple's Table V; issue 14)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedsilo.config import ByWriterSplit, LabelSkewSplit, MirrorParams, SingleDomainDatasetParams, SourceParams
from fedsilo.data.fetch import fetch
from fedsilo.data.harmonize import harmonize_dataset
from fedsilo.data.sources import femnist
from fedsilo.data.sources.base import LabelFileError
from fedsilo.data.splits import SplitError, make_split


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("femnist") / "raw"
    fetch("femnist", SourceParams(mirror=MirrorParams(per_class=4)), root / "femnist")
    return root


@pytest.fixture(scope="module")
def harmonized(raw, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("femnist_h") / "femnist_28"
    harmonize_dataset(SingleDomainDatasetParams(kind="femnist", image_size=28, workers=1), raw, out, quiet=True)
    return out


def _leaf(path: Path, users: dict[str, tuple[list, list]]) -> None:
    """A LEAF JSON file: users -> (images as 784 values, labels)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"users": list(users), "num_samples": [len(y) for _, y in users.values()],
           "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}}
    path.write_text(json.dumps(doc))


def test_mirror_is_leafs_sample_split_layout_and_every_record_names_its_writer(raw):
    folder = raw / "femnist" / "data" / "femnist" / "data"
    assert sorted(p.parent.name for p in folder.rglob("*.json")) == ["test", "test", "train", "train"]
    doc = json.loads(next((folder / "train").glob("*.json")).read_text())
    assert set(doc) == {"users", "num_samples", "user_data"} and len(doc["users"]) == 8
    rec = femnist.read_records(raw / "femnist")
    assert list(rec.columns)[-1] == "writer" and rec["writer"].nunique() == 16
    assert set(rec["domain"]) == {"FEMNIST"} and set(rec["subset"]) == {"train", "test"}
    assert (rec.groupby("writer")["subset"].nunique() == 2).all(), "LEAF -t sample: every writer on both sides"
    assert rec["id"].is_unique and rec["group"].is_unique, "an image is its own group: writers are not patients"
    assert rec["label"].between(0, 61).all() and (rec["original_label"] == [femnist.CLASSES[k] for k in rec["label"]]).all()
    # pixels as LEAF stores them, grey / 255: read back to the grey levels, dark ink on white paper
    u = doc["users"][0]
    row = rec.index[(rec["writer"] == u) & (rec["subset"] == "train")][0]
    container, _, i = rec.loc[row, "path"].rpartition("#")
    img = femnist.load_container(raw / "femnist", container)[int(i)]
    assert img.shape == (28, 28) and img.dtype == np.uint8
    assert np.array_equal(img.ravel(), np.rint(np.asarray(doc["user_data"][u]["x"][0]) * 255).astype(np.uint8))
    assert np.median(img) == 255 and img.min() < 128


def test_harmonize_keeps_the_writer_and_the_grey_pixels(raw, harmonized, tmp_path):
    rec = pd.read_parquet(harmonized / "records.parquet")
    images = np.load(harmonized / "images.npy")
    assert "writer" in rec.columns and rec["writer"].nunique() == 16 and images.shape[1:] == (28, 28, 1)
    card = json.loads((harmonized / "card.json").read_text())
    assert len(card["classes"]) == 62 and card["classes"][10] == "A"
    container, _, i = rec["source_path"].iloc[5].rpartition("#")
    assert np.array_equal(images[5, ..., 0], femnist.load_container(raw / "femnist", container)[int(i)])
    # a dataset whose source names no writer has no such column (its records are as they were)
    other = tmp_path / "raw"
    fetch("emnist", SourceParams(mirror=MirrorParams(per_class=1)), other / "emnist")
    harmonize_dataset(SingleDomainDatasetParams(kind="emnist", image_size=28, workers=1), other, tmp_path / "emnist", quiet=True)
    assert "writer" not in pd.read_parquet(tmp_path / "emnist" / "records.parquet").columns


def test_by_writer_gives_each_drawn_writer_its_own_client_with_leafs_train_and_test(harmonized):
    rec = pd.read_parquet(harmonized / "records.parquet")
    split = make_split(rec, ByWriterSplit(protocol="by_writer", clients=12), seed=0)
    assert split == make_split(rec, ByWriterSplit(protocol="by_writer", clients=12), seed=0)
    clients = split["clients"]
    assert len(clients) == 12 and split["num_classes"] == rec["label"].max() + 1
    names = [c["name"] for c in clients]
    assert len(set(names)) == 12 and set(names) <= set(rec["writer"])
    for c in clients:
        rows = rec.index[rec["writer"] == c["name"]]
        assert sorted(c["train"] + c["test"]) == sorted(rows), "a client holds all of its writer's images, nobody else's"
        assert set(rec.loc[c["train"], "subset"]) == {"train"} and set(rec.loc[c["test"], "subset"]) == {"test"}
    other = make_split(rec, ByWriterSplit(protocol="by_writer", clients=12, seed=1), seed=1)
    assert [c["name"] for c in other["clients"]] != names, "the split seed draws the writers"
    with pytest.raises(SplitError, match="split.clients: 17 writers"):
        make_split(rec, ByWriterSplit(protocol="by_writer", clients=17), seed=0)
    with pytest.raises(SplitError, match="no writer column"):
        make_split(rec.drop(columns="writer"), ByWriterSplit(protocol="by_writer", clients=2), seed=0)
    # the same records under label skew ignore the writers
    assert len(make_split(rec, LabelSkewSplit(protocol="label_skew", clients=4, scheme="dirichlet", beta=1.0, min_per_client=5), seed=0)["clients"]) == 4


def test_all_data_without_a_split_is_split_per_writer_as_leafs_split_data(tmp_path):
    rng = np.random.default_rng(0)

    def imgs(n, ints=False):
        x = rng.integers(0, 256, (n, 784))
        return (x if ints else x / 255).tolist()

    raw = tmp_path / "femnist"
    _leaf(raw / "data" / "all_data" / "all_data_0.json",
          {"w_ten": (imgs(10), list(range(10))), "w_two": (imgs(2), [3, 4]), "w_one": (imgs(1), [5])})
    _leaf(raw / "data" / "all_data" / "all_data_1.json", {"w/odd": (imgs(20, ints=True), [61] * 20)})
    rec = femnist.read_records(raw)
    assert set(rec["subset"]) == {""} and rec.groupby("writer").size().to_dict() == {"w_ten": 10, "w_two": 2, "w_one": 1, "w/odd": 20}
    container = rec.loc[rec["writer"] == "w/odd", "path"].iloc[0].rpartition("#")[0]
    doc = json.loads((raw / container).read_text())
    assert np.array_equal(femnist.load_container(raw, container)[0].ravel(), doc["user_data"]["w/odd"]["x"][0]), "0-255 values kept"
    split = make_split(rec, ByWriterSplit(protocol="by_writer"), seed=0)  # every writer with two images or more
    sizes = {c["name"]: (len(c["train"]), len(c["test"])) for c in split["clients"]}
    assert sizes == {"w_ten": (9, 1), "w_two": (1, 1), "w_odd": (18, 2)}, "max(1, floor(0.9 n)) train, one of two"
    # a later LEAF stage wins over all_data, as LEAF's scripts read it; another LEAF dataset's files are not read
    _leaf(raw / "data" / "train" / "all_data_0_train_9.json", {"w_ten": (imgs(9), list(range(9)))})
    _leaf(raw / "data" / "test" / "all_data_0_test_9.json", {"w_ten": (imgs(1), [9])})
    (raw / "shakespeare" / "data" / "train").mkdir(parents=True)
    (raw / "shakespeare" / "data" / "train" / "all_data_train_9.json").write_text('{"users": ["x"], "user_data": {"x": {"x": ["abc"], "y": ["d"]}}}')
    assert set(femnist.read_records(raw)["subset"]) == {"train", "test"}
    # LEAF's -t user (whole writers on one side) is not a per-writer train / test split
    _leaf(raw / "data" / "test" / "all_data_0_test_9.json", {"w_other": (imgs(3), [1, 2, 3])})
    with pytest.raises(SplitError, match=r"writer 'w_other' has only \['test'\] images .*LEAF's -t user"):
        make_split(femnist.read_records(raw), ByWriterSplit(protocol="by_writer"), seed=0)
    # two LEAF runs' files in one folder put a writer twice
    _leaf(raw / "data" / "train" / "all_data_0_train_8.json", {"w_ten": (imgs(8), list(range(8)))})
    with pytest.raises(LabelFileError, match="writer 'w_ten' is in 2 train files"):
        femnist.read_records(raw)


@pytest.mark.parametrize("users,pattern", [
    ({"w": ([[0.5] * 784], [62])}, r"label 62 of writer 'w' is not one of the 62 classes"),
    ({"w": ([[0.5] * 784, [0.5] * 784], [1])}, r"user 'w' has 2 images and 1 labels"),
    ({"w": ([[0.5] * 700], [1])}, r"expected 784"),
])
def test_bad_leaf_files_are_named(tmp_path, users, pattern):
    _leaf(tmp_path / "data" / "all_data" / "all_data_0.json", users)
    with pytest.raises(LabelFileError, match=pattern):
        femnist.read_records(tmp_path)
    (tmp_path / "data" / "all_data" / "all_data_0.json").write_text('{"users": ["w"], "num_samples": [1]}')
    with pytest.raises(LabelFileError, match="not a LEAF JSON file"):
        femnist.read_records(tmp_path)
    with pytest.raises(LabelFileError, match="no LEAF FEMNIST JSON files"):
        femnist.read_records(tmp_path / "data" / "train")


def test_a_federation_of_writers_trains(harmonized):
    """The natural partition through the loader and the engine: one round of FedAvg, every writer a client."""
    import torch

    from fedsilo.client.data import load_clients
    from fedsilo.config import TrainParams
    from fedsilo.fl.engine import Engine
    from fedsilo.methods import method_class
    from fedsilo.models import build_model

    rec = pd.read_parquet(harmonized / "records.parquet")
    split = make_split(rec, ByWriterSplit(protocol="by_writer", clients=4), seed=0)
    clients, channels, classes = load_clients(harmonized, split, torch.device("cpu"))
    assert [c.name for c in clients] == [c["name"] for c in split["clients"]] and channels == 1
    tp = TrainParams(rounds=1, batch_size=16, lr=0.01, device="cpu", count_flops=False)
    cls = method_class("fedavg")
    model = build_model("fedecouple_cnn_gray", channels, classes, seed=0, image_size=28)
    h = Engine(cls(cls.params_cls(), tp), model, clients, tp, seed=0).run()
    assert set(h[-1]["eval"]) == {c.name for c in clients}
