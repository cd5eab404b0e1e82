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
from fedsilo.data.harmonize import HarmonizeError, decode_one, harmonize_cxr
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
    table = pd.read_csv(raw / "st_marys" / "labels.csv", dtype=str, keep_default_na=False)
    # as a table typed by hand: one row in another case than its file, one naming a file the export lacks
    png = table.index[table["path"].str.endswith(".png")][0]
    real_png = table.loc[png, "path"]
    table.loc[png, "path"] = real_png.upper()
    table.loc[len(table)] = {"path": "export/H-missing/1/1.dcm", "label": "Normal", "patient_id": "H-missing", "view": "PA"}
    table.to_csv(raw / "st_marys" / "labels.csv", index=False)
    card = harmonize_cxr(p.datasets["chest_xray4"], raw, tmp_path / "h" / "chest_xray4", quiet=True)

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
    assert set(kept.loc[kept["id"].str.lower().str.endswith(".png"), "reader"]) == {"image"}
    upper = rec.set_index("id").loc[table.loc[png, "path"]]  # read from the one file it names but for case
    assert upper["path"] == real_png and upper["reader"] == "image"
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
    # the table was edited in the fetched copy (above): said, the only warning, and listed beside the source's fingerprint
    assert [w.split(" (")[0] for w in card["warnings"]] == ["data/raw/st_marys: 1 file(s) are not what fetch wrote"]
    assert [c.split(" (")[0] for c in card["sources"]["st_marys"]["changed_since_fetch"]] == ["labels.csv"]
    assert "changed_since_fetch" not in card["sources"]["rsna"]
    # the card records the rules the table was read with, its defaults spelled out
    assert card["rules"]["tables"]["st_marys"]["positive"] == ["Lung Opacity"] and card["rules"]["tables"]["st_marys"]["domain"] == "St Marys"


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
    # the same files by their headers' View Position: the Philips CR and SIIM files say PA, the NIH conversion nothing
    views = cxr_table.read_records(raw / "st_marys", CXRTableRules(**{**rules, "view": None, "dicom_view": True}), "General")
    said = dict(zip(views["id"].map(lambda r: originals[r].name), views["excluded"]))
    assert said == {f.name: "" if f.name.startswith(("RG1", "1.2.276")) else "no view" for f in files}


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
    ([{**ROW, "split": "train"}, {**ROW, "path": "a/2.png", "split": "TEST"}], {"subset": "split"},
     "row 3: patient 'p1' is test here and outside test on row 2"),
    ([{**ROW, "split": "test"}, {**ROW, "path": "a/2.png", "split": ""}], {"subset": "split"},  # blank goes to training
     "row 3: patient 'p1' is outside test here and test on row 2"),
    ([], {}, "the label table has no row"),
])
def test_label_table_mistakes_are_refused_naming_row_and_key(tmp_path, rows, rules, needle):
    root = _export(tmp_path, rows) if rows else tmp_path
    if not rows:
        (tmp_path / "labels.csv").write_text("path,label,patient_id,view\n")
    with pytest.raises(LabelFileError) as err:
        cxr_table.read_records(root, CXRTableRules(**rules), "H", key="K")
    assert needle in str(err.value)


def test_a_tables_row_mistakes_are_refused_together_not_one_fix_and_rerun_at_a_time(tmp_path, monkeypatch):
    """Three rows with three mistakes: one refusal naming each row (it named the first only, and a hospital fixed and
    reran three times); one mistake reads as before; at MAX_ERRORS mistakes the reading stops and says so."""
    from fedsilo.data.sources.tables import Rows

    rows = [ROW, {**ROW, "path": "/data/a/2.png"}, {**ROW, "path": "a/2.png", "view": "OBLIQUE"}, {**ROW, "path": "a/./1.png"}]
    root = _export(tmp_path, rows)
    with pytest.raises(LabelFileError) as err:
        cxr_table.read_records(root, CXRTableRules(), "H", key="K")
    lines = str(err.value).split("\n  ")
    assert lines[0] == "3 rows of the label table are refused; correct them all, then harmonize again:"
    assert [line.split(": ", 1)[1] for line in lines[1:]] == [
        "row 3: '/data/a/2.png' is an absolute path; paths are relative to the source's folder " + str(root),
        "row 4: view 'OBLIQUE' is neither frontal nor lateral; add it to K.frontal or K.lateral",
        "row 5: a/1.png is listed again (first on row 2); one row per image"]
    monkeypatch.setattr(Rows, "MAX_ERRORS", 2)
    with pytest.raises(LabelFileError, match=r"^2 rows of the label table are refused \(the reading stopped at 2\)"):
        cxr_table.read_records(root, CXRTableRules(), "H", key="K")


