"""The transcribed numbers of the pFedDB paper are internally consistent (each Avg is the mean of its domains)."""

from pathlib import Path

import yaml

PUBLISHED = Path(__file__).resolve().parents[1] / "pipelines" / "pfeddb" / "published.yaml"


def test_published_tables_are_consistent():
    d = yaml.safe_load(PUBLISHED.read_text())
    assert set(d["accuracy"]) == {"chest_xray4", "digits5", "office_caltech10", "domainnet10"}
    for ds, table in d["accuracy"].items():
        n = len(table["domains"]) + 1
        for method, v in table["methods"].items():
            assert len(v["mean"]) == n and len(v.get("std", [0] * n)) == n, (ds, method)
            if "note" in v:  # a row whose published Avg disagrees with its domains, kept as published
                continue
            assert abs(sum(v["mean"][:-1]) / (n - 1) - v["mean"][-1]) < 0.15, (ds, method)
    assert len([m for m in d["accuracy"]["chest_xray4"]["methods"] if not m.startswith("pfeddb_")]) == 12  # Table 1's rows
    # Tables 3-5 are rows of the accuracy tables under the paper preset's variant keys, with Table 3's Param and Ratio
    office, cxr = d["accuracy"]["office_caltech10"]["methods"], d["accuracy"]["chest_xray4"]["methods"]
    assert [office[m]["param_MB"] for m in ("pfeddb_cut_a", "pfeddb", "pfeddb_cut_c", "pfeddb_cut_d")] == [9.4, 153.5, 217.5, 217.7]
    assert [cxr[m]["ratio"] for m in ("pfeddb_cut_a", "pfeddb_cut_b", "pfeddb", "pfeddb_cut_d")] == [0.05, 0.20, 0.68, 0.99]
    assert len([m for m in office if m.startswith("pfeddb_fusion_")]) == 5 and "pfeddb_one_phase" in cxr
    assert [r["l_c"] for r in d["vit_cut_depth"]["office_caltech10"]["rows"]] == [3, 6, 9, 12]


FEDECOUPLE = PUBLISHED.parents[1] / "fedecouple" / "published.yaml"
PAPER_002 = PUBLISHED.parents[3] / "shared" / "papers" / "002_44ecbdf434336040.txt"


def test_fedecouple_tables_have_the_report_shape_and_every_number_is_in_the_paper():
    """Each table is one dataset under one split (one domain + Avg, equal); every mean and std printed in the paper's
    text (checked where ../shared/papers is present)."""
    import re

    d = yaml.safe_load(FEDECOUPLE.read_text())
    assert len(d["accuracy"]) == 25 and {"cifar10_s20", "cifar10_k3", "cifar100_dir0_01", "emnist_dir1", "femnist_80", "femnist_100"} <= set(d["accuracy"])
    paper = PAPER_002.read_text() if PAPER_002.exists() else None
    for name, table in d["accuracy"].items():
        assert len(table["domains"]) == 1, name
        for method, v in table["methods"].items():
            assert len(v["mean"]) == 2 and v["mean"][0] == v["mean"][1], (name, method)
            if paper is not None:
                for x in [v["mean"][0], *(v.get("std") or [])[:1]]:
                    assert re.search(rf"(?<![\d.]){re.escape(str(x))}0?(?![\d])", paper), (name, method, x)
    assert d["accuracy"]["cifar10_s20"]["methods"]["fedecouple"]["mean"][0] == 83.4
    # the tables across experiments (Tables VI and XII): every cell printed in the paper
    for name, table in d["across"].items():
        cells = [v for per in table["methods"].values() for row in per.values() for v in row.values()]
        assert cells and all(isinstance(v, float) for v in cells), name
        if paper is not None:
            for x in cells:
                assert re.search(rf"(?<![\d.]){re.escape(f'{x:.2f}')}(?![\d])", paper), (name, x)


