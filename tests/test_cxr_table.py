"""A hospital's own chest X-rays (``reader: cxr_table``): its export and label table become one more domain of
Chest-X-Ray-4, harmonized as the public sources are; the table's mistakes are refused by row and key."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from fedsilo.cli import main as fedsilo
from fedsilo.config import ConfigError, CXRTableRules, MirrorParams, SourceParams, parse_params
from fedsilo.data.dicom import dicom_to_uint8
from fedsilo.data.fetch import fetch
from fedsilo.data.harmonize import decode_one, harmonize_cxr
from fedsilo.data.imageops import finish
from fedsilo.data.sources import cxr_table
from fedsilo.data.sources.base import LabelFileError
from fedsilo.data.splits import check_patient_disjoint, make_split
from tests.conftest import SAMPLES, needs_samples


def _params(tables: dict | None = None, **own) -> dict:
    return {
        "sources": {"rsna": {"mode": "mirror", "mirror": {"patients": 24, "image_px": 64}},
                    "st_marys": {"mode": "mirror", "reader": "cxr_table", "mirror": {"patients": 40, "image_px": 64}, **own}},
        "datasets": {"chest_xray4": {"sources": ["rsna", "st_marys"], "image_size": 32, "workers": 1, "tables": tables or {}}},
        "experiments": {"quick": {"dataset": "chest_xray4", "split": {"protocol": "domain_clients", "n_train": 10, "n_test": 6}}},
        "methods": {"fedavg": {}},
        "pipeline": {"sources": ["rsna", "st_marys"], "datasets": ["chest_xray4"], "splits": {"quick": "chest_xray4"},
                     "experiments": ["quick"], "methods": ["fedavg"], "seeds": [0]},
        "tracking": {"enabled": False},
    }


def test_a_hospitals_export_is_a_domain_of_its_own_harmonized_as_the_public_sources_are(tmp_path):
    p = parse_params(_params({"st_marys": {"domain": "St Marys"}}))
    raw = tmp_path / "raw"
    for s in ("rsna", "st_marys"):
        fetch(s, p.sources[s], raw / s)
    card = harmonize_cxr(p.datasets["chest_xray4"], raw, tmp_path / "h" / "chest_xray4", quiet=True)

    table = pd.read_csv(raw / "st_marys" / "labels.csv", dtype=str, keep_default_na=False)
    rec = cxr_table.read_records(raw / "st_marys", CXRTableRules(), "St Marys")
    # every row is a record, its reason the rules': other findings under their own name, blanks, laterals
    assert len(rec) == len(table)
    assert any("\\" in v for v in table["path"]) and not rec["id"].str.contains("\\\\", regex=False).any()
    reasons = set(card["domains"]["St Marys"]["excluded_by_reason"])
    assert {"lateral view", "no label"} <= reasons and {r for r in reasons if r.startswith("label ")}
    assert not rec.loc[rec["view"] == "lateral", "excluded"].eq("").any()
    kept = rec[rec["excluded"] == ""]
    assert set(kept["label"]) == {0, 1} and set(kept["original_label"].str.casefold()) <= {"lung opacity", "normal", "no finding"}
    # DICOMs told by their preamble when the export gives them no suffix
    suffixless = kept[~kept["id"].str.contains(".", regex=False) & (kept["path"] != "")]
    assert len(suffixless) and set(suffixless["reader"]) == {"dicom"}
    assert set(kept.loc[kept["id"].str.endswith(".png"), "reader"]) == {"image"}
    # the row naming a file the export lacks is quarantined, not dropped
    assert card["domains"]["St Marys"]["quarantined"] == 1

    h = tmp_path / "h" / "chest_xray4"
    images = np.load(h / "images.npy")
    recs = pd.read_parquet(h / "records.parquet")
    mine = recs[recs["domain"] == "St Marys"]
    assert len(mine) == card["domains"]["St Marys"]["images"] == len(kept) - 1
    for i in mine.index[:12]:  # each harmonized image is its own file's, decoded by harmonize's own rules
        src = raw / "st_marys" / mine.loc[i, "source_path"]
        reader = "image" if src.suffix == ".png" else "dicom"
        np.testing.assert_array_equal(images[i], decode_one((str(src), reader, 32, "crop", "bit_depth", (0.5, 99.5))))
    # patients are the groups: a patient's studies never straddle a split
    assert mine["group"].str.startswith("St Marys/H").all() and mine["group"].nunique() < len(mine)
    split = make_split(recs, p.experiments["quick"].split, 0)
    check_patient_disjoint(recs, split)
    assert "warnings" not in card


@needs_samples("cxr/dicom")
def test_real_dicoms_and_pngs_read_through_a_hand_written_label_table(tmp_path):
    """The real CXR files of ../shared/samples (DICOMs in four encodings, NIH PNGs), laid out as an export: one DICOM
    renamed without its suffix, the table with the hospital's own column names, values and a subset column."""
    export = tmp_path / "export"
    (export / "img").mkdir(parents=True)
    rows, originals = [], {}
    files = sorted((SAMPLES / "cxr" / "dicom").glob("*.dcm")) + sorted((SAMPLES / "cxr" / "png").glob("*.png"))
    for k, f in enumerate(files):
        name = f"img/{k:02d}" + ("" if k == 0 else f.suffix)
        shutil.copy(f, export / name)
        originals[name] = f
        rows.append({"Accession": name, "Finding": ("opacity" if k % 2 else "NORMAL"), "MRN": f"mrn{k // 2}",
                     "Projection": "PA", "Set": "test" if k // 2 == 0 else "train"})
    pd.DataFrame(rows).to_csv(export / "reports.csv", index=False)
    rules = {"file": "reports.csv", "path": "Accession", "label": "Finding", "positive": ["Opacity"], "negative": ["normal"],
             "patient": "MRN", "view": "Projection", "subset": "Set", "domain": "General"}
    p = parse_params(_params({"st_marys": rules}, mode="local", path=str(export)))
    raw = tmp_path / "raw"
    fetch("st_marys", p.sources["st_marys"], raw / "st_marys")
    fetch("rsna", p.sources["rsna"], raw / "rsna")
    card = harmonize_cxr(p.datasets["chest_xray4"].model_copy(update={"max_quarantine_fraction": 0.0}), raw,
                         tmp_path / "h" / "chest_xray4", quiet=True)
    d = card["domains"]["General"]
    assert d["images"] == len(files) and d["excluded"] == 0 and d["quarantined"] == 0
    assert d["by_class"] == {"Normal": (len(files) + 1) // 2, "Lung Opacity": len(files) // 2}
    assert d["by_subset"] == {"test": 2, "train": len(files) - 2}
    recs = pd.read_parquet(tmp_path / "h" / "chest_xray4" / "records.parquet")
    images = np.load(tmp_path / "h" / "chest_xray4" / "images.npy")
    for i in recs.index[recs["domain"] == "General"]:
        orig = originals[recs.loc[i, "source_path"]]
        if orig.suffix == ".dcm":
            want = finish(dicom_to_uint8(orig, "bit_depth")[0], 32, "crop")
        else:
            want = decode_one((str(orig), "image", 32, "crop", "bit_depth", (0.5, 99.5)))
        np.testing.assert_array_equal(images[i], want)


def _export(tmp_path: Path, rows: list[dict], files: tuple[str, ...] = ("a/1.png", "a/2.png")) -> Path:
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_bytes(b"")
    pd.DataFrame(rows).to_csv(tmp_path / "labels.csv", index=False)
    return tmp_path


ROW = {"path": "a/1.png", "label": "Normal", "patient_id": "p1", "view": "PA"}


@pytest.mark.parametrize("rows,rules,needle", [
    ([{k: v for k, v in ROW.items() if k != "view"}], {}, "missing column(s) 'view' (K.view)"),
    ([{**ROW, "path": "/data/a/1.png"}], {}, "row 2: '/data/a/1.png' is an absolute path"),
    ([{**ROW, "path": "C:\\export\\1.png"}], {}, "is an absolute path"),
    ([{**ROW, "path": "a/../../etc/passwd"}], {}, "leaves the source's folder"),
    ([ROW, {**ROW, "path": "a/./1.png", "label": "Lung Opacity"}], {}, "row 3: a/1.png is listed again (first on row 2)"),
    ([{**ROW, "view": "OBLIQUE"}], {}, "row 2: view 'OBLIQUE' is neither frontal nor lateral; add it to K.frontal or K.lateral"),
    ([{**ROW, "split": "holdout"}], {"subset": "split"}, "split 'holdout' is not one of train, val, test"),
    ([{**ROW, "split": "train"}, {**ROW, "path": "a/2.png", "split": "test"}], {"subset": "split"},
     "row 3: patient 'p1' is in subset test, and in train on row 2"),
    ([], {}, "the label table has no row"),
])
def test_label_table_mistakes_are_refused_naming_row_and_key(tmp_path, rows, rules, needle):
    root = _export(tmp_path, rows) if rows else tmp_path
    if not rows:
        (tmp_path / "labels.csv").write_text("path,label,patient_id,view\n")
    with pytest.raises(LabelFileError) as err:
        cxr_table.read_records(root, CXRTableRules(**rules), "H", key="K")
    assert needle in str(err.value)


def test_a_table_reads_the_hospitals_own_words_and_a_missing_table_is_named(tmp_path):
    root = _export(tmp_path, [{"path": "a\\1.png", "label": " lung opacity ", "patient_id": "p1", "view": "ap"},
                              {"path": "a/2.png", "label": "Effusion", "patient_id": "", "view": "LL"},
                              {"path": "a/3.png", "label": "", "patient_id": "p3", "view": ""}])
    rec = cxr_table.read_records(root, CXRTableRules(), "H").set_index("id")
    assert rec.loc["a/1.png", ["label", "view", "group", "excluded"]].tolist() == [1, "frontal", "p1", ""]
    assert rec.loc["a/2.png", "excluded"] == "label Effusion"  # the finding first, then the view and patient
    assert rec.loc["a/3.png", ["excluded", "path"]].tolist() == ["no label", ""]  # not in the export: no path
    no_patient = cxr_table.read_records(root, CXRTableRules(patient=None, view=None), "H").set_index("id")
    assert no_patient["group"].tolist() == no_patient.index.tolist() and set(no_patient["view"]) == {"frontal"}
    with pytest.raises(LabelFileError, match=r"labels2.csv: the label table is missing \(K.file: 'labels2.csv'"):
        cxr_table.read_records(root, CXRTableRules(file="labels2.csv"), "H", key="K")


def test_without_a_patient_column_harmonize_warns_in_the_card_and_on_stderr(tmp_path, capsys, monkeypatch):
    raw = _params({"st_marys": {"patient": None}})
    raw["sources"]["st_marys"]["mirror"]["patients"] = 12
    raw["datasets"]["chest_xray4"]["sources"] = ["st_marys"]
    raw["sources"].pop("rsna")
    raw["pipeline"]["sources"] = ["st_marys"]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    assert fedsilo(["fetch", "--source", "st_marys", "-q"]) == 0
    assert fedsilo(["harmonize", "--dataset", "chest_xray4", "-q"]) == 0
    err = capsys.readouterr().err
    assert "warning: datasets.chest_xray4: st_marys (st_marys) has no patient column" in err
    card = (tmp_path / "data" / "harmonized" / "chest_xray4" / "card.md").read_text()
    assert "## Warnings" in card and "two images of one patient may land on both sides" in card


@pytest.mark.parametrize("edit,needle", [
    (lambda r: r["sources"].update(rsna={"mode": "local", "path": "/x", "reader": "cxr_table"}),
     "sources.rsna.reader: rsna is a public source with its own reader"),
    (lambda r: r["sources"].update({"St-Marys": r["sources"].pop("st_marys")}), "sources.St-Marys: a source of your own needs a name"),
    (lambda r: r["sources"]["st_marys"].update(mode="download"), "sources.st_marys.mode: 'download' is not offered by reader cxr_table"),
    (lambda r: r["sources"]["st_marys"].pop("reader"), "sources.st_marys: unknown source"),
    (lambda r: r["datasets"]["chest_xray4"]["tables"].update(other={}), "tables.other: 'other' is not among this dataset's sources"),
    (lambda r: r["datasets"]["chest_xray4"]["tables"].update(st_marys={"domain": "rsna"}),
     "datasets.chest_xray4.tables.st_marys.domain: 'rsna' is also the domain of rsna"),
    (lambda r: r["datasets"]["chest_xray4"]["tables"].update(st_marys={"domain": "St Mary's"}), "a domain name is letters, digits"),
    (lambda r: r["datasets"]["chest_xray4"]["tables"].update(st_marys={"negative": ["Normal", "lung opacity"]}),
     "positive and negative share lung opacity"),
    (lambda r: r["datasets"]["chest_xray4"].update(sources=["rsna", "st_marys", "rsna"]), "rsna listed twice"),
])
def test_a_table_source_is_refused_by_key_where_it_cannot_work(edit, needle):
    raw = _params()
    edit(raw)
    with pytest.raises(ConfigError) as err:
        parse_params(raw)
    assert needle in str(err.value)


def test_a_public_source_still_has_no_reader_and_digits_refuse_a_table():
    assert SourceParams().reader is None and MirrorParams().patients == 80
    raw = _params()
    raw["datasets"]["digits5"] = {"kind": "digits5", "sources": ["st_marys"]}
    with pytest.raises(ConfigError, match="'st_marys' is not a source of digits5"):
        parse_params(raw)
