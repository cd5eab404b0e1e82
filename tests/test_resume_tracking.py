"""A train stage killed mid-run resumes to the same numbers; MLflow gets one run per (method, seed) with its tags."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from tests.conftest import small_params


def _project(mirror_root, dest, tracking: bool):
    (dest / "data").mkdir(parents=True)
    shutil.copytree(mirror_root / "data" / "harmonized", dest / "data" / "harmonized")
    # a checkpoint after every round (not auto's timed schedule): the tests interrupt the run after a given round
    raw = small_params(rounds=6, local_epochs=1, checkpoint_every=1)
    raw["tracking"] = {"enabled": tracking, "uri": f"sqlite:///{dest / 'mlflow.db'}"}
    (dest / "params.yaml").write_text(yaml.safe_dump(raw))
    _main(dest, "split", "--experiment", "quick")
    return dest


def _cli(root, *args, wait=True):
    cmd = [sys.executable, "-m", "fedsilo.cli", "--root", str(root), "--params", str(root / "params.yaml"), *args]
    env = {**os.environ, "MLFLOW_TRACKING_URI": ""}
    env.pop("MLFLOW_TRACKING_URI")
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return r


def _main(root, *args):
    """A command run in this process, as `fedsilo` runs it: the runs that need no process of their own (the
    interpreter, torch and MLflow started anew cost seconds each on two cores); those killed, and the resumed run
    compared with them, go through :func:`_cli`."""
    from fedsilo.cli import main

    saved = os.environ.pop("MLFLOW_TRACKING_URI", None)  # the project's own store, as _cli's environment says
    try:
        assert main(["-q", "--root", str(root), "--params", str(root / "params.yaml"), *args]) == 0
    finally:
        if saved is not None:
            os.environ["MLFLOW_TRACKING_URI"] = saved


TRAIN = ("train", "--experiment", "quick", "--method", "fedbn", "--seed", "0")


def test_killed_train_stage_resumes_to_identical_metrics(mirror_root, tmp_path):
    a = _project(mirror_root, tmp_path / "a", tracking=False)
    b = _project(mirror_root, tmp_path / "b", tracking=True)
    _main(a, *TRAIN)  # the uninterrupted run, here; the killed and resumed one in processes of their own
    ckpt = b / "state" / "quick" / "fedbn" / "seed0" / "checkpoint.pt"
    proc = _cli(b, *TRAIN, wait=False)
    killed_at = None
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if ckpt.exists():
            try:
                rnd = torch.load(ckpt, weights_only=False)["round"]
            except Exception:  # noqa: BLE001 - caught between write and rename on some filesystems
                rnd = 0
            if rnd >= 2:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                killed_at = rnd
                break
        time.sleep(0.05)
    assert killed_at is not None and killed_at < 6, "the run should have been killed mid-way"
    assert not (b / "results" / "quick" / "fedbn" / "seed0").exists()
    resumed_after = torch.load(ckpt, weights_only=False)["round"]  # killed_at, or a round written since it was read
    said = _cli(b, *TRAIN).stderr
    assert f"resuming quick/fedbn/seed0 after round {resumed_after} of 6 (checkpoint {ckpt})" in said, said
    ma = json.loads((a / "results/quick/fedbn/seed0/metrics.json").read_text())
    mb = json.loads((b / "results/quick/fedbn/seed0/metrics.json").read_text())
    assert ma["per_client"] == mb["per_client"] and ma["bytes_up_per_round"] == mb["bytes_up_per_round"]
    ha = json.loads((a / "results/quick/fedbn/seed0/history.json").read_text())
    hb = json.loads((b / "results/quick/fedbn/seed0/history.json").read_text())
    assert [h["eval"] for h in ha] == [h["eval"] for h in hb]

    # the resumed run continued the same MLflow run: one run, FINISHED, a mean_acc point for every round
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{b / 'mlflow.db'}")
    exp = client.get_experiment_by_name("quick")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED" and runs[0].info.run_id == mb["mlflow_run_id"]
    tags = runs[0].data.tags
    for t in ("git_commit", "params_hash", "method", "dataset", "protocol", "data.harmonized.sha256.images", "data.split.sha256"):
        assert tags.get(t), t
    assert tags["method"] == "fedbn" and tags["method.base"] == "fedbn" and tags["protocol"] == "domain_clients" and "paper" not in tags
    # metrics.json alone ties the result to its params, data, code and checkout, as the README's recipe recomputes them
    import hashlib

    def h(x):
        return hashlib.sha256(json.dumps(x, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    assert h(mb["run"]) == mb["params_hash"] == tags["params_hash"]
    assert h({"params": mb["run"], "data": mb["data"], "code": mb["code"]}) == mb["config_hash"] == tags["config_hash"]
    folder = b / "data/harmonized/chest_xray4"
    for name, tag in (("images.npy", "images"), ("records.parquet", "records")):
        sha = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        assert mb["data"]["harmonized_sha256"][name] == sha == tags[f"data.harmonized.sha256.{tag}"]
    split = hashlib.sha256((b / "data/splits/quick.json").read_bytes()).hexdigest()
    assert mb["data"]["split_sha256"] == split == tags["data.split.sha256"]
    assert mb["git"] == {"commit": tags["git_commit"], "dirty": tags["git_dirty"] == "true"}
    from fedsilo.data.fetch import sources_fingerprint

    fingerprints = sources_fingerprint("chest_xray4", tuple(mb["data_sources"]), mirror_root / "data/raw")["sources"]
    assert len(fingerprints) == 4
    for src, how in mb["data_sources"].items():  # each raw source's part of the dataset's fingerprint
        assert how["sha256"] == fingerprints[src]["sha256"] == tags[f"data.source.{src}.sha256"], src
        assert (how["files"], how["bytes"]) == (fingerprints[src]["files"], fingerprints[src]["bytes"])
    steps = sorted({m.step for m in client.get_metric_history(runs[0].info.run_id, "mean_acc")})
    assert steps == list(range(1, 7))
    assert runs[0].data.params["train.rounds"] == "6"
    assert "bytes_up.CheXpert" in runs[0].data.metrics


def test_a_run_refuses_arrays_changed_after_harmonize_or_harmonized_with_other_settings(mirror_root, tmp_path, capsys):
    """A train run by hand on arrays edited after harmonize trained on them and recorded the card's hashes (the config
    hash and MLflow tags of the data it did not read); and on arrays harmonized with other dataset settings than
    params has now, it recorded those settings' data as the card's. Both are refused before anything is written."""
    from fedsilo.cli import main

    a = _project(mirror_root, tmp_path / "a", tracking=False)
    images = a / "data/harmonized/chest_xray4/images.npy"
    kept = images.read_bytes()
    edited = bytearray(kept)
    edited[-1] ^= 0xFF  # one pixel
    images.write_bytes(bytes(edited))
    argv = ["-q", "--root", str(a), "--params", str(a / "params.yaml"), *TRAIN]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "images.npy changed after harmonize wrote card.json" in err and "dvc checkout harmonize@chest_xray4" in err, err
    assert not (a / "results").exists() and not (a / "state").exists()
    images.write_bytes(kept)
    raw = yaml.safe_load((a / "params.yaml").read_text())
    raw["datasets"]["chest_xray4"]["image_size"] = 48
    (a / "params.yaml").write_text(yaml.safe_dump(raw))
    assert main(argv) == 2
    assert "harmonized with other settings than datasets.chest_xray4 has now (image_size" in capsys.readouterr().err
    assert not (a / "results").exists()


def test_changed_config_does_not_resume_a_stale_checkpoint(mirror_root, tmp_path):
    a = _project(mirror_root, tmp_path / "a", tracking=False)
    _main(a, *TRAIN)
    raw = yaml.safe_load((a / "params.yaml").read_text())
    raw["experiments"]["quick"]["train"]["rounds"] = 2
    (a / "params.yaml").write_text(yaml.safe_dump(raw))
    _main(a, *TRAIN)
    h = json.loads((a / "results/quick/fedbn/seed0/history.json").read_text())
    assert [x["round"] for x in h] == [1, 2]


def test_resolved_method_values_reach_metrics_and_mlflow_and_client_models_are_kept_only_when_asked(mirror_root, tmp_path):
    """pFedDB with cut_depth: null picks its depth itself; metrics.json and the MLflow params show which, and the
    shared fraction. final_model.pt holds the server state; the clients' stores only with keep_client_models."""
    from mlflow.tracking import MlflowClient

    from fedsilo.methods.pfeddb import closest_to_70
    from fedsilo.models import build_model

    root = _project(mirror_root, tmp_path / "p", tracking=True)
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["experiments"]["quick"]["train"].update({"rounds": 2, "count_flops": True})  # the one CLI run that counts FLOPs
    raw["methods"]["pfeddb"] = {"cut_depth": None, "local_rounds": 1}
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    _main(root, "train", "--experiment", "quick", "--method", "pfeddb", "--seed", "0")
    met = json.loads((root / "results/quick/pfeddb/seed0/metrics.json").read_text())
    expected = closest_to_70(build_model("simple_cnn", 1, 2, seed=0, width=0.25))
    res = met["method_resolved"]
    assert res["cut_depth"] == expected and 0.0 < res["backbone_shared_fraction"] < 1.0
    assert 0.0 < res["shared_param_fraction"] < 1.0 and res["shared_tensors"] > 0
    c = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    (run,) = c.search_runs([c.get_experiment_by_name("quick").experiment_id])
    assert run.data.params["method.cut_depth"] == "None"
    assert run.data.params["method_resolved.cut_depth"] == str(expected)
    assert float(run.data.params["method_resolved.backbone_shared_fraction"]) == res["backbone_shared_fraction"]
    assert run.data.metrics["final.train_flops_per_round"] == met["train_flops_per_round"] > 0
    spectra = json.loads((root / "results/quick/pfeddb/seed0/spectrum.json").read_text())["clients"]
    assert set(spectra) == set(met["per_client"]) and all(len(v) == 128 for v in spectra.values())
    final = torch.load(root / "results/quick/pfeddb/seed0/final_model.pt", weights_only=False)
    assert "stores" not in final and final["server"]
    raw["experiments"]["quick"]["train"]["keep_client_models"] = True
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    _main(root, "train", "--experiment", "quick", "--method", "pfeddb", "--seed", "0")
    final = torch.load(root / "results/quick/pfeddb/seed0/final_model.pt", weights_only=False)
    assert len(final["stores"]) == 4 and all(any(k.startswith("private.") for k in s) for s in final["stores"])
    # keeping the stores changes what is saved, not what is trained: the same numbers
    assert json.loads((root / "results/quick/pfeddb/seed0/metrics.json").read_text())["mean_acc"] == met["mean_acc"]


