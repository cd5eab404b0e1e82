"""A real deployment on loopback, as two hospitals and a coordinator run it: a SuperLink with TLS (certificates
from `fedsilo deploy certs`) and SuperNode authentication, two SuperNodes started by `fedsilo site supernode`
with the keys the coordinator registered (`fedsilo deploy key`, `flwr supernode register`), each site training on
the images it harmonized and split itself; the App from `fedsilo deploy app`, run with `flwr run`.

Checked: the run completes with the in-process engine's numbers on the same two splits; the wire log shows that
only FedBN's shared tensors left a site; a federation pinning another fingerprint for a site is refused before any
round, naming the site, and the site is told; a SuperNode whose key was not registered is not let in.

Every process listens on 127.0.0.1 only and is stopped at the end (SIGTERM, then SIGKILL after 20 s). One run
takes ~1-2 minutes on two cores: each SuperNode polls every 3 s and starts a fresh ClientApp process per message.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

import pytest
import torch
import yaml

pytest.importorskip("flwr")

BIN = Path(sys.executable).parent
if not (BIN / "flower-superlink").exists() or not (BIN / "fedsilo").exists():
    pytest.skip("flower-superlink / fedsilo are not installed beside this Python", allow_module_level=True)

from fedsilo.cli import main as fedsilo_cli  # noqa: E402
from fedsilo.fl.credentials import make_certificates, make_node_key  # noqa: E402
from fedsilo.fl.deploy import deployment_spec  # noqa: E402
from fedsilo.fl.engine import Engine  # noqa: E402
from fedsilo.fl.params import load_params  # noqa: E402
from fedsilo.fl.site import load_site, site_card  # noqa: E402
from fedsilo.models import batchnorm_keys  # noqa: E402
from tests.deploy_sites import SITE_SOURCES, make_site  # noqa: E402

REPO_PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"
# one round: each message a SuperNode takes starts a ClientApp process (torch and fedsilo imported anew, seconds each
# on a 2-core machine); the evaluation after it is another process, which must find the BatchNorm layers the training
# process kept at the site (FedBN's private part) to give the engine's numbers
TRAIN = {"model": "simple_cnn", "model_width": 0.25, "rounds": 1, "eval_every": 1, "batch_size": 8, "lr": 0.05, "device": "cpu"}
CONNECTION = "fedsilo-test"
HOSPITALS = SITE_SOURCES[:2]  # CheXpert, RSNA


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_history(app: Path, sites: dict[str, Path]) -> list[dict]:
    """The in-process engine's history of the App's deployment on the sites' own splits (in ``sites``' order, the
    federation's), on one thread as each ClientApp runs (OMP_NUM_THREADS=1): what a deployed run must equal."""
    spec = deployment_spec(json.loads((app / "deployment.json").read_text()))
    clients = [load_site(load_params(p), "site", p.parent, torch.device("cpu"), index=k) for k, p in enumerate(sites.values())]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return Engine(spec.method(), spec.make_model(), clients, spec.train, seed=0).run()
    finally:
        torch.set_num_threads(threads)


