"""`fedsilo new-paper`: a paper's pipeline folder of one's own (its `dvc repro` is tests/test_dvc_pipeline's)."""

from __future__ import annotations

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
    assert main([*args, "mine", "--experiment", "digits5_domains", "--methods", "fedavg,fedprox,ditto", "--title", "Mine (2026)"]) == 0
    folder = tmp_path / "pipelines" / "mine"
    assert sorted(p.name for p in folder.iterdir()) == ["dvc.yaml", "params.yaml", "published.yaml"]
    assert "dvc repro pipelines/mine/dvc.yaml" in capsys.readouterr().out
    raw = yaml.safe_load((folder / "params.yaml").read_text())
    root = yaml.safe_load((REPO / "params.yaml").read_text())
    assert (raw["paper"], raw["params_file"], raw["data"], raw["seeds"]) == ("mine", "pipelines/mine/params.yaml", "params.yaml", root["pipeline"]["seeds"])
    assert raw["experiments"] == {"mine_digits5_domains": root["experiments"]["digits5_domains"]}
    assert raw["methods"] == {"fedavg": root["methods"]["fedavg"] or {}, "fedprox": root["methods"]["fedprox"], "ditto": {}}
    assert raw["runs"] == {"table1": {"experiments": ["mine_digits5_domains"], "methods": ["fedavg", "fedprox", "ditto"]}}
    assert (folder / "params.yaml").read_text().startswith("# Mine (2026): a paper's pipeline")
    assert yaml.safe_load((folder / "published.yaml").read_text()) == {"accuracy": {}}
    capsys.readouterr()
    assert main(["--root", str(tmp_path), "--params", str(folder / "params.yaml"), "check-params"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["Mine", "--experiment", "digits5_domains", "--methods", "fedavg"], "'Mine' is no paper name"),
    (["taken", "--experiment", "digits5_domains", "--methods", "fedavg"], "pipelines/taken exists"),
    (["mine", "--experiment", "digits5_domain", "--methods", "fedavg"], "--experiment: 'digits5_domain' is not under experiments in"),
    (["mine", "--experiment", "unbuilt", "--methods", "fedavg"], "its dataset 'cifar10_32' is not in pipeline.datasets"),
    (["mine", "--experiment", "digits5_domains", "--methods", "fedavg,fedprx"], "--methods: 'fedprx' is no registered method (did you mean 'fedprox'?)"),
    (["mine", "--experiment", "digits5_domains", "--methods", "fedavg,fedavg"], "names a method twice"),
])
def test_new_paper_refuses_by_name_and_writes_nothing(tmp_path, capsys, argv, said):
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["experiments"]["unbuilt"] = {"dataset": "cifar10_32", "split": {"protocol": "label_skew", "scheme": "pathological",
                                                                        "clients": 4, "classes_per_client": 2}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    (tmp_path / "pipelines" / "taken").mkdir(parents=True)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["--root", str(tmp_path), "--params", str(tmp_path / "params.yaml"), "new-paper", *argv]) == 2
    assert said in capsys.readouterr().err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_new_paper_takes_the_root_params_not_a_papers(tmp_path, capsys):
    assert main(["--params", str(REPO / "pipelines/f2dc/params.yaml"), "--root", str(REPO), "new-paper", "mine",
                 "--experiment", "f2dc_pacs", "--methods", "fedavg"]) == 2
    assert "a paper's params file; new-paper takes the root's" in capsys.readouterr().err