def test_parallel_runs_share_a_fresh_sqlite_store_that_the_grid_created_first(tmp_path):
    # two grid workers starting at once on a store nobody created yet: MLflow builds its tables in both ("duplicate
    # column name"); and both find no experiment of their name and create it (one fails on the unique name)
    import sqlite3

    from fedsilo.tracking import Tracker, init_store

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    init_store(uri)
    tables = {r[0] for r in sqlite3.connect(tmp_path / "mlflow.db").execute("select name from sqlite_master where type='table'")}
    assert {"experiments", "runs", "metrics", "alembic_version"} <= tables
    first, second = Tracker(True, uri), Tracker(True, uri)
    first.start("pfeddb_office", "a", {}, {})
    real, looked = second.client.get_experiment_by_name, []

    def late_lookup(name):  # the second worker looked before the first created the experiment
        looked.append(name)
        return None if len(looked) == 1 else real(name)

    second.client.get_experiment_by_name = late_lookup
    assert second.start("pfeddb_office", "b", {}, {})
    runs = first.client.search_runs([first.client.get_experiment_by_name("pfeddb_office").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["a", "b"]


def test_a_new_experiment_keeps_its_artifacts_beside_the_database_whatever_folder_the_run_starts_in(tmp_path, monkeypatch):
    """A grid's first queue worker created its experiments in the temporary copy of the repository it ran in, where
    MLflow's default ``./mlruns`` put every later run's artifacts (gone with the copy)."""
    from fedsilo.tracking import Tracker, artifact_location

    db = tmp_path / "store" / "mlflow.db"
    db.parent.mkdir()
    elsewhere = tmp_path / "worker-copy"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    t = Tracker(True, f"sqlite:///{db}")
    run = t.start("paper/quickstart/e1", "fedavg-seed0", {"a": 1}, {})
    (elsewhere / "metrics.json").write_text("{}")
    t.finish({"acc": 1.0}, [elsewhere / "metrics.json"])
    where = t.client.get_run(run).info.artifact_uri
    assert where.startswith((tmp_path / "store" / "mlruns").as_uri()) and where == artifact_location(t.uri, "paper/quickstart/e1") + f"/{run}/artifacts"
    assert list((tmp_path / "store" / "mlruns").rglob("metrics.json")) and artifact_location("http://mlflow:5000", "e") is None


def test_a_repository_copied_with_its_store_keeps_every_runs_artifacts_inside_the_copy(tmp_path, monkeypatch, caplog):
    """`cp -a` of a repository with mlflow.db and mlruns/: the experiments' artifact folders were absolute addresses in
    the original, so the copy's runs wrote their artifacts into the original's mlruns/ (and made it again where it was
    gone). The copy's store now points its own experiments (and their earlier runs) at its own mlruns/; the original's
    store is untouched, and an experiment whose artifacts were put elsewhere on purpose is left as it is."""
    import shutil

    from fedsilo.tracking import Tracker, relocate_artifacts

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first, copy = tmp_path / "first", tmp_path / "copy"
    first.mkdir()
    (first / "metrics.json").write_text('{"acc": 1}')
    t = Tracker(True, f"sqlite:///{first / 'mlflow.db'}")
    before = t.start("cxr4_quickstart", "fedavg-seed0", {"a": 1}, {})
    t.finish({"acc": 1.0}, [first / "metrics.json"])
    custom = t.client.create_experiment("shared", artifact_location=(tmp_path / "archive" / "mlruns" / "shared").as_uri())
    shutil.copytree(first, copy)
    with caplog.at_level("WARNING", logger="fedsilo.tracking"):
        c = Tracker(True, f"sqlite:///{copy / 'mlflow.db'}")
    assert f"moved or copied from {first}: the artifact folders of 1 MLflow experiment(s) now point into {copy / 'mlruns'}" in caplog.text
    shutil.rmtree(first / "mlruns")
    after = c.start("cxr4_quickstart", "fedavg-seed1", {"a": 1}, {})
    c.finish({"acc": 1.0}, [copy / "metrics.json"])
    for run in (before, after):  # the earlier run's artifacts found in the copy's mlruns/, the new run's written there
        uri = c.client.get_run(run).info.artifact_uri
        assert uri.startswith((copy / "mlruns").as_uri() + "/"), uri
        assert (copy / "mlruns" / uri.removeprefix((copy / "mlruns").as_uri() + "/") / "metrics.json").is_file()
    assert not (first / "mlruns").exists()  # nothing written into the original's folder
    assert c.client.get_experiment(custom).artifact_location == (tmp_path / "archive" / "mlruns" / "shared").as_uri()
    assert t.client.get_run(before).info.artifact_uri.startswith((first / "mlruns").as_uri())  # the original's store as it was
    caplog.clear()
    with caplog.at_level("WARNING", logger="fedsilo.tracking"):
        Tracker(True, f"sqlite:///{copy / 'mlflow.db'}")
    assert "moved or copied" not in caplog.text  # once
    # the database copied alone (its mlruns/ left behind, still there): its earlier run keeps pointing at its artifacts
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(first / "mlflow.db", alone / "mlflow.db")
    shutil.copytree(copy / "mlruns", first / "mlruns")  # the original's artifacts back where they were
    solo = Tracker(True, f"sqlite:///{alone / 'mlflow.db'}")
    assert solo.client.get_run(before).info.artifact_uri.startswith((first / "mlruns").as_uri())
    assert solo.client.get_experiment_by_name("cxr4_quickstart").artifact_location.startswith((alone / "mlruns").as_uri())
    # the same folder by another path (a link, a second mount): no move
    (tmp_path / "link").symlink_to(first, target_is_directory=True)
    assert relocate_artifacts(f"sqlite:///{tmp_path / 'link' / 'mlflow.db'}") == []


def test_what_a_round_and_a_summary_log_and_the_data_hashes_a_run_is_tagged_with(tmp_path):
    """Params flatten to dotted keys; a round logs each site's accuracy, an AUC only where defined (no NaN), a
    training loss only where trained; names MLflow refuses are made legal; a summary logs each client's accuracy. A
    run's data hashes come from the dvc.lock entries that record an md5, a later lock over an earlier one."""
    from fedsilo.tracking import dvc_hashes, flat_summary, flatten, metric_key, round_metrics

    assert flatten({"train": {"lr": 0.1, "augment": {"hflip": True}}, "seed": 0}) == {
        "train.lr": 0.1, "train.augment.hflip": True, "seed": 0}
    entry = {"round": 1, "bytes_up_total": 10, "bytes_down_total": 20, "bytes_up": {"a": 4}, "bytes_down": {"a": 8},
             "train_loss": {"a": 0.5, "St Mary's (b)": None}, "mean_acc": 0.6, "std_acc": 0.1,
             "eval": {"a": {"acc": 0.7, "auc": 0.8}, "St Mary's (b)": {"acc": 0.5, "auc": float("nan")}}}
    m = round_metrics(entry)
    assert m["auc.a"] == 0.8 and m["acc.St Mary_s _b_"] == 0.5 and "auc.St Mary_s _b_" not in m
    assert m["train_loss.a"] == 0.5 and not any(k.startswith("train_loss.St") for k in m)
    assert metric_key("acc.Zürich/α:1") == "acc.Zürich/α_1"
    summary = flat_summary({"mean_acc": 0.6, "std_acc": 0.1, "per_client": {"a": {"acc": 0.7}, "b": {"acc": 0.5}}})
    assert summary == {"mean_acc": 0.6, "std_acc": 0.1, "acc.a": 0.7, "acc.b": 0.5}

    first, second = tmp_path / "dvc.lock", tmp_path / "papers" / "dvc.lock"
    second.parent.mkdir()
    first.write_text(yaml.safe_dump({"stages": {"harmonize": {"outs": [
        {"path": "data/harmonized/a", "md5": "old.dir"}, {"path": "data/splits/a", "md5": None},
        {"path": "data/other", "md5": "x.dir"}]}}}))
    second.write_text(yaml.safe_dump({"stages": {"harmonize": {"outs": [{"path": "data/harmonized/a", "md5": "new.dir"}]}}}))
    assert dvc_hashes(["data/harmonized/a", "data/splits/a"], [first, second, tmp_path / "missing.lock"]) == {
        "data/harmonized/a": "new.dir"}


def test_a_commit_is_dirty_by_its_code_not_by_the_dvc_locks_a_running_repro_rewrites(tmp_path):
    import subprocess as sp

    from fedsilo.tracking import git_commit

    def git(*args):
        sp.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    for name in ("dvc.lock", "papers/p/dvc.lock", "train.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("v1\n")
    git("add", ".")
    git("commit", "-q", "-m", "c")
    (tmp_path / "dvc.lock").write_text("v2\n")
    (tmp_path / "papers" / "p" / "dvc.lock").write_text("v2\n")
    sha, dirty = git_commit(tmp_path)
    assert len(sha) == 40 and not dirty
    (tmp_path / "train.py").write_text("v2\n")
    assert git_commit(tmp_path) == (sha, True)


def test_a_runs_folder_supersedes_the_run_it_last_served_unless_that_run_is_resumed_or_ended(tmp_path, monkeypatch):
    """start_in: the folder's earlier run, still RUNNING and not the one continued, is marked KILLED; a resumed run
    is left running; a finished one stays FINISHED; a run that fails to log its params is not left RUNNING.
    MLFLOW_TRACKING_URI wins over params; two experiments whose names make the same folder name keep their artifacts
    apart (the name's hash)."""
    from fedsilo.tracking import Tracker, artifact_location

    a, b = artifact_location("sqlite:///m.db", "paper/e 1"), artifact_location("sqlite:///m.db", "paper_e_1")
    assert a != b and a.rsplit("/", 1)[1].startswith("paper_e_1-") and b.rsplit("/", 1)[1].startswith("paper_e_1-")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'env.db'}")
    t = Tracker(True, f"sqlite:///{tmp_path / 'params.db'}")
    assert t.uri == f"sqlite:///{tmp_path / 'env.db'}"
    status = lambda run: t.client.get_run(run).info.status  # noqa: E731
    first = t.start_in(tmp_path, "e", "r", {}, {})
    assert t.start_in(tmp_path, "e", "r", {}, {}, run_id=first) == first and status(first) == "RUNNING"
    second = t.start_in(tmp_path, "e", "r", {}, {})
    assert status(first) == "KILLED" and status(second) == "RUNNING"
    t.finish({}, [])
    t.start_in(tmp_path, "e", "r", {}, {})
    assert status(second) == "FINISHED"
    monkeypatch.setattr(t.client, "log_batch", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("store full")))
    with pytest.raises(RuntimeError, match="store full"):
        t.start("e", "r", {"a": 1}, {})
    assert status(t.run_id) == "FAILED"


def test_a_run_id_the_store_lacks_starts_a_new_run_and_a_failing_store_is_not_taken_for_one(tmp_path, monkeypatch):
    """A checkpoint's MLflow run that another tracking store holds: a new run here (and nothing to mark KILLED);
    the store failing otherwise (unreachable, locked) stops the start, where it silently began a second run and left
    the first RUNNING."""
    from mlflow.exceptions import MlflowException

    from fedsilo.tracking import Tracker

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    t = Tracker(True, f"sqlite:///{tmp_path / 'mlflow.db'}")
    first = t.start("e", "fedavg-seed0", {}, {})
    assert t.start("e", "fedavg-seed0", {}, {}, run_id=first) == first  # resumed
    gone = "0123456789abcdef0123456789abcdef"
    new = t.start("e", "fedavg-seed0", {}, {}, run_id=gone)
    assert new not in (gone, first) and t.supersede(gone) is False

    def down(run_id):
        raise MlflowException("database is locked")

    monkeypatch.setattr(t.client, "get_run", down)
    with pytest.raises(MlflowException, match="database is locked"):
        t.start("e", "fedavg-seed0", {}, {}, run_id=first)
    with pytest.raises(MlflowException, match="database is locked"):
        t.supersede(first)
    runs = Tracker(True, f"sqlite:///{tmp_path / 'mlflow.db'}").client.search_runs([t.client.get_experiment_by_name("e").experiment_id])
    assert len(runs) == 2


def test_a_run_whose_process_died_is_found_and_ended_and_a_live_one_is_left(tmp_path, monkeypatch, capsys):
    """Every run carries its process (host, pid, start time; a resume re-tags it); `fedsilo stale-runs` lists the
    RUNNING runs whose process on this host is gone, `--end` marks them KILLED (the grid does at its end), leaving
    a live run, a finished one and another host's as they are."""
    import socket

    from mlflow.entities import RunTag

    from fedsilo.cli import main
    from fedsilo.tracking import PROCESS_TAGS, Tracker, process_tags

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t = Tracker(True, uri)
    live = t.start("e", "live", {}, {})
    assert {k: t.client.get_run(live).data.tags[k] for k in PROCESS_TAGS} == process_tags()
    dead_pid = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_pid.wait()
    dead = t.start("e", "killed", {}, {})
    t.client.log_batch(dead, tags=[RunTag("fedsilo.pid", str(dead_pid.pid))])  # its process: gone
    elsewhere = t.start("e", "other-host", {}, {})
    t.client.log_batch(elsewhere, tags=[RunTag("fedsilo.host", "gpu-node-7"), RunTag("fedsilo.host_id", "another-boot/pid:[1]"),
                                        RunTag("fedsilo.pid", str(dead_pid.pid))])
    # this hostname, another pid namespace (a container on the host's network): its pids are not ours to look up
    boxed = t.start("e", "container", {}, {})
    t.client.log_batch(boxed, tags=[RunTag("fedsilo.host_id", "another-boot/pid:[2]"), RunTag("fedsilo.pid", str(dead_pid.pid))])
    edited = t.start("e", "edited", {}, {})
    t.client.log_batch(edited, tags=[RunTag("fedsilo.pid", "twelve")])  # a tag edited by hand: not judged, no crash
    done = t.start("e", "done", {}, {})
    t.client.set_terminated(done, "FINISHED")
    raw = small_params()
    raw["tracking"] = {"enabled": True, "uri": uri}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    args = ["--root", str(tmp_path), "--params", str(tmp_path / "params.yaml"), "stale-runs"]
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "1 RUNNING run(s) whose process on" in out and f"e  killed  {dead}  (pid {dead_pid.pid}" in out
    assert ("3 other RUNNING run(s) not judged here: started on gpu-node-7 (run this there); 1 started on "
            f"{socket.gethostname()} in another container or before a reboot; 1 without their process's tags") in out
    assert t.client.get_run(dead).info.status == "RUNNING"  # listed only
    assert main([*args, "--end"]) == 0 and "marked KILLED" in capsys.readouterr().out
    status = {r: t.client.get_run(r).info.status for r in (live, dead, elsewhere, boxed, edited, done)}
    assert status == {live: "RUNNING", dead: "KILLED", elsewhere: "RUNNING", boxed: "RUNNING", edited: "RUNNING", done: "FINISHED"}
    # a killed process its parent has not reaped (Flower's SuperExec leaves a SIGKILLed ServerApp so) is gone too
    import psutil

    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(zombie.pid).create_time()
        zombie.kill()
        deadline = time.monotonic() + 30
        while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the killed child never became a zombie"
            time.sleep(0.05)
        unreaped = t.start("e", "unreaped", {}, {})
        t.client.log_batch(unreaped, tags=[RunTag("fedsilo.pid", str(zombie.pid)), RunTag("fedsilo.pid_started", f"{started:.3f}")])
        assert main(args) == 0 and f"e  unreaped  {unreaped}  (pid {zombie.pid}" in capsys.readouterr().out
    finally:
        zombie.wait()
    # its checkpoint resumes it all the same, re-tagged with the resuming process
    t.client.log_batch(dead, tags=[RunTag("fedsilo.pid", "1")])
    assert Tracker(True, uri).start("e", "killed", {}, {}, run_id=dead) == dead
    assert t.client.get_run(dead).info.status == "RUNNING" and t.client.get_run(dead).data.tags["fedsilo.pid"] == str(os.getpid())


def test_a_run_whose_pid_now_belongs_to_another_process_is_judged_gone(tmp_path, monkeypatch):
    """A pid is reused once its process is gone: a RUNNING run tagged with a live pid but another start time is the
    dead process's run (judged gone, marked KILLED), while the run of the live process itself is left."""
    from mlflow.entities import RunTag

    from fedsilo.tracking import Tracker, end_stale_runs, stale_runs

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t = Tracker(True, uri)
    live = t.start("e", "live", {}, {})
    reused = t.start("e", "reused", {}, {})
    started = float(t.client.get_run(reused).data.tags["fedsilo.pid_started"])
    t.client.log_batch(reused, tags=[RunTag("fedsilo.pid_started", f"{started - 3600:.3f}")])  # an hour before this process
    gone, _ = stale_runs(t.client)
    assert [r.info.run_id for r in gone] == [reused]
    assert [r.info.run_id for r in end_stale_runs(uri)] == [reused]
    assert t.client.get_run(reused).info.status == "KILLED" and t.client.get_run(live).info.status == "RUNNING"