class Federation:
    """The processes of one loopback deployment and the commands the coordinator runs against it."""

    def __init__(self, base: Path, host: str = "127.0.0.1", sources: tuple[str, ...] = SITE_SOURCES):
        self.base, self.host, self.sources = base, host, sources  # the SuperLink's address: loopback here, a network's in scripts/check_deploy_hosts.py
        self.procs: list[tuple[subprocess.Popen, TextIO]] = []
        self.env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                    "OMP_NUM_THREADS": "1",  # one thread per ClientApp: the engine it is compared with runs one
                    "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.cli_home = base / "coordinator" / "flwr"
        self.port = _free_port()
        self.address = f"{host}:{self.port}"

    def start(self, name: str, cmd: list[str], cwd: Path, home: Path) -> subprocess.Popen:
        home.mkdir(parents=True, exist_ok=True)
        log = open(self.base / f"{name}.log", "w")
        p = subprocess.Popen(cmd, cwd=cwd, env={**self.env, "FLWR_HOME": str(home)}, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL)
        self.procs.append((p, log))
        return p

    def flwr(self, *args: str, timeout: float = 120) -> dict:
        r = subprocess.run([str(BIN / "flwr"), *args, "--format", "json"], cwd=self.base, env={**self.env, "FLWR_HOME": str(self.cli_home)},
                           capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, f"flwr {' '.join(args)}: {r.stdout}{r.stderr}"
        return json.loads(r.stdout)

    def fedsilo(self, *args: str, cwd: Path, cli: bool = False) -> str:
        """A fedsilo command; ``cli``: with the coordinator's flwr CLI configuration (its SuperLink connection)."""
        env = {**self.env, "FLWR_HOME": str(self.cli_home)} if cli else self.env
        r = subprocess.run([str(BIN / "fedsilo"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"fedsilo {' '.join(args)}: {r.stdout}{r.stderr}"
        return r.stdout

    def wait_healthy(self, ca: Path, limit: float = 60) -> None:
        ctx = ssl.create_default_context(cafile=str(ca))  # verifies the certificate against the federation's CA
        deadline = time.monotonic() + limit
        while True:
            try:
                with urllib.request.urlopen(f"https://{self.address}/health", context=ctx, timeout=2):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def poll(self, check: Callable[[], Any], limit: float, hint: Callable[[], bool], what: str) -> Any:
        """``check()`` (a `flwr` CLI call: a second or two of CPU each, which a 2-core machine takes from the
        processes it waits for) until it returns something true: every 2 s once ``hint()`` (a cheap look at a log or
        a file) says the awaited state is likely reached, every 15 s before."""
        deadline = time.monotonic() + limit
        last = -math.inf
        while True:
            now = time.monotonic()
            if now - last >= (2 if hint() else 15):
                last = now
                out = check()
                if out:
                    return out
            assert now < deadline, f"{what} after {limit:.0f} s"
            time.sleep(0.5)

    def wait_online(self, n: int, limit: float = 90) -> None:
        def started() -> bool:  # each SuperNode logs its node ID once the SuperLink has let it in
            logs = [Path(log.name) for _, log in self.procs if Path(log.name).name.startswith("supernode_")]
            return sum("SuperNode ID:" in f.read_text() for f in logs) >= n

        def online() -> bool:
            return sum(x["status"] == "online" for x in self.flwr("supernode", "list", CONNECTION)["nodes"]) >= n

        self.poll(online, limit, started, f"fewer than {n} SuperNodes online")

    def run(self, app: Path, ended: Callable[[], bool], limit: float = 420) -> dict:
        """Starts the App and waits until the SuperLink says the run finished; ``ended()`` is a local sign that it
        did (the results written, a refusal recorded)."""
        rid = self.flwr("run", str(app), CONNECTION)["run-id"]

        def finished() -> Optional[dict]:
            run = self.flwr("list", "--run-id", str(rid), CONNECTION)["runs"][0]
            return run if run["status"].startswith("finished") else None

        return self.poll(finished, limit, ended, f"run {rid} not finished")

    # --- the steps of a deployment, as the hospitals and the coordinator take them
    def hospitals(self) -> tuple[dict[str, Path], dict[str, dict]]:
        """Each hospital's folder: its own data, harmonized and split there; its card; its key pair. Returns the
        sites' params files and cards by source."""
        sites = {s: make_site(self.base / s, s) for s in self.sources}
        cards = {}
        for s, params in sites.items():  # `fedsilo site card` as make_site runs its commands: in this process
            assert fedsilo_cli(["-q", "--params", str(params), "--root", str(params.parent), "site", "card", "--experiment", "site"]) == 0
            cards[s] = json.loads((params.parent / "data/site/site.json").read_text())
            make_node_key(params.parent / "keys", s)
        return sites, cards

    def start_superlink(self, coordinator: Path, certs: dict[str, Path], name: str = "superlink",
                        database: Optional[str] = None) -> subprocess.Popen:
        """The SuperLink, started by `fedsilo deploy superlink`: TLS and SuperNode authentication, its state in memory
        or in ``database``; once it answers its health check, the coordinator's flwr CLI connection to it."""
        p = self.start(name, [str(BIN / "fedsilo"), "deploy", "superlink", "--certs", str(certs["ca.crt"].parent), "--database",
                              database or ":memory:", "--listen", f"{self.host}:{self.port}"],  # becomes flower-superlink
                       cwd=coordinator, home=coordinator / "superlink-home")
        self.wait_healthy(certs["ca.crt"])
        self.cli_home.mkdir(parents=True, exist_ok=True)
        (self.cli_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "{self.address}"\n'
            f'root-certificates = "{certs["ca.crt"]}"\n')
        return p

    def register(self, sites: dict[str, Path]) -> dict[str, int]:
        """The coordinator registers each site's public key; the node ids it pins in federation.yaml, by source."""
        node_ids = {}
        for s, params in sites.items():
            reg = self.flwr("supernode", "register", str(params.parent / "keys" / f"{s}.pub"), CONNECTION)
            assert reg["success"]
            node_ids[s] = int(reg["node-id"])  # pinned in federation.yaml: each name admitted only from its own key
        return node_ids

    def start_supernodes(self, sites: dict[str, Path], certs: dict[str, Path]) -> None:
        """Each hospital starts its SuperNode with fedsilo's command."""
        for s, params in sites.items():
            self.start_supernode(s, params, certs)

    def start_supernode(self, s: str, params: Path, certs: dict[str, Path], log: str = "") -> subprocess.Popen:
        """Site ``s``'s SuperNode (its key ``keys/<s>``), logging to ``<log or supernode_<s>>.log``."""
        return self.start(log or f"supernode_{s}", [
            str(BIN / "fedsilo"), "--params", str(params), "--root", str(params.parent), "site", "supernode", "--experiment", "site",
            "--superlink", self.address, "--root-certificates", str(certs["ca.crt"]), "--auth-key", str(params.parent / "keys" / s),
            "--port", str(_free_port())], cwd=params.parent, home=params.parent / "flwr-home")

    def app(self, coordinator: Path, name: str, method: str, cards: dict[str, dict], node_ids: dict[str, int], train: dict,
            params: Path = REPO_PARAMS, **out: str) -> Path:
        """The coordinator's federation.yaml (the sites in ``cards``' order, each pinned to its registered node) and
        the App `fedsilo deploy app` builds from it into ``coordinator/app``; ``out``: --results, --state."""
        fed_file = coordinator / "federation.yaml"
        fed_file.write_text(yaml.safe_dump({
            "name": name, "method": method, "seed": 0, "train": train, "contract": next(iter(cards.values()))["contract"],
            "sites": [{"name": c["site"], "fingerprint": c["fingerprint"], "node_id": node_ids[s]} for s, c in cards.items()]},
            sort_keys=False))
        flags = [a for k, v in out.items() for a in (f"--{k}", v)]
        self.fedsilo("--params", str(params), "deploy", "app", "--federation", str(fed_file), "--out", str(coordinator / "app"),
                     *flags, cwd=coordinator)
        return coordinator / "app"

    def stop(self) -> None:
        import psutil

        # a SuperNode's ClientApps are started by its flower-superexec (each with --parent-pid of that SuperExec, not
        # of the SuperNode): taken now, while they are still its descendants, and ended below if they outlive it
        below = []
        for p, _ in self.procs:
            try:
                below += psutil.Process(p.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        for p, _ in reversed(self.procs):  # SuperNodes first, the SuperLink last
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p, log in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            log.close()
        for q in below:  # ClientApp processes a SuperNode started while the SuperLink died outlive it: end them
            try:
                q.kill()
            except psutil.NoSuchProcess:
                pass


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    base = tmp_path_factory.mktemp("deployment")
    # two sites (scripts/check_deploy_*.py run three): each message a site takes starts a ClientApp process, seconds
    # of CPU each on two cores
    fed = Federation(base, sources=HOSPITALS)
    try:
        yield fed
    finally:
        fed.stop()


def test_two_hospitals_train_over_tls_with_registered_nodes_and_only_shared_tensors_leave(federation):
    fed, base = federation, federation.base
    coordinator = base / "coordinator"
    coordinator.mkdir()
    sites, cards = fed.hospitals()
    # --- the coordinator: certificates, the SuperLink (TLS, node authentication), its CLI connection, the registrations
    certs = make_certificates(coordinator / "certs", ("127.0.0.1", "localhost"))
    fed.start_superlink(coordinator, certs)
    node_ids = fed.register(sites)
    fed.start_supernodes(sites, certs)
    # a SuperNode whose key nobody registered is turned away
    stranger = make_node_key(base / "stranger", "stranger")
    intruder = fed.start("supernode_stranger", [str(BIN / "flower-supernode"), "--superlink", fed.address, "--root-certificates",
                                                str(certs["ca.crt"]), "--auth-supernode-private-key", str(stranger["stranger"]),
                                                "--node-config", 'params="/nowhere" experiment="site"', "--port", str(_free_port()),
                                                "--max-retries", "1"],
                         cwd=base / "stranger", home=base / "stranger" / "flwr-home")
    fed.wait_online(len(HOSPITALS))

    # --- the federation file and its App; the run
    results = coordinator / "results"
    fed.app(coordinator, "two_hospitals", "fedbn", cards, node_ids, TRAIN, results=str(results))
    fed_file = coordinator / "federation.yaml"
    run = fed.run(coordinator / "app", ended=lambda: (results / "metrics.json").exists())
    assert run["status"] == "finished:completed", run

    metrics = json.loads((results / "metrics.json").read_text())
    history = json.loads((results / "history.json").read_text())
    assert metrics["clients"] == ["CheXpert", "RSNA"] and len(history) == TRAIN["rounds"]
    assert metrics["fingerprints"] == {c["site"]: c["fingerprint"] for c in cards.values()}

    # the coordinator's view: each site's pinned node online at the SuperLink, no checkpoint left, the results written
    status = json.loads(fed.fedsilo("deploy", "status", "--app", str(coordinator / "app"), "--connection", CONNECTION, "--json",
                                    cwd=coordinator, cli=True))
    assert [(x["site"], x["node_id"], x["status"]) for x in status["sites"]] == [
        (cards[s]["site"], node_ids[s], "online") for s in HOSPITALS]
    assert status["checkpoint"] is None and status["results"] == str(results) and status["unlisted_nodes"] == []
    assert status["certificates"]["folder"] == "certs" and status["certificates"]["warnings"] == []  # a year left

    # the engine in this process, on the same two splits: the same evaluations and bytes
    reference = engine_history(coordinator / "app", sites)
    spec = deployment_spec(json.loads((coordinator / "app/deployment.json").read_text()))
    assert [h.get("eval") for h in history] == [h.get("eval") for h in reference] and "eval" in history[-1]
    assert [h["bytes_up"] for h in history] == [h["bytes_up"] for h in reference]

    # what crossed the wire: every upload holds FedBN's shared tensors only, none of the BatchNorm layers that stay home
    wire = [json.loads(line) for line in (results / "wire.jsonl").read_text().splitlines()]
    bn = batchnorm_keys(spec.make_model())
    shared = set(spec.make_model().state_dict()) - bn
    ups = [w for w in wire if w["to"] == "server" and w["message"] == "train"]
    assert len(ups) == len(HOSPITALS) * TRAIN["rounds"] and all(set(w["arrays"]["up"]) == shared for w in ups)
    assert all(set(w) - {"round", "message", "site", "to", "config", "metrics", "flower_run"} == set() for w in wire
               if w["to"] == "server" and w["message"] != "train")  # registrations and scores: no tensor at all
    assert [w["tensor_bytes"]["up"] for w in ups] == [h["bytes_up"][s] for h in history for s in h["sampled"]]

    # each hospital's own wire log on its disk (written by its ClientApp processes): its uploads hold the shared keys only
    for s in HOSPITALS:
        logs = list((sites[s].parent / "state/deploy/two_hospitals").glob("*/wire.jsonl"))
        assert len(logs) == 1, logs
        own = [json.loads(line) for line in logs[0].read_text().splitlines()]
        sent = [w for w in own if w["message"] == "train" and w["to"] == "server"]
        assert len(sent) == TRAIN["rounds"] and all(set(w["arrays"]["up"]) == shared for w in sent)
        assert [w["tensor_bytes"]["up"] for w in sent] == [w["tensor_bytes"]["up"] for w in ups if w["site"] == cards[s]["site"]]
    # and `fedsilo site audit` at one hospital sums it up: its upload per round, the shared keys, the bytes the coordinator counted
    (audit,) = json.loads(fed.fedsilo("--root", str(sites["rsna"].parent), "site", "audit", "--json", cwd=sites["rsna"].parent))
    assert audit["sent"]["train"]["messages"] == TRAIN["rounds"] and set(audit["sent"]["train"]["arrays"]["up"]) == shared
    assert audit["sent_tensor_bytes"] == sum(w["tensor_bytes"]["up"] for w in ups if w["site"] == "RSNA")

    # node authentication: the unregistered SuperNode gave up without being let in
    assert intruder.wait(timeout=60) != 0
    assert "Failed to activate SuperNode" in (base / "supernode_stranger.log").read_text()

    # --- the same sites under a federation that pins another fingerprint for RSNA: refused before any round
    pinned = yaml.safe_load(fed_file.read_text())
    pinned["sites"][1]["fingerprint"] = site_card(load_params(sites["chexpert"]), "site", sites["chexpert"].parent)["fingerprint"]
    bad = coordinator / "federation_wrong_rsna.yaml"
    bad.write_text(yaml.safe_dump(pinned, sort_keys=False))
    fed.fedsilo("--params", str(REPO_PARAMS), "deploy", "app", "--federation", str(bad), "--out", str(coordinator / "app_wrong"),
                "--results", str(coordinator / "results_wrong"), cwd=coordinator)
    wire_wrong = coordinator / "results_wrong.wire" / "wire.jsonl"
    run = fed.run(coordinator / "app_wrong", ended=lambda: wire_wrong.exists() and "query.refused" in wire_wrong.read_text())
    assert run["status"] == "finished:failed"
    assert "site 'RSNA' refused: its data fingerprint" in run["status-details"]
    assert f"(sites[1], RSNA: {pinned['sites'][1]['fingerprint'][:16]})" in run["status-details"]
    assert not (coordinator / "results_wrong").exists()  # no results; what crossed before the refusal is kept
    assert "query.refused" in wire_wrong.read_text()
    deadline = time.monotonic() + 30  # the refused site was told why (its SuperNode's log)
    while "the federation refused this site" not in (base / "supernode_rsna.log").read_text():
        assert time.monotonic() < deadline, (base / "supernode_rsna.log").read_text()[-2000:]
        time.sleep(1)
