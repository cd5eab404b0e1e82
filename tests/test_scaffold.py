"""`fedsilo new-paper`: a paper's pipeline folder of one's own (its `dvc repro` is tests/test_dvc_pipeline's)."""

from __future__ import annotations

import copy
import shutil

import pytest
import yaml

from fedsilo.cli import main
from fedsilo.scaffold import DVC_YAML, GROUP
from tests.conftest import REPO

PAPERS = ("pfeddb", "f2dc", "cd2pfed", "fedecouple", "pfeddil")


def test_its_stages_are_every_shipped_papers():
    """The stages new-paper writes are those of each shipped paper's dvc.yaml at both scales (their check_params,
    code_fingerprint, split and report stages, and the deps, params and outs of their train stages): a stage edited in
    one is edited in all, or this fails."""
    ours = yaml.safe_load(DVC_YAML.format(title="t", name="n", group=GROUP))["stages"]
    train = {k: v for k, v in ours.pop(f"train_{GROUP}").items() if k != "matrix"}
    for paper in PAPERS:
        for scale in ("", "paper/"):
            f = f"pipelines/{paper}/{scale}dvc.yaml"
            theirs = yaml.safe_load((REPO / f).read_text())["stages"]
            for name, stage in ours.items():
                assert theirs[name] == stage, (f, name)
            trains = [v for k, v in theirs.items() if k.startswith("train_")]
            assert trains and all({k: v for k, v in t.items() if k != "matrix"} == train for t in trains), f


