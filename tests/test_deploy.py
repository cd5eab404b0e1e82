"""A real deployment's parts, in one process: each site's card and fingerprint (fl/site.py), the Flower App the
coordinator builds (fl/deploy.py), and the ServerApp admitting only the sites and data the federation pins. The same
apps over a real SuperLink and SuperNodes with TLS and node authentication: tests/test_deploy_processes.py."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402

from fedsilo.config import ConfigError  # noqa: E402
from fedsilo.fl.deploy import deployment_spec, load_federation, write_app  # noqa: E402
from fedsilo.fl.engine import Engine  # noqa: E402
from fedsilo.fl.flower import ClientFailed, SiteRefused  # noqa: E402
from fedsilo.fl.params import load_params  # noqa: E402
from fedsilo.fl.site import load_site, site_card  # noqa: E402
from tests.deploy_sites import SITE_SOURCES, make_site  # noqa: E402
from tests.test_flower import LoopGrid, identity  # noqa: E402,F401 - the fixture
from tests.tiny import CPU_TRAIN  # noqa: E402

REPO_PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"  # the coordinator's methods entries
TRAIN = {"model": "simple_cnn", "model_width": 0.25, "rounds": 2, "batch_size": 8, "lr": 0.05, "device": "cpu"}


@pytest.fixture(scope="module")
def sites(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("sites")
    return {s: make_site(base / s, s) for s in SITE_SOURCES}


def _card(params_file: Path) -> dict:
    return site_card(load_params(params_file), "site", params_file.parent)


def _federation(tmp: Path, sites: dict[str, Path], method: str = "fedbn", node_ids: Optional[dict[str, int]] = None,
                train: Optional[dict] = None, **pin) -> Path:
    """The federation of ``sites`` in their dict order (client index = place in it); ``pin``: site -> fingerprint;
    ``node_ids``: site -> the node it must connect as."""
    cards = [_card(p) for p in sites.values()]
    fed = {"name": "three_hospitals", "method": method, "seed": 0, "train": train or TRAIN,
           "contract": cards[0]["contract"],
           "sites": [{"name": c["site"], "fingerprint": pin.get(c["site"], c["fingerprint"]),
                      **({"node_id": node_ids[c["site"]]} if node_ids and c["site"] in node_ids else {})} for c in cards]}
    (tmp / "federation.yaml").write_text(yaml.safe_dump(fed, sort_keys=False))
    return tmp / "federation.yaml"


def test_a_site_card_holds_hashes_and_counts_and_its_fingerprint_follows_the_data(sites, tmp_path):
    card = _card(sites["rsna"])
    assert (card["site"], card["n_train"], card["n_test"]) == ("RSNA", 16, 10)
    assert card["contract"] == {"task": "binary: 1 = Lung Opacity, 0 = Normal", "classes": ["Normal", "Lung Opacity"], "image_shape": [16, 16, 1]}
    assert _card(sites["rsna"]) == card  # deterministic
    # another split seed over the same images: another fingerprint
    other = make_site(tmp_path / "rsna_seed1", "rsna", split_seed=1)
    assert _card(other)["data_sha256"] == card["data_sha256"] and _card(other)["fingerprint"] != card["fingerprint"]
    # images edited after harmonize are refused, not fingerprinted
    edited = make_site(tmp_path / "rsna_edit", "rsna")
    arr = np.load(tmp_path / "rsna_edit/data/harmonized/chest_xray4/images.npy")
    arr[0] ^= 1
    np.save(tmp_path / "rsna_edit/data/harmonized/chest_xray4/images.npy", arr)
    with pytest.raises(ConfigError, match=r"images.npy changed after harmonize wrote card.json"):
        _card(edited)


def test_a_site_split_must_be_one_client(sites, tmp_path):
    params = yaml.safe_load(sites["rsna"].read_text())
    params["sources"]["chexpert"] = {"mode": "mirror", "mirror": {"patients": 40}}
    params["datasets"]["chest_xray4"]["sources"] = ["rsna", "chexpert"]
    params["pipeline"]["sources"] = ["rsna", "chexpert"]
    folder = tmp_path / "two"
    folder.mkdir()
    (folder / "params.yaml").write_text(yaml.safe_dump(params))
    from fedsilo.cli import main as fedsilo

    common = ["-q", "--params", str(folder / "params.yaml"), "--root", str(folder)]
    for cmd in (["fetch", "--source", "rsna"], ["fetch", "--source", "chexpert"], ["harmonize", "--dataset", "chest_xray4"], ["split", "--experiment", "site"]):
        assert fedsilo(common + cmd) == 0
    with pytest.raises(ConfigError, match=r"experiments.site.split: a site's split holds its own data as one client .* 2 clients"):
        _card(folder / "params.yaml")


def test_a_site_harmonized_again_after_its_split_is_refused_until_it_splits_again(tmp_path):
    """A split names the arrays it was made from: a site that re-harmonized (here at another image size) and did not
    split again has a split of other arrays, which its card and its data loading refuse, naming the split to rerun."""
    from fedsilo.cli import main as fedsilo

    params_file = make_site(tmp_path / "rsna", "rsna")
    raw = yaml.safe_load(params_file.read_text())
    raw["datasets"]["chest_xray4"]["image_size"] = 8
    params_file.write_text(yaml.safe_dump(raw, sort_keys=False))
    common = ["-q", "--params", str(params_file), "--root", str(params_file.parent)]
    assert fedsilo([*common, "harmonize", "--dataset", "chest_xray4"]) == 0
    params = load_params(params_file)
    for read in (lambda: _card(params_file), lambda: load_site(params, "site", params_file.parent, torch.device("cpu"))):
        with pytest.raises(ConfigError, match=r"splits/site.json: built for other arrays than .* holds \(re-harmonized since\); rerun "
                                              r"`fedsilo split --experiment site`"):
            read()
    assert fedsilo([*common, "split", "--experiment", "site"]) == 0
    assert _card(params_file)["contract"]["image_shape"] == [8, 8, 1]
    # the dataset's settings edited and not harmonized again: the card and the data loading refuse, naming each
    raw["datasets"]["chest_xray4"]["image_size"] = 12
    params_file.write_text(yaml.safe_dump(raw, sort_keys=False))
    params = load_params(params_file)
    for read in (lambda: _card(params_file), lambda: load_site(params, "site", params_file.parent, torch.device("cpu"))):
        with pytest.raises(ConfigError, match=r"harmonized with other settings than datasets\.chest_xray4 has now \(image_size: "
                                              r"built with 8, now 12\); rerun `fedsilo harmonize --dataset chest_xray4` and "
                                              r"`fedsilo split --experiment site`"):
            read()


def _deployed(tmp: Path, sites: dict[str, Path], node_ids: Optional[dict[str, int]] = None, **pin):
    fed = load_federation(_federation(tmp, sites, node_ids=node_ids, **pin))
    write_app(fed, load_params(REPO_PARAMS), tmp / "app", results=str(tmp / "results"))
    return tmp / "app"


class SiteGrid(LoopGrid):
    """LoopGrid whose nodes are the sites: each node's config names its params file and experiment, as the
    SuperNode's --node-config does; ``node_ids``: each site's node in the sites' order (default 100, 101, ...)."""

    def __init__(self, app, sites: dict[str, Path], run_id: int = 1, node_ids: Optional[list[int]] = None):
        super().__init__(app, 0)
        ids = node_ids or [100 + k for k in range(len(sites))]
        self.contexts = {n: Context(run_id=run_id, node_id=n, node_config={"params": str(p), "experiment": "site"},
                                    state=RecordDict(), run_config={}) for n, p in zip(ids, sites.values())}


class NodeRestartsAt(SiteGrid):
    """SiteGrid whose first node's SuperNode restarts before round ``rnd``: its node state (its store) is gone."""

    def __init__(self, app, sites: dict[str, Path], rnd: int, run_id: int):
        super().__init__(app, sites, run_id)
        self.rnd, self.restarted = rnd, False

    def send_and_receive(self, messages, timeout=None):
        if not self.restarted and any(m.metadata.group_id == str(self.rnd) for m in messages):
            self.contexts[100].state = RecordDict()
            self.restarted = True
        return super().send_and_receive(messages, timeout)


class DownAt(SiteGrid):
    """SiteGrid whose SuperLink goes down as round ``rnd``'s train messages are sent: none of them is delivered."""

    def __init__(self, app, sites: dict[str, Path], rnd: int, run_id: int, node_ids: Optional[list[int]] = None):
        super().__init__(app, sites, run_id, node_ids)
        self.rnd = rnd

    def send_and_receive(self, messages, timeout=None):
        if any(m.metadata.message_type == "train" and m.metadata.group_id == str(self.rnd) for m in messages):
            raise ConnectionError("the SuperLink went down")
        return super().send_and_receive(messages, timeout)


def _engine_reference(dep: dict, sites: dict[str, Path], keep: Optional[list] = None, **membership) -> list[dict]:
    """The in-process engine's history on the sites' own splits (client index: their place in ``sites``), with the
    deployment's method, model and seed, on one thread as the deployed apps ran in these tests (a convolution summed
    over other thread counts differs in the last bit); ``membership``: the engine's ``left`` / ``joined`` / ``away``;
    ``keep``: a list the engine is appended to."""
    spec = deployment_spec(dep)
    clients = [load_site(load_params(p), "site", p.parent, torch.device("cpu"), index=k) for k, p in enumerate(sites.values())]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        engine = Engine(spec.method(), spec.make_model(), clients, spec.train, seed=0, **membership)
        if keep is not None:
            keep.append(engine)
        return engine.run()
    finally:
        torch.set_num_threads(threads)


def _server_context(tmp: Path, **run_config) -> Context:
    """The ServerApp's context: its results and state folders in the test's folder (never the working directory's)."""
    return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                   run_config={"results-dir": str(tmp / "results"), "state-dir": str(tmp / "state"), **run_config})