def test_a_table_reads_the_hospitals_own_words_and_a_missing_table_is_named(tmp_path):
    root = _export(tmp_path, [{"path": "a\\1.png", "label": " lung opacity ", "patient_id": "p1", "view": "ap", "set": "Test"},
                              {"path": "a/2.png", "label": "Effusion", "patient_id": "", "view": "LL", "set": ""},
                              {"path": "a/3.png", "label": "", "patient_id": "p3", "view": "", "set": ""},
                              {"path": "a/4.png", "label": "1.0", "patient_id": "N/A", "view": "PA", "set": ""},
                              {"path": "a/5.png", "label": "Normal", "patient_id": "p1", "view": "LL", "set": "train"}],
                   files=("a/1.png", "a/2.png", "a/4.png", "a/5.png"))
    rec = cxr_table.read_records(root, CXRTableRules(subset="set"), "H").set_index("id")
    assert rec.loc["a/1.png", ["label", "view", "group", "excluded", "subset"]].tolist() == [1, "frontal", "p1", "", "test"]
    assert rec.loc["a/2.png", "excluded"] == "label Effusion"  # the finding first, then the view and patient
    assert rec.loc["a/3.png", ["excluded", "path"]].tolist() == ["no label", ""]  # not in the export: no path
    assert rec.loc["a/4.png", "excluded"] == "label 1.0"  # not a word of the default rules
    # an excluded (lateral) image of p1 outside test is no leak: it never reaches a split
    assert rec.loc["a/5.png", "excluded"] == "lateral view"
    numeric = cxr_table.read_records(root, CXRTableRules(positive=("1",), negative=("0",), subset="set"), "H").set_index("id")
    assert numeric.loc["a/4.png", ["original_label", "excluded"]].tolist() == ["1.0", "no patient id"]  # a patient written N/A is none
    anyone = cxr_table.read_records(root, CXRTableRules(positive=("1",), negative=("0",), patient=None, subset="set"), "H")
    assert anyone.set_index("id").loc["a/4.png", ["label", "excluded"]].tolist() == [1, ""]  # 1.0 is the word 1
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
    assert "has no view column" not in err  # the view column is there
    for dicom_view in (False, True):  # without a view column: warned, unless the headers give the views
        raw["datasets"]["chest_xray4"]["tables"]["st_marys"] = {"view": None, "dicom_view": dicom_view}
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
        assert fedsilo(["harmonize", "--dataset", "chest_xray4", "-q"]) == 0
        err = capsys.readouterr().err
        assert ("st_marys (st_marys) has no view column (view: null): every image is taken as frontal" in err) is not dicom_view
        card = (tmp_path / "data" / "harmonized" / "chest_xray4" / "card.md").read_text()
        assert ("every image is taken as frontal" in card) is not dicom_view