PFEDDIL = PUBLISHED.parents[1] / "pfeddil" / "published.yaml"
PAPER_003 = PUBLISHED.parents[3] / "shared" / "papers" / "003_259c27eb0eeacb6d.txt"


def test_pfeddil_tables_are_the_papers():
    """Tables 1-3: one value per task of the stream + Avg (the mean of the tasks' values, as printed); Tables 4-6 with
    their datasets; every number printed in the paper's text (checked where ../shared/papers is present)."""
    import re

    d = yaml.safe_load(PFEDDIL.read_text())
    assert set(d["accuracy"]) == {"digit10", "office31", "domainnet"}
    paper = PAPER_003.read_text() if PAPER_003.exists() else None
    printed = set(re.findall(r"\d+\.\d+", paper)) if paper else None
    for name, table in d["accuracy"].items():
        assert len(table["methods"]) == 11, name
        n = len(table["domains"])
        for m, v in table["methods"].items():
            assert len(v["mean"]) == n + 1, (name, m)
            assert abs(sum(v["mean"][:n]) / n - v["mean"][n]) < 0.6, (name, m)  # the paper's own rounding
            if printed is not None:
                assert {f"{x:.2f}" for x in v["mean"]} <= printed, (name, m)
    for table in ("seconds_per_round", "rounds_to_best", "lambda"):
        assert {"digit10", "office31", "domainnet"} <= set(d[table]), table
    assert d["lambda"]["digit10"]["avg_acc"][2] == d["accuracy"]["digit10"]["methods"]["pfeddil"]["mean"][-1]


def test_check_params_refuses_a_published_reference_the_report_could_not_read(tmp_path, capsys):
    """A typo in ``experiments.<e>.published`` (its file or its table) stops check-params, naming the key, instead of
    the report stage once every run has trained (DVC removes the old report before running it)."""
    import shutil

    from fedsilo.cli import main

    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "pipelines" / "f2dc").mkdir(parents=True)
    for f in ("params.yaml", "pipelines/f2dc/published.yaml"):  # the root's params too: the paper's reuses its data
        shutil.copy(repo / f, tmp_path / f)
    text = (repo / "pipelines/f2dc/params.yaml").read_text()
    mine = tmp_path / "pipelines/f2dc/params.yaml"
    for wrong, said in (("published.yaml#pacss", "pipelines/f2dc/published.yaml has no accuracy table 'pacss' (has: "),
                        ("publishd.yaml#pacs", "pipelines/f2dc/publishd.yaml not found")):
        mine.write_text(text.replace("published.yaml#pacs", wrong))
        capsys.readouterr()
        assert main(["--params", str(mine), "--root", str(tmp_path), "check-params"]) == 2
        err = capsys.readouterr().err
        assert "experiments.f2dc_pacs.published: " in err and said in err, err
    # the table's contents too: a domain the experiment will not have, a row of the wrong length
    pub = tmp_path / "pipelines/f2dc/published.yaml"
    shipped = pub.read_text()
    mine.write_text(text)
    for old, new, said in (("domains: [photo, art_painting, cartoon, sketch]", "domains: [photo, art_paintng, cartoon, sketch]",
                            "domains: 'art_paintng' is not a domain of this experiment (did you mean 'art_painting'?)"),
                           ("fedprox:  {mean: [61.88, 57.40, 76.34, 80.14, 68.94]", "fedprox:  {mean: [61.88, 57.40, 76.34, 80.14]",
                            "methods.fedprox.mean: 4 value(s) for the columns ['photo', 'art_painting', 'cartoon', 'sketch']; "
                            "give 5 (each column, then the Avg) or 1 (the Avg alone)")):
        assert shipped.count(old) == 1
        pub.write_text(shipped.replace(old, new))
        capsys.readouterr()
        assert main(["--params", str(mine), "--root", str(tmp_path), "check-params"]) == 2
        err = capsys.readouterr().err
        assert "experiments.f2dc_pacs.published (pipelines/f2dc/published.yaml#pacs): " in err and said in err, err