def test_new_paper_writes_a_pipeline_check_params_accepts(tmp_path, capsys):
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    args = ["--root", str(tmp_path), "--params", str(tmp_path / "params.yaml"), "new-paper"]
    root = yaml.safe_load((REPO / "params.yaml").read_text())
    root["tracking"] = {"enabled": True, "uri": "http://mlflow.lab:5000"}  # the root's store is the paper's
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(root, sort_keys=False))
    assert main([*args, "mine", "--experiment", "digits5_domains", "--methods", "fedavg, fedprox,ditto", "--title", "Mine (2026)"]) == 0
    folder = tmp_path / "pipelines" / "mine"
    assert sorted(p.name for p in folder.iterdir()) == ["dvc.yaml", "params.yaml", "published.yaml"]
    assert "dvc repro pipelines/mine/dvc.yaml" in capsys.readouterr().out
    raw = yaml.safe_load((folder / "params.yaml").read_text())
    assert raw["tracking"] == {"enabled": True, "uri": "http://mlflow.lab:5000"}
    assert (raw["paper"], raw["params_file"], raw["data"], raw["seeds"]) == ("mine", "pipelines/mine/params.yaml", "params.yaml", root["pipeline"]["seeds"])
    assert raw["experiments"] == {"mine_digits5_domains": root["experiments"]["digits5_domains"]}
    assert raw["methods"] == {"fedavg": root["methods"]["fedavg"] or {}, "fedprox": root["methods"]["fedprox"], "ditto": {}}
    assert raw["runs"] == {"table1": {"experiments": ["mine_digits5_domains"], "methods": ["fedavg", "fedprox", "ditto"]}}
    assert (folder / "params.yaml").read_text().startswith("# Mine (2026): a paper's pipeline")
    assert yaml.safe_load((folder / "published.yaml").read_text()) == {"accuracy": {}}
    capsys.readouterr()
    assert main(["--root", str(tmp_path), "--params", str(folder / "params.yaml"), "check-params"]) == 0, capsys.readouterr().err
    # a paper renamed by hand after a root experiment is refused by the pipeline too (its results/<name>/ is the root's)
    (folder / "params.yaml").write_text((folder / "params.yaml").read_text().replace("paper: mine", "paper: cxr4_quickstart"))
    assert main(["--root", str(tmp_path), "--params", str(folder / "params.yaml"), "check-params"]) == 2
    assert "paper: 'cxr4_quickstart' is an experiment of params.yaml: its results/cxr4_quickstart/" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["Mine", "--experiment", "digits5_domains", "--methods", "fedavg"], "'Mine' is no paper name (did you mean 'mine'?)"),
    # a root experiment's name: the paper's results/<name>/ would be that experiment's, its report depending on them
    (["cxr4_quickstart", "--experiment", "digits5_domains", "--methods", "fedavg"],
     "'cxr4_quickstart' is an experiment of"),
    (["deploy", "--experiment", "digits5_domains", "--methods", "fedavg"], "paper: 'deploy' names a folder of the root pipeline's"),
    # a title that would end the files' comment line and break the YAML DVC reads
    (["mine", "--experiment", "digits5_domains", "--methods", "fedavg", "--title", "Mine (2026)\nseeds: [7]"],
     "--title: one line of printable text"),
    (["mine", "--experiment", "digits5_domains", "--methods", "fedavg", "--title", "Mine (2026)\u2028seeds: [7]"],
     "--title: one line of printable text"),
    (["taken", "--experiment", "digits5_domains", "--methods", "fedavg"], "pipelines/taken exists"),
    (["mine", "--experiment", "digits5_domain", "--methods", "fedavg"], "--experiment: 'digits5_domain' is not under experiments in"),
    (["mine", "--experiment", "unbuilt", "--methods", "fedavg"], "its dataset 'cifar10_32' is not in pipeline.datasets"),
    (["mine", "--experiment", "digits5_domains", "--methods", "fedavg,fedprx"], "--methods: 'fedprx' is no registered method (did you mean 'fedprox'?)"),
    (["mine", "--experiment", "digits5_domains", "--methods", "fedavg,fedavg"], "names a method twice"),
    # what check-params would refuse is refused before anything is written
    (["methods", "--experiment", "digits5_domains", "--methods", "fedavg"],
     "pipelines/methods/params.yaml: paper: 'methods' names a folder of the root pipeline's"),
    (["report", "--experiment", "digits5_domains", "--methods", "fedavg"], "paper: 'report' names a folder of the root pipeline's"),
    (["selected", "--experiment", "digits5_domains", "--methods", "fedavg"], "paper: 'selected' names a folder of the root pipeline's"),
    (["mine", "--experiment", "digits5_domains", "--methods", "fedavg,pfeddil"],
     "pipelines/mine/params.yaml: methods.pfeddil: pfeddil learns a stream of domain tasks only"),
])
def test_new_paper_refuses_by_name_and_writes_nothing(tmp_path, capsys, argv, said):
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["experiments"]["unbuilt"] = {"dataset": "cifar10_32", "split": {"protocol": "label_skew", "scheme": "pathological",
                                                                        "clients": 4, "classes_per_client": 2}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    (tmp_path / "pipelines" / "taken").mkdir(parents=True)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["--root", str(tmp_path), "--params", str(tmp_path / "params.yaml"), "new-paper", *argv]) == 2
    err = capsys.readouterr().err
    assert said in err, err
    assert "error: new-paper:" not in err  # the command is named once
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_new_paper_leaves_the_roots_published_table_out(tmp_path, capsys):
    """The root experiment's published table is the root's comparison, not the new paper's."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["experiments"]["digits5_domains"]["published"] = "published.yaml#digits"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    assert main(["--root", str(tmp_path), "--params", str(tmp_path / "params.yaml"), "new-paper", "mine",
                 "--experiment", "digits5_domains", "--methods", "fedavg"]) == 0, capsys.readouterr().err
    written = yaml.safe_load((tmp_path / "pipelines" / "mine" / "params.yaml").read_text())
    assert "published" not in written["experiments"]["mine_digits5_domains"]
    assert written["experiments"]["mine_digits5_domains"]["split"] == raw["experiments"]["digits5_domains"]["split"]


def test_new_paper_that_fails_while_writing_leaves_no_folder(tmp_path, monkeypatch):
    """Whole or nothing: a write that fails after params.yaml and dvc.yaml (a full disk) leaves no half a pipeline,
    whose folder would make the next new-paper refuse the name."""
    import fedsilo.scaffold as scaffold
    from fedsilo.config import load_params

    class FullDisk(str):
        def format(self, *a, **k):
            raise OSError(28, "No space left on device")

    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.setattr(scaffold, "PUBLISHED_YAML", FullDisk(scaffold.PUBLISHED_YAML))
    with pytest.raises(OSError, match="No space left"):
        scaffold.new_paper(load_params(tmp_path / "params.yaml"), tmp_path, "mine", "digits5_domains", ["fedavg"])
    assert not (tmp_path / "pipelines" / "mine").exists()
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [tmp_path / "params.yaml"]  # no temporary copy either


def test_new_paper_takes_the_root_params_not_a_papers(tmp_path, capsys):
    assert main(["--params", str(REPO / "pipelines/f2dc/params.yaml"), "--root", str(REPO), "new-paper", "mine",
                 "--experiment", "f2dc_pacs", "--methods", "fedavg"]) == 2
    assert "a paper's params file; new-paper takes the root's" in capsys.readouterr().err


def test_a_papers_run_groups_and_its_dvc_yaml_must_agree(tmp_path):
    """check-params refuses a run group with no train_<group> stage in the dvc.yaml beside the params file (it would
    train nothing, and the report stage would stop after DVC removed its old output), a train stage whose matrix reads
    another group's runs, an across group without its across stage, and a stage naming no group; the shipped papers
    agree, at both scales."""
    from fedsilo.config import ConfigError, PaperMeta, RunGroup
    from fedsilo.scaffold import check_paper_stages
    from tests.conftest import paper_params

    for paper in ("pfeddb", "f2dc", "cd2pfed", "fedecouple", "pfeddil"):
        for scale in ("quickstart", "paper"):
            shipped_p = paper_params(paper, scale, check=False)
            check_paper_stages(shipped_p, shipped_p.paper.params_file, REPO)
    p = paper_params("cd2pfed", "quickstart", check=False)
    dvc = tmp_path / "pipelines" / "cd2pfed" / "dvc.yaml"
    dvc.parent.mkdir(parents=True)
    shipped = yaml.safe_load((REPO / "pipelines" / "cd2pfed" / "dvc.yaml").read_text())
    where = "pipelines/cd2pfed/params.yaml"

    def check(stages: dict, runs: dict | None = None) -> None:
        dvc.write_text(yaml.safe_dump({**shipped, "stages": stages}))
        meta = p.paper
        if runs is not None:
            p._paper = PaperMeta(name=meta.name, scale=meta.scale, params_file=meta.params_file, runs=runs)
        try:
            check_paper_stages(p, where, tmp_path)
        finally:
            p._paper = meta

    check(shipped["stages"])  # as shipped
    runs = dict(p.paper.runs)
    with pytest.raises(ConfigError, match=r"runs\.extra: pipelines/cd2pfed/dvc\.yaml has no train_extra stage, so its runs would never train"):
        check(shipped["stages"], {**runs, "extra": RunGroup(experiments=runs["table4"].experiments, methods=("fedavg",))})
    check(shipped["stages"], {**runs, "nothing": RunGroup(experiments=runs["table4"].experiments, methods=())})  # trains nothing
    crossed = copy.deepcopy(shipped["stages"])
    crossed["train_table5"]["matrix"]["method"] = "${runs.table4.methods}"
    with pytest.raises(ConfigError, match=r"stage train_table5's matrix\.method is '\$\{runs\.table4\.methods\}', not '\$\{runs\.table5\.methods\}'"):
        check(crossed)
    with pytest.raises(ConfigError, match=r"runs\.fig5\.across: pipelines/cd2pfed/dvc\.yaml has no across_fig5 stage"):
        check({k: v for k, v in shipped["stages"].items() if k != "across_fig5"})
    ghost = {**shipped["stages"], "train_tabel4": shipped["stages"]["train_table4"]}
    with pytest.raises(ConfigError, match=r"stage train_tabel4: no run group 'tabel4' under runs \(did you mean 'table4'\?\)"):
        check(ghost)
    with pytest.raises(ConfigError, match=r"stage across_table4: runs\.table4 has no across: true"):
        check({**shipped["stages"], "across_table4": shipped["stages"]["across_fig5"]})
    dvc.unlink()  # a params file run by hand, with no dvc.yaml beside it: nothing to agree with
    check_paper_stages(p, where, tmp_path)


@pytest.mark.parametrize("name, said", [
    ("My-Paper", "'My-Paper' is no paper name (did you mean 'my_paper'?)"),  # the near name is a slug: suggested
    ("_mine", "'_mine' is no paper name: lower-case letters"),  # no slug near it: no suggestion
    ("groups", "paper: 'groups' names a folder of the root pipeline's"),  # results/groups/: the root's run groups
    ("across", "paper: 'across' names a folder of the root pipeline's"),  # results/across/
])
def test_new_paper_suggests_only_a_valid_name_and_keeps_off_every_root_folder(tmp_path, capsys, name, said):
    """new-paper's name refusal suggests the name with its other characters made `_` only where that is a paper
    name; the root's results/groups/ and results/across/ are refused as paper names like results/report/."""
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    assert main(["--root", str(tmp_path), "--params", str(tmp_path / "params.yaml"), "new-paper", name, "--experiment",
                 "digits5_domains", "--methods", "fedavg"]) == 2
    err = capsys.readouterr().err
    assert said in err and (name != "_mine" or "did you mean" not in err), err
    assert not (tmp_path / "pipelines").exists()