@pytest.mark.parametrize("edit,needle", [
    (lambda r: r["sources"].update(rsna={"mode": "local", "path": "/x", "reader": "cxr_table"}),
     "sources.rsna.reader: rsna is a public source with its own reader"),
    (lambda r: r["sources"].update({"St-Marys": r["sources"].pop("st_marys")}), "sources.St-Marys: a source of your own needs a name"),
    (lambda r: r["sources"]["st_marys"].update(mode="download"), "sources.st_marys.mode: 'download' is not offered by reader cxr_table"),
    (lambda r: r["sources"]["st_marys"].pop("reader"), "sources.st_marys: unknown source"),
    (lambda r: r["datasets"]["chest_xray4"]["tables"].update(other={}), "tables.other: 'other' is not among this dataset's sources"),
    (lambda r: r["datasets"]["chest_xray4"]["tables"].update(st_marys={"domain": "rsna"}),
     "datasets.chest_xray4.tables.st_marys.domain: 'rsna' is also the domain of rsna"),
    (lambda r: r["datasets"]["chest_xray4"]["tables"].update(st_marys={"domain": "St Mary's"}), "a domain name is letters (accented ones too), digits"),
    (lambda r: r["datasets"]["chest_xray4"]["tables"].update(st_marys={"domain": "_São"}), "starting with a letter or digit"),
    (lambda r: r["datasets"]["chest_xray4"]["tables"].update(st_marys={"negative": ["Normal", "lung opacity"]}),
     "positive and negative share lung opacity"),
    (lambda r: r["datasets"]["chest_xray4"].update(sources=["rsna", "st_marys", "rsna"]), "rsna listed twice"),
    (lambda r: r["datasets"]["chest_xray4"]["tables"].update(rsna={}), "tables.rsna: rsna is a public source read by its own rules"),
    (lambda r: r["datasets"]["chest_xray4"]["tables"].update(st_marys={"file": "/srv/labels.csv"}), "the label table is a file inside the source's folder"),
    (lambda r: r["datasets"]["chest_xray4"]["tables"].update(st_marys={"file": "../labels.csv"}), "the label table is a file inside the source's folder"),
    (lambda r: r["datasets"]["chest_xray4"]["tables"].update(st_marys={"encoding": "klingon"}), "'klingon' is not a text encoding"),
    (lambda r: r["datasets"]["chest_xray4"]["tables"].update(st_marys={"encoding": "base64"}), "'base64' is not a text encoding"),
    (lambda r: r["sources"].update({"final": r["sources"].pop("st_marys")}) or r["datasets"]["chest_xray4"].update(sources=["rsna", "final"]),
     "datasets.chest_xray4.tables.final.domain: 'final' (the source's name) is a column of the report's tables"),
    (lambda r: r["datasets"]["chest_xray4"]["tables"].update(st_marys={"domain": "Avg"}), "'Avg' is a column of the report's tables"),
    (lambda r: r["datasets"]["chest_xray4"]["tables"].update(st_marys={"lateral": ["LL", "pa"]}), "frontal and lateral share pa"),
    (lambda r: r["datasets"]["chest_xray4"]["tables"].update(st_marys={"positive": [1], "negative": ["1.0"]}), "positive and negative share 1"),
    (lambda r: (r["sources"].update(mnist={"mode": "mirror"}), r["datasets"]["chest_xray4"].update(sources=["mnist"])),
     "datasets.chest_xray4.sources: 'mnist' is not a chest X-ray source"),
    (lambda r: (r["sources"].update(chest_xray4_released={"mode": "mirror"}),
                r["datasets"]["chest_xray4"].update(sources=["chest_xray4_released", "st_marys"], tables={"st_marys": {"domain": "RSNA"}})),
     "datasets.chest_xray4.tables.st_marys.domain: 'RSNA' is also the domain of chest_xray4_released"),
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
    # the released Chest-X-Ray-4 may take a hospital of its own beside its four domains
    raw = _params()
    raw["sources"]["chest_xray4_released"] = {"mode": "mirror"}
    raw["datasets"]["chest_xray4"]["sources"] = ["chest_xray4_released", "st_marys"]
    raw["pipeline"]["sources"] = ["chest_xray4_released", "st_marys"]
    assert parse_params(raw).datasets["chest_xray4"].own_sources() == ("st_marys",)


def test_a_papers_pipeline_refuses_a_dataset_that_holds_a_hospitals_own_source(tmp_path):
    from fedsilo.config import load_paper_params
    from tests.conftest import REPO

    root = yaml.safe_load((REPO / "params.yaml").read_text())
    root["sources"]["st_marys"] = {"mode": "mirror", "reader": "cxr_table"}
    root["datasets"]["chest_xray4"]["sources"] = list(root["datasets"]["chest_xray4"].get("sources", ["chexpert", "openi", "rsna", "vinbigdata"])) + ["st_marys"]
    root["pipeline"]["sources"].append("st_marys")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(root))
    paper = REPO / "pipelines" / "pfeddb" / "params.yaml"
    raw = yaml.safe_load(paper.read_text())
    raw["data"] = str(tmp_path / "params.yaml")
    with pytest.raises(ConfigError, match=r"experiments\.pfeddb_cxr4\.dataset: 'chest_xray4' holds sources of your own .*\(st_marys\)"):
        load_paper_params(paper, raw)


def test_two_hospitals_mirrors_differ_and_an_all_excluded_table_says_why(tmp_path):
    raw = _params({"st_marys": {"positive": ["Pneumonia"], "negative": ["Healthy"]}})
    raw["sources"]["st_anne"] = {**raw["sources"]["st_marys"]}
    p = parse_params(raw)
    fetch("st_marys", p.sources["st_marys"], tmp_path / "raw" / "st_marys")
    fetch("st_anne", p.sources["st_anne"], tmp_path / "raw" / "st_anne")
    assert (tmp_path / "raw" / "st_marys" / "labels.csv").read_bytes() != (tmp_path / "raw" / "st_anne" / "labels.csv").read_bytes()
    fetch("rsna", p.sources["rsna"], tmp_path / "raw" / "rsna")
    with pytest.raises(HarmonizeError, match=r"st_marys: no image passes the label rules \(excluded: label Lung Opacity: \d+.*datasets\.chest_xray4\.tables\.st_marys"):
        harmonize_cxr(p.datasets["chest_xray4"], tmp_path / "raw", tmp_path / "h" / "chest_xray4", quiet=True)


def test_a_semicolon_table_or_another_encoding_is_named_with_the_key_to_set(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "1.png").write_bytes(b"")
    (tmp_path / "labels.csv").write_text("path;label;patient_id;view\na/1.png;Normal;p1;PA\n")
    with pytest.raises(LabelFileError, match=r"the header holds ';': set K.sep to it"):
        cxr_table.read_records(tmp_path, CXRTableRules(), "H", key="K")
    assert len(cxr_table.read_records(tmp_path, CXRTableRules(sep=";"), "H", key="K")) == 1
    (tmp_path / "labels.csv").write_bytes("path,label,patient_id,view\na/1.png,Épanchement,p1,PA\n".encode("cp1252"))
    with pytest.raises(LabelFileError, match=r"set K.encoding to the table's encoding"):
        cxr_table.read_records(tmp_path, CXRTableRules(), "H", key="K")
    rec = cxr_table.read_records(tmp_path, CXRTableRules(encoding="cp1252"), "H", key="K")
    assert rec["excluded"].tolist() == ["label Épanchement"]


def test_a_dry_run_counts_what_harmonize_keeps_and_writes_nothing(tmp_path, capsys, monkeypatch):
    """`fedsilo harmonize --dry-run` reads the label files only: its counts per domain are harmonize's (kept = images
    + quarantined), for a hospital's table beside RSNA and for a benchmark; no file is written."""
    from fedsilo.data.harmonize import harmonize_dataset, preview_dataset

    raw = _params()  # no tables entry: the reader's defaults, which the card spells out
    raw["sources"]["office_caltech10"] = {"mode": "mirror", "mirror": {"per_class": 2, "image_px": 32}}
    raw["datasets"]["office"] = {"kind": "office_caltech10", "image_size": 16, "workers": 1, "max_per_domain": 15}
    raw["pipeline"]["sources"] = ["rsna", "st_marys", "office_caltech10"]
    raw["pipeline"]["datasets"] = ["chest_xray4", "office"]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    for s in raw["pipeline"]["sources"]:
        assert fedsilo(["fetch", "--source", s, "-q"]) == 0
    table = pd.read_csv("data/raw/st_marys/labels.csv", dtype=str, keep_default_na=False)
    table.loc[len(table)] = {"path": "export/gone.dcm", "label": "Normal", "patient_id": "P9", "view": "PA"}
    table.to_csv("data/raw/st_marys/labels.csv", index=False)
    capsys.readouterr()
    assert fedsilo(["harmonize", "--dataset", "chest_xray4", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "1 kept rows name no file (e.g. st_marys/export/gone.dcm)" in out and "nothing written" in out
    assert not Path("data/harmonized").exists()
    p = parse_params(raw)
    for name in ("chest_xray4", "office"):
        pv = preview_dataset(p.datasets[name], Path("data/raw"), name)
        card = harmonize_dataset(p.datasets[name], Path("data/raw"), Path("data/harmonized") / name, quiet=True)
        assert set(pv["domains"]) == set(card["domains"])
        for dom, d in card["domains"].items():
            v = pv["domains"][dom]
            assert v["kept"] == d["images"] + d["quarantined"] and v["excluded"] == d["excluded"], (name, dom)
            assert v["excluded_by_reason"] == d["excluded_by_reason"]
            if d["quarantined"] == 0:
                assert v["by_class"] == d["by_class"]
    assert pv["domains"]["amazon"]["kept"] == 15  # max_per_domain as harmonize applies it
    rules = yaml.safe_load(Path("data/harmonized/chest_xray4/card.json").read_text())["rules"]["tables"]["st_marys"]
    assert rules["positive"] == ["Lung Opacity"] and rules["view"] == "view" and rules["dicom_view"] is False
    # what harmonize would refuse, the dry run refuses already: too many files missing, nothing kept
    table = pd.read_csv("data/raw/st_marys/labels.csv", dtype=str, keep_default_na=False)
    table.loc[:40, "path"] = [f"gone/{i}.dcm" for i in range(41)]
    table.to_csv("data/raw/st_marys/labels.csv", index=False)
    capsys.readouterr()
    assert fedsilo(["harmonize", "--dataset", "chest_xray4", "--dry-run"]) == 2
    assert "error: harmonize would fail: st_marys:" in capsys.readouterr().err
    raw["datasets"]["chest_xray4"]["tables"] = {"st_marys": {"positive": ["Pneumonia"], "negative": ["Healthy"]}}
    Path("params.yaml").write_text(yaml.safe_dump(raw))
    assert fedsilo(["harmonize", "--dataset", "chest_xray4", "--dry-run"]) == 2
    assert "harmonize would fail: st_marys: no image passes the label rules" in capsys.readouterr().err


def test_dicom_view_takes_the_view_from_each_headers_view_position(tmp_path):
    """``dicom_view``: without a view column each DICOM's View Position decides (the mirror's headers record each
    image's view), a PNG has none; an unmapped header value is refused naming the file; an unreadable header is left
    to the decoder."""
    from fedsilo.data.mirror.cxr import _write_vin_dicom

    p = parse_params(_params())
    fetch("st_marys", p.sources["st_marys"], tmp_path / "raw")
    with_column = cxr_table.read_records(tmp_path / "raw", CXRTableRules(), "H").set_index("id")
    table = pd.read_csv(tmp_path / "raw" / "labels.csv", dtype=str, keep_default_na=False)
    table.drop(columns="view").to_csv(tmp_path / "raw" / "labels.csv", index=False)
    from_headers = cxr_table.read_records(tmp_path / "raw", CXRTableRules(view=None, dicom_view=True), "H").set_index("id")
    dicom = with_column["reader"] == "dicom"
    assert dicom.sum() > 10 and (with_column.loc[dicom, "view"] == "lateral").any()
    pd.testing.assert_series_equal(from_headers.loc[dicom, "excluded"], with_column.loc[dicom, "excluded"])
    seen = dicom & ~with_column["excluded"].str.startswith("label") & (with_column["excluded"] != "no label")
    pd.testing.assert_series_equal(from_headers.loc[seen, "view"], with_column.loc[seen, "view"])  # headers read for these only
    png = with_column["reader"] == "image"
    by_label = with_column.loc[png, "excluded"].str.startswith("label") | (with_column.loc[png, "excluded"] == "no label")
    assert set(from_headers.loc[png, "view"]) == {"unknown"}  # a PNG has no header: no view, unless its label went first
    assert from_headers.loc[png, "excluded"].tolist() == with_column.loc[png, "excluded"].where(by_label, "no view").tolist()

    rng = np.random.default_rng(0)
    _write_vin_dicom(tmp_path / "raw" / "odd.dcm", "odd", rng.random((32, 32)), rng, 0, view="OBL")
    (tmp_path / "raw" / "broken.dcm").write_bytes(b"not a dicom")
    extra = pd.DataFrame([{"path": "odd.dcm", "label": "Normal", "patient_id": "Z1"}])
    pd.concat([table.drop(columns="view"), extra]).to_csv(tmp_path / "raw" / "labels.csv", index=False)
    with pytest.raises(LabelFileError, match=r"the DICOM header's View Position \(odd.dcm\) 'OBL' is neither frontal nor lateral; add it to K.frontal"):
        cxr_table.read_records(tmp_path / "raw", CXRTableRules(view=None, dicom_view=True), "H", key="K")
    extra = pd.DataFrame([{"path": "broken.dcm", "label": "Normal", "patient_id": "Z2"}])
    pd.concat([table.drop(columns="view"), extra]).to_csv(tmp_path / "raw" / "labels.csv", index=False)
    broken = cxr_table.read_records(tmp_path / "raw", CXRTableRules(view=None, dicom_view=True), "H").set_index("id").loc["broken.dcm"]
    assert broken["excluded"] == "" and broken["view"] == "unknown"  # kept: harmonize's decoder quarantines it, named
    img, err = decode_one_safe(tmp_path / "raw" / "broken.dcm")
    assert img is None and "broken.dcm" in err


def decode_one_safe(path: Path):
    from fedsilo.data.harmonize import _decode_safe

    return _decode_safe((str(path), "dicom", 32, "crop", "bit_depth", (0.5, 99.5)))


def test_a_view_cell_comes_before_the_header_and_a_blank_one_takes_it(tmp_path):
    from fedsilo.data.mirror.cxr import _write_vin_dicom

    rng = np.random.default_rng(0)
    for name, view in (("pa_header", "PA"), ("ll_header", "LL"), ("twice", ["AP", "AP"]), ("two", ["AP", "LL"])):
        _write_vin_dicom(tmp_path / f"{name}.dcm", name, rng.random((32, 32)), rng, 0, view=view)
    rows = [{"path": "pa_header.dcm", "label": "Normal", "patient_id": "p1", "view": "LL"},   # the table says lateral
            {"path": "ll_header.dcm", "label": "Normal", "patient_id": "p2", "view": ""},     # the header says lateral
            {"path": "twice.dcm", "label": "Normal", "patient_id": "p3", "view": ""}]         # AP\\AP is AP
    pd.DataFrame(rows).to_csv(tmp_path / "labels.csv", index=False)
    rec = cxr_table.read_records(tmp_path, CXRTableRules(dicom_view=True), "H").set_index("id")
    assert rec["view"].tolist() == ["lateral", "lateral", "frontal"] and rec["excluded"].tolist() == ["lateral view"] * 2 + [""]
    pd.DataFrame(rows + [{"path": "two.dcm", "label": "Normal", "patient_id": "p4", "view": ""}]).to_csv(tmp_path / "labels.csv", index=False)
    with pytest.raises(LabelFileError, match=r"View Position \(two.dcm\) 'AP\\\\LL' is neither frontal nor lateral"):
        cxr_table.read_records(tmp_path, CXRTableRules(dicom_view=True), "H")


def test_a_header_pydicom_cannot_parse_is_a_decode_error_and_an_unopenable_file_goes_to_the_decoder(tmp_path, monkeypatch):
    import pydicom

    from fedsilo.data.dicom import view_position
    from fedsilo.data.imageops import ImageDecodeError

    def damaged(*a, **k):
        raise NotImplementedError("Unknown Value Representation 'C\\x1e'")

    (tmp_path / "x.dcm").write_bytes(b"")
    monkeypatch.setattr(pydicom, "dcmread", damaged)
    with pytest.raises(ImageDecodeError, match=r"x.dcm.*NotImplementedError: Unknown Value Representation"):
        view_position(tmp_path / "x.dcm")
    monkeypatch.undo()

    def unopenable(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(cxr_table, "is_dicom_file", unopenable)
    _export(tmp_path, [ROW], files=("a/1.png", "a/2"))
    pd.DataFrame([ROW, {**ROW, "path": "a/2", "patient_id": "p2"}]).to_csv(tmp_path / "labels.csv", index=False)
    rec = cxr_table.read_records(tmp_path, CXRTableRules(), "H").set_index("id")
    assert rec.loc["a/2", ["reader", "excluded", "path"]].tolist() == ["image", "", "a/2"]  # the decoder says why


def test_paths_match_a_file_blind_to_case_and_unicode_form_only_when_one_file_does(tmp_path):
    import unicodedata

    nfd = unicodedata.normalize("NFD", "José")
    for f in ("a/X.png", "a/x.png", f"b/{nfd}.png", "c/only.png"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_bytes(b"")
    rows = [{**ROW, "path": "A/X.PNG"}, {**ROW, "path": f"b/{unicodedata.normalize('NFC', 'José')}.png", "patient_id": "p2"},
            {**ROW, "path": "C/Only.png", "patient_id": "p3"}]
    pd.DataFrame(rows).to_csv(tmp_path / "labels.csv", index=False)
    rec = cxr_table.read_records(tmp_path, CXRTableRules(), "H")
    assert rec["path"].tolist() == ["", f"b/{nfd}.png", "c/only.png"]  # X.png and x.png: two candidates, none taken
    pd.DataFrame(rows + [{**ROW, "path": "c/only.png", "patient_id": "p9", "label": "Lung Opacity"}]).to_csv(tmp_path / "labels.csv", index=False)
    with pytest.raises(LabelFileError, match=r"row 5: c/only.png is listed again \(first on row 4\)"):
        cxr_table.read_records(tmp_path, CXRTableRules(), "H")


def test_a_hospital_with_its_own_export_makes_the_site_card_a_federation_admits(tmp_path, monkeypatch, capsys):
    """A deployed site on its own export (deploy/site/params.yaml's commented route): fetch, harmonize, split and
    `fedsilo site card` give the card the coordinator pins, under the site's own domain name."""
    import json

    raw = _params({"st_marys": {"domain": "St Marys"}})
    raw["sources"].pop("rsna")
    raw["datasets"]["chest_xray4"]["sources"] = ["st_marys"]
    raw["experiments"] = {"site": {"dataset": "chest_xray4", "split": {"protocol": "domain_clients", "n_train": 12, "n_test": 8}}}
    raw["pipeline"].update(sources=["st_marys"], splits={"site": "chest_xray4"}, experiments=["site"])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    for cmd in (["fetch", "--source", "st_marys"], ["harmonize", "--dataset", "chest_xray4"], ["split", "--experiment", "site"],
                ["site", "card", "--experiment", "site"]):
        assert fedsilo([*cmd, "-q"]) == 0, cmd
    card = json.loads((tmp_path / "data" / "site" / "site.json").read_text())
    assert card["site"] == card["domain"] == "St Marys" and (card["n_train"], card["n_test"]) == (12, 8)
    assert card["contract"]["classes"] == ["Normal", "Lung Opacity"] and card["contract"]["image_shape"] == [32, 32, 1]
    assert len(card["fingerprint"]) == 64


@needs_samples("cxr/dicom")
def test_a_study_level_table_reads_each_image_of_the_study_by_its_headers_view(tmp_path):
    """One row per study (a radiology report's finding), its DICOMs in the study's folder: each image's view is its
    header's (a PA kept, the same image relabelled LL excluded as lateral, one without the tag excluded as no view),
    the study is the images' group, and the rules say what a study row needs."""
    import pydicom

    dicoms = sorted((SAMPLES / "cxr" / "dicom").glob("*.dcm"))
    pa = next(f for f in dicoms if pydicom.dcmread(f, stop_before_pixels=True).get("ViewPosition") == "PA")
    none = next(f for f in dicoms if not pydicom.dcmread(f, stop_before_pixels=True).get("ViewPosition"))
    study = tmp_path / "export" / "ACC1001"
    study.mkdir(parents=True)
    shutil.copy(pa, study / "IM1")  # suffix-less, as PACS exports write them
    lat = pydicom.dcmread(pa)
    lat.ViewPosition = "LL"
    lat.save_as(study / "IM2")
    shutil.copy(none, study / "IM3")
    other = tmp_path / "export" / "ACC1002"
    other.mkdir()
    lat.ViewPosition, lat.SOPInstanceUID = "PA", pydicom.uid.generate_uid()  # another instance of the image: not a copy
    lat.save_as(other / "IM1")
    (study / "report.txt").write_text("FINDINGS: ...")  # a study folder may hold its report beside the images
    # the second row names its study in another case, as a table typed by hand does
    (tmp_path / "export" / "labels.csv").write_text("path,label,patient_id,view\nACC1001,Lung Opacity,P1,\nacc1002,Normal,P2,\n")
    rec = cxr_table.read_records(tmp_path / "export", CXRTableRules(dicom_view=True), "H", "datasets.c.tables.h")
    got = rec.set_index("id")[["label", "view", "excluded", "group", "reader"]].to_dict("index")
    assert got == {
        "ACC1001/IM1": {"label": 1, "view": "frontal", "excluded": "", "group": "P1", "reader": "dicom"},
        "ACC1001/IM2": {"label": -1, "view": "lateral", "excluded": "lateral view", "group": "P1", "reader": "dicom"},
        "ACC1001/IM3": {"label": -1, "view": "unknown", "excluded": "no view", "group": "P1", "reader": "dicom"},
        "ACC1001/report.txt": {"label": -1, "view": "unknown", "excluded": "not an image file (.txt)", "group": "P1", "reader": ""},
        "ACC1002/IM1": {"label": 0, "view": "frontal", "excluded": "", "group": "P2", "reader": "dicom"},
    }
    # an image's own reason comes before its row's blank patient, as for a one-image row
    (tmp_path / "export" / "labels.csv").write_text("path,label,patient_id,view\nACC1001,Lung Opacity,,\n")
    rec = cxr_table.read_records(tmp_path / "export", CXRTableRules(dicom_view=True), "H", "datasets.c.tables.h")
    assert rec.set_index("id")["excluded"].to_dict() == {"ACC1001/IM1": "no patient id", "ACC1001/IM2": "lateral view",
                                                         "ACC1001/IM3": "no view", "ACC1001/report.txt": "not an image file (.txt)"}
    (tmp_path / "export" / "labels.csv").write_text("path,label,patient_id,view\nACC1001,Lung Opacity,P1,\n")
    with pytest.raises(LabelFileError, match=r"row 2: ACC1001 is a study's folder, .*set datasets\.c\.tables\.h\.dicom_view: true"):
        cxr_table.read_records(tmp_path / "export", CXRTableRules(), "H", "datasets.c.tables.h")
    (tmp_path / "export" / "labels.csv").write_text("path,label,patient_id,view\nACC1001,Lung Opacity,P1,PA\n")
    with pytest.raises(LabelFileError, match=r"row 2: ACC1001 is a study's folder, .*leave its view cell blank and set"):
        cxr_table.read_records(tmp_path / "export", CXRTableRules(dicom_view=True), "H", "datasets.c.tables.h")


def test_a_report_table_finds_its_studies_images_by_the_headers_accession_number(tmp_path):
    """dicom_match by AccessionNumber: one row per study (a report's finding), its DICOMs found anywhere in the export
    by their header; each image's view is its header's, its group its header's PatientID (no patient column), so a
    patient's two studies stay together and a patient in test and outside it is refused; a study without images, an
    image no row lists, a report and a file that is no DICOM are excluded with their reasons; an accession on two
    rows, a table whose accessions lost their zeros and rules that cannot work are refused naming the key."""
    import pydicom

    from fedsilo.data.mirror.cxr import _write_vin_dicom

    rng = np.random.default_rng(0)
    root = tmp_path / "raw"
    studies = {"00071": ("P1", ("PA", "LL")), "00072": ("P1", ("AP",)), "00073": ("P2", ("PA",)), "00074": ("N/A", ("PA",)),
               "00099": ("P3", ("PA",))}
    for acc, (pid, views) in studies.items():
        for k, view in enumerate(views):
            f = root / "export" / f"1.2.{acc}" / f"IM{k}"
            f.parent.mkdir(parents=True, exist_ok=True)
            _write_vin_dicom(f, f"{acc}-{k}", rng.random((32, 32)), rng, k, view=view)
            ds = pydicom.dcmread(f)
            ds.AccessionNumber, ds.PatientID = acc, pid
            ds.save_as(f)
    (root / "export" / "notes.txt").write_text("exported")
    from tests.test_image_table import _pixelless_dicom

    _pixelless_dicom(root / "export" / "1.2.00073" / "SR1")  # the study's structured report, beside its image
    report = pydicom.dcmread(root / "export" / "1.2.00073" / "SR1")
    report.AccessionNumber, report.PatientID = "00073", "P2"
    report.save_as(root / "export" / "1.2.00073" / "SR1")
    (root / "reports.csv").write_text("accession,finding,split\n00071,Lung Opacity,\n00072,Normal,\n00073,No Finding,test\n"
                                      "00080,Normal,\n,Normal,\n00074,Normal,\n")
    rules = CXRTableRules(file="reports.csv", label="finding", patient=None, view=None, dicom_view=True, subset="split",
                          dicom_match={"folder": "export", "column": "accession"})
    notes: list[str] = []
    rec = cxr_table.read_records(root, rules, "H", "datasets.c.tables.h", warnings=notes).set_index("id")
    kept = rec[rec["excluded"] == ""]
    assert notes == ["1 of 4 images datasets.c.tables.h.dicom_match matched have no PatientID in their header (blank or a "
                     "placeholder): each is grouped with its row's images only; name the table's patient column "
                     "(datasets.c.tables.h.patient) if it has one"]
    assert kept[["label", "group", "view"]].to_dict("index") == {
        "export/1.2.00071/IM0": {"label": 1, "group": "P1", "view": "frontal"},
        "export/1.2.00072/IM0": {"label": 0, "group": "P1", "view": "frontal"},  # the patient's second study: its group too
        "export/1.2.00073/IM0": {"label": 0, "group": "P2", "view": "frontal"},
        "export/1.2.00074/IM0": {"label": 0, "group": "study 00074", "view": "frontal"}}  # a placeholder PatientID: no patient
    assert rec.loc["export/1.2.00073/IM0", "subset"] == "test"
    assert rec.loc[rec["excluded"] != "", "excluded"].to_dict() == {
        "export/1.2.00071/IM1": "lateral view", "reports.csv: row 5 (study 00080)": "no DICOM with this AccessionNumber under export",
        "reports.csv: row 6": "no AccessionNumber in the row",
        "export/notes.txt": "not a DICOM (datasets.c.tables.h.dicom_match matches DICOMs by their AccessionNumber)",
        "export/1.2.00099/IM0": "its AccessionNumber is in no row of the table",
        "export/1.2.00073/SR1": "not an image: a DICOM without pixels (Enhanced SR Storage)"}
    # the header's patient is the group: one patient in test on one row and outside it on another is refused
    (root / "reports.csv").write_text("accession,finding,split\n00071,Lung Opacity,test\n00072,Normal,\n")
    with pytest.raises(LabelFileError, match=r"row 3: patient 'P1' is outside test here and test on row 2"):
        cxr_table.read_records(root, rules, "H", "datasets.c.tables.h")
    (root / "reports.csv").write_text("accession,finding,split\n00071,Lung Opacity,\n00071,Normal,\n")
    with pytest.raises(LabelFileError, match=r"row 3: study '00071' is listed again \(first on row 2\); with "
                                             r"datasets\.c\.tables\.h\.dicom_match the table has one row per study"):
        cxr_table.read_records(root, rules, "H", "datasets.c.tables.h")
    (root / "reports.csv").write_text("accession,finding,split\n71,Lung Opacity,\n72,Normal,\n")
    with pytest.raises(LabelFileError, match=r"no DICOM under export has an AccessionNumber in the column accession \(the "
                                             r"table's: 71, 72, \.\.\.; the headers': 00071, 00072, 00073, \.\.\.\)"):
        cxr_table.read_records(root, rules, "H", "datasets.c.tables.h")
    with pytest.raises(ValueError, match="dicom_match: a row matched by AccessionNumber holds every image of a study"):
        CXRTableRules(dicom_match={"folder": "export", "column": "accession"})
    with pytest.raises(ValueError, match="view: a row matched by AccessionNumber holds several images"):
        CXRTableRules(view="view", dicom_view=True, dicom_match={"folder": "export", "column": "accession"})
    with pytest.raises(ValueError, match="dicom_match: the images are found by their DICOM headers, not by a path column"):
        CXRTableRules(path="file", dicom_view=True, dicom_match={"folder": "export", "column": "accession"})
    with pytest.raises(ValueError, match=r"dicom_match\.tag"):
        CXRTableRules(dicom_view=True, dicom_match={"folder": "export", "column": "accession", "tag": "StudyDate"})


@needs_samples("cxr/dicom")
def test_real_dicoms_found_by_their_study_uid_take_their_studys_finding(tmp_path):
    """The real chest DICOMs of ../shared/samples, renamed by number in one folder as a PACS export names them, labelled
    by a table of their StudyInstanceUIDs: the two encodings of one study both take its row's finding, each image's
    group is its header's PatientID, and the image whose header has no View Position is excluded as "no view"."""
    import pydicom

    export = tmp_path / "site"
    (export / "pacs").mkdir(parents=True)
    rows, studies = [], {}
    for k, f in enumerate(sorted((SAMPLES / "cxr" / "dicom").glob("*.dcm"))):
        shutil.copy(f, export / "pacs" / f"{k:04d}")
        head = pydicom.dcmread(f, stop_before_pixels=True)
        studies.setdefault(str(head.StudyInstanceUID), []).append((f"pacs/{k:04d}", str(head.PatientID), head.get("ViewPosition")))
    for n, uid in enumerate(studies):
        rows.append({"study": uid, "finding": ("Lung Opacity" if n % 2 else "Normal")})
    pd.DataFrame(rows).to_csv(export / "studies.csv", index=False)
    rules = CXRTableRules(file="studies.csv", label="finding", patient=None, view=None, dicom_view=True,
                          dicom_match={"folder": "pacs", "column": "study", "tag": "StudyInstanceUID"})
    rec = cxr_table.read_records(export, rules, "H", "datasets.c.tables.site").set_index("id")
    assert len(rec) == sum(len(v) for v in studies.values()) and len(studies) < len(rec)  # one study holds two files
    for n, files in enumerate(studies.values()):
        for path, pid, view in files:
            row = rec.loc[path]
            assert row["group"] == pid and row["original_label"] == rows[n]["finding"]
            assert (row["excluded"] == "") == bool(view) and (view or row["excluded"] == "no view")


def test_a_typo_that_leaves_a_class_without_rows_is_refused_and_a_near_word_is_warned(tmp_path):
    """A positive word written 'Lung Opacty' excludes every opacity of the table as another finding: the site would
    harmonize to one class and pass a federation's checks. Refused, naming both spellings; a near word beside rows of
    its class (a table's own misspelling) is a warning only."""
    rows = [{"path": f"a/{i}.png", "label": "Lung Opacity" if i % 2 else "Normal", "patient_id": f"p{i}", "view": "PA", "set": ""}
            for i in range(6)]
    root = _export(tmp_path, rows, files=tuple(r["path"] for r in rows))
    with pytest.raises(LabelFileError, match=r"no row is positive \(K\.positive: \['Lung Opacty'\]\), .*'Lung Opacity' \(3 "
                                             r"row\(s\)\) is close to 'Lung Opacty': a typo in K\.positive or in the table\?"):
        cxr_table.read_records(root, CXRTableRules(positive=("Lung Opacty",), subset="set"), "H", key="K")
    root2 = _export(tmp_path / "b", rows + [{"path": "a/9.png", "label": "Lung Opacitty", "patient_id": "p9", "view": "PA", "set": ""}],
                    files=(*(r["path"] for r in rows), "a/9.png"))
    said: list[str] = []
    rec = cxr_table.read_records(root2, CXRTableRules(subset="set"), "H", key="K", warnings=said)
    assert (rec["label"] == 1).sum() == 3 and said == ["K: 1 row(s) labelled 'Lung Opacitty' are excluded as another finding; "
                                                        "close to 'Lung Opacity' of the rules: add it there if it means the same"]



def test_a_domain_may_be_named_in_any_script():
    from fedsilo.config import check_domain_name

    for name in ("Clínica Ñ", "São Paulo", "Hôpital-2", "Zürich.1"):
        check_domain_name(name)  # MLflow takes them as metric keys (acc.São Paulo), the reports as columns


def test_a_header_written_with_spaces_after_its_commas_is_read_as_its_names(tmp_path):
    root = _export(tmp_path, [ROW])
    (root / "labels.csv").write_text("path, label, patient_id , view\na/1.png, Normal, p1, PA\n")
    rec = cxr_table.read_records(root, CXRTableRules(), "H")
    assert rec.loc[0, ["label", "group", "view"]].tolist() == [0, "p1", "frontal"]