def test_a_published_tables_columns_and_rows_are_checked():
    """published_table_problems: local / new / external columns take one value each (no Avg); std as long as mean;
    a domain is checked only where params say the experiment's domains; every shipped table of every paper passes."""
    from fedsilo.data.splits import dataset_domains
    from fedsilo.report.versus import load_published_entries, published_table_problems
    from tests.conftest import paper_params

    metric = {"domains": ["local", "new"], "methods": {"a": {"mean": [1.0, 2.0], "std": [0.1]}, "b": {"mean": [1.0, 2.0, 3.0]}}}
    assert published_table_problems(metric, ["CIFAR-10"]) == ["methods.a.std: 1 value(s) for 2 means",
                                                              "methods.b.mean: 3 value(s) for the columns ['local', 'new']; give 2"]
    # and the report agrees: a one-value row of a local / new / external table is no Avg-only row there
    import pandas as pd
    import pytest

    from fedsilo.report import ReportError
    from fedsilo.report.versus import versus_paper

    ours = pd.concat({"mean": pd.DataFrame({"local": [90.0], "new": [60.0]}, index=["a"])}, axis=1)
    with pytest.raises(ReportError, match=r"methods\.a\.mean has 1 values for 2 columns"):
        versus_paper(ours, {"domains": ["local", "new"], "methods": {"a": {"mean": [61.0]}}}, avg=False)
    # one rule: check-params passes a row's width exactly where the report stage takes it
    for avg, cols in ((False, ["local", "new"]), (True, ["d1", "d2"])):
        frame = pd.concat({"mean": pd.DataFrame({c: [50.0] for c in cols + (["Avg"] if avg else [])}, index=["a"])}, axis=1)
        for n in range(1, 5):
            table = {"domains": cols, "methods": {"a": {"mean": [60.0] * n}}}
            try:
                versus_paper(frame, table, avg=avg)
                taken = True
            except ReportError:
                taken = False
            assert taken == (published_table_problems(table, None) == []) == (n in ((3, 1) if avg else (2,))), (avg, n)
    by_folder = {"domains": ["site_a"], "methods": {"a": {"mean": [1.0]}, "b": {"param_MB": 3.0}}}
    assert published_table_problems(by_folder, None) == []
    assert published_table_problems({"domains": "photo", "methods": {}}, None)[0].startswith("domains: give the table's columns as a list")
    seen = 0
    for paper in ("pfeddb", "f2dc", "cd2pfed", "fedecouple", "pfeddil"):
        for scale in ("quickstart", "paper"):
            p = paper_params(paper, scale, check=False)
            for e, ex in p.experiments.items():
                table = load_published_entries(PUBLISHED.parents[2], ex.published)["accuracy"] if ex.published else None
                if table is not None:
                    assert published_table_problems(table, dataset_domains(p, ex.dataset)) == [], (paper, scale, e)
                    seen += 1
    assert seen > 40


def test_every_row_of_a_published_table_is_checked_whatever_comes_before_it():
    """A row of other numbers (no mean: pFedDB's Param rows) does not end the check of the rows after it; a std given
    as one number instead of a list is named; rows given as a list instead of a mapping are named, not a crash."""
    from fedsilo.report.versus import published_table_problems

    table = {"domains": ["A", "B"], "methods": {"params_only": {"param_MB": 3.0}, "a": {"mean": [1.0, 2.0]},
                                                "b": {"mean": [1.0, 2.0, 1.5], "std": 0.5}}}
    assert published_table_problems(table, ["A", "B"]) == [
        "methods.a.mean: 2 value(s) for the columns ['A', 'B']; give 3 (each column, then the Avg) or 1 (the Avg alone)",
        "methods.b.std: 1 value(s) for 3 means"]
    assert published_table_problems({"domains": ["A"], "methods": [{"a": {"mean": [1.0, 1.0]}}]}, None) == [
        "methods: give the paper's rows as a mapping method -> {mean: [...], std: [...]}"]
