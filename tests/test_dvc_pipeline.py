"""`dvc repro` on a copy of the repository, then a params edit reruns only what depends on it."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, add_benchmarks, small_params

pytestmark = pytest.mark.skipif(shutil.which("dvc", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")) is None, reason="dvc not installed")


def _run(cwd, *cmd):
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
    env.pop("MLFLOW_TRACKING_URI", None)
    if (Path(cwd) / "src" / "fedsilo").is_dir():  # the copy's code runs, as `pip install -e .` there would make it
        env["PYTHONPATH"] = os.pathsep.join([str(Path(cwd) / "src"), *filter(None, [env.get("PYTHONPATH")])])
    r = subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{cmd}: {r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory):
    dest = tmp_path_factory.mktemp("repo")
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    # the root's pipeline and pFedDB's quickstart beside it (the paper_repo tests): the other papers' dvc.yaml files add
    # thousands of stages that every `dvc repro` loads (~8 s a command here), and their stages resolve in
    # test_every_run_group_of_the_papers_pipelines_resolves_to_its_train_stages, on the repository itself
    files = [f for f in files if not f.startswith("pipelines/") or (f.startswith("pipelines/pfeddb/") and "/paper/" not in f)]
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, dest / f)
    raw = add_benchmarks(small_params(rounds=1))
    raw["pipeline"]["methods"] = ["fedprox", "fedbn"]  # two train stages: an edit of one leaves the other up to date
    # Digits-Five on two of its domains (its five sources' reading is test_benchmarks'): three fetch stages fewer
    raw["datasets"]["digits5"]["sources"] = ["mnist", "usps"]
    raw["pipeline"]["sources"] = [s for s in raw["pipeline"]["sources"] if s not in ("svhn", "synthdigits", "mnist_m")]
    raw["tracking"] = {"enabled": True, "uri": "sqlite:///mlflow.db"}
    # a hospital's own export (reader: cxr_table) as a dataset of its own, split but not trained
    raw["sources"]["st_marys"] = {"mode": "mirror", "reader": "cxr_table", "mirror": {"patients": 24, "image_px": 64}}
    raw["datasets"]["cxr_sites"] = {"kind": "chest_xray4", "sources": ["st_marys"], "image_size": 16, "workers": 1,
                                    "tables": {"st_marys": {"domain": "St Marys"}}}
    raw["experiments"]["sites_split"] = {"dataset": "cxr_sites", "split": {"protocol": "domain_clients", "n_train": 8, "n_test": 6}}
    raw["pipeline"]["sources"].append("st_marys")
    raw["pipeline"]["datasets"].append("cxr_sites")
    raw["pipeline"]["splits"]["sites_split"] = "cxr_sites"
    (dest / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    _run(dest, "git", "init", "-q")
    _run(dest, "git", "add", "-A")
    _run(dest, "git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "copy")
    _run(dest, "dvc", "repro")
    return dest


def _stale(repo, dvcfile: str = "dvc.yaml") -> set[str]:
    """Stages of one pipeline file that are out of date (`dvc status` alone would list every dvc.yaml of the repo)."""
    return set(json.loads(_run(repo, "dvc", "status", dvcfile, "--json") or "{}"))


def test_repro_writes_report_and_mlflow_runs(repo_copy):
    report = repo_copy / "results" / "report" / "quick"
    table = (report / "quick_accuracy.md").read_text()
    for m in ("fedprox", "fedbn"):
        assert f"| {m} |" in table
    assert "| method | CheXpert | OpenI | RSNA | VinBigData | Avg |" in table
    assert (report / "quick_curves.png").stat().st_size > 1000
    assert (report / "quick_accuracy.csv").exists() and (report / "quick_accuracy.tex").exists()
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{repo_copy / 'mlflow.db'}")
    runs = c.search_runs([c.get_experiment_by_name("quick").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["fedbn-seed0", "fedprox-seed0"]
    # the report names the MLflow run behind each row (the same name is reused when a run is trained again)
    with open(report / "quick_runs.csv") as fh:
        behind = {(row["method"], row["mlflow_experiment"], row["mlflow_run_id"], row["params_hash"]) for row in csv.DictReader(fh)}
    assert behind == {(r.info.run_name.split("-seed")[0], "quick", r.info.run_id, r.data.tags["params_hash"]) for r in runs}
    assert "quick: the runs behind these tables" in (report / "README.md").read_text()
    for r in runs:
        assert r.data.tags["dvc.md5.data/harmonized/chest_xray4"].endswith(".dir")
        assert r.data.tags["data.source.rsna"] == "mirror: offline mirror (seed 0)"  # which copy, beside the hashes
        assert len(r.data.tags["git_commit"]) == 40
    assert _stale(repo_copy) == set()


def test_repro_builds_all_five_harmonized_datasets_and_every_protocols_split(repo_copy):
    for d in ("chest_xray4", "digits5", "office_caltech10", "pacs", "domainnet10"):
        card = json.loads((repo_copy / "data" / "harmonized" / d / "card.json").read_text())
        assert card["total_images"] > 0 and (repo_copy / "data" / "harmonized" / d / "card.md").exists()
    protocols = {}
    for e in ("quick", "digits_dc", "office_multi", "pacs_skew", "dn_incremental", "cxr_holdout"):
        protocols[e] = json.loads((repo_copy / "data" / "splits" / f"{e}.json").read_text())["protocol"]
    assert sorted(set(protocols.values())) == ["domain_clients", "domain_incremental", "domain_multi_clients", "holdout_domain", "label_skew"]
    for src in ("mnist", "domainnet"):
        manifest = json.loads((repo_copy / "data" / "raw" / src / "fedsilo_manifest.json").read_text())
        assert manifest["mode"] == "mirror" and manifest["files"]


def test_split_param_edit_reruns_only_that_split(repo_copy):
    params = repo_copy / "params.yaml"
    original = params.read_text()
    try:
        raw = yaml.safe_load(original)
        raw["experiments"]["pacs_skew"]["split"]["beta"] = 0.1
        params.write_text(yaml.safe_dump(raw, sort_keys=False))
        # check_params reruns on any edit (its output stays the same when the file holds: nothing else reruns for it)
        assert _stale(repo_copy) == {"check_params", "split@pacs_skew"}
        raw["datasets"]["pacs"]["image_size"] = 20
        params.write_text(yaml.safe_dump(raw, sort_keys=False))
        # PACS's fingerprint is rewritten (seconds; it reads the dataset's source list) with the same content;
        # CXR's harmonize, split and training are untouched
        assert _stale(repo_copy) == {"check_params", "fingerprint@pacs", "harmonize@pacs", "split@pacs_skew"}
    finally:
        params.write_text(original)
    assert _stale(repo_copy) == set()


def test_method_param_edit_reruns_only_that_method_and_the_report(repo_copy):
    params = repo_copy / "params.yaml"
    original = params.read_text()
    try:
        raw = yaml.safe_load(original)
        raw["methods"]["fedprox"]["mu"] = 0.5
        params.write_text(yaml.safe_dump(raw, sort_keys=False))
        # code_fingerprint reads the methods' keys: it reruns (seconds), fedbn's code file comes out the same
        assert _stale(repo_copy) == {"check_params", "code_fingerprint", "train@quick-fedprox-0", "report@quick"}
        raw["experiments"]["quick"]["train"]["lr"] = 0.05
        params.write_text(yaml.safe_dump(raw, sort_keys=False))
        assert _stale(repo_copy) == {"check_params", "code_fingerprint", "train@quick-fedprox-0", "train@quick-fedbn-0", "report@quick"}
        # the edit beside a typo: `dvc repro` stops at check_params, naming the key, before DVC removes the stale
        # runs' results to rerun them
        raw["methods"]["fedprox"]["muu"] = 0.5
        params.write_text(yaml.safe_dump(raw, sort_keys=False))
        r = subprocess.run(["dvc", "repro"], cwd=repo_copy, capture_output=True, text=True, timeout=900,
                           env={**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")})
        assert r.returncode != 0 and "methods.fedprox.muu" in r.stdout + r.stderr
        assert (repo_copy / "results" / "quick" / "fedprox" / "seed0" / "metrics.json").exists()
        assert (repo_copy / "results" / "quick" / "fedbn" / "seed0" / "metrics.json").exists()
    finally:
        params.write_text(original)
    assert _stale(repo_copy) == set()


# ------------------------------------------------------------------------------------------ a paper's own pipeline
PFEDDB = "pipelines/pfeddb/dvc.yaml"


def _tiny_pfeddb(repo) -> dict:
    """pipelines/pfeddb/params.yaml cut down to tiny runs on the copy's root datasets: FedProx on one experiment,
    pFedDB (two phases) with onboarding on the other; the other groups stay, empty (a stage group with no run:
    every group's stages resolve for the shipped params in test_every_run_group_of_the_papers_pipelines_resolves_...,
    and each train stage is one command line, so trained here once stands for all)."""
    raw = yaml.safe_load((repo / "pipelines" / "pfeddb" / "params.yaml").read_text())
    train = {"model": "simple_cnn", "model_width": 0.25, "rounds": 2, "batch_size": 16, "lr": 0.02, "device": "cpu", "count_flops": False}
    raw["experiments"] = {
        "pq_cxr": {"dataset": "chest_xray4", "split": {"protocol": "domain_clients", "n_train": 16, "n_test": 8}, "train": train},
        "pq_hold": {"dataset": "chest_xray4", "split": {"protocol": "holdout_domain", "holdout": "OpenI", "n_train": 16, "n_test": 8},
                    "train": train, "onboarding": {"pretrain_rounds": 1, "rounds": 1}},
    }
    raw["runs"] = {
        "tables_1_2": {"experiments": ["pq_cxr"], "methods": ["fedprox"]},
        "tables_1_2_pfeddr": {"experiments": ["pq_cxr"], "methods": []},
        "tables_1_2_pfeddr_domainnet": {"experiments": ["pq_cxr"], "methods": []},
        "table3_office": {"experiments": ["pq_cxr"], "methods": []},
        "table3_cxr4": {"experiments": ["pq_cxr"], "methods": []},
        "table4": {"experiments": ["pq_cxr"], "methods": []},
        "table5": {"experiments": ["pq_cxr"], "methods": []},
        "fig5": {"experiments": ["pq_cxr"], "methods": []},
        "fig6": {"experiments": ["pq_hold"], "methods": ["pfeddb"]},
    }
    raw["onboarding"] = ["pq_hold"]
    raw["methods"]["pfeddb"]["local_rounds"] = 1  # the only two-phase method trained here
    return raw


@pytest.fixture(scope="module")
def paper_repo(repo_copy):
    params = repo_copy / "pipelines" / "pfeddb" / "params.yaml"
    params.write_text(yaml.safe_dump(_tiny_pfeddb(repo_copy), sort_keys=False))
    _run(repo_copy, "dvc", "repro", PFEDDB)
    return repo_copy


def test_a_papers_pipeline_runs_beside_the_root_and_reuses_its_data(paper_repo):
    ns = paper_repo / "results" / "pfeddb" / "quickstart"
    for run in ("pq_cxr/fedprox", "pq_hold/pfeddb"):
        assert (ns / run / "seed0" / "metrics.json").exists(), run
    assert not (ns / "pq_hold" / "fedprox").exists()  # only the runs its groups list, not a cross product
    assert (ns / "pq_hold" / "onboarding" / "seed0" / "onboarding.json").exists()
    assert "| fedprox |" in (ns / "report" / "pq_cxr" / "pq_cxr_accuracy.md").read_text()
    assert (paper_repo / "data" / "splits" / "pfeddb" / "quickstart" / "pq_cxr.json").exists()
    # the root's results stay in place, and both pipelines are up to date
    assert (paper_repo / "results" / "quick" / "fedprox" / "seed0" / "metrics.json").exists()
    assert _stale(paper_repo) == set() and _stale(paper_repo, PFEDDB) == set()
    # one data copy: the paper's split indexes the root's harmonized arrays
    split = json.loads((paper_repo / "data" / "splits" / "pfeddb" / "quickstart" / "pq_cxr.json").read_text())
    card = json.loads((paper_repo / "data" / "harmonized" / "chest_xray4" / "card.json").read_text())
    assert split["data_sha256"] == card["sha256"]
    assert not list((paper_repo / "data").glob("**/pfeddb/**/images.npy"))
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{paper_repo / 'mlflow.db'}")
    runs = c.search_runs([c.get_experiment_by_name("pfeddb/quickstart/pq_cxr").experiment_id])
    assert "fedprox-seed0" in {r.info.run_name for r in runs}


def test_every_run_group_of_the_papers_pipelines_resolves_to_its_train_stages():
    """The shipped params of both scales give every runs group of a paper's dvc.yaml its train stages (one per
    experiment x method x seed), which the pipeline tests above train only a few of (one `dvc stage list` of the
    ten files: a DVC process each cost seconds)."""
    files = [f"pipelines/{paper}/{scale}dvc.yaml" for paper in ("pfeddb", "f2dc", "fedecouple", "cd2pfed", "pfeddil")
             for scale in ("", "paper/")]
    listed = _run(REPO, "dvc", "stage", "list", *files, "--name-only").split()
    for f in files:
        params = yaml.safe_load((REPO / f.replace("dvc.yaml", "params.yaml")).read_text())
        mine = [n.rpartition(":")[2] for n in listed if n.rpartition(":")[0] == f]
        assert mine, f
        for group, runs in params["runs"].items():
            want = len(runs["experiments"]) * len(runs["methods"]) * len(params["seeds"])
            got = [n for n in mine if n.startswith(f"train_{group}@")]
            assert want and len(got) == want, (f, group, want, len(got))


def test_a_method_edit_in_a_papers_params_reruns_only_its_runs_and_that_papers_report(paper_repo):
    params = paper_repo / "pipelines" / "pfeddb" / "params.yaml"
    original = params.read_text()
    try:
        raw = yaml.safe_load(original)
        raw["methods"]["fedprox"]["mu"] = 0.5
        params.write_text(yaml.safe_dump(raw, sort_keys=False))
        assert _stale(paper_repo, PFEDDB) == {
            f"{PFEDDB}:check_params", f"{PFEDDB}:code_fingerprint", f"{PFEDDB}:train_tables_1_2@pq_cxr-fedprox-0", f"{PFEDDB}:report@pq_cxr",
            f"{PFEDDB}:report@pq_hold"
        }
        assert _stale(paper_repo) == set()  # the root pipeline is untouched
    finally:
        params.write_text(original)
    assert _stale(paper_repo, PFEDDB) == set()


def test_a_paper_of_ones_own_from_new_paper_runs_as_the_shipped_ones_do(repo_copy):
    """`fedsilo new-paper` writes a pipeline folder that `dvc repro` runs as it is, beside the root's (its split and
    runs from the root's data, its report); a run group then added to its params alone stops the repro at
    check_params, naming the missing stage, with the report kept."""
    _run(repo_copy, "fedsilo", "new-paper", "mine", "--experiment", "quick", "--methods", "fedavg,fedbn", "--title", "Mine (2026)")
    mine = "pipelines/mine/dvc.yaml"
    _run(repo_copy, "dvc", "repro", mine)
    ns = repo_copy / "results" / "mine" / "quickstart"
    for m in ("fedavg", "fedbn"):
        assert (ns / "mine_quick" / m / "seed0" / "metrics.json").exists(), m
    assert "| fedbn |" in (ns / "report" / "mine_quick" / "mine_quick_accuracy.md").read_text()
    assert _stale(repo_copy, mine) == set() and _stale(repo_copy) == set()
    params = repo_copy / "pipelines" / "mine" / "params.yaml"
    original = params.read_text()
    try:
        raw = yaml.safe_load(original)
        raw["methods"]["fedprox"] = {"mu": 0.1}
        raw["runs"]["ablation"] = {"experiments": ["mine_quick"], "methods": ["fedprox"]}
        params.write_text(yaml.safe_dump(raw, sort_keys=False))
        r = subprocess.run(["dvc", "repro", mine], cwd=repo_copy, capture_output=True, text=True, timeout=900,
                           env={**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")})
        assert r.returncode != 0 and "runs.ablation: pipelines/mine/dvc.yaml has no train_ablation stage" in r.stdout + r.stderr
        assert (ns / "report" / "mine_quick" / "mine_quick_accuracy.md").exists()
    finally:
        params.write_text(original)


def test_a_hospitals_table_rules_reharmonize_its_dataset_and_its_folder_refetches(repo_copy):
    """A label-table rule is a harmonize param: editing it leaves the export's fetch alone and makes only that
    dataset's fingerprint and harmonize stale; editing the source (its path; here its mirror) re-fetches it."""
    params = repo_copy / "params.yaml"
    original = params.read_text()
    card = json.loads((repo_copy / "data" / "harmonized" / "cxr_sites" / "card.json").read_text())
    assert card["domains"]["St Marys"]["images"] > 0 and card["rules"]["tables"]["st_marys"]["domain"] == "St Marys"
    try:
        raw = yaml.safe_load(original)
        raw["datasets"]["cxr_sites"]["tables"]["st_marys"]["negative"] = ["Normal"]
        params.write_text(yaml.safe_dump(raw, sort_keys=False))
        assert _stale(repo_copy) == {"check_params", "fingerprint@cxr_sites", "harmonize@cxr_sites"}
        raw = yaml.safe_load(original)
        raw["sources"]["st_marys"]["mirror"]["seed"] = 5
        params.write_text(yaml.safe_dump(raw, sort_keys=False))
        assert _stale(repo_copy) == {"check_params", "fetch@st_marys"}
    finally:
        params.write_text(original)
    assert _stale(repo_copy) == set()