def _marked_federation(tmp: Path, name: str, sites: dict[str, Path], train: dict, left: tuple[str, ...] = (),
                       method: str = "fedbn", node_ids: Optional[dict[str, int]] = None) -> Path:
    """A federation.yaml in ``tmp/name`` whose sites in ``left`` are marked ``left: true`` (the others false)."""
    (tmp / name).mkdir()
    raw = yaml.safe_load(_federation(tmp / name, sites, method=method, train=train, node_ids=node_ids).read_text())
    for entry in raw["sites"]:
        entry["left"] = entry["name"] in left
    (tmp / name / "federation.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return tmp / name / "federation.yaml"


def _run_context(tmp: Path, run_id: int, name: str = "run", uri: Optional[str] = None) -> Context:
    """The ServerApp's context of a run whose results and state live in ``tmp/name`` and ``tmp/name.state``."""
    return Context(run_id=run_id, node_id=0, node_config={}, state=RecordDict(),
                   run_config={"results-dir": str(tmp / name), "state-dir": str(tmp / f"{name}.state"), "wait-s": 30,
                               **({"tracking-uri": uri} if uri else {})})


def _load_apps(app_dir: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"fedsilo_app_{abs(hash(app_dir))}", app_dir / "fedsilo_app.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.server, mod.client


@pytest.mark.usefixtures("identity")
def test_the_deployed_apps_train_on_each_sites_own_split_as_the_engine_does(sites, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    roster = {s: sites[s] for s in ("rsna", "chexpert", "vinbigdata")}  # client order is the federation file's, not the names'
    app = _deployed(tmp_path, roster)
    server, client = _load_apps(app)
    grid = SiteGrid(client, sites)  # the nodes connect in another order
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference below: a convolution summed over other thread counts differs in the last bit
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    try:
        server._main(grid, _server_context(tmp_path, **{"tracking-uri": uri}))
    finally:
        torch.set_num_threads(threads)
    metrics = json.loads((tmp_path / "results/metrics.json").read_text())
    assert metrics["clients"] == ["RSNA", "CheXpert", "VinBigData"] and metrics["dropped_rounds"] == {}
    assert metrics["fingerprints"] == {c["site"]: c["fingerprint"] for c in map(_card, sites.values())}

    # the run in MLflow: tied to the deployment's hash and each site's pinned fingerprint, its rounds, its final numbers
    from mlflow.tracking import MlflowClient

    mc = MlflowClient(uri)
    run = mc.get_run(metrics["mlflow_run_id"])
    assert mc.get_experiment(run.info.experiment_id).name == metrics["mlflow_experiment"] == "deploy/three_hospitals"
    assert run.info.status == "FINISHED"
    assert run.data.tags["deployment_sha256"] == metrics["deployment_sha256"]
    assert {k: v for k, v in run.data.tags.items() if k.endswith(".fingerprint")} == {
        f"site.{n}.fingerprint": f for n, f in metrics["fingerprints"].items()}
    assert run.data.metrics["final.mean_acc"] == pytest.approx(metrics["mean_acc"])
    assert run.data.params["train.rounds"] == "2" and run.data.params["seed"] == "0"
    assert {a.path for a in mc.list_artifacts(run.info.run_id)} == {"metrics.json", "history.json", "wire.jsonl"}

    # the in-process engine on the same three splits, the same model and seed: the same numbers

    dep = json.loads((app / "deployment.json").read_text())
    spec = deployment_spec(dep)
    reference = _engine_reference(dep, roster)
    history = json.loads((tmp_path / "results/history.json").read_text())
    assert [h["eval"] for h in history] == [h["eval"] for h in reference]
    assert [h["bytes_up"] for h in history] == [h["bytes_up"] for h in reference]

    # the wire log: every train reply carries the shared tensors only (FedBN: no BatchNorm key), with their bytes
    from fedsilo.models import batchnorm_keys

    wire = [json.loads(line) for line in (tmp_path / "results/wire.jsonl").read_text().splitlines()]
    ups = [w for w in wire if w["message"] == "train" and w["to"] == "server"]
    bn = batchnorm_keys(spec.make_model())
    assert len(ups) == 2 * 3 and all(set(w["arrays"]["up"]) and not set(w["arrays"]["up"]) & bn for w in ups)
    assert [w["tensor_bytes"]["up"] for w in ups] == [h["bytes_up"][s] for h in history for s in h["sampled"]]
    registered = [w for w in wire if w["message"] == "query.register" and w["to"] == "server"]
    assert len(registered) == 3 and all("arrays" not in w for w in registered)  # a registration carries no tensor
    assert sum(w["message"] == "query.register" and w["to"] == "site" for w in wire) == 3

    # each site's own wire log, on its disk: every message it received and every reply it sent, as the coordinator
    # recorded them for that site (the coordinator's register lines name a node, not yet a site)
    from fedsilo.fl.deploy import site_keep_dir

    def seen(lines):
        return [(w["round"], w["message"], w["to"], w.get("arrays"), w.get("tensor_bytes"), w.get("config"), w.get("metrics"))
                for w in lines]

    keep = site_keep_dir(dep)
    for ctx in grid.contexts.values():
        own = [json.loads(x) for x in (keep(ctx) / "wire.jsonl").read_text().splitlines()]
        name = _card(Path(ctx.node_config["params"]))["site"]
        assert seen(w for w in own if w["message"] != "query.register") == seen(
            w for w in wire if w.get("site") == name and w["message"] != "query.register"), name
        assert [w["to"] for w in own if w["message"] == "query.register"] == ["site", "server"]
        sent = [w for w in own if w["message"] == "train" and w["to"] == "server"]
        assert len(sent) == 2 and all(set(w["arrays"]["up"]) and not set(w["arrays"]["up"]) & bn for w in sent)  # no BatchNorm left
        assert all(w["flower_run"] == 1 for w in own) and len(own) == len([w for w in wire if w.get("site") == name]) + 1

    # `fedsilo site audit` sums up that log at the site: what it sent (FedBN's shared tensors, their bytes as the
    # coordinator counted them), what it received, and the BatchNorm layers it keeps, which never left
    from fedsilo.cli import main
    from fedsilo.client.local import evaluate_client
    from fedsilo.fl.deploy import load_site_model, site_audit

    for ctx in grid.contexts.values():
        root, name = Path(ctx.node_config["params"]).parent, _card(Path(ctx.node_config["params"]))["site"]
        (audit,) = site_audit(root)
        theirs = [w for w in wire if w.get("site") == name]
        assert (audit["federation"], audit["deployment"], audit["runs"], audit["unreadable_lines"]) == (
            "three_hospitals", keep(ctx).name, {"1": [1, 2]}, [])
        train = audit["sent"]["train"]
        assert train["messages"] == 2 and set(train["arrays"]["up"]) == set(spec.make_model().state_dict()) - bn
        assert train["tensor_bytes"] == sum(w["tensor_bytes"]["up"] for w in theirs if w["message"] == "train" and w["to"] == "server")
        assert audit["sent_tensor_bytes"] == train["tensor_bytes"]  # scores and registration: no tensor
        assert audit["received_tensor_bytes"] == sum(sum(w.get("tensor_bytes", {}).values()) for w in theirs if w["to"] == "site")
        assert set(audit["sent"]) == {"query.register", "train", "evaluate"} and audit["errors"] == []
        assert audit["kept"][name]["keys"] == sorted(bn) and audit["kept"][name]["rounds"][-1] == 2
        # the model it takes home: the one it was evaluated with in the last round, rebuilt from the file alone, scores
        # on its own test images what the coordinator recorded for it
        assert audit["kept"][name]["model"]["round"] == 2
        model, info = load_site_model(Path(audit["kept"][name]["model"]["path"]))
        assert (info["round"], info["site"], info["deployment"]) == (2, name, dep)
        assert (Path(audit["kept"][name]["model"]["path"]).stat().st_mode & 0o777) == 0o600
        own_data = load_site(load_params(Path(ctx.node_config["params"])), "site", root, torch.device("cpu"))
        assert evaluate_client(model, own_data, cfg=spec.train) == pytest.approx(history[-1]["eval"][name])
        capsys.readouterr()
        assert main(["--root", str(root), "site", "audit", "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == [audit]
        assert main(["--root", str(root), "site", "audit"]) == 0
        text = capsys.readouterr().out
        assert f"sent train x2: up: {len(train['arrays']['up'])} tensors" in text and f"kept here for {name}: rounds" in text
    assert main(["--root", str(tmp_path), "site", "audit"]) == 2
    assert "holds no site wire log" in capsys.readouterr().err


class DropsTraining(SiteGrid):
    """SiteGrid whose node 101 trains round ``at`` (``kind``; or scores it) and goes away before its reply leaves:
    the SuperLink answers for it."""

    kind, at = "train", "2"

    def send_and_receive(self, messages, timeout=None):
        from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

        out = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = m.object_id  # as the SuperLink sets it when it takes the message
            if (m.metadata.message_type, m.metadata.group_id, m.metadata.dst_node_id) == (self.kind, self.at, 101):
                super().send_and_receive([m], timeout)
                out.append(create_message_error_unavailable_res_message(m.metadata, "node_unavail"))
            else:
                out.extend(super().send_and_receive([m], timeout))
        return out


@pytest.mark.usefixtures("identity")
def test_a_deployed_round_goes_on_without_a_site_gone_during_its_training_when_min_train_sites_allow(sites, tmp_path):
    """The App's run config ``min-train-sites`` reaches the ServerApp: with 2, round 2 goes on without the site whose
    SuperNode went away while it trained; metrics.json names the rounds it was left out of. Without it (the
    default), the same loss ends the run naming the site. (What the round then is, the engine's round without that
    site, is tests/test_flower.py's.)"""
    app = _deployed(tmp_path, sites)
    server, client = _load_apps(app)
    grid = DropsTraining(client, sites)
    name = _card(Path(grid.contexts[101].node_config["params"]))["site"]
    server._main(grid, _server_context(tmp_path, **{"min-train-sites": 2}))
    metrics = json.loads((tmp_path / "results/metrics.json").read_text())
    history = json.loads((tmp_path / "results/history.json").read_text())
    assert metrics["dropped_rounds"] == {name: [2]} and name in history[0]["sampled"] and name not in history[1]["sampled"]
    assert metrics["bytes_down_dropped_total"] == history[1]["dropped"][name] == history[0]["bytes_down"][name] > 0
    assert set(history[1]["eval"]) == set(metrics["clients"])  # every site is still evaluated
    with pytest.raises(ClientFailed, match=rf"client {name}: train in round 2 failed: Error: Node Unavailable"):
        server._main(DropsTraining(client, sites, run_id=2), _server_context(tmp_path / "strict"))
    # min-eval-sites: round 1's evaluation goes on without the site gone during it (tests/test_flower.py's); not
    # waited for (rejoin-s 0: this grid would answer for it again each time it is sent the message)
    grid = type("DropsEvaluation", (DropsTraining,), {"kind": "evaluate", "at": "1"})(client, sites, run_id=3)
    server._main(grid, _server_context(tmp_path / "eval", **{"min-eval-sites": 2, "rejoin-s": 0.0}))
    metrics = json.loads((tmp_path / "eval/results/metrics.json").read_text())
    history = json.loads((tmp_path / "eval/results/history.json").read_text())
    assert metrics["unevaluated_rounds"] == {name: [1]} and metrics["dropped_rounds"] == {} and "eval" not in history[0]
    assert history[0]["eval_missing"] == [name] and name not in history[0]["eval_partial"] and set(history[1]["eval"]) == set(metrics["clients"])


@pytest.mark.usefixtures("identity")
def test_a_deployed_run_that_went_down_resumes_after_its_checkpoint_to_the_uninterrupted_numbers(sites, tmp_path):
    """FedBN keeps each site's BatchNorm layers at the site: the resumed run has the uninterrupted run's numbers only
    if every site takes them from the store it kept on its disk (a fresh store gives others). Two sites of three
    train each round, so a site resumes from the last round it trained, not the last round. The run it is compared
    with loses one site's node state between its rounds (its SuperNode restarted): that site too reads its disk.
    Then a server that names a later store than a message allows, or an earlier round than a site last trained, is
    refused by the site."""
    from flwr.app import ConfigRecord, Message
    from mlflow.tracking import MlflowClient

    from fedsilo.fl.deploy import peek_checkpoint, resume_key
    from fedsilo.models import batchnorm_keys

    fed = load_federation(_federation(tmp_path, sites, train={**TRAIN, "rounds": 3, "client_fraction": 0.67}))
    write_app(fed, load_params(REPO_PARAMS), tmp_path / "app")
    dep = json.loads((tmp_path / "app/deployment.json").read_text())
    server, client = _load_apps(tmp_path / "app")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def ctx(name: str, run_id: int) -> Context:
        return Context(run_id=run_id, node_id=0, node_config={}, state=RecordDict(),
                       run_config={"results-dir": str(tmp_path / name), "state-dir": str(tmp_path / f"{name}.state"), "tracking-uri": uri})

    class Recording(SiteGrid):
        sent: list = []

        def send_and_receive(self, messages, timeout=None):
            self.sent.extend(messages)
            return super().send_and_receive(messages, timeout)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        restarts = NodeRestartsAt(client, sites, rnd=2, run_id=1)
        server._main(restarts, ctx("whole", 1))
        assert restarts.restarted
        with pytest.raises(ConnectionError, match="went down"):
            server._main(DownAt(client, sites, rnd=3, run_id=2), ctx("resumed", 2))
        checkpoint = tmp_path / "resumed.state/checkpoint.pt"
        assert peek_checkpoint(checkpoint, resume_key(dep))["round"] == 2 and not (tmp_path / "resumed").exists()
        grid = Recording(client, sites, run_id=3)
        server._main(grid, ctx("resumed", 3))  # `flwr run` again: a new run, fresh node state
    finally:
        torch.set_num_threads(threads)
    whole = json.loads((tmp_path / "whole/history.json").read_text())
    resumed = json.loads((tmp_path / "resumed/history.json").read_text())
    for key in ("sampled", "eval", "bytes_up", "bytes_down", "train_loss"):
        assert [h[key] for h in resumed] == [h[key] for h in whole], key
    assert all(len(h["sampled"]) == 2 for h in whole) and len({tuple(h["sampled"]) for h in whole}) > 1
    assert not checkpoint.exists()  # finished: running the App again trains again

    # the wire log holds both attempts, each line with its Flower run: rounds 1-2 from the first, 3 from the second
    wire = [json.loads(line) for line in (tmp_path / "resumed/wire.jsonl").read_text().splitlines()]
    ups = sorted((w["flower_run"], w["round"], w["site"]) for w in wire if w["message"] == "train" and w["to"] == "server")
    assert ups == sorted((2 if h["round"] < 3 else 3, h["round"], s) for h in whole for s in h["sampled"])
    # one MLflow run, continued by the resumed attempt, FINISHED
    metrics = json.loads((tmp_path / "resumed/metrics.json").read_text())
    mc = MlflowClient(uri)
    runs = mc.search_runs([mc.get_experiment_by_name("deploy/three_hospitals").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"] and metrics["mlflow_run_id"] in {r.info.run_id for r in runs}
    assert [m.step for m in mc.get_metric_history(metrics["mlflow_run_id"], "mean_acc")] == [1, 2, 3]
    # each site keeps its stores (FedBN: its BatchNorm layers only), owner-readable, the newest at its last round
    bn = batchnorm_keys(deployment_spec(dep).make_model())
    last = {s: max(h["round"] for h in whole if s in h["sampled"]) for s in ("CheXpert", "RSNA", "VinBigData")}
    for p in sites.values():
        name = _card(p)["site"]
        folder = p.parent / "state/deploy/three_hospitals" / resume_key(dep, code=False)[:16] / name
        newest = max(folder.glob("store-r*.pt"))
        assert newest.name == f"store-r{last[name]:06d}.pt" and (newest.stat().st_mode & 0o777) == 0o600
        assert set(torch.load(newest, weights_only=True)["store"]) == bn

    # a server replaying recorded messages in yet another run: the sites refuse what a resume never asks for
    site = next(s for s in ("CheXpert", "RSNA", "VinBigData") if last[s] == 3)
    k = [c["site"] for c in map(_card, sites.values())].index(site)  # its node: 100 + k
    train3 = next(m for m in grid.sent if m.metadata.message_type == "train" and m.metadata.dst_node_id == 100 + k)
    index = list(train3.content.config_records["fedsilo"]["name"]).index(site)

    def crafted(kind: str, rnd: int, last_trained: int) -> Message:
        cfg = dict(train3.content.config_records["fedsilo"])
        cfg["round"], cfg["last_trained"] = rnd, [last_trained if i == index else 0 for i in range(len(cfg["name"]))]
        content = RecordDict({"fedsilo": ConfigRecord(cfg), **({"down": train3.content.array_records["down"]} if kind == "train" else {})})
        return Message(content, dst_node_id=100 + k, message_type=kind, group_id=str(rnd))

    replay = SiteGrid(client, sites, run_id=4)
    # an announce of a later round loads the store of round 3; a train of round 2 may not use it
    (said,) = replay.send_and_receive([crafted("query.announce", 4, 3)])
    assert not said.has_error(), said.error.reason if said.has_error() else ""
    (reply,) = replay.send_and_receive([crafted("train", 2, 3)])
    assert reply.has_error() and f"client {site}: its store is of round 3; this message may use round 1 at most" in reply.error.reason
    # a fresh node state: a train of round 2 from the kept store of round 1, after the site trained round 3
    (reply,) = SiteGrid(client, sites, run_id=5).send_and_receive([crafted("train", 2, 1)])
    assert reply.has_error() and f"client {site}: asked to train round 2 from its kept store of round 1, but it trained round 3" in reply.error.reason
    # nor a store of a later round than the message allows
    (reply,) = SiteGrid(client, sites, run_id=6).send_and_receive([crafted("train", 3, 3)])
    assert reply.has_error() and "store of round 3 for a message that allows round 2 at most" in reply.error.reason


@pytest.mark.usefixtures("identity")
def test_a_site_given_a_new_key_mid_run_resumes_under_its_new_node_from_the_stores_on_its_disk(sites, tmp_path):
    """A hospital's key is replaced mid-run (a reinstalled machine, a key that leaked): the coordinator registers the
    new key and pins the new node in a new App. The node id is who may speak for the site, not what is trained, so
    the new App resumes the old App's checkpoint; the site, now a new node with fresh node state, reads its FedBN
    layers from its disk, and the run ends with the uninterrupted numbers; its old node is refused; the MLflow run
    carries the new node id. Another fingerprint would not resume (tested above)."""
    from mlflow.tracking import MlflowClient

    from fedsilo.fl.deploy import peek_checkpoint, resume_key, site_keep_dir
    from fedsilo.fl.flower import SiteRefused

    train = {**TRAIN, "rounds": 2}
    old_ids = {"CheXpert": 100, "RSNA": 101, "VinBigData": 102}  # by site name, in the sites' order
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_app(load_federation(_federation(tmp_path / "a", sites, node_ids=old_ids, train=train)), load_params(REPO_PARAMS), tmp_path / "app")
    rekeyed = {**old_ids, "RSNA": 201}
    write_app(load_federation(_federation(tmp_path / "b", sites, node_ids=rekeyed, train=train)), load_params(REPO_PARAMS), tmp_path / "app2")
    dep, dep2 = (json.loads((tmp_path / a / "deployment.json").read_text()) for a in ("app", "app2"))
    assert dep != dep2 and resume_key(dep) == resume_key(dep2) and resume_key(dep, code=False) == resume_key(dep2, code=False)
    ctx = Context(run_id=0, node_id=0, node_config={"params": str(sites["rsna"]), "experiment": "site"}, state=RecordDict(), run_config={})
    assert site_keep_dir(dep)(ctx) == site_keep_dir(dep2)(ctx)  # the site's stores stay where it kept them
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def run_config(name: str) -> dict:
        return {"results-dir": str(tmp_path / name), "state-dir": str(tmp_path / f"{name}.state"), "tracking-uri": uri}

    def grid(app, run_id: int, nodes: dict[str, int], down_at: Optional[int] = None) -> SiteGrid:
        ids = list(nodes.values())
        return DownAt(app, sites, down_at, run_id, ids) if down_at else SiteGrid(app, sites, run_id, ids)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        server, client = _load_apps(tmp_path / "app")
        server._main(grid(client, 1, old_ids), Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config("whole")))
        with pytest.raises(ConnectionError, match="went down"):
            server._main(grid(client, 2, old_ids, down_at=2),
                         Context(run_id=2, node_id=0, node_config={}, state=RecordDict(), run_config=run_config("resumed")))
        assert peek_checkpoint(tmp_path / "resumed.state/checkpoint.pt", resume_key(dep2))["round"] == 1
        server2, client2 = _load_apps(tmp_path / "app2")
        # RSNA's old node, still registered, is not let in under the new App
        with pytest.raises(SiteRefused, match=r"site 'RSNA' refused: it connected as node 101, but the federation pins RSNA to node 201"):
            server2._main(grid(client2, 3, old_ids), Context(run_id=3, node_id=0, node_config={}, state=RecordDict(),
                                                             run_config=run_config("resumed")))
        server2._main(grid(client2, 4, rekeyed), Context(run_id=4, node_id=0, node_config={}, state=RecordDict(),
                                                         run_config=run_config("resumed")))
    finally:
        torch.set_num_threads(threads)
    whole = json.loads((tmp_path / "whole/history.json").read_text())
    resumed = json.loads((tmp_path / "resumed/history.json").read_text())
    for key in ("eval", "bytes_up", "bytes_down", "train_loss"):
        assert [h[key] for h in resumed] == [h[key] for h in whole], key
    # resumed, not started again: round 1 was trained under the old App (Flower run 2), round 2 under the new one
    wire = [json.loads(line) for line in (tmp_path / "resumed/wire.jsonl").read_text().splitlines()]
    assert sorted({(w["round"], w["flower_run"]) for w in wire if w["message"] == "train" and w["to"] == "server"}) == [(1, 2), (2, 4)]
    metrics = json.loads((tmp_path / "resumed/metrics.json").read_text())
    run = MlflowClient(uri).get_run(metrics["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["site.RSNA.node_id"] == "201"
    assert [m.step for m in MlflowClient(uri).get_metric_history(run.info.run_id, "mean_acc")] == [1, 2]


class LateNode(SiteGrid):
    """SiteGrid whose node ``late`` is not online for the SuperLink's first ``polls`` listings."""

    def __init__(self, app, sites: dict[str, Path], run_id: int, late: int, polls: int):
        super().__init__(app, sites, run_id)
        self.late, self.polls = late, polls

    def get_node_ids(self):
        self.polls -= 1
        return [n for n in self.contexts if n != self.late or self.polls < 0]


@pytest.mark.usefixtures("identity")
def test_a_site_that_leaves_for_good_is_left_out_of_the_rest_of_the_run_as_the_engine_leaves_it_out(sites, tmp_path):
    """A hospital leaves the federation mid-run: the coordinator marks its entry ``left: true`` and writes the App
    again. That is still the run in progress (resume_key leaves ``left`` out, as it leaves out node ids), so the new
    App resumes the old one's checkpoint: from the next round the site is neither sampled nor evaluated, while the
    others carry on from their FedBN layers on their disks, which ends with the numbers of the in-process engine
    told that the site left after round 2. Its SuperNode, still running, is told it left (by its pinned node before
    it is asked to register; unpinned, once it registered) and the run waits for the sites still in (one connects
    late). Marking one left without a run to resume, or all but one, is refused by key."""
    from mlflow.tracking import MlflowClient

    from fedsilo.fl.deploy import resume_key

    train = {**TRAIN, "rounds": 4}
    gone = "VinBigData"
    nodes = {"CheXpert": 100, "RSNA": 101, gone: 102}  # SiteGrid's nodes, in the sites' order

    def federation(name: str, left: tuple[str, ...] = (), pinned: bool = False) -> Path:
        return _marked_federation(tmp_path, name, sites, train, left, node_ids=nodes if pinned else None)

    for app, fed in (("app", federation("a")), ("app2", federation("b", (gone,), pinned=True)), ("app3", federation("c", (gone,)))):
        write_app(load_federation(fed), load_params(REPO_PARAMS), tmp_path / app)
    dep, dep2, dep3 = (json.loads((tmp_path / a / "deployment.json").read_text()) for a in ("app", "app2", "app3"))
    assert dep != dep2 != dep3 and resume_key(dep) == resume_key(dep2) == resume_key(dep3)
    assert resume_key(dep, code=False) == resume_key(dep3, code=False)  # the sites keep their stores where they are
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def ctx(run_id: int, name: str = "run") -> Context:
        return _run_context(tmp_path, run_id, name, uri)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        server, client = _load_apps(tmp_path / "app")
        with pytest.raises(ConnectionError, match="went down"):  # rounds 1-2 with every site, then the SuperLink goes down
            server._main(DownAt(client, sites, rnd=3, run_id=1), ctx(1))
        server2, client2 = _load_apps(tmp_path / "app2")
        with pytest.raises(ConnectionError, match="went down"):  # round 3 without it; the coordinator's machine goes down
            server2._main(DownAt(client2, sites, rnd=4, run_id=2), ctx(2))
        with pytest.raises(ConfigError, match=rf"sites: {gone} marked left, but there is no checkpoint of this deployment to resume"):
            server2._main(SiteGrid(client2, sites, run_id=4), ctx(4, "fresh"))
        server3, client3 = _load_apps(tmp_path / "app3")
        grid = LateNode(client3, sites, run_id=5, late=nodes["RSNA"], polls=3)  # RSNA comes online late
        server3._main(grid, ctx(5))
    finally:
        torch.set_num_threads(threads)
    history = json.loads((tmp_path / "run/history.json").read_text())
    metrics = json.loads((tmp_path / "run/metrics.json").read_text())
    assert metrics["sites_left"] == {gone: 2} and metrics["clients"] == ["CheXpert", "RSNA", gone]
    assert [h.get("left", []) for h in history] == [[], [], [gone], [gone]]
    assert all(gone not in h["sampled"] and set(h["eval"]) == {"CheXpert", "RSNA"} for h in history[2:])
    assert all(gone in h["sampled"] and gone in h["eval"] for h in history[:2])
    assert metrics["mean_acc"] == pytest.approx(np.mean([v["acc"] for v in history[-1]["eval"].values()]))
    run = MlflowClient(uri).get_run(metrics["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags[f"site.{gone}.left_after_round"] == "2"
    wire = [json.loads(line) for line in (tmp_path / "run/wire.jsonl").read_text().splitlines()]
    note = f"site {gone!r} left the federation (sites[2].left in federation.yaml)"
    for flower_run, asked in ((2, [100, 101]), (5, [100, 102, 101])):  # pinned: told, never asked; unpinned: asked, then told
        lines = [w for w in wire if w["flower_run"] == flower_run and w["round"] == 0 and w["to"] == "site"]
        assert [w["node"] for w in lines if w["message"] == "query.register"] == asked, flower_run
        told = [w for w in lines if w["message"] == "query.refused"]
        assert [w["node"] for w in told] == [102] and note in told[0]["reason"], flower_run

    # the in-process engine on the same three splits, told that the site left after round 2: the same numbers
    reference = _engine_reference(dep, sites, left={gone: 2})
    for key in ("sampled", "eval", "bytes_up", "bytes_down", "train_loss", "mean_acc"):
        assert [h[key] for h in history] == [h[key] for h in reference], key
    assert [h.get("left") for h in reference] == [h.get("left") for h in history]

    with pytest.raises(ConfigError, match=r"sites: 2 of the 3 sites marked left; a federation needs two sites that have not left"):
        load_federation(federation("d", (gone, "RSNA")))


@pytest.mark.usefixtures("identity")
def test_a_site_that_left_comes_back_when_its_mark_is_taken_away_as_the_engine_has_it(sites, tmp_path):
    """A hospital that left (``left: true``, the App written again and resumed) comes back: the coordinator takes the
    mark away and writes the App again, which resumes the run's checkpoint with the site in it from the next round.
    It registers again and carries on from its FedBN layers on its disk (as after rounds it was not sampled for),
    which ends with the numbers of the in-process engine told that the site was away in round 2. The history
    names it as left in that round and back in round 3; metrics.json and MLflow record the rounds it was gone. A site
    gone in a round of a local phase every site trains comes back to pFedDB, training the round it missed first, and
    is refused by FedAvg with ``local_rounds`` (its federation starts from the local phase's uploads)."""
    from mlflow.tracking import MlflowClient

    train = {**TRAIN, "rounds": 3}
    gone = "VinBigData"

    def federation(name: str, left: tuple[str, ...] = (), method: str = "fedbn") -> Path:
        return _marked_federation(tmp_path, name, sites, train, left, method=method)

    for app, fed in (("app", federation("a")), ("app2", federation("b", (gone,)))):
        write_app(load_federation(fed), load_params(REPO_PARAMS), tmp_path / app)
    dep = json.loads((tmp_path / "app" / "deployment.json").read_text())
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def ctx(run_id: int, name: str = "run") -> Context:
        return _run_context(tmp_path, run_id, name, uri)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        server, client = _load_apps(tmp_path / "app")
        with pytest.raises(ConnectionError, match="went down"):  # round 1 with every site
            server._main(DownAt(client, sites, rnd=2, run_id=1), ctx(1))
        server2, client2 = _load_apps(tmp_path / "app2")
        with pytest.raises(ConnectionError, match="went down"):  # round 2 without it
            server2._main(DownAt(client2, sites, rnd=3, run_id=2), ctx(2))
        server._main(SiteGrid(client, sites, run_id=3), ctx(3))  # its mark taken away: round 3 with it again
    finally:
        torch.set_num_threads(threads)
    history = json.loads((tmp_path / "run/history.json").read_text())
    metrics = json.loads((tmp_path / "run/metrics.json").read_text())
    assert [h.get("left", []) for h in history] == [[], [gone], []]
    assert [h.get("back", []) for h in history] == [[], [], [gone]]
    assert metrics["sites_left"] == {} and metrics["sites_away"] == {gone: [[2, 2]]}
    assert gone in history[2]["sampled"] and gone in history[2]["eval"]
    run = MlflowClient(uri).get_run(metrics["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags[f"site.{gone}.away_rounds"] == "2-2"

    reference = _engine_reference(dep, sites, away={gone: [(2, 2)]})
    for key in ("sampled", "eval", "bytes_up", "bytes_down", "train_loss", "mean_acc", "left", "back"):
        assert [h.get(key) for h in history] == [h.get(key) for h in reference], key
    assert gone not in history[1]["sampled"] and history[2]["train_loss"][gone] != history[0]["train_loss"][gone]

    # pFedDB with two local rounds: gone in round 2, the last of its Phase 1, it comes back in round 3 and first trains
    # the Phase-1 round it missed, as the server's download says (the engine's numbers with `away`); FedAvg with two
    # local rounds (its sites do not catch up) refuses it, naming the rounds
    coordinator = yaml.safe_load(REPO_PARAMS.read_text())
    coordinator["methods"]["pfeddb"]["local_rounds"] = 2
    coordinator["methods"]["fedavg"] = {"local_rounds": 2}
    (tmp_path / "coordinator.yaml").write_text(yaml.safe_dump(coordinator, sort_keys=False))
    for m in ("pfeddb", "fedavg"):
        for app, fed in ((f"{m}_app", federation(f"{m}a", method=m)), (f"{m}_app2", federation(f"{m}b", (gone,), method=m))):
            write_app(load_federation(fed), load_params(tmp_path / "coordinator.yaml"), tmp_path / app)
    torch.set_num_threads(1)
    try:
        for k, m in enumerate(("pfeddb", "fedavg")):
            server, client = _load_apps(tmp_path / f"{m}_app")
            with pytest.raises(ConnectionError, match="went down"):
                server._main(DownAt(client, sites, rnd=2, run_id=4 + 3 * k), ctx(4 + 3 * k, m))
            server2, client2 = _load_apps(tmp_path / f"{m}_app2")
            with pytest.raises(ConnectionError, match="went down"):
                server2._main(DownAt(client2, sites, rnd=3, run_id=5 + 3 * k), ctx(5 + 3 * k, m))
            if m == "fedavg":
                with pytest.raises(ConfigError, match=rf"sites: {gone} left after round 1 .* missed round\(s\) 2-2 of fedavg's local phase"):
                    server._main(SiteGrid(client, sites, run_id=6 + 3 * k), ctx(6 + 3 * k, m))
            else:
                server._main(SiteGrid(client, sites, run_id=6 + 3 * k), ctx(6 + 3 * k, m))
    finally:
        torch.set_num_threads(threads)
    history = json.loads((tmp_path / "pfeddb/history.json").read_text())
    reference = _engine_reference(json.loads((tmp_path / "pfeddb_app/deployment.json").read_text()), sites, away={gone: [(2, 2)]})
    for key in ("sampled", "eval", "bytes_up", "bytes_down", "train_loss", "mean_acc", "left", "back"):
        assert [h.get(key) for h in history] == [h.get(key) for h in reference], key
    assert history[2]["bytes_down"][gone] == history[2]["bytes_down"]["CheXpert"] + 16  # the round to catch up: two int64


@pytest.mark.usefixtures("identity")
@pytest.mark.parametrize("method, params", [("fedheal", {}), ("cd2pfed", {}), ("pfeddb", {"local_rounds": 1})])
def test_a_site_joins_a_run_of_a_method_that_counts_the_federation_or_keeps_a_record_per_site(method, params, sites, tmp_path):
    """Over Flower, as on the engine: a site joining in round 2 gives the numbers of the engine whose third client
    joins in round 2, for FedHEAL, whose starting weight 1 / K counts the sites of the round (the engine, told of the
    joiner from the start, counts it from its round only), CD2-pFed, whose server keeps each site's last round by
    name (a record sized by the federation the run started with had no place for the joiner), and pFedDB, whose
    joiner trains the Phase-1 round it missed first, as the server's download says (its store on its disk)."""
    train = {**TRAIN, "rounds": 3}
    new = "VinBigData"
    first = {k: sites[k] for k in ("chexpert", "rsna")}
    coordinator = yaml.safe_load(REPO_PARAMS.read_text())
    coordinator["methods"].update({method: params})
    (tmp_path / "coordinator.yaml").write_text(yaml.safe_dump(coordinator, sort_keys=False))

    def federation(name: str, members: dict) -> Path:
        (tmp_path / name).mkdir()
        raw = yaml.safe_load(_federation(tmp_path / name, members, method=method, train=train).read_text())
        for entry in raw["sites"]:
            entry["joined"] = entry["name"] == new
        (tmp_path / name / "federation.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        return tmp_path / name / "federation.yaml"

    for app, fed in (("app", federation("a", first)), ("app2", federation("b", sites))):
        write_app(load_federation(fed), load_params(tmp_path / "coordinator.yaml"), tmp_path / app)
    dep2 = json.loads((tmp_path / "app2" / "deployment.json").read_text())
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                  run_config={"results-dir": str(tmp_path / "run"), "state-dir": str(tmp_path / "run.state"), "wait-s": 30})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        server, client = _load_apps(tmp_path / "app")
        with pytest.raises(ConnectionError, match="went down"):  # round 1 with the two sites
            server._main(DownAt(client, first, rnd=2, run_id=1), ctx)
        server2, client2 = _load_apps(tmp_path / "app2")
        server2._main(SiteGrid(client2, sites, run_id=2), ctx)  # resumed with the new site, to the end
    finally:
        torch.set_num_threads(threads)
    history = json.loads((tmp_path / "run/history.json").read_text())
    assert [h.get("joined") for h in history] == [None, [new], None]
    reference = _engine_reference(dep2, sites, joined={new: 2})
    for key in ("sampled", "eval", "bytes_up", "bytes_down", "train_loss", "mean_acc"):
        assert [h[key] for h in history] == [h[key] for h in reference], key


@pytest.mark.usefixtures("identity")
def test_a_site_that_joins_a_run_in_progress_takes_part_from_the_next_round_as_the_engine_has_it(sites, tmp_path, monkeypatch):
    """A hospital joins a federation mid-run: the coordinator lists it after the sites the run started with, marked
    ``joined: true``, and writes the App again. resume_key covers the sites the run started with, so the new App
    resumes the checkpoint; the new site takes part from the next round, from a fresh store (Ditto: its personal
    model, the seeded initial model as every site's started), which ends with the numbers of the in-process engine
    whose third client joins in round 2. Refused by key: a site marked joined with no run to resume; once it joined,
    its mark taken away (the run would start afresh) or other data pinned for it; one listed before a site the run
    started with; a method not declared joinable (pFedDB made so here); FedAvg with local rounds once one went by; a
    run with no round left."""
    from fedsilo.fl.deploy import resume_key

    train = {**TRAIN, "rounds": 3}
    new = "VinBigData"
    first = {k: sites[k] for k in ("chexpert", "rsna")}
    coordinator = yaml.safe_load(REPO_PARAMS.read_text())
    coordinator["methods"].update({"ditto": {"lam": 0.5}, "pfeddb": {"local_rounds": 1},
                                   "fedavg_lr2": {"method": "fedavg", "local_rounds": 2}})
    (tmp_path / "coordinator.yaml").write_text(yaml.safe_dump(coordinator, sort_keys=False))

    def federation(name: str, members: dict, method: str = "ditto", mark: bool = True, **pin) -> Path:
        (tmp_path / name).mkdir()
        raw = yaml.safe_load(_federation(tmp_path / name, members, method=method, train=train, **pin).read_text())
        for entry in raw["sites"]:
            entry["joined"] = entry["name"] == new and mark
        (tmp_path / name / "federation.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        return tmp_path / name / "federation.yaml"

    for app, fed in (("app", federation("a", first)), ("app2", federation("b", sites)), ("unmarked", federation("u", sites, mark=False)),
                     ("other", federation("o", sites, VinBigData="f" * 64))):
        write_app(load_federation(fed), load_params(tmp_path / "coordinator.yaml"), tmp_path / app)
    dep, dep2 = (json.loads((tmp_path / a / "deployment.json").read_text()) for a in ("app", "app2"))
    assert resume_key(dep) == resume_key(dep2) and resume_key(dep, code=False) == resume_key(dep2, code=False)

    def ctx(run_id: int, name: str = "run") -> Context:
        return Context(run_id=run_id, node_id=0, node_config={}, state=RecordDict(),
                       run_config={"results-dir": str(tmp_path / name), "state-dir": str(tmp_path / f"{name}.state"), "wait-s": 30})

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        server, client = _load_apps(tmp_path / "app")
        with pytest.raises(ConnectionError, match="went down"):  # round 1 with the two sites, then the SuperLink goes down
            server._main(DownAt(client, first, rnd=2, run_id=1), ctx(1))
        server2, client2 = _load_apps(tmp_path / "app2")
        with pytest.raises(ConfigError, match=rf"sites: {new} marked joined, but there is no checkpoint of this deployment to resume"):
            server2._main(SiteGrid(client2, sites, run_id=2), ctx(2, "fresh"))
        with pytest.raises(ConnectionError, match="went down"):  # round 2 with the new site, then the SuperLink goes down
            server2._main(DownAt(client2, sites, rnd=3, run_id=3), ctx(3))
        unmarked, unmarked_client = _load_apps(tmp_path / "unmarked")
        with pytest.raises(ConfigError, match=rf"sites: {new} joined the run in progress in .* and is no longer marked `joined: true`"):
            unmarked._main(SiteGrid(unmarked_client, sites, run_id=4), ctx(4))
        other, other_client = _load_apps(tmp_path / "other")
        with pytest.raises(ConfigError, match=rf"sites\[2\]: {new} joined the run with data fingerprint .* and the federation pins "
                                              "ffffffffffffffff now"):
            other._main(SiteGrid(other_client, sites, run_id=5), ctx(5))
        server2._main(SiteGrid(client2, sites, run_id=6), ctx(6))
    finally:
        torch.set_num_threads(threads)
    history = json.loads((tmp_path / "run/history.json").read_text())
    metrics = json.loads((tmp_path / "run/metrics.json").read_text())
    assert metrics["sites_joined"] == {new: 2} and metrics["clients"] == ["CheXpert", "RSNA", new]
    assert [h["sampled"] for h in history] == [["CheXpert", "RSNA"]] + [["CheXpert", "RSNA", new]] * 2
    assert [h.get("joined") for h in history] == [None, [new], None] and new not in history[0]["eval"] and new in history[1]["eval"]

    # the in-process engine on the three splits, its third client joining in round 2: the same numbers
    engines: list = []
    reference = _engine_reference(dep2, sites, keep=engines, joined={new: 2})
    for key in ("sampled", "eval", "bytes_up", "bytes_down", "train_loss", "mean_acc"):
        assert [h[key] for h in history] == [h[key] for h in reference], key

    # the coordinator's final_model.pt is Ditto's global model, the engine's server state: a whole model, which a
    # hospital scores its images with (`fedsilo site predict --model final_model.pt`)
    import pandas as pd

    from fedsilo.cli import main
    from fedsilo.client.local import predict
    from fedsilo.fl.deploy import load_site_model

    final = tmp_path / "run" / "final_model.pt"
    held = torch.load(final, weights_only=True)["server"]
    assert held.keys() == engines[0].server.keys() and all(torch.equal(held[k], engines[0].server[k]) for k in held)
    model, info = load_site_model(final)
    assert info["round"] == 3 and "site" not in info
    vin = sites["vinbigdata"].parent
    table = pd.read_parquet(vin / "data/harmonized/chest_xray4/records.parquet").head(3)
    out = tmp_path / "global.csv"
    assert main(["-q", "--params", str(sites["vinbigdata"]), "--root", str(vin), "site", "predict", "--experiment", "site",
                 "--model", str(final), "--out", str(out), "--images", *[str(vin / "data/raw/vinbigdata" / p) for p in table["source_path"]]]) == 0
    x = torch.from_numpy(np.load(vin / "data/harmonized/chest_xray4/images.npy")[:3]).permute(0, 3, 1, 2).contiguous()
    rows = pd.read_csv(out)
    assert np.allclose(rows[["prob.Normal", "prob.Lung Opacity"]].to_numpy(dtype=float), predict(model, x, cfg=CPU_TRAIN).softmax(1).numpy(), atol=1e-6)

    # a method not declared joinable (a new one's default) refuses, naming why (pFedDB, made so for the test)
    from fedsilo.methods.pfeddb.method import PFedDB

    monkeypatch.setattr(PFedDB, "joinable", False)
    monkeypatch.setattr(PFedDB, "join_refusal", "its Phase 2 starts from each site's Phase-1 model", raising=False)

    def joining(tag: str, method: str, run_id: int) -> tuple:
        """The apps of ``method`` without the new site and with it marked joined, after round 1 without it (the
        SuperLink going down at round 2): ((server, client) without it, (server, client) with it)."""
        for app, members in ((tag, first), (f"{tag}2", sites)):
            write_app(load_federation(federation(f"{app}_fed", members, method)), load_params(tmp_path / "coordinator.yaml"),
                      tmp_path / app)
        server, client = _load_apps(tmp_path / tag)
        with pytest.raises(ConnectionError, match="went down"):
            server._main(DownAt(client, first, rnd=2, run_id=run_id), ctx(run_id, tag))
        return (server, client), _load_apps(tmp_path / f"{tag}2")

    torch.set_num_threads(1)
    try:
        _, (heal2, heal_client2) = joining("heal", "pfeddb", 7)
        with pytest.raises(ConfigError, match=rf"sites: {new} marked joined: pfeddb takes no site mid-run \(its Phase 2 "
                                              r"starts .* a site can join a run of cd2pfed, ditto, f2dc, fdse, fedavg"):
            heal2._main(SiteGrid(heal_client2, sites, run_id=8), ctx(8, "heal"))
        # FedAvg with two local rounds, whose sites do not catch up: no site joins while its local phase is under way
        (fa, fa_client), (fa2, fa_client2) = joining("fa", "fedavg_lr2", 11)
        with pytest.raises(ConfigError, match=rf"sites: {new} marked joined in round 2, but fedavg_lr2's local phase, which every "
                                              r"site trains from round 1 .* has rounds 1-1 behind it: join after round 2"):
            fa2._main(SiteGrid(fa_client2, sites, run_id=12), ctx(12, "fa"))
        with pytest.raises(ConnectionError, match="went down"):  # round 2, the local phase's last, without it
            fa._main(DownAt(fa_client, first, rnd=3, run_id=13), ctx(13, "fa"))
        fa2._main(SiteGrid(fa_client2, sites, run_id=14), ctx(14, "fa"))  # then it joins, in round 3
    finally:
        torch.set_num_threads(threads)
    assert [h.get("joined") for h in json.loads((tmp_path / "fa/history.json").read_text())] == [None, None, [new]]
    # a run whose checkpoint holds its last round (the ServerApp stopped as it wrote the results): no round to join
    import fedsilo.fl.deploy as deploy

    def stopped(*args, **kw):
        raise KeyboardInterrupt

    torch.set_num_threads(1)
    try:
        with monkeypatch.context() as m:
            m.setattr(deploy, "_write_results", stopped)
            with pytest.raises(KeyboardInterrupt):
                server._main(SiteGrid(client, first, run_id=9), ctx(9, "last"))
        with pytest.raises(ConfigError, match=rf"sites: {new} marked joined, but the run's checkpoint holds its last round \(3\)"):
            server2._main(SiteGrid(client2, sites, run_id=10), ctx(10, "last"))
    finally:
        torch.set_num_threads(threads)
    raw = yaml.safe_load((tmp_path / "b/federation.yaml").read_text())
    raw["sites"] = [raw["sites"][2], *raw["sites"][:2]]
    (tmp_path / "e").mkdir()
    (tmp_path / "e/federation.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ConfigError, match=rf"sites: CheXpert, RSNA listed after {new}, which joined the run in progress"):
        load_federation(tmp_path / "e/federation.yaml")


def test_a_site_audit_reads_each_flower_run_apart_counts_error_replies_apart_and_names_a_cut_line(tmp_path, capsys):
    """A log of two Flower runs (the second started afresh from round 1), a refused train (an error reply), and a
    last line cut short (a SuperNode killed while writing): each run with its rounds, the error beside the real
    uploads, the cut line named by number; a stray copy of a store file is not taken for one."""
    from fedsilo.cli import main
    from fedsilo.fl.deploy import site_audit
    from fedsilo.fl.flower import KeptStores

    folder = tmp_path / "state/deploy/fed/0123456789abcdef"
    up = {"arrays": {"up": {"w": ["float32", [4]]}}, "tensor_bytes": {"up": 16}}
    lines = [{"round": r, "message": "train", "to": "server", "flower_run": run, **up} for run, rs in ((1, (1, 2)), (2, (1,))) for r in rs]
    lines.append({"round": 2, "message": "train", "to": "server", "flower_run": 2, "error": "PrivacyViolation: refused"})
    folder.mkdir(parents=True)
    (folder / "wire.jsonl").write_text("".join(json.dumps(w) + "\n" for w in lines) + '{"round": 3, "message": "tr')
    kept = KeptStores(folder, "Site A")
    kept.save(1, {"bn": torch.zeros(3)})
    (kept.folder / "store-r000001-copy.pt").write_bytes(kept.path(1).read_bytes())
    (audit,) = site_audit(tmp_path)
    assert audit["runs"] == {"1": [1, 2], "2": [1, 2]} and audit["unreadable_lines"] == [len(lines) + 1]
    assert (audit["sent"]["train"]["messages"], audit["sent"]["train"]["errors"], audit["sent_tensor_bytes"]) == (3, 1, 48)
    assert audit["errors"] == [{"round": 2, "message": "train", "flower_run": 2, "error": "PrivacyViolation: refused"}]
    assert audit["kept"]["Site A"]["rounds"] == [1] and audit["kept"]["Site A"]["tensor_bytes"] == 12
    capsys.readouterr()
    assert main(["--root", str(tmp_path), "site", "audit"]) == 0
    text = capsys.readouterr().out
    assert "Flower runs 1 (rounds 1-2), 2 (rounds 1-2)" in text and "sent train x3" in text and "1 errors" in text
    assert "1 lines cannot be read" in text
    assert "a reply counts as sent when the ClientApp handed it to this site's SuperNode" in text  # not that it arrived


def test_kept_stores_give_only_the_round_the_server_names_and_no_later_one(tmp_path):
    from fedsilo.fl.engine import PrivacyViolation
    from fedsilo.fl.flower import KeptStores

    kept = KeptStores(tmp_path, "Site A/1")
    for r in (1, 2, 3):
        kept.save(r, {"bn.weight": torch.full((2,), float(r))})
    assert kept.folder == tmp_path / "Site_A_1" and kept.rounds() == [1, 2, 3]
    cpu = torch.device("cpu")
    assert torch.equal(kept.load(2, limit=2, device=cpu)["bn.weight"], torch.full((2,), 2.0))
    # a train message of round 2 may use the store after round 1 at most, whatever the server names
    with pytest.raises(PrivacyViolation, match=r"store of round 2 for a message that allows round 1 at most"):
        kept.load(2, limit=1, device=cpu)
    # another site's file under this site's name is refused; a missing round is named with what is kept
    torch.save({"round": 2, "site": "Site B", "store": {}}, kept.path(2))
    with pytest.raises(RuntimeError, match=r"holds round 2 of site 'Site B', not round 2 of 'Site A/1'"):
        kept.load(2, limit=3, device=cpu)
    kept.drop_before(2)  # a resume after round 2 needs round 2's store or a later one
    assert kept.rounds() == [2, 3]
    kept.drop_before(0)  # no checkpoint yet: nothing can go
    assert kept.rounds() == [2, 3]
    with pytest.raises(FileNotFoundError, match=r"store-r000001.pt is missing \(kept: rounds \[2, 3\]\)"):
        kept.load(1, limit=3, device=cpu)
    # a store written after round 2 replaces those of later rounds (an attempt that did not reach them, an earlier run)
    kept.save(2, {"bn.weight": torch.zeros(2)})
    assert kept.rounds() == [2]


def test_a_checkpoint_resumes_only_the_same_deployment_and_code(tmp_path):
    from fedsilo.fl.deploy import peek_checkpoint, resume_key

    dep = {"federation": "f", "method": {"key": "fedbn"}, "train": {"lr": 0.05, "checkpoint_every": 1}, "sites": []}
    key = resume_key(dep)
    # how often it is written is not what is trained; the learning rate is; the sites' folder key has no code in it
    assert resume_key({**dep, "train": {"lr": 0.05, "checkpoint_every": 5}}) == key
    assert resume_key({**dep, "train": {"lr": 0.01, "checkpoint_every": 1}}) != key
    assert resume_key(dep, code=False) != key
    torch.save({"config_hash": key, "round": 3, "meta": {"mlflow_run_id": "abc"}}, tmp_path / "checkpoint.pt")
    assert peek_checkpoint(tmp_path / "checkpoint.pt", key) == {"round": 3, "mlflow_run_id": "abc"}
    assert peek_checkpoint(tmp_path / "checkpoint.pt", resume_key({**dep, "seed": 1})) is None
    assert peek_checkpoint(tmp_path / "absent.pt", key) is None


@pytest.mark.usefixtures("identity")
def test_a_site_with_other_data_than_the_federation_pins_is_refused_by_name(sites, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    app = _deployed(tmp_path, sites, RSNA="0" * 64)
    server, client = _load_apps(app)
    grid = SiteGrid(client, sites)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(SiteRefused, match=r"site 'RSNA' refused: its data fingerprint [0-9a-f]{16} is not the one the "
                                          r"federation pins for it \(sites\[1\], RSNA: 0{16}\); same contract"):
        server._main(grid, _server_context(tmp_path, **{"tracking-uri": uri}))
    assert not (tmp_path / "results").exists()
    from mlflow.tracking import MlflowClient

    runs = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("deploy/three_hospitals").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]  # the refused run is not left RUNNING
    assert [kind for kind, _ in grid.replies].count("query.refused") == 1  # the refused site was told why
    wire = [json.loads(line) for line in (tmp_path / "results.wire/wire.jsonl").read_text().splitlines()]
    assert [w for w in wire if w["message"] == "query.refused"][0]["reason"].startswith("site 'RSNA' refused")


@pytest.mark.usefixtures("identity")
def test_a_site_harmonized_to_another_contract_or_unlisted_or_twice_is_refused(sites, tmp_path):
    app = _deployed(tmp_path, sites)
    server, client = _load_apps(app)
    ctx = _server_context(tmp_path)
    # RSNA harmonized at 8 px instead of the agreed 16: the message says the contract differs, and how
    small = make_site(tmp_path / "rsna8", "rsna", image_size=8)
    with pytest.raises(SiteRefused, match=r"site 'RSNA' refused: .*its contract differs: image_shape \[8, 8, 1\] \(agreed \[16, 16, 1\]\)"):
        server._main(SiteGrid(client, {**sites, "rsna": small}), ctx)
    # a fourth node whose site the federation does not list, and a second node claiming CheXpert: both refused
    other = make_site(tmp_path / "openi", "openi")
    grid = SiteGrid(client, {**sites, "openi": other, "chexpert2": sites["chexpert"]})
    with pytest.raises(SiteRefused) as err:
        server._main(grid, ctx)
    assert "site 'OpenI' is not one of the federation's 3 sites: refused" in str(err.value)
    assert "site 'CheXpert' refused: another node registered under that name first" in str(err.value)
    assert [kind for kind, _ in grid.replies].count("query.refused") == 2


@pytest.mark.usefixtures("identity")
def test_a_site_name_pinned_to_a_node_is_refused_from_any_other_node(sites, tmp_path):
    """federation.yaml pins each site to the node-id `flwr supernode register` gave its key: a node registered with
    another key cannot take the site's name (here RSNA's entry pins the node VinBigData connects as)."""
    nodes = {_card(p)["site"]: 100 + k for k, p in enumerate(sites.values())}  # SiteGrid's node of each site
    pins = {**nodes, "RSNA": nodes["VinBigData"]}
    app = _deployed(tmp_path, sites, node_ids=pins)
    server, client = _load_apps(app)
    grid = SiteGrid(client, sites)
    with pytest.raises(SiteRefused) as err:
        server._main(grid, _server_context(tmp_path))
    assert str(err.value) == (f"site 'RSNA' refused: it connected as node {nodes['RSNA']}, but the federation pins RSNA to node "
                              f"{nodes['VinBigData']} (the node `flwr supernode register` created for RSNA's public key): another "
                              "site's key, or a re-registered key whose new node-id the coordinator has not pinned")
    assert [kind for kind, _ in grid.replies].count("query.refused") == 1  # CheXpert and VinBigData came from their nodes
    with pytest.raises(ConfigError, match=r"sites.0.node_id"):
        load_federation(_federation(tmp_path, sites, node_ids={"CheXpert": 0}))


def test_the_shipped_site_params_and_federation_example_validate(tmp_path):
    """deploy/site/params.yaml (a hospital's template) loads; deploy/federation.example.yaml resolves into an App
    against the repository's params.yaml; a federation naming an unknown method or a bad fingerprint is refused by key."""
    repo = REPO_PARAMS.parent
    site = load_params(repo / "deploy/site/params.yaml")
    assert site.experiments["site"].split.protocol == "domain_clients"
    fed = load_federation(repo / "deploy/federation.example.yaml")
    dep = write_app(fed, load_params(REPO_PARAMS), tmp_path / "app")
    assert dep["method"]["base"] == "fedbn" and [s["name"] for s in dep["sites"]] == ["CheXpert", "RSNA", "VinBigData"]
    assert sorted(p.name for p in (tmp_path / "app").iterdir()) == ["deployment.json", "fedsilo_app.py", "pyproject.toml"]
    raw = yaml.safe_load((repo / "deploy/federation.example.yaml").read_text())
    with pytest.raises(ConfigError, match=r"method: 'fedmagic' is not a methods entry"):
        write_app(load_federation(_dump(tmp_path / "a.yaml", {**raw, "method": "fedmagic"})), load_params(REPO_PARAMS), tmp_path / "app2")
    assert not (tmp_path / "app2").exists()  # nothing half-written
    bad = {**raw, "sites": [{**raw["sites"][0], "fingerprint": "abc"}] + raw["sites"][1:]}
    with pytest.raises(ConfigError, match=r"sites.0.fingerprint"):
        load_federation(_dump(tmp_path / "b.yaml", bad))
    with pytest.raises(ConfigError, match=r"train.rounds"):
        load_federation(_dump(tmp_path / "c.yaml", {**raw, "train": {**raw["train"], "rounds": 0}}))
    # a host policy the sites could not build: refused with the federation file, not in every site's first batch
    with pytest.raises(ConfigError, match=r"h\.yaml: train\.augment\.host\[0\]\.name: 'Clahe' is not an albumentations transform"):
        load_federation(_dump(tmp_path / "h.yaml", {**raw, "train": {**raw["train"], "augment": {"host": [{"name": "Clahe"}]}}}))
    # statistics for three channels on the grey chest X-ray contract: refused when the App is written, not at the sites
    with pytest.raises(ConfigError, match=r"train.normalize: mean has 3 values for images of 1 channel\(s\)"):
        write_app(load_federation(_dump(tmp_path / "n.yaml", {**raw, "train": {**raw["train"], "normalize": "imagenet"}})),
                  load_params(REPO_PARAMS), tmp_path / "app4")
    assert not (tmp_path / "app4").exists()
    # F²DC's modules after a unit that gives no feature map on the federation's backbone: refused when the App is
    # written (it failed in the ServerApp after every site had registered), naming the key
    coordinator = yaml.safe_load(REPO_PARAMS.read_text())
    coordinator["methods"]["f2dc_fc"] = {"method": "f2dc", "layers": ["fc2"]}
    (tmp_path / "coord.yaml").write_text(yaml.safe_dump(coordinator))
    with pytest.raises(ConfigError, match=r"methods\.f2dc_fc\.layers: unit 'fc2' gives a 2-d output.* \[f2dc on the backbone simple_cnn, train\.model\]"):
        write_app(load_federation(_dump(tmp_path / "f.yaml", {**raw, "method": "f2dc_fc", "train": {**raw["train"], "model": "simple_cnn"}})),
                  load_params(tmp_path / "coord.yaml"), tmp_path / "app5")
    assert not (tmp_path / "app5").exists()
    # where the run is logged goes to the App's run config as written (any character), not into the deployment's hash
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:  # 3.10: the same parser, as Flower's dependency
        import tomli as tomllib

    uri = 'sqlite:///C:\\runs\\"fed"\x7f\t\U0001f600.db'
    dep2 = write_app(load_federation(_dump(tmp_path / "d.yaml", {**raw, "tracking_uri": uri})), load_params(REPO_PARAMS), tmp_path / "app3")
    config = tomllib.loads((tmp_path / "app3/pyproject.toml").read_text(encoding="utf-8"))["tool"]["flwr"]["app"]["config"]
    assert config["tracking-uri"] == uri and dep2 == dep
    # the App's run-config keys the ServerApp reads, as written; a whole-number key given a word is refused by key
    from types import SimpleNamespace

    from fedsilo.fl.deploy import _int_config

    assert config["min-train-sites"] == 0 and config["min-eval-sites"] == 0 and config["rejoin-s"] == 600.0
    assert _int_config(SimpleNamespace(run_config={"min-train-sites": 2}), "min-train-sites", 0) == 2
    assert _int_config(SimpleNamespace(run_config={}), "min-train-sites", 0) == 0
    for bad in ("two", 1.5, True):
        with pytest.raises(ConfigError, match=r"run config min-train-sites: .* is not a whole number"):
            _int_config(SimpleNamespace(run_config={"min-train-sites": bad}), "min-train-sites", 0)


@pytest.fixture(autouse=True)
def _no_outside_tracking_store(monkeypatch):
    """The ServerApp logs to MLFLOW_TRACKING_URI when it is set: never to a store outside the test's folder."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _dump(path: Path, obj: dict) -> Path:
    path.write_text(yaml.safe_dump(obj))
    return path


@pytest.mark.usefixtures("identity")
def test_hospitals_with_a_stream_of_domains_learn_it_as_the_continual_engine_does(tmp_path, monkeypatch):
    """Three hospitals whose images come as a stream of domains, each split by its own `domain_incremental`
    (one client, its own name): the cards list each task's counts, the deployed pFedDIL run gives the continual
    engine's numbers on the same streams, and metrics.json holds the stream's accuracy matrix and forgetting. A
    hospital that leaves mid-stream: the rest of the run is the continual engine's with it left; it cannot come back."""
    from fedsilo.fl.continual import ContinualEngine
    from tests.deploy_sites import make_stream_site

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    sites = {n: make_stream_site(tmp_path / n.replace(" ", "_"), n, mirror_seed=k) for k, n in enumerate(("Hospital A", "Hospital B", "Hospital C"))}
    card = _card(sites["Hospital B"])
    assert card["site"] == "Hospital B" and [t["domain"] for t in card["tasks"]] == ["CheXpert", "OpenI"]
    assert card["n_train"] == sum(t["n_train"] for t in card["tasks"]) and all(t["n_train"] and t["n_test"] for t in card["tasks"])
    coordinator = yaml.safe_load(REPO_PARAMS.read_text())
    coordinator["methods"]["pfeddil"] = {"lam": 0.5}
    (tmp_path / "coordinator.yaml").write_text(yaml.safe_dump(coordinator, sort_keys=False))
    train = {**TRAIN, "client_fraction": 0.67}
    fed = load_federation(_federation(tmp_path, sites, method="pfeddil", train=train))
    write_app(fed, load_params(tmp_path / "coordinator.yaml"), tmp_path / "app", results=str(tmp_path / "results"))
    server, client = _load_apps(tmp_path / "app")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        server._main(SiteGrid(client, sites), _server_context(tmp_path))
        spec = deployment_spec(json.loads((tmp_path / "app/deployment.json").read_text()))
        streams = [load_site(load_params(p), "site", p.parent, torch.device("cpu"), index=k) for k, p in enumerate(sites.values())]
        tasks = [[s[t] for s in streams] for t in range(2)]
        reference = ContinualEngine(spec.method(), spec.make_model(), tasks, ["CheXpert", "OpenI"], spec.train, 0).run()
    finally:
        torch.set_num_threads(threads)
    history = json.loads((tmp_path / "results/history.json").read_text())
    assert [h["domain"] for h in history] == ["CheXpert", "CheXpert", "OpenI", "OpenI"]
    # train_flops: the last round's training and announcements (pFedDIL's Eq. 2 passes), counted on the sites
    for key in ("sampled", "eval", "task_acc", "bytes_up", "bytes_task_end", "storage", "train_flops"):
        assert [h.get(key) for h in history] == [h.get(key) for h in reference], key
    assert history[-1]["train_flops"] > 0 and json.loads((tmp_path / "results/metrics.json").read_text())["client_domains"] == {
        n: ["CheXpert", "OpenI"] for n in sites}
    metrics = json.loads((tmp_path / "results/metrics.json").read_text())
    assert len(metrics["accuracy_matrix"]) == 2 and metrics["forgetting"] is not None
    assert metrics["mean_acc"] == metrics["final_acc"] and metrics["clients"] == ["Hospital A", "Hospital B", "Hospital C"]
    wire = [json.loads(line) for line in (tmp_path / "results/wire.jsonl").read_text().splitlines()]
    ends = [w for w in wire if w["message"] == "query.task_end"]
    assert ends and all(set(w.get("arrays", {})) <= {"keep"} for w in ends)  # the family model to the site, nothing back

    # a site leaving mid-stream (after round 1, inside task 0): the rounds after go on without it, as the continual
    # engine's with that site left: not sampled, sent no task end, not evaluated (a task's accuracy over the others)
    (tmp_path / "cut").mkdir()
    raw = yaml.safe_load((tmp_path / "federation.yaml").read_text())
    raw["sites"][2]["left"] = True
    (tmp_path / "cut/federation.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    write_app(load_federation(tmp_path / "cut/federation.yaml"), load_params(tmp_path / "coordinator.yaml"), tmp_path / "app2",
              results=str(tmp_path / "cut/results"))
    server2, client2 = _load_apps(tmp_path / "app2")
    torch.set_num_threads(1)
    try:
        with pytest.raises(ConnectionError, match="went down"):
            server._main(DownAt(client, sites, rnd=2, run_id=2), _server_context(tmp_path / "cut"))
        with pytest.raises(ConnectionError, match="went down"):  # round 2 (task 0's end) without it
            server2._main(DownAt(client2, sites, rnd=3, run_id=3), _server_context(tmp_path / "cut"))
        # it cannot come back to the stream (it missed task 0's end): refused by name
        raw["sites"][2]["left"] = False
        (tmp_path / "back.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        write_app(load_federation(tmp_path / "back.yaml"), load_params(tmp_path / "coordinator.yaml"), tmp_path / "app3")
        server3, client3 = _load_apps(tmp_path / "app3")
        with pytest.raises(ConfigError, match=r"sites: Hospital C left the stream after round 1 .* cannot come back to it"):
            server3._main(SiteGrid(client3, sites, run_id=4), _server_context(tmp_path / "cut"))
        server2._main(SiteGrid(client2, sites, run_id=5), _server_context(tmp_path / "cut"))
        without = ContinualEngine(spec.method(), spec.make_model(), tasks, ["CheXpert", "OpenI"], spec.train, 0,
                                  left={"Hospital C": 1}).run()
    finally:
        torch.set_num_threads(threads)
    left = json.loads((tmp_path / "cut/results/history.json").read_text())
    for key in ("sampled", "eval", "task_acc", "bytes_up", "bytes_task_end", "storage", "left"):
        assert [h.get(key) for h in left] == [h.get(key) for h in without], key
    assert all("Hospital C" not in h["eval"] for h in left[1:]) and "Hospital C" in left[0]["eval"]
    assert "Hospital C" in history[1]["bytes_task_end"]  # in the run it stayed in, task 0's end sent it its family model
    assert "Hospital C" not in left[1]["bytes_task_end"] and set(left[-1]["storage"]) == {"Hospital A", "Hospital B"}
    cut = json.loads((tmp_path / "cut/results/metrics.json").read_text())
    assert cut["sites_left"] == {"Hospital C": 1} and cut["sites_at_end"] == ["Hospital A", "Hospital B"]
    assert len(cut["accuracy_matrix_sites_at_end"]) == 2 and cut["forgetting_sites_at_end"] is not None


def _unit(path: Path) -> dict[str, dict[str, str]]:
    import configparser

    cp = configparser.ConfigParser(interpolation=None, strict=True)
    cp.optionxform = str  # systemd keys are case-sensitive
    cp.read_string(path.read_text())
    return {s: dict(cp[s]) for s in cp.sections()}


def _words(line: str) -> list[str]:
    """A systemd command line or Environment= value back into its words (systemd's quoting, %% and $$ undone)."""
    import shlex

    return [w.replace("%%", "%").replace("$$", "$") for w in shlex.split(line)]


def test_a_dollar_or_percent_in_a_unit_is_written_so_that_systemd_reads_it_literally(tmp_path):
    """systemd expands ``$VAR`` in a command line (``$$`` is a literal $) and ``%`` specifiers everywhere (``%%``), but
    no variable in an Environment= assignment: a path with a $ or % reaches the command as written."""
    from fedsilo.fl.services import systemd_unit

    text = systemd_unit("site at 100%", ["/usr/bin/python3", "/srv/$SITE/params.yaml", "50%"], tmp_path, 70,
                        {"NOTE": "cost $5 at 10%"})
    lines = text.splitlines()
    assert 'ExecStart=/usr/bin/python3 "/srv/$$SITE/params.yaml" 50%%' in lines
    assert 'Environment="NOTE=cost $5 at 10%%"' in lines and "Description=site at 100%%" in lines
    assert _words(next(x for x in lines if x.startswith("ExecStart="))[10:]) == ["/usr/bin/python3", "/srv/$SITE/params.yaml", "50%"]


def test_a_site_and_the_superlink_install_as_systemd_services_of_the_commands_they_run(sites, tmp_path, capsys):
    """`--systemd-unit FILE` writes a service whose command is the fedsilo command itself, with this Python and
    absolute paths: run from elsewhere, without PATH, it checks the site's data and gives the same flower-supernode
    command. The SuperNode restarts only once the SuperLink lets its key in again (after Flower's heartbeat patience),
    never after fedsilo refused its input (exit 2). Missing files are refused by flag and write no unit."""
    import os
    import subprocess
    import sys

    from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE

    from fedsilo.cli import main
    from fedsilo.fl.credentials import make_certificates, make_node_key

    params, root = sites["rsna"], sites["rsna"].parent
    certs = make_certificates(tmp_path / "certs", ("coordinator.example.org",))
    key = make_node_key(tmp_path / "keys", "rsna")["rsna"]
    site = ["--params", str(params), "--root", str(root), "site", "supernode", "--experiment", "site", "--superlink",
            "coordinator.example.org:9093", "--root-certificates", str(certs["ca.crt"]), "--auth-key", str(key)]
    unit = tmp_path / "fedsilo-site-rsna.service"
    assert main([*site, "--systemd-unit", str(unit)]) == 0
    u = _unit(unit)["Service"]
    assert _words(u["ExecStart"]) == [sys.executable, "-m", "fedsilo.cli", "--params", str(params.resolve()), "--root",
                                      str(root.resolve()), *site[4:], "--port", "9094"]
    assert u["WorkingDirectory"] == str(root.resolve()) and u["User"] == root.owner() and u["Type"] == "exec"
    assert int(u["RestartSec"]) == HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL + 10 > 60
    assert (u["Restart"], u["RestartPreventExitStatus"]) == ("on-failure", "2")
    assert dict(w.split("=", 1) for w in _words(u["Environment"])) == {"FLWR_HOME": str(root.resolve() / ".flwr"), "FLWR_TELEMETRY_ENABLED": "0"}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PATH"}
    r = subprocess.run([*_words(u["ExecStart"]), "--dry-run"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    capsys.readouterr()
    assert main([*site, "--dry-run"]) == 0
    line = r.stderr.strip().splitlines()[-1]
    assert line == capsys.readouterr().err.strip().splitlines()[-1]  # the same flower-supernode command
    words = shlex.split(line.split("): ", 1)[1])  # printed as a shell takes it: the node config one word
    assert words[0].endswith("flower-supernode") and words[words.index("--node-config") + 1].startswith("params=")
    assert " experiment=" in words[words.index("--node-config") + 1]

    # the coordinator's SuperLink: TLS from the certificates, node authentication, its state on disk
    link = tmp_path / "fedsilo-superlink.service"
    assert main(["deploy", "superlink", "--certs", str(tmp_path / "certs"), "--database", str(tmp_path / "superlink.db"),
                 "--systemd-unit", str(link)]) == 0
    cmd = _words(_unit(link)["Service"]["ExecStart"])
    assert cmd == [sys.executable, "-m", "fedsilo.cli", "deploy", "superlink", "--certs", str(tmp_path / "certs"), "--database",
                   str(tmp_path / "superlink.db"), "--listen", "0.0.0.0:9093"]
    r = subprocess.run([*cmd, "--dry-run"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr.strip().endswith(
        f"--enable-supernode-auth --database {tmp_path / 'superlink.db'} --host 0.0.0.0 --port 9093 --disable-runtime-dependency-installation"), r.stderr

    # systemd reads both without a complaint (where systemd-analyze is installed)
    import shutil

    if shutil.which("systemd-analyze"):
        for f in (unit, link):
            v = subprocess.run(["systemd-analyze", "verify", str(f)], capture_output=True, text=True, timeout=60)
            assert str(f) not in v.stdout + v.stderr, v.stdout + v.stderr

    # refused by flag, nothing written
    for bad, match in (([*site[:-1], str(tmp_path / "keys/nokey")], r"--auth-key: .*nokey: no such file"),
                       (["deploy", "superlink", "--certs", str(tmp_path / "keys")], r"--certs: .*keys lacks ca.crt, server.pem, server.key"),
                       (["deploy", "superlink", "--certs", str(tmp_path / "certs"), "--listen", "9093"], r"--listen: '9093'; give host:port")):
        out = tmp_path / "bad.service"
        capsys.readouterr()
        assert main([*bad, "--systemd-unit", str(out)]) == 2
        assert re.search(match, capsys.readouterr().err) and not out.exists()
    assert main([*site, "--systemd-unit", str(tmp_path / "no/such/folder/x.service")]) == 2
    assert "--systemd-unit: " in capsys.readouterr().err


def test_deployment_status_names_each_sites_node_state_and_the_round_a_run_resumes_after(sites, tmp_path):
    """Each site as the SuperLink lists its pinned node (online since / offline since, not registered, not pinned,
    left),
    the registered nodes of no site, the checkpoint's round only when it is this deployment's, the results once
    written; relative folders are the SuperLink's."""
    from fedsilo.fl.deploy import deployment_status, resume_key

    fed = load_federation(_federation(tmp_path, sites, node_ids={"CheXpert": 11, "RSNA": 12}))
    write_app(fed, load_params(REPO_PARAMS), tmp_path / "app", results="out/results", state="out/state")
    nodes = [{"node-id": "11", "status": "online", "online-at": "2026-11-27T10:00:00", "offline-at": "N/A"},
             {"node-id": "12", "status": "offline", "online-at": "2026-11-27T10:00:00", "offline-at": "2026-11-27T10:05:00"},
             {"node-id": "99", "status": "registered", "online-at": "N/A", "offline-at": "N/A"},
             {"node-id": "98", "status": "unregistered", "online-at": "N/A", "offline-at": "N/A"}]  # flwr's N/A: no time yet
    st = deployment_status(tmp_path / "app", nodes, superlink_dir=tmp_path)
    assert [(x["site"], x["node_id"], x["status"], x["since"]) for x in st["sites"]] == [
        ("CheXpert", 11, "online", "2026-11-27T10:00:00"), ("RSNA", 12, "offline", "2026-11-27T10:05:00"),
        ("VinBigData", None, "not pinned", None)]
    assert st["unlisted_nodes"] == [{"node_id": 99, "status": "registered"}] and st["checkpoint"] is None and st["results"] is None
    assert st["stream"] is False  # FedBN on the sites' static data: its rounds are the run's, not per task
    assert deployment_status(tmp_path / "app", nodes[2:], superlink_dir=tmp_path)["sites"][0]["status"] == "not registered"
    never = [{**nodes[0], "status": "registered", "online-at": "N/A"}]  # registered, never online yet
    assert deployment_status(tmp_path / "app", never, superlink_dir=tmp_path)["sites"][0] == {
        "site": "CheXpert", "node_id": 11, "status": "registered", "since": None}

    dep = json.loads((tmp_path / "app/deployment.json").read_text())
    ckpt = tmp_path / "out/state/checkpoint.pt"
    ckpt.parent.mkdir(parents=True)
    torch.save({"config_hash": resume_key(dep), "round": 2, "meta": {}}, ckpt)
    assert deployment_status(tmp_path / "app", nodes, superlink_dir=tmp_path)["checkpoint"] == {"round": 2, "path": str(ckpt)}
    torch.save({"config_hash": "another deployment", "round": 5, "meta": {}}, ckpt)
    assert deployment_status(tmp_path / "app", nodes, superlink_dir=tmp_path)["checkpoint"]["other"]
    # a run in progress: its ServerApp holds the run lock, and its wire log says what it last sent or received
    from fedsilo.fl.run import run_lock

    assert deployment_status(tmp_path / "app", nodes, superlink_dir=tmp_path)["running"] is None
    (tmp_path / "out/results.wire").mkdir(parents=True)
    (tmp_path / "out/results.wire/wire.jsonl").write_text(json.dumps({"round": 2, "message": "train", "to": "site", "site": "RSNA",
                                                                     "flower_run": 7}) + "\n")
    asked = []

    def flower_says(status, why=None):
        return lambda run_id: asked.append(run_id) or (status, why)

    with run_lock(tmp_path / "out/state/run.lock", "the run"):
        st = deployment_status(tmp_path / "app", nodes, superlink_dir=tmp_path, flower_run=flower_says("running"))
    assert st["running"].startswith("pid ") and st["last_message"]["site"] == "RSNA" and st["last_message"]["round"] == 2
    assert 0 <= st["last_message"]["seconds_ago"] < 60
    assert "flower_run" not in st and asked == []  # a ServerApp holds the lock: Flower is not asked
    assert deployment_status(tmp_path / "app", nodes, superlink_dir=tmp_path)["running"] is None  # released at its end
    # the lock free, the last message's Flower run (7) still running: its ServerApp died; ended or not listed: it did not
    st = deployment_status(tmp_path / "app", nodes, superlink_dir=tmp_path, flower_run=flower_says("running"))
    assert st["flower_run"] == {"run_id": 7, "status": "running", "error": None, "serverapp_died": True} and asked == [7]
    st = deployment_status(tmp_path / "app", nodes, superlink_dir=tmp_path, flower_run=flower_says("finished:completed"))
    assert not st["flower_run"]["serverapp_died"]
    st = deployment_status(tmp_path / "app", nodes, superlink_dir=tmp_path, flower_run=flower_says(None, "flwr ls: no"))
    assert st["flower_run"] == {"run_id": 7, "status": None, "error": "flwr ls: no", "serverapp_died": False}
    (tmp_path / "out/results").mkdir(parents=True)
    (tmp_path / "out/results/metrics.json").write_text("{}")
    assert deployment_status(tmp_path / "app", nodes, superlink_dir=tmp_path)["results"] == str(tmp_path / "out/results")
    dep["sites"][1]["left"] = True  # RSNA left the federation: whatever its node does, it is `left`, and its node no one's
    dep["sites"][2]["joined"] = True  # VinBigData joined the run in progress
    (tmp_path / "app/deployment.json").write_text(json.dumps(dep))
    st = deployment_status(tmp_path / "app", nodes, superlink_dir=tmp_path)
    assert st["sites"][1] == {"site": "RSNA", "node_id": 12, "status": "left", "since": None} and st["unlisted_nodes"] == [
        {"node_id": 99, "status": "registered"}]
    assert st["sites"][2] == {"site": "VinBigData", "node_id": None, "status": "not pinned", "since": None, "joined": True}
    with pytest.raises(ConfigError, match=r"--app: .* holds no deployment.json"):
        deployment_status(tmp_path, nodes)


def test_deployment_status_tells_the_wire_logs_last_message_not_its_first(sites, tmp_path):
    """The status's ``last_message`` is the wire log's last line (what the ServerApp did last), read from its end,
    however many lines come before it."""
    from fedsilo.fl.deploy import deployment_status

    fed = load_federation(_federation(tmp_path, sites, node_ids={"CheXpert": 11}))
    write_app(fed, load_params(REPO_PARAMS), tmp_path / "app", results="out/results", state="out/state")
    (tmp_path / "out/results.wire").mkdir(parents=True)
    lines = [{"round": r, "message": m, "to": "site", "site": "CheXpert", "flower_run": 7}
             for r in (1, 2) for m in ("train", "evaluate")]
    (tmp_path / "out/results.wire/wire.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    last = deployment_status(tmp_path / "app", [], superlink_dir=tmp_path)["last_message"]
    assert (last["round"], last["message"], last["flower_run"]) == (2, "evaluate", 7)


def test_an_app_whose_rounds_are_all_local_is_refused_by_key_and_not_written(sites, tmp_path, capsys):
    """`deploy app` of pFedDB whose local_rounds fill the federation's train.rounds (the repository's 6 against 3):
    refused as check-params refuses the same experiment, naming both keys; no App folder is left. With rounds to
    spare, the App is written and the command says which params file the method's params came from."""
    from fedsilo.cli import main

    fed_file = _federation(tmp_path, sites, method="pfeddb", train={**TRAIN, "rounds": 3})
    with pytest.raises(ConfigError, match=r"methods.pfeddb.local_rounds: 6 local rounds leave no federated round in train.rounds \(3\)"):
        write_app(load_federation(fed_file), load_params(REPO_PARAMS), tmp_path / "app")
    assert not (tmp_path / "app").exists()
    args = ["--params", str(REPO_PARAMS), "deploy", "app", "--federation", str(fed_file), "--out", str(tmp_path / "app")]
    capsys.readouterr()
    assert main(args) == 2 and "local_rounds: 6 local rounds" in capsys.readouterr().err and not (tmp_path / "app").exists()
    fed_file = _federation(tmp_path, sites, method="pfeddb", train={**TRAIN, "rounds": 7})
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"deploy app: {tmp_path / 'app'} (pfeddb, 3 sites, 7 rounds, params from {REPO_PARAMS}); run it with: flwr run" in out


def test_deploy_status_names_a_flower_run_left_running_by_a_serverapp_that_died(sites, tmp_path, monkeypatch, capsys):
    """The wire log's last message came from Flower run 7, which the SuperLink still lists as running, and no
    ServerApp holds the deployment's run lock (it was SIGKILLed: Flower does not notice): status says so and how to
    go on; a run Flower lists as finished, or one whose ServerApp holds the lock, gets no such line."""
    from fedsilo.cli import main
    from fedsilo.fl.run import run_lock

    fed = load_federation(_federation(tmp_path, sites, node_ids={"CheXpert": 11, "RSNA": 12}))
    write_app(fed, load_params(REPO_PARAMS), tmp_path / "app", results="out/results", state="out/state")
    (tmp_path / "out/state").mkdir(parents=True)
    (tmp_path / "out/results.wire").mkdir(parents=True)
    (tmp_path / "out/results.wire/wire.jsonl").write_text(json.dumps({"round": 2, "message": "train", "to": "site", "site": "RSNA",
                                                                     "flower_run": 7}) + "\n")
    nodes = json.dumps({"success": True, "nodes": [{"node-id": "11", "status": "online", "online-at": "N/A", "offline-at": "N/A"}]})
    fake = tmp_path / "bin" / "flwr"
    fake.parent.mkdir()

    def flwr_says(status: str) -> None:
        runs = json.dumps({"success": True, "runs": [{"run-id": "7", "status": status}]})
        fake.write_text(f"#!/bin/sh\nif [ \"$1\" = ls ]; then echo '{runs}'; else echo '{nodes}'; fi\n")
        fake.chmod(0o755)

    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    args = ["deploy", "status", "--app", str(tmp_path / "app"), "--superlink-dir", str(tmp_path), "--connection", "hosp"]
    flwr_says("running")
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "none in progress on this machine" in out and "but Flower lists its run 7 as running" in out
    assert "`flwr stop 7 hosp`, then `flwr run <app> hosp --stream`" in out
    with run_lock(tmp_path / "out/state/run.lock", "the run"):
        assert main(args) == 0
    assert "Flower lists its run" not in capsys.readouterr().out
    flwr_says("finished:stopped")
    assert main(args) == 0
    assert "Flower lists its run" not in capsys.readouterr().out


def test_deploy_status_with_the_superlink_down_still_tells_what_the_disk_holds(sites, tmp_path, monkeypatch, capsys):
    """`fedsilo deploy status` when `flwr supernode list` cannot reach the SuperLink (killed, not yet restarted):
    the checkpoint round and the run lock are printed, each pinned site's state is `unknown`, and the command still
    fails (exit 2) naming flwr's error."""
    from fedsilo.cli import main
    from fedsilo.fl.deploy import resume_key

    fed = load_federation(_federation(tmp_path, sites, node_ids={"CheXpert": 11, "RSNA": 12}))
    write_app(fed, load_params(REPO_PARAMS), tmp_path / "app", results="out/results", state="out/state")
    dep = json.loads((tmp_path / "app/deployment.json").read_text())
    (tmp_path / "out/state").mkdir(parents=True)
    torch.save({"config_hash": resume_key(dep), "round": 2, "meta": {}}, tmp_path / "out/state/checkpoint.pt")
    fake = tmp_path / "bin" / "flwr"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'Connection to the SuperLink is unavailable.' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    capsys.readouterr()
    assert main(["deploy", "status", "--app", str(tmp_path / "app"), "--superlink-dir", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "CheXpert" in out and "unknown" in out and "not pinned" in out  # VinBigData has no node: that is known
    assert f"round 2 ({tmp_path / 'out/state/checkpoint.pt'})" in out and "none in progress on this machine" in out
    assert "flwr supernode list: Connection to the SuperLink is unavailable." in err and "states above are unknown" in err
    assert main(["deploy", "status", "--app", str(tmp_path / "app"), "--superlink-dir", str(tmp_path), "--json"]) == 2
    out, err = capsys.readouterr()
    st = json.loads(out)
    assert [x["status"] for x in st["sites"]] == ["unknown", "unknown", "not pinned"] and st["checkpoint"]["round"] == 2
    assert "the same --database" in err  # what to do, as in the text mode
    fake.write_text("#!/bin/sh\nexit 3\n")  # killed before it said anything
    assert main(["deploy", "status", "--app", str(tmp_path / "app"), "--superlink-dir", str(tmp_path)]) == 2
    assert "flwr supernode list: exit 3, no output: the sites' states above are unknown" in capsys.readouterr().err


def _tls_handshake(cert: Path, key: Path, ca: Path, hostname: str) -> str:
    """A TLS server on loopback with ``cert``/``key``; a client trusting ``ca`` only dials it as ``hostname`` (the
    name check included, as a SuperNode's gRPC channel does). Returns the subject the client saw."""
    import socket
    import ssl
    import threading

    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve():
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(1)
            except (ssl.SSLError, OSError):
                pass

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                    client_ctx.wrap_socket(raw, server_hostname=hostname) as tls:
                subject = dict(x[0] for x in tls.getpeercert()["subject"])["commonName"]
                tls.send(b"x")
        finally:
            t.join(timeout=10)
    return subject


def test_credentials_are_checked_before_flower_starts_and_the_superlinks_certificate_renews_without_touching_the_sites(
        sites, tmp_path, capsys):
    """Flower ends every failed start with exit status 1, so fedsilo checks the credentials first and refuses by flag
    (exit 2, which its systemd units never restart): an expired or not-yet-valid certificate, a server key that is
    not the certificate's, a certificate not signed by the CA, a site given server.pem as its CA, a key that is no
    OpenSSH elliptic-curve key. Within 30 days of an expiry both parties warn. `deploy certs --renew` signs a new
    SuperLink certificate with the CA in the folder (same names, the old pair kept as .old) and a client that trusts
    only the unchanged ca.crt completes a real TLS handshake with it."""
    import datetime
    import os
    import shutil
    import ssl

    from cryptography import x509

    from fedsilo.cli import _certificates_status, main
    from fedsilo.fl.credentials import (
        check_site_credentials,
        check_superlink_certificates,
        make_certificates,
        make_node_key,
        renew_server_certificate,
    )

    now = datetime.datetime.now(datetime.timezone.utc)
    certs = tmp_path / "certs"
    assert main(["deploy", "certs", "--out", str(certs), "--host", "coordinator.example.org", "--host", "10.0.0.5",
                 "--days", "20"]) == 0
    ca_bytes, old_pem = (certs / "ca.crt").read_bytes(), (certs / "server.pem").read_bytes()
    ca = x509.load_pem_x509_certificate(ca_bytes)
    assert 3649 <= (ca.not_valid_after_utc - now).days <= 3650  # the CA outlives many server certificates
    checked = check_superlink_certificates(certs)
    assert len(checked["warnings"]) == 1 and "the SuperLink's certificate" in checked["warnings"][0]
    assert "expires in 19 days" in checked["warnings"][0] and "fedsilo deploy certs --renew" in checked["warnings"][0]
    capsys.readouterr()
    superlink = ["deploy", "superlink", "--certs", str(certs), "--database", ":memory:", "--dry-run"]
    assert main(superlink) == 0 and "warning: the SuperLink's certificate" in capsys.readouterr().err
    assert _tls_handshake(certs / "server.pem", certs / "server.key", certs / "ca.crt", "coordinator.example.org") == "coordinator.example.org"

    # renewed: the same names, a year, the CA untouched; a client trusting the old ca.crt accepts it, by name
    assert main(["deploy", "certs", "--renew", "--out", str(certs)]) == 0
    assert "restart the SuperLink" in capsys.readouterr().out
    assert (certs / "ca.crt").read_bytes() == ca_bytes and (certs / "server.pem.old").read_bytes() == old_pem
    new = x509.load_pem_x509_certificate((certs / "server.pem").read_bytes())
    names = new.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["coordinator.example.org"]
    assert [str(a) for a in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    assert (certs / "server.key").stat().st_mode & 0o777 == 0o600 and not list(certs.glob(".*renewing"))
    assert check_superlink_certificates(certs)["warnings"] == []
    assert _tls_handshake(certs / "server.pem", certs / "server.key", certs / "ca.crt", "10.0.0.5") == "coordinator.example.org"
    with pytest.raises(ssl.SSLCertVerificationError):  # the name check is real
        _tls_handshake(certs / "server.pem", certs / "server.key", certs / "ca.crt", "elsewhere.example.org")

    # refused by flag, at the coordinator
    with pytest.raises(ConfigError, match=r"--certs: .*server\.pem expired on"):
        check_superlink_certificates(certs, now=now + datetime.timedelta(days=400))
    with pytest.raises(ConfigError, match=r"--certs: .*ca\.crt is valid only from .*clock"):
        check_superlink_certificates(certs, now=now - datetime.timedelta(days=1))
    assert _certificates_status(certs)["warnings"] == [] and _certificates_status(tmp_path / "keys") is None
    good_key = (certs / "server.key").read_bytes()
    shutil.copy(certs / "server.key.old", certs / "server.key")
    capsys.readouterr()
    assert main(superlink) == 2 and re.search(r"--certs: .*server\.key is not the key of .*server\.pem", capsys.readouterr().err)
    assert "is not the key of" in _certificates_status(certs)["problem"]
    (certs / "server.key").write_bytes(good_key)
    other = make_certificates(tmp_path / "other", ("coordinator.example.org",))
    shutil.copy(other["ca.crt"], certs / "ca.crt")
    with pytest.raises(ConfigError, match=r"--certs: .*server\.pem is not signed by .*ca\.crt"):
        check_superlink_certificates(certs)
    (certs / "ca.crt").write_bytes(ca_bytes)
    # the CA must outlive what it signs
    short = make_certificates(tmp_path / "short", ("localhost",), days=5, ca_days=10)
    with pytest.raises(ConfigError, match=r"--days: 30; the federation CA .* expires on"):
        renew_server_certificate(short["ca.crt"].parent, days=30)
    with pytest.raises(ConfigError, match=r"--ca-days: 10; the CA must stay valid"):
        make_certificates(tmp_path / "short2", ("localhost",), days=30, ca_days=10)

    # a missing file is named, not a traceback; a renewal that fails while swapping leaves the old pair in place
    (certs / "server.key").rename(certs / "server.key.away")
    with pytest.raises(ConfigError, match=r"--certs: .*server\.key: No such file"):
        check_superlink_certificates(certs)
    assert "server.key: No such file" in _certificates_status(certs)["problem"]
    (certs / "server.key.away").rename(certs / "server.key")
    before = {n: (certs / n).read_bytes() for n in ("server.pem", "server.key")}
    real_replace, calls = os.replace, []

    def failing_replace(src, dst):
        calls.append(dst)
        if len(calls) == 3:  # server.key is in place, server.pem is not yet
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "replace", failing_replace)
        with pytest.raises(OSError, match="No space left"):
            renew_server_certificate(certs)
    assert {n: (certs / n).read_bytes() for n in ("server.pem", "server.key")} == before and not list(certs.glob(".*renewing"))
    check_superlink_certificates(certs)
    if os.getuid() == 0:  # renewed with sudo: the new key keeps the SuperLink account's ownership, the old key stays private
        os.chown(certs / "server.key", 4321, 4321)
        os.chmod(certs / "server.key", 0o640)
        renew_server_certificate(certs)
        st = (certs / "server.key").stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (4321, 4321, 0o600)
        assert (certs / "server.key.old").stat().st_mode & 0o777 == 0o600
        check_superlink_certificates(certs)
    # a CA bundle (the coordinator's while sites move to a new CA): the CA that signed server.pem may come second
    bundle = tmp_path / "bundle"
    shutil.copytree(certs, bundle)
    (bundle / "ca.crt").write_bytes(other["ca.crt"].read_bytes() + ca_bytes)
    assert check_superlink_certificates(bundle)["warnings"] == []
    (bundle / "ca.crt").write_bytes(other["ca.crt"].read_bytes())
    with pytest.raises(ConfigError, match=r"--certs: .*server\.pem is not signed by a CA of .*ca\.crt \(.+\)"):
        check_superlink_certificates(bundle)

    # at a site
    key = make_node_key(tmp_path / "keys", "rsna")["rsna"]
    assert check_site_credentials(certs / "ca.crt", key) == []
    # a bundle with an expired old CA and the valid new one is taken (the valid one counts)
    expired = make_certificates(tmp_path / "expired", ("localhost",), days=1, ca_days=1)["ca.crt"]
    site_bundle = tmp_path / "site_bundle.crt"
    site_bundle.write_bytes(expired.read_bytes() + ca_bytes)
    assert check_site_credentials(site_bundle, key, now=now + datetime.timedelta(days=3)) == []
    with pytest.raises(ConfigError, match=r"--root-certificates: .*ca\.crt expired on"):
        check_site_credentials(expired, key, now=now + datetime.timedelta(days=3))
    with pytest.raises(ConfigError, match=r"--root-certificates: .*valid only from .*clock"):
        check_site_credentials(certs / "ca.crt", key, now=now - datetime.timedelta(days=1))
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    ed = tmp_path / "ed25519.key"
    ed.write_bytes(ed25519.Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                                      serialization.NoEncryption()))
    with pytest.raises(ConfigError, match=r"--auth-key: .*ed25519\.key is a Ed25519PrivateKey; Flower's node authentication takes an elliptic-curve key"):
        check_site_credentials(certs / "ca.crt", ed)
    assert "the federation CA" in check_site_credentials(certs / "ca.crt", key, now=now + datetime.timedelta(days=3640))[0]
    with pytest.raises(ConfigError, match=r"--root-certificates: .*ca\.crt expired on"):
        check_site_credentials(certs / "ca.crt", key, now=now + datetime.timedelta(days=3651))
    with pytest.raises(ConfigError, match=r"--root-certificates: .*server\.pem holds no CA certificate"):
        check_site_credentials(certs / "server.pem", key)
    with pytest.raises(ConfigError, match=r"--auth-key: .*is not an unencrypted OpenSSH private key"):
        check_site_credentials(certs / "ca.crt", certs / "server.key")  # a PEM key, not the node key
    garbage = tmp_path / "garbage.key"
    garbage.write_text("not a key\n")
    site = ["--params", str(sites["rsna"]), "--root", str(sites["rsna"].parent), "site", "supernode", "--experiment", "site",
            "--superlink", "coordinator.example.org:9093", "--root-certificates", str(certs / "ca.crt"), "--auth-key", str(garbage),
            "--dry-run"]
    capsys.readouterr()
    assert main(site) == 2 and re.search(r"--auth-key: .*garbage\.key is not an unencrypted OpenSSH", capsys.readouterr().err)
    assert main([*site[:-2], str(key), "--dry-run"]) == 0
    # what Flower's SuperNode fails on only after starting (exit 1, retried by a service manager): refused, exit 2
    good = [*site[:-2], str(key)]
    def with_link(link: str) -> list[str]:
        return [*good[:good.index("--superlink") + 1], link, *good[good.index("--superlink") + 2:], "--dry-run"]

    for link in ("coordinator.example.org", "coordinator.example.org:port", "coordinator.example.org:70000", "[host]:9093"):
        capsys.readouterr()
        assert main(with_link(link)) == 2
        assert f"--superlink: {link!r} is not host:port" in capsys.readouterr().err
    for link in ("10.0.0.5:9093", "[fe80::1%eth0]:9093", "::1:9093", "[::1]:9093", "coord_1.lan:9093"):  # Flower takes these
        assert main(with_link(link)) == 0, link
    import socket

    with socket.socket() as taken:  # another SuperNode of this site listening on its Runtime API port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        capsys.readouterr()
        assert main([*good, "--port", str(port)]) == 2  # not --dry-run: it would start now
        assert f"--port: 127.0.0.1:{port} is taken: a process on this machine listens on it" in capsys.readouterr().err
        assert main([*good, "--port", str(port), "--dry-run"]) == 0  # a dry run starts nothing: not checked


def test_credentials_files_are_private_never_replaced_and_a_ca_about_to_expire_warns_either_party(tmp_path):
    """Private keys 0600, certificates and public keys 0644; a second `deploy certs` or `deploy key` into the same
    folder replaces nothing; a key name that is no file name, a certificate of no day, a ca.key that is not the
    CA's, are refused. A host name longer than X.509's 64-character common name still gets its certificate. A CA
    expiring within 30 days warns the coordinator; a site whose bundle also holds a CA valid for years does not warn."""
    import stat

    from cryptography import x509

    from fedsilo.fl.credentials import (
        check_site_credentials,
        check_superlink_certificates,
        make_certificates,
        make_node_key,
        renew_server_certificate,
    )

    short = make_certificates(tmp_path / "short", ("localhost",), days=10, ca_days=20)
    key = make_node_key(tmp_path / "keys", "st-marys.1")
    umask = os.umask(0)
    os.umask(umask)
    for files, private in ((short, ("ca.key", "server.key")), (key, ("st-marys.1",))):
        for name, path in files.items():
            assert stat.S_IMODE(path.stat().st_mode) == (0o600 if name in private else 0o644) & ~umask, name
    before = {p: p.read_bytes() for p in [*short.values(), *key.values()]}
    with pytest.raises(ConfigError, match=r"ca\.crt, server\.pem, ca\.key, server\.key already exist; .*never replaced"):
        make_certificates(tmp_path / "short", ("localhost",))
    with pytest.raises(ConfigError, match=r"st-marys\.1, st-marys\.1\.pub already exist"):
        make_node_key(tmp_path / "keys", "st-marys.1")
    assert {p: p.read_bytes() for p in before} == before
    for bad in ("../site", ".hidden", "a b"):
        with pytest.raises(ConfigError, match=r"--name: .*letters, digits"):
            make_node_key(tmp_path / "keys", bad)
    with pytest.raises(ConfigError, match=r"--days: 0; a certificate must be valid for at least a day"):
        make_certificates(tmp_path / "none", ("localhost",), days=0)

    warnings = check_superlink_certificates(tmp_path / "short")["warnings"]
    assert len(warnings) == 2 and "the federation CA" in warnings[1] and "expires in 19 days" in warnings[1]
    long = make_certificates(tmp_path / "long", ("a" * 70 + ".hospital.example.org", "10.0.0.5"))
    server = x509.load_pem_x509_certificate(long["server.pem"].read_bytes())
    assert server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName) == [
        "a" * 70 + ".hospital.example.org"]
    bundle = tmp_path / "bundle.crt"
    bundle.write_bytes(short["ca.crt"].read_bytes() + long["ca.crt"].read_bytes())
    assert "the federation CA" in check_site_credentials(short["ca.crt"], key["st-marys.1"])[0]
    assert check_site_credentials(bundle, key["st-marys.1"]) == []

    (tmp_path / "long" / "ca.key").write_bytes(short["ca.key"].read_bytes())  # another CA's key
    with pytest.raises(ConfigError, match=r"--out: .*ca\.key is not the key of .*ca\.crt"):
        renew_server_certificate(tmp_path / "long")


def test_a_site_scores_new_image_files_with_the_model_it_kept_as_it_scores_its_harmonized_images(sites, tmp_path, capsys):
    """`fedsilo site predict` harmonizes each file with the site's own dataset options and scores it with the kept
    model: on the raw files behind a site's harmonized images (RSNA's DICOMs, one without its suffix; CheXpert's
    JPEGs) it gives the probabilities the model gives those harmonized images; an unreadable file is a row with its
    error; a model of another image size, a missing file and no file at all are refused by name."""
    import pandas as pd

    from fedsilo.cli import main
    from fedsilo.client.local import predict
    from fedsilo.fl.flower import KeptStores

    dep = json.loads((_deployed(tmp_path, sites) / "deployment.json").read_text())
    model = deployment_spec(dep).make_model()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # not the initialisation: a model whose outputs differ per image
    kept = KeptStores(tmp_path / "keep", "RSNA")
    kept.save_model(2, model, {"deployment": dep})
    for source in ("rsna", "chexpert"):
        root = sites[source].parent
        table = pd.read_parquet(root / "data/harmonized/chest_xray4/records.parquet").head(6)
        files = [root / "data/raw" / source / p for p in table["source_path"]]
        if source == "rsna":
            bare = tmp_path / "export" / "image_without_suffix"
            bare.parent.mkdir(exist_ok=True)
            bare.write_bytes(files[0].read_bytes())
            (tmp_path / "export" / "notes.txt").write_text("not an image\n")
            files = [*files, bare, tmp_path / "export" / "notes.txt"]
        out = tmp_path / f"{source}.csv"
        capsys.readouterr()
        assert main(["--params", str(sites[source]), "--root", str(root), "site", "predict", "--experiment", "site",
                     "--model", str(kept.model_path), "--out", str(out), "--images", *map(str, files)]) == 0
        err = capsys.readouterr().err
        assert "images scored by" in err and "(predicted: " in err
        if source == "rsna":  # its own model; one file not scored
            assert "is the model site" not in err and "1 row not scored (its error column says why)" in err
        else:  # RSNA's kept model on CheXpert's images: said (its own part learned RSNA's data), not refused
            assert f"{kept.model_path} is the model site RSNA kept (its own part learned RSNA's data), not this site's" in err
        rows = pd.read_csv(out)
        rows[["predicted", "error"]] = rows[["predicted", "error"]].fillna("")
        x = torch.from_numpy(np.load(root / "data/harmonized/chest_xray4/images.npy")[:6]).permute(0, 3, 1, 2).contiguous()
        want = predict(model.eval(), x, cfg=CPU_TRAIN).softmax(1).numpy()
        got = rows[["prob.Normal", "prob.Lung Opacity"]].to_numpy(dtype=float)
        assert np.allclose(got[:6], want, atol=1e-6) and list(rows["predicted"][:6]) == [dep["contract"]["classes"][j] for j in want.argmax(1)]
        assert (rows["error"][:6] == "").all()
        if source == "rsna":
            assert np.allclose(got[6], want[0], atol=1e-6)  # DICOM known by its preamble
            assert rows["predicted"][7] == "" and "notes.txt" in rows["error"][7] and np.isnan(got[7]).all()
    # a folder: its images (the DICOM without a suffix, by its preamble) are scored, its other files left out, said
    assert main(["--params", str(sites["rsna"]), "--root", str(sites["rsna"].parent), "site", "predict", "--experiment",
                 "site", "--model", str(kept.model_path), "--out", str(tmp_path / "folder.csv"), "--images", str(bare.parent)]) == 0
    assert "1 file(s) under the folders named are not images, left out: notes.txt (not an image file (.txt))" in capsys.readouterr().err
    assert list(pd.read_csv(tmp_path / "folder.csv")["path"]) == [str(bare)]
    (tmp_path / "tables").mkdir()
    (tmp_path / "tables" / "labels.csv").write_text("path,label\n")
    # refused by name
    other = tmp_path / "other_size.yaml"
    raw = yaml.safe_load(sites["rsna"].read_text())
    raw["datasets"]["chest_xray4"]["image_size"] = 32
    other.write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    args = ["--root", str(sites["rsna"].parent), "site", "predict", "--experiment", "site", "--model", str(kept.model_path)]
    assert main(["--params", str(other), *args, "--images", str(files[0])]) == 2
    assert "datasets.chest_xray4.image_size: 32; the model takes 16 px images" in capsys.readouterr().err
    assert main(["--params", str(sites["rsna"]), *args, "--images", str(tmp_path / "nowhere.dcm")]) == 2
    assert "nowhere.dcm: no such file or folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # argparse's refusal, with predict's own usage line
        main(["--params", str(sites["rsna"]), *args])
    assert stop.value.code == 2 and "site predict: error: the following arguments are required: --images" in capsys.readouterr().err
    assert main(["--params", str(sites["rsna"]), *args, "--images", str(tmp_path / "tables")]) == 2
    assert "1 file(s) under the folders, none an image" in capsys.readouterr().err


def test_predict_reads_files_by_the_rules_of_the_models_kind_and_refuses_another_size_either_way(tmp_path):
    """The site's dataset decides how predict reads a file, checked against the model's contract before any file is
    read: a chest X-ray dataset reads grey for a grey model (a DICOM by its preamble), and an RGB model is refused by
    the dataset's key (not failed later on a tensor's shape); an image size other than the model's, smaller or larger,
    is refused naming both."""
    from fedsilo.config import parse_params
    from fedsilo.fl.predict import _decoder
    from tests.conftest import small_params

    p = parse_params(small_params(image_size=32))
    png = tmp_path / "x.png"
    png.write_bytes(b"not read here")
    job, workers = _decoder(p, "quick", {"image_shape": [32, 32, 1]})
    assert job(png)[:3] == (str(png), "standard", 32) and workers == 1
    with pytest.raises(ConfigError, match=re.escape("datasets.chest_xray4 (kind chest_xray4): the model takes 3-channel images")):
        _decoder(p, "quick", {"image_shape": [32, 32, 3]})
    for size in (16, 64):
        with pytest.raises(ConfigError, match=re.escape(f"datasets.chest_xray4.image_size: 32; the model takes {size} px images")):
            _decoder(p, "quick", {"image_shape": [size, size, 1]})
    with pytest.raises(ConfigError, match=rf"experiments\.site: not defined in {re.escape(str(p.source))}"):
        _decoder(p, "site", {"image_shape": [32, 32, 1]})
    with pytest.raises(ConfigError, match=r"experiments\.quik: not defined in .* \(did you mean 'quick'\?\)"):
        _decoder(p, "quik", {"image_shape": [32, 32, 1]})


def _kept_rgb_model(tmp_path: Path, card: dict, site: str):
    """A FedAvg Simple-CNN (quarter width) for a harmonized RGB dataset's 16 px images, kept as a deployed site keeps
    its model (``model.pt``): (model, the site's stores, the deployment it records)."""
    from fedsilo.fl.flower import KeptStores

    dep = {"method": {"key": "fedavg", "base": "fedavg", "params": {}}, "seed": 0,
           "train": {"model": "simple_cnn", "model_width": 0.25, "device": "cpu"},
           "contract": {"task": card["task"], "classes": list(card["classes"]), "image_shape": [16, 16, 3]}}
    model = deployment_spec(dep).make_model()
    kept = KeptStores(tmp_path / "keep", site)
    kept.save_model(1, model, {"deployment": dep})
    return model, kept, dep


def _slide_site(tmp_path: Path, raw_dir: Path, cut: dict):
    """A site whose own folder ``raw_dir`` (one folder per class) holds slides cut by the rules ``cut``: its params,
    harmonized into ``tmp_path / "h"``, and a model kept for it (:func:`_kept_rgb_model`). Returns (params, classes,
    model, kept)."""
    from fedsilo.config import parse_params
    from fedsilo.data.harmonize import harmonize_dataset
    from tests.conftest import small_params

    raw = small_params()
    raw.update(sources={"lab": {"mode": "local", "reader": "image_folder", "path": str(raw_dir)}},
               datasets={"d": {"kind": "image_folder", "sources": ["lab"], "image_size": 16, "workers": 1,
                               "folders": {"lab": {"slides": cut}}}},
               experiments={"site": {"dataset": "d", "split": {"protocol": "domain_clients", "n_train": 4, "n_test": 4}}},
               pipeline={"sources": ["lab"], "datasets": ["d"], "splits": {"site": "d"}, "experiments": ["site"],
                         "methods": ["fedavg"], "seeds": [0]})
    p = parse_params(raw)
    card = harmonize_dataset(p.datasets["d"], tmp_path / "data/raw", tmp_path / "h", quiet=True)
    model, kept, _ = _kept_rgb_model(tmp_path, card, "lab")
    return p, list(card["classes"]), model, kept


def test_site_predict_scores_a_slides_tissue_patches_and_pools_them(tmp_path, monkeypatch):
    """A whole-slide image given to site predict is cut into tissue patches by the site's own slides rules, each patch
    harmonized and scored as harmonize's patches are (the same pixels, so the model's probabilities on the harmonized
    patches), and the slide's row holds their mean; an image beside it is scored as before."""
    pytest.importorskip("tiffslide")
    import pandas as pd

    from fedsilo.client.local import predict
    from fedsilo.data import slides
    from fedsilo.fl.predict import predict_images
    from tests.test_slides import _slide

    monkeypatch.setattr(slides, "SMALL_TIFF_BYTES", 0)
    raw_dir = tmp_path / "data/raw/lab"
    _slide(raw_dir / "tumour" / "S1.tif", (900, 800), 500)
    _slide(raw_dir / "normal" / "S2.tif", (1200, 1200), 300, seed=1)
    cut = {"mpp": 2.0, "patch_px": 32, "max_patches": 50}
    p, classes, model, kept = _slide_site(tmp_path, raw_dir, cut)
    photo = tmp_path / "new" / "photo.png"
    photo.parent.mkdir()
    import cv2

    assert cv2.imwrite(str(photo), np.random.default_rng(0).integers(0, 256, (20, 20, 3), dtype=np.uint8))
    rows = predict_images(p, "site", kept.model_path, [raw_dir / "tumour" / "S1.tif", photo], quiet=True).set_index("path")
    harmonized = pd.read_parquet(tmp_path / "h" / "records.parquet")
    s1 = harmonized[harmonized["source_path"] == "tumour/S1.tif"]
    patch_rows = rows[rows["slide"] == str(raw_dir / "tumour" / "S1.tif")]
    assert [p.rsplit("#", 1)[1] for p in patch_rows.index] == [i.rsplit("#", 1)[1] for i in s1["id"]]  # the same patches
    x = torch.from_numpy(np.load(tmp_path / "h" / "images.npy")[s1.index.to_numpy()]).permute(0, 3, 1, 2).contiguous()
    want = predict(model.eval(), x, cfg=CPU_TRAIN).softmax(1).numpy()
    prob = [f"prob.{c}" for c in classes]
    assert np.allclose(patch_rows[prob].to_numpy(dtype=float), want, atol=1e-6)
    slide_row = rows.loc[str(raw_dir / "tumour" / "S1.tif")]
    assert slide_row["patches"] == len(s1) and slide_row["error"] == "" and slide_row["slide"] == ""
    assert np.allclose(slide_row[prob].to_numpy(dtype=float), want.mean(0), atol=1e-6)
    assert slide_row["predicted"] == classes[int(want.mean(0).argmax())]
    assert rows.loc[str(photo), "error"] == "" and rows.loc[str(photo), "predicted"] in classes


def test_a_slides_row_pools_the_patches_that_were_read_and_predicts_the_argmax_of_their_mean(tmp_path, monkeypatch):
    """A patch that cannot be read is its own row's error and stays out of its slide's row: the slide's probabilities
    are the mean over the patches scored, ``patches`` their count, and ``predicted`` the class of that mean (here not
    the first patch's class)."""
    pytest.importorskip("tiffslide")
    from fedsilo.client import local
    from fedsilo.data import harmonize, slides
    from fedsilo.fl.predict import predict_images
    from tests.test_slides import _slide

    monkeypatch.setattr(slides, "SMALL_TIFF_BYTES", 0)
    raw_dir = tmp_path / "data/raw/lab"
    _slide(raw_dir / "tumour" / "S1.tif", (900, 800), 500)
    _slide(raw_dir / "normal" / "S2.tif", (1200, 1200), 300, seed=1)
    p, classes, _, kept = _slide_site(tmp_path, raw_dir, {"mpp": 2.0, "patch_px": 32, "max_patches": 50})
    real = harmonize.decode_all

    def last_patch_broken(jobs, *a, **k):
        out = list(real(jobs, *a, **k))
        out[-1] = (None, "broken patch")
        return out

    def scores(model, images, *a, **k):  # the first patch for class 0, every other for class 1
        probs = np.tile(np.array([[0.3, 0.7]], dtype=np.float32), (len(images), 1))
        probs[0] = [0.9, 0.1]
        return probs

    monkeypatch.setattr(harmonize, "decode_all", last_patch_broken)
    monkeypatch.setattr(local, "predict_probabilities", scores)
    slide = str(raw_dir / "tumour" / "S1.tif")
    rows = predict_images(p, "site", kept.model_path, [raw_dir / "tumour" / "S1.tif"], quiet=True).set_index("path")
    patches = rows[rows["slide"] == slide]
    read = patches[patches["error"] == ""]
    assert len(read) == len(patches) - 1 >= 3 and patches["error"].iloc[-1] == "broken patch"
    prob = [f"prob.{c}" for c in classes]
    assert rows.loc[slide, "patches"] == len(read) and rows.loc[slide, "error"] == ""
    want = read[prob].to_numpy(dtype=float).mean(0)
    assert np.allclose(rows.loc[slide, prob].to_numpy(dtype=float), want) and rows.loc[slide, "predicted"] == classes[1]


def test_sources_that_cut_slides_alike_give_predict_one_rule_and_sources_that_differ_none(tmp_path):
    """predict cuts a new slide as the site's sources cut theirs: two sources with the same slides rules (their
    region annotations aside) are one rule, named by the first source's key; rules that differ leave no rule to
    choose, said by the sources' names."""
    from fedsilo.config import parse_params
    from fedsilo.fl.predict import _slide_rules
    from tests.conftest import small_params

    def params(second: dict):
        raw = small_params()
        raw.update(sources={s: {"mode": "local", "reader": "image_folder", "path": str(tmp_path / s)} for s in ("lab", "annex")},
                   datasets={"d": {"kind": "image_folder", "sources": ["lab", "annex"], "image_size": 16, "workers": 1,
                                   "folders": {"lab": {"slides": {"mpp": 2.0, "patch_px": 32}}, "annex": {"slides": second}}}},
                   experiments={"site": {"dataset": "d", "split": {"protocol": "domain_clients", "n_train": 4, "n_test": 4}}},
                   pipeline={"sources": ["lab", "annex"], "datasets": ["d"], "splits": {"site": "d"}, "experiments": ["site"],
                             "methods": ["fedavg"], "seeds": [0]})
        return parse_params(raw)

    rules, key = _slide_rules(params({"mpp": 2.0, "patch_px": 32}), "site")
    assert rules is not None and rules.mpp == 2.0 and rules.patch_px == 32 and key.endswith(".slides")
    rules, why = _slide_rules(params({"mpp": 1.0, "patch_px": 32}), "site")
    assert rules is None and why == "the sources annex, lab of datasets.d cut slides differently: make their slides rules one"


def test_site_predict_reads_a_dicom_slide_at_the_focal_plane_and_optical_path_harmonize_read(tmp_path, monkeypatch):
    """A DICOM z-stack of two optical paths given to site predict is cut and read at the plane and path the site's
    slides rules name (slides.focal_plane / optical_path), as harmonize cut and read it: the same patches, the
    model's probabilities on the harmonized ones."""
    pytest.importorskip("openslide")
    pytest.importorskip("wsidicom")
    import pandas as pd

    from fedsilo.client.local import predict
    from fedsilo.data import slides
    from fedsilo.fl.predict import predict_images
    from tests.test_slides import MPP0, _slide, _z_stack

    monkeypatch.setattr(slides, "SMALL_TIFF_BYTES", 0)
    raw_dir = tmp_path / "data/raw/lab"
    rng = np.random.default_rng(3)

    def plane(lo: int, left: int) -> np.ndarray:  # stained tissue at columns left..left+400
        p = np.full((1024, 1024, 3), 238, np.uint8)
        green = rng.integers(lo, lo + 20, (600, 400))
        p[200:800, left:left + 400] = np.stack([green + 60, green, green + 30], axis=-1)
        return p

    # only the second path's 4 um plane holds its tissue on the right: patches cut on another plane lie elsewhere
    _z_stack(raw_dir / "tumour" / "Z1", [plane(20 + 20 * k, 100) for k in range(3)], MPP0,
             second_path=[plane(100, 100), plane(120, 100), plane(140, 560)])
    _slide(raw_dir / "normal" / "S2.tif", (1200, 1200), 300, seed=1)
    cut = {"mpp": 1.0, "patch_px": 32, "max_patches": 50, "focal_plane": 4.0, "optical_path": "2"}
    p, classes, model, kept = _slide_site(tmp_path, raw_dir, cut)
    z1 = raw_dir / "tumour" / "Z1" / "L1.dcm"
    rows = predict_images(p, "site", kept.model_path, [z1], quiet=True).set_index("path")
    harmonized = pd.read_parquet(tmp_path / "h" / "records.parquet")
    mine = harmonized[harmonized["source_path"] == "tumour/Z1/L1.dcm"]
    patch_rows = rows[rows["slide"] == str(z1)]
    assert len(mine) == 16 and [q.rsplit("#", 1)[1] for q in patch_rows.index] == [i.rsplit("#", 1)[1] for i in mine["id"]]
    assert min(int(i.split("#x")[1].split("y")[0]) for i in mine["id"]) >= 512  # the chosen plane's tissue
    x = torch.from_numpy(np.load(tmp_path / "h" / "images.npy")[mine.index.to_numpy()]).permute(0, 3, 1, 2).contiguous()
    want = predict(model.eval(), x, cfg=CPU_TRAIN).softmax(1).numpy()
    assert np.allclose(patch_rows[[f"prob.{c}" for c in classes]].to_numpy(dtype=float), want, atol=1e-6)


def test_site_predict_reads_rgb_benchmark_files_as_harmonize_does(tmp_path, capsys):
    """The multi-domain benchmarks' files (RGB JPEGs: an Office-Caltech-10 mirror here) are harmonized for a
    prediction as harmonize wrote them (stretched to the dataset's size), so the model scores them as it scores the
    harmonized arrays; a model made for grayscale images is refused for this dataset by key."""
    import pandas as pd

    from fedsilo.cli import main
    from fedsilo.client.local import predict
    from fedsilo.config import parse_params
    from fedsilo.data.fetch import fetch
    from fedsilo.data.harmonize import harmonize_dataset
    from fedsilo.fl.flower import KeptStores
    from tests.conftest import add_benchmarks, small_params

    raw = add_benchmarks(small_params())
    raw.update(sources={"office_caltech10": raw["sources"]["office_caltech10"]}, datasets={"office_caltech10": raw["datasets"]["office_caltech10"]},
               experiments={"site": {"dataset": "office_caltech10", "split": {"protocol": "domain_clients", "n_train": 4, "n_test": 4}}},
               pipeline={"sources": ["office_caltech10"], "datasets": ["office_caltech10"], "splits": {"site": "office_caltech10"},
                         "experiments": ["site"], "methods": ["fedavg"], "seeds": [0]})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    p = parse_params(raw)
    fetch("office_caltech10", p.sources["office_caltech10"], tmp_path / "data/raw/office_caltech10")
    harmonized = tmp_path / "data/harmonized/office_caltech10"
    card = harmonize_dataset(p.datasets["office_caltech10"], tmp_path / "data/raw", harmonized, quiet=True)
    table = pd.read_parquet(harmonized / "records.parquet").iloc[::7].head(8)
    files = [tmp_path / "data/raw/office_caltech10" / f for f in table["source_path"]]
    classes = list(card["classes"])
    model, kept, dep = _kept_rgb_model(tmp_path, card, "amazon")
    out = tmp_path / "predictions.csv"
    args = ["--params", str(tmp_path / "params.yaml"), "--root", str(tmp_path), "site", "predict", "--experiment", "site"]
    assert main([*args, "--model", str(kept.model_path), "--out", str(out), "--images", *map(str, files)]) == 0
    rows = pd.read_csv(out)
    x = torch.from_numpy(np.load(harmonized / "images.npy")[table.index.to_numpy()]).permute(0, 3, 1, 2).contiguous()
    want = predict(model.eval(), x, cfg=CPU_TRAIN).softmax(1).numpy()
    assert np.allclose(rows[[f"prob.{c}" for c in classes]].to_numpy(dtype=float), want, atol=1e-6)
    assert list(rows["predicted"]) == [classes[j] for j in want.argmax(1)]
    assert list(rows.columns) == ["path", "predicted", *(f"prob.{c}" for c in classes), "error"]  # no slide: no slide columns
    # a DICOM of the site's (suffix-less, colour) reads as harmonize reads its own: as RGB; a slide is never decoded
    from fedsilo.data.harmonize import decode_one, to_rgb_square
    from tests.test_image_table import _colour_dicom

    photo = np.random.default_rng(5).integers(0, 256, (24, 24, 3), dtype=np.uint8)
    _colour_dicom(tmp_path / "new" / "IMG0001", photo)
    (tmp_path / "new" / "scan.svs").write_bytes(b"a slide")
    assert main([*args, "--model", str(kept.model_path), "--out", str(out), "--images", str(tmp_path / "new")]) == 0
    rows = pd.read_csv(out, keep_default_na=False).set_index("path")
    assert rows.loc[str(tmp_path / "new" / "IMG0001"), "error"] == "" and rows.loc[str(tmp_path / "new" / "IMG0001"), "predicted"] in classes
    np.testing.assert_array_equal(decode_one((str(tmp_path / "new" / "IMG0001"), "dicom_rgb", 16, "stretch", "", (0.0, 100.0))),
                                  to_rgb_square(photo, 16, "stretch"))
    assert rows.loc[str(tmp_path / "new" / "scan.svs"), "error"] == ("a whole-slide image: set datasets.office_caltech10."
                                                                    "folders.<source>.slides (or tables) to score its tissue patches")
    gray = KeptStores(tmp_path / "keep", "gray")
    gray.save_model(1, deployment_spec({**dep, "contract": {**dep["contract"], "image_shape": [16, 16, 1]}}).make_model(),
                    {"deployment": {**dep, "contract": {**dep["contract"], "image_shape": [16, 16, 1]}}})
    capsys.readouterr()
    assert main([*args, "--model", str(gray.model_path), "--images", str(files[0])]) == 2
    assert "datasets.office_caltech10 (kind office_caltech10): the model takes 1-channel images" in capsys.readouterr().err


@pytest.mark.usefixtures("identity")
def test_a_hospital_that_was_not_in_a_deployment_onboards_with_the_federations_model(sites, tmp_path, capsys, monkeypatch):
    """The coordinator's results hold the server state after the last round (``final_model.pt``: pFedDB's phi, the
    shared branch, nothing a site keeps). A hospital that was not part of the run adapts it on its own data
    (`fedsilo site onboard`, pFedDB Fig. 6): under freeze_global the kept model's phi is the downloaded phi exactly, its
    own branch trained; each strategy's numbers are the same whether run alone or beside another; the kept model is
    one `fedsilo site predict` scores with. After a FedBN deployment, freeze_global trains the newcomer's own BatchNorm
    under the federation's frozen layers, finetune_all every layer. Refused by name: a member of the deployment, a
    method that builds its own model around the backbone (pFedDR), freeze_global where sites keep nothing (FedAvg), a
    file that is no final model, a site whose data break the contract."""
    import pandas as pd

    import fedsilo.fl.onboard as onboard
    from fedsilo.cli import main
    from fedsilo.client.local import predict
    from fedsilo.fl.deploy import load_site_model
    from fedsilo.fl.onboard import onboard_site
    from fedsilo.methods.base import payload_bytes
    from fedsilo.methods.pfeddb.model import SHARED

    members = {k: sites[k] for k in ("chexpert", "rsna")}
    coordinator = yaml.safe_load(REPO_PARAMS.read_text())
    coordinator["methods"]["pfeddb"]["local_rounds"] = 1
    (tmp_path / "coordinator.yaml").write_text(yaml.safe_dump(coordinator, sort_keys=False))
    fed = load_federation(_federation(tmp_path, members, method="pfeddb", train={**TRAIN, "rounds": 2}))
    write_app(fed, load_params(tmp_path / "coordinator.yaml"), tmp_path / "app", results=str(tmp_path / "results"))
    server, client = _load_apps(tmp_path / "app")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        server._main(SiteGrid(client, members), _server_context(tmp_path))
    finally:
        torch.set_num_threads(threads)
    final = tmp_path / "results" / "final_model.pt"
    held = torch.load(final, weights_only=True)
    wire = [json.loads(line) for line in (tmp_path / "results/wire.jsonl").read_text().splitlines()]
    shared = {k for w in wire if w["message"] == "train" and w["to"] == "server" for k in w["arrays"]["up"]}
    assert held["round"] == 2 and set(held["server"]) == shared and all(k.startswith(SHARED) for k in shared)
    assert held["deployment"] == json.loads((tmp_path / "results/deployment.json").read_text())

    # the newcomer: VinBigData, with one pre-training round and two adaptation rounds in its own params, in a folder
    # of its own (the module's VinBigData site keeps models of other tests' deployments)
    import shutil

    vin = tmp_path / "newcomer"
    shutil.copytree(sites["vinbigdata"].parent / "data", vin / "data", ignore=shutil.ignore_patterns("site"))
    raw = yaml.safe_load(sites["vinbigdata"].read_text())
    raw["experiments"]["site"]["onboarding"] = {"pretrain_rounds": 1, "rounds": 2}
    params = tmp_path / "newcomer.yaml"
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    seen: list = []  # what onboard_newcomer returned, models with it (the newcomer's own local model among them)
    real = onboard.onboard_newcomer
    monkeypatch.setattr(onboard, "onboard_newcomer", lambda *a, **k: seen.append(real(*a, **k)) or {**seen[-1], "models": dict(seen[-1]["models"])})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        base = ["-q", "--params", str(params), "--root", str(vin), "site"]
        assert main([*base, "onboard", "--experiment", "site", "--model", str(final), "--strategy", "freeze_global", "finetune_all"]) == 0
        out = vin / "onboarding" / "three_hospitals" / "pfeddb" / "seed0"
        assert "kept freeze_global" in capsys.readouterr().err
        alone, _ = onboard_site(load_params(params), "site", vin, final, ["finetune_all"], out=tmp_path / "alone", quiet=True)
    finally:
        torch.set_num_threads(threads)
    summary = json.loads((out / "onboarding.json").read_text())
    assert summary["site"] == "VinBigData" and summary["strategies"] == ["freeze_global", "finetune_all"] and summary["kept"] == "freeze_global"
    assert [len(c) for c in summary["accuracy_per_round"].values()] == [2, 2] and summary["server_round"] == 2
    phi = {k: v for k, v in held["server"].items()}
    assert summary["bytes_down_phi"] == payload_bytes(phi)
    assert alone["accuracy_per_round"]["finetune_all"] == summary["accuracy_per_round"]["finetune_all"]
    kept = torch.load(out / "model.pt", weights_only=True)
    assert (out / "model.pt").stat().st_mode & 0o077 == 0  # the site's own, as a deployed site's model
    assert all(torch.equal(kept["model"][k], phi[k]) for k in phi)  # freeze_global: phi as downloaded
    local = seen[0]["models"]["local"]  # its own model before it took phi
    assert all(torch.equal(kept["model"][k], v) for k, v in seen[0]["models"]["freeze_global"].items())
    own = [k for k in kept["model"] if not k.startswith(SHARED) and kept["model"][k].is_floating_point() and "running_" not in k]
    assert own and any(not torch.equal(kept["model"][k], local[k]) for k in own)  # its own branch trained on
    assert kept["onboarding"]["kept"] == "freeze_global"

    # `fedsilo site predict` scores with it (the only model under the site's root: found without --model)
    table = pd.read_parquet(vin / "data/harmonized/chest_xray4/records.parquet").head(3)
    files = [str(vin / "data/raw/vinbigdata" / p) for p in table["source_path"]]
    assert main([*base, "predict", "--experiment", "site", "--out", str(tmp_path / "p.csv"), "--images", *files]) == 0
    rows = pd.read_csv(tmp_path / "p.csv")
    model, _ = load_site_model(out / "model.pt")
    x = torch.from_numpy(np.load(vin / "data/harmonized/chest_xray4/images.npy")[:3]).permute(0, 3, 1, 2).contiguous()
    want = predict(model, x, cfg=CPU_TRAIN).softmax(1).numpy()
    assert np.allclose(rows[["prob.Normal", "prob.Lung Opacity"]].to_numpy(dtype=float), want, atol=1e-6)

    # refused by name
    def refused(*args, model=final, params_file=params, root=vin) -> str:
        capsys.readouterr()
        assert main(["-q", "--params", str(params_file), "--root", str(root), "site", "onboard", "--experiment", "site",
                     "--model", str(model), *args]) == 2
        return capsys.readouterr().err

    assert "site RSNA took part in the deployment three_hospitals" in refused(params_file=sites["rsna"], root=sites["rsna"].parent)
    assert ("--strategy: finetune_all, finetune_all: name each of freeze_global, finetune_all, from_scratch, as_member at most once"
            in refused("--strategy", "finetune_all", "finetune_all"))
    other = {**held, "deployment": {**held["deployment"], "method": {**held["deployment"]["method"], "base": "pfeddr", "key": "pfeddr", "params": {}}}}
    torch.save(other, tmp_path / "pfeddr_final.pt")
    assert "pfeddr builds its own model around the backbone" in refused("--strategy", "finetune_all", model=tmp_path / "pfeddr_final.pt")
    capsys.readouterr()  # pFedDB's phi alone scores nothing: predict sends the hospital to onboarding
    assert main([*base, "predict", "--experiment", "site", "--model", str(final), "--images", files[0]]) == 2
    err = capsys.readouterr().err
    assert "the federation's model of pfeddb lacks the" in err and "(`fedsilo site onboard`)" in err
    (tmp_path / "junk.pt").write_text("not a model\n")
    assert "not a model file fedsilo wrote, or one cut short in a copy" in refused(model=tmp_path / "junk.pt")
    # predict and evaluate too, for a file cut short in a copy: one line, not torch's advice to drop weights_only
    (tmp_path / "cut.pt").write_bytes(final.read_bytes()[:2000])
    for cmd in (["predict", "--experiment", "site", "--images", files[0]], ["evaluate", "--dataset", "chest_xray4"]):
        capsys.readouterr()
        assert main([*base, *cmd, "--model", str(tmp_path / "cut.pt")]) == 2
        err = capsys.readouterr().err
        assert f"--model: {tmp_path / 'cut.pt'}: not a model file fedsilo wrote, or one cut short" in err
        assert "Traceback" not in err and "weights_only" not in err
    # a wrong --out is refused before the scoring (its results would be lost at the end)
    (tmp_path / "taken.csv").write_text("x\n")
    for cmd, why in ((["predict", "--experiment", "site", "--images", files[0], "--out", str(tmp_path)], "is a folder; predict writes one CSV"),
                     (["predict", "--experiment", "site", "--images", files[0], "--out", str(tmp_path / "no" / "p.csv")], "does not exist"),
                     (["evaluate", "--dataset", "chest_xray4", "--out", str(tmp_path / "taken.csv")], "is a file; evaluate writes a folder")):
        capsys.readouterr()
        assert main([*base, *cmd]) == 2
        assert why in capsys.readouterr().err, cmd
    # its onboarded model scored on its own dataset (its training split among the images): no external validation
    capsys.readouterr()
    assert main([*base, "evaluate", "--dataset", "chest_xray4", "--bootstrap", "20", "--out", str(tmp_path / "own.csv")]) == 0
    said = capsys.readouterr()
    assert "# Evaluation on the data VinBigData trained on (not an external validation): chest_xray4" in said.out
    assert "warning: datasets.chest_xray4 is the data VinBigData trained on" in said.err
    # its split edited in params and not rebuilt is still the split it trained on: the warning stays
    edited = copy.deepcopy(raw)
    edited["experiments"]["site"]["split"]["seed"] = 7
    params.write_text(yaml.safe_dump(edited, sort_keys=False))
    assert main([*base, "evaluate", "--dataset", "chest_xray4", "--bootstrap", "20", "--out", str(tmp_path / "own_edited.csv")]) == 0
    assert "warning: datasets.chest_xray4 is the data VinBigData trained on" in capsys.readouterr().err
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    torch.save({"round": 1, "model": {}}, tmp_path / "site_model.pt")
    assert "not a deployment's final model" in refused(model=tmp_path / "site_model.pt")
    torch.save({k: v for k, v in held.items() if k != "round"}, tmp_path / "no_round.pt")  # cut short: no round to name
    assert "not a deployment's final model" in refused(model=tmp_path / "no_round.pt")
    bigger = {**held, "deployment": {**held["deployment"], "contract": {**held["deployment"]["contract"], "image_shape": [32, 32, 1]}}}
    torch.save(bigger, tmp_path / "bigger.pt")
    assert ("(datasets.chest_xray4) does not fit the deployment's contract: image_shape [16, 16, 1] (agreed [32, 32, 1]); "
            f"set datasets.chest_xray4.image_size: 32 in {params} and harmonize again") in refused(model=tmp_path / "bigger.pt")

    # a FedBN deployment on the same two sites: the newcomer trains what FedBN sites keep (BatchNorm) under the
    # federation's frozen layers, or every layer from them
    from fedsilo.models import batchnorm_keys

    (tmp_path / "bn").mkdir()
    fed = load_federation(_federation(tmp_path / "bn", members, method="fedbn", train={**TRAIN, "rounds": 2}))
    generic: list = []
    adapt = onboard.adapt_federation_model
    monkeypatch.setattr(onboard, "adapt_federation_model", lambda *a, **k: generic.append(adapt(*a, **k)) or {**generic[-1], "models": dict(generic[-1]["models"])})
    write_app(fed, load_params(REPO_PARAMS), tmp_path / "bn_app")
    server, client = _load_apps(tmp_path / "bn_app")
    torch.set_num_threads(1)
    try:
        server._main(SiteGrid(client, members), _server_context(tmp_path / "bn"))
        bn_final = tmp_path / "bn" / "results" / "final_model.pt"  # the server context names the results folder
        bn_held = torch.load(bn_final, weights_only=True)
        bn_out = tmp_path / "bn_onboard"
        capsys.readouterr()
        assert main([*base, "onboard", "--experiment", "site", "--model", str(bn_final), "--strategy", "freeze_global",
                     "finetune_all", "as_member", "--out", str(bn_out)]) == 0
        assert "site onboard: VinBigData adapted the federation's model of fedbn" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)
    bn_summary = json.loads((bn_out / "onboarding.json").read_text())
    bn = batchnorm_keys(deployment_spec(bn_held["deployment"]).make_model())
    assert set(bn_held["server"]) and not set(bn_held["server"]) & bn  # the shared layers only: no site's BatchNorm
    assert bn_summary["pretrain_rounds"] == 0 and bn_summary["bytes_down"] == payload_bytes(bn_held["server"])
    # as_member: FedBN's own round against the finished federation, from what the server would send a third site
    # (the federation's layers: the same tensors, so no more bytes)
    sent = bn_held["newcomer"]
    assert sent["index"] == 2 and sent["round"] == 2
    assert all(torch.equal(sent["download"][k], v) for k, v in bn_held["server"].items()) and set(sent["download"]) == set(bn_held["server"])
    assert bn_final.stat().st_size < 1.5 * payload_bytes(bn_held["server"])  # the tensors it shares with the model stored once
    assert bn_summary["strategies"] == ["freeze_global", "finetune_all", "as_member"]
    assert len(bn_summary["accuracy_per_round"]["as_member"]) == 2
    kept = torch.load(bn_out / "model.pt", weights_only=True)["model"]
    tuned = generic[0]["models"]["finetune_all"]
    init = deployment_spec(bn_held["deployment"]).make_model().state_dict()
    assert all(torch.equal(kept[k], v) for k, v in bn_held["server"].items())  # freeze_global: the federation's layers
    assert any(not torch.equal(kept[k], init[k]) for k in bn if k.endswith("weight"))  # its own BatchNorm trained
    assert any(not torch.equal(tuned[k], v) for k, v in bn_held["server"].items())  # finetune_all: every layer trains,
    assert any(not torch.equal(tuned[k], init[k]) for k in bn if k.endswith("weight"))  # its own BatchNorm too
    assert load_site_model(bn_out / "model.pt")[0] is not None
    # as_member alone downloads the newcomer's payloads only, not what else the server holds (here a server-side
    # tensor a site is never sent)
    roomy = {**bn_held, "server": {**bn_held["server"], "server::bookkeeping": torch.zeros(4096)}}
    torch.save(roomy, tmp_path / "roomy_final.pt")
    torch.set_num_threads(1)
    capsys.readouterr()
    try:  # into the folder of the first onboarding: it replaces that one's model, and says so
        assert main([*base, "onboard", "--experiment", "site", "--model", str(tmp_path / "roomy_final.pt"), "--strategy",
                     "as_member", "--out", str(bn_out)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "; it replaced the model onboarding kept there before (freeze_global; --out elsewhere keeps both)" in capsys.readouterr().err
    member_only = json.loads((bn_out / "onboarding.json").read_text())
    assert member_only["replaced"] == {"kept": "freeze_global", "strategies": ["freeze_global", "finetune_all", "as_member"]}
    assert member_only["bytes_down"] == payload_bytes({**sent["download"], **sent["eval"]}) < payload_bytes(roomy["server"])
    # a method whose federation's model is whole keeps nothing a site trains alone
    whole = {**bn_held, "server": {**init, **bn_held["server"]},
             "deployment": {**bn_held["deployment"], "method": {**bn_held["deployment"]["method"], "base": "fedavg", "key": "fedavg", "params": {}}}}
    torch.save(whole, tmp_path / "fedavg_final.pt")
    assert "freeze_global: fedavg's sites keep no part of their own" in refused("--strategy", "freeze_global", model=tmp_path / "fedavg_final.pt")
    assert "--strategy as_member: fedavg: its sites are all evaluated with the federation's global model" in refused(
        "--strategy", "as_member", model=tmp_path / "fedavg_final.pt")
    # a method whose sites are evaluated with a model their own training makes (Ditto's personal model): by default
    # it adapts as its sites do, from the newcomer's download a final_model.pt of an older fedsilo does not hold
    personal = {**{k: v for k, v in whole.items() if k != "newcomer"},
                "deployment": {**whole["deployment"], "method": {**whole["deployment"]["method"], "base": "ditto", "key": "ditto"}}}
    torch.save(personal, tmp_path / "ditto_final.pt")
    assert "--strategy as_member: " + str(tmp_path / "ditto_final.pt") + " holds no download for a newcomer" in refused(model=tmp_path / "ditto_final.pt")
    assert "--strategy freeze_global: ditto's sites are evaluated with a model their own training makes" in refused(
        "--strategy", "freeze_global", model=tmp_path / "ditto_final.pt")


def test_whose_model_scores_a_sites_images_is_told_only_where_its_split_names_the_site(sites, tmp_path):
    """another_sites_model compares the model's site with the one client of this site's split: a split not built yet
    (site predict before `fedsilo split`) or one naming no client says nothing, where it raised FileNotFoundError or
    IndexError before a single image was scored."""
    from fedsilo.fl.predict import another_sites_model

    params = load_params(sites["rsna"])
    info = {"site": "CheXpert"}
    assert "is the model site CheXpert kept" in another_sites_model(params, "site", info, Path("m.pt"), sites["rsna"].parent)
    assert another_sites_model(params, "site", info, Path("m.pt"), tmp_path) is None  # no split here
    split = params.layout(tmp_path).split("site")
    split.parent.mkdir(parents=True)
    split.write_text(json.dumps({"clients": []}))
    assert another_sites_model(params, "site", info, Path("m.pt"), tmp_path) is None


def test_site_predicts_summary_says_none_predicted_and_names_the_error_column_only_where_a_row_has_an_error(sites, tmp_path, capsys):
    """`fedsilo site predict`'s last line: 'predicted: none' where no image was scored (not an empty list), and the
    error column named only when a row is not scored."""
    import pandas as pd

    from fedsilo.cli import main
    from fedsilo.fl.flower import KeptStores

    dep = json.loads((_deployed(tmp_path, sites) / "deployment.json").read_text())
    kept = KeptStores(tmp_path / "keep", "RSNA")
    kept.save_model(2, deployment_spec(dep).make_model(), {"deployment": dep})
    root = sites["rsna"].parent
    image = root / "data/raw/rsna" / pd.read_parquet(root / "data/harmonized/chest_xray4/records.parquet")["source_path"][0]
    notes = tmp_path / "notes.txt"
    notes.write_text("not an image\n")
    base = ["--params", str(sites["rsna"]), "--root", str(root), "site", "predict", "--experiment", "site", "--model",
            str(kept.model_path), "--images"]
    capsys.readouterr()
    assert main([*base, str(image), "--out", str(tmp_path / "one.csv")]) == 0
    assert capsys.readouterr().err.rstrip().endswith(f"1 images scored by {kept.model_path} (predicted: "
                                                     f"{pd.read_csv(tmp_path / 'one.csv')['predicted'][0]} 1), 0 rows not scored; {tmp_path / 'one.csv'}")
    assert main([*base, str(notes), "--out", str(tmp_path / "none.csv")]) == 0
    assert (f"0 images scored by {kept.model_path} (predicted: none), 1 row not scored (its error column says why); "
            f"{tmp_path / 'none.csv'}") in capsys.readouterr().err


def test_a_contract_that_differs_in_channels_only_names_no_image_size_to_set(sites, tmp_path):
    """onboard's contract refusal adds `set datasets.<d>.image_size` only where the image size differs: another
    channel count (or class list) is not fixed by that key."""
    from fedsilo.fl.onboard import onboard_site

    dep = json.loads((_deployed(tmp_path, sites) / "deployment.json").read_text())
    shape = [int(v) for v in dep["contract"]["image_shape"]]
    dep["contract"]["image_shape"] = [*shape[:2], 3]
    torch.save({"deployment": dep, "server": {}, "round": 2}, tmp_path / "rgb.pt")
    with pytest.raises(ConfigError, match=r"does not fit the deployment's contract: image_shape") as err:
        onboard_site(load_params(sites["vinbigdata"]), "site", sites["vinbigdata"].parent, tmp_path / "rgb.pt", quiet=True)
    assert "image_size" not in str(err.value), err.value


def test_a_supernodes_addresses_are_refused_by_what_flower_would_fail_on():
    """_check_supernode_addresses: a SuperLink port 65536 or a host with a space, a --port of 0 or past 65535 are
    refused; a port a SuperNode that ended left in TIME_WAIT is free (SO_REUSEADDR), as Flower would find it."""
    import socket

    from fedsilo.cli import _check_supernode_addresses

    for link in ("coordinator.example.org:65536", "coordinator.example.org:0", "coord inator.lan:9093"):
        with pytest.raises(ConfigError, match=re.escape(f"--superlink: {link!r} is not host:port")):
            _check_supernode_addresses(link, 9094, bind=False)
    for port in (0, 65536):
        with pytest.raises(ConfigError, match=rf"--port: {port} is not a port number \(1-65535\)"):
            _check_supernode_addresses("coordinator.example.org:65535", port, bind=False)
    with socket.socket() as server:  # a connection this side closes first: its port is left in TIME_WAIT
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a SuperNode's gRPC server sets it
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()
        client.recv(1)
        client.close()
    _check_supernode_addresses("coordinator.example.org:9093", port, bind=True)


def test_a_systemd_unit_is_written_while_the_sites_supernode_holds_its_port(sites, tmp_path, capsys):
    """`site supernode --systemd-unit` starts nothing now: the port its SuperNode will listen on is not checked (the
    site's SuperNode running while its unit is written again holds it), as with --dry-run."""
    import socket

    from fedsilo.cli import main
    from fedsilo.fl.credentials import make_certificates, make_node_key

    certs = make_certificates(tmp_path / "certs", ("coordinator.example.org",))
    key = make_node_key(tmp_path / "keys", "rsna")["rsna"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        unit = tmp_path / "fedsilo-site-rsna.service"
        assert main(["--params", str(sites["rsna"]), "--root", str(sites["rsna"].parent), "site", "supernode", "--experiment",
                     "site", "--superlink", "coordinator.example.org:9093", "--root-certificates", str(certs["ca.crt"]),
                     "--auth-key", str(key), "--port", str(port), "--systemd-unit", str(unit)]) == 0, capsys.readouterr().err
    assert unit.is_file()