def test_a_method_added_to_the_code_retrains_no_other_method(repo_copy):
    """A researcher's new method module: the code stage reruns (every method's code file is rewritten) and no train
    stage does, the methods' files coming out the same (each covers the modules its method imports; tests/
    test_code_reaches_results.py checks that an edit of one method's module changes that method's file only)."""
    (repo_copy / "src" / "fedsilo" / "methods" / "fedavgm.py").write_text('"""FedAvgM, not yet registered."""\n')
    assert _stale(repo_copy) == {"code_fingerprint"}
    out = _run(repo_copy, "dvc", "repro", "dvc.yaml")
    ran = {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")}
    assert ran == {"code_fingerprint"}, ran
    assert _stale(repo_copy) == set()


def test_bytecode_beside_the_package_reruns_nothing(repo_copy):
    """Python writes __pycache__/ beside the modules it imports (a test run, `fedsilo` without
    PYTHONDONTWRITEBYTECODE): the harmonize stages depend on src/fedsilo/data/ and the code stage on the package's
    folders, yet no stage reruns for it (.dvcignore)."""
    before = _stale(repo_copy)
    assert before == set()  # up to date first: the assertion below could not fail otherwise
    made = []
    for sub in ("data", "methods", "fl", "client"):
        cache = repo_copy / "src" / "fedsilo" / sub / "__pycache__"
        cache.mkdir(exist_ok=True)
        made.append(cache)
        (cache / "x.cpython-311.pyc").write_bytes(b"bytecode")
    (repo_copy / "src" / "fedsilo" / "data" / "stray.pyc").write_bytes(b"bytecode")
    try:
        assert _stale(repo_copy) == before
    finally:
        for cache in made:
            shutil.rmtree(cache)
        (repo_copy / "src" / "fedsilo" / "data" / "stray.pyc").unlink()


def test_refetching_one_source_reharmonizes_only_the_datasets_built_on_it(repo_copy):
    """Issue 17.3: changing PACS's source (here its mirror's seed; a user changes its path) re-fetches PACS and
    re-harmonizes PACS only: the other datasets' fingerprints are rewritten unchanged, so their harmonize stages
    (and their splits and runs) stay as they are. The last test of the module: it leaves PACS re-fetched."""
    params = repo_copy / "params.yaml"

    def lock() -> dict:
        return yaml.safe_load((repo_copy / "dvc.lock").read_text())["stages"]

    before = lock()
    raw = yaml.safe_load(params.read_text())
    raw["sources"]["pacs"]["mirror"]["seed"] = 7
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert _stale(repo_copy) == {"check_params", "fetch@pacs"}
    out = _run(repo_copy, "dvc", "repro", "harmonize@chest_xray4", "harmonize@digits5", "harmonize@pacs")
    ran = {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")}
    assert {"fetch@pacs", "fingerprint@chest_xray4", "harmonize@pacs"} <= ran
    assert "harmonize@chest_xray4" not in ran and "harmonize@digits5" not in ran, ran
    after = lock()
    for d in ("chest_xray4", "digits5"):
        assert after[f"harmonize@{d}"] == before[f"harmonize@{d}"]
        assert after[f"fingerprint@{d}"]["outs"] == before[f"fingerprint@{d}"]["outs"]
    assert after["harmonize@pacs"]["outs"] != before["harmonize@pacs"]["outs"]
