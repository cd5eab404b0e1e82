"""A real cross-silo deployment on Flower: a SuperLink at the coordinator, one SuperNode per hospital, TLS on, only
registered SuperNodes admitted, and each site training on the images it harmonized and split itself.

Who holds what:

- The **coordinator** writes ``federation.yaml`` (:class:`Federation`): the federation's name, the method (a
  ``methods.<key>`` of its params file, whose typed params are used), ``train`` (an experiment's train section: the
  model, rounds, local epochs, batch size, learning rate...), the seed, the **contract** every site's data must meet (task,
  class names in label order, harmonized image shape) and the **sites**, in client-index order, each with the data
  fingerprint it sent (``fedsilo site card``). ``fedsilo deploy app`` turns it into a Flower App folder
  (:func:`write_app`) holding ``deployment.json``: the method's typed params and the train params, resolved and
  validated once, so that every party builds the method and the model from the same file. ``flwr run`` ships that
  folder, hashed, to the SuperLink and on to every SuperNode.
- Each **site** keeps its params file (its own source, harmonize options and one-client split) and its data, and
  starts ``flower-supernode`` with ``--node-config`` naming them (``fedsilo site supernode`` prints or runs the
  command). Its ClientApp reads only that site's split; its store (private layers, personal model) lives in the
  SuperNode's per-run state and never enters a message.

The ServerApp (:func:`server_app`) admits a site only under a listed name, with its pinned fingerprint and, when the
site's entry pins a ``node_id`` (the id ``flwr supernode register`` gave the site's public key), only from that node:
a site cannot register under another's name (anything else ends the run before round 1, naming the site and what
differs), runs the rounds exactly as the in-process engine
(fl/flower.py: same sampling, aggregation and evaluation), and writes into ``results-dir`` (a run-config key;
default ``results/deploy/<federation>/<method>/seed<k>`` under the SuperLink's working directory):
``metrics.json`` (the train stage's summary plus every site's fingerprint), ``history.json`` and ``wire.jsonl``: one
line per message that crossed the network, with its direction, site, record keys, dtypes, shapes and tensor bytes
(never values): what an auditor reads to see that only the method's shared tensors left a site.

A deployed run is checkpointed: the ServerApp writes its state and history to ``state-dir`` (a run-config key;
default ``state/deploy/<federation>/<method>/seed<k>``) every round, and each site keeps its store after every round
it trains under ``<site root>/state/deploy/<federation>/<key>/<site>/`` (:class:`~fedsilo.fl.flower.KeptStores`).
``flwr run`` of the same App after the SuperLink, the ServerApp or a site went down resumes after the last
checkpoint, with the same numbers as an uninterrupted run, in the same MLflow run; another deployment or another
fedsilo on the coordinator starts afresh (:func:`resume_key`). A finished run removes its checkpoint (running the App
again trains again, from fresh stores); each site's last store stays until then: its personal model. A site whose
SuperNode goes away during a run (a restart, a lost link: the SuperLink answers for it once it missed its heartbeats)
is waited for up to ``rejoin-s`` (a run-config key, default 600 s) and sent an evaluation, task end or announcement
again once the SuperLink lists it online (the node id its key was registered with); it answers from the store the
message names. A training lost that way ends the run (``flwr run`` again redoes the round from the checkpoint),
unless ``min-train-sites`` (a run-config key, default 0: never) of the round's sampled sites trained: the round then
goes on without it, as if it had not been sampled (the history's ``dropped``), and it carries on from its last store
the server took. An evaluation lost that way ends the run the same way unless ``min-eval-sites`` (default 0: never)
of the sites evaluated scored and it is not the last: that evaluation then holds the scores of the sites that
answered and no mean (the history's ``eval_partial`` / ``eval_missing``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from pydantic import Field, field_validator

from fedsilo.client.hostaug import check_host_policy
from fedsilo.config import ConfigError, Params, Strict, TrainParams, format_validation_error
from fedsilo.utils.io import atomic_dir, canonical_hash, read_json, write_json

log = logging.getLogger("fedsilo.deploy")

APP_FILE = "deployment.json"  # inside the Flower App: what every party builds the method and model from
MODULE = "fedsilo_app"  # the App's module: two lines that build the apps from APP_FILE beside it


class SiteEntry(Strict):
    name: str = Field(..., min_length=1, description="the site's client name (its split's one client: `fedsilo site card` prints it)")
    fingerprint: str = Field(..., pattern=r"^[0-9a-f]{64}$", description="the sha256 `fedsilo site card` printed at the site")
    node_id: Optional[int] = Field(None, gt=0, description="the node-id `flwr supernode register <site's .pub>` printed: "
                                   "the site is admitted only from the node registered with its key")
    left: bool = Field(False, description="the site left the federation: `fedsilo deploy app` again and `flwr run` "
                       "resume the run in progress without it from its next round (neither sampled nor evaluated); "
                       "its entry stays, as it was part of the rounds before. Taking the mark away later brings it back "
                       "from the round after the checkpoint then resumed, carrying on from the store on its disk (not "
                       "a site of a task stream: it cannot come back to one)")
    joined: bool = Field(False, description="the site joined the run in progress: listed after every site the run started "
                         "with, it takes part from the round after the checkpoint `flwr run` resumes, from a fresh store "
                         "(for methods whose server holds nothing sized by the federation: FedAvg, FedBN, ...); the mark "
                         "stays for the rest of the run")

    @field_validator("fingerprint", mode="before")
    @classmethod
    def _quoted(cls, v: Any) -> Any:
        if not isinstance(v, str):
            raise ValueError("put the fingerprint in quotes (YAML reads a hex string of digits only as a number)")
        return v


class Contract(Strict):
    task: str
    classes: tuple[str, ...] = Field(..., min_length=2)
    image_shape: tuple[int, int, int] = Field(..., description="harmonized height, width, channels")


class Federation(Strict):
    """``federation.yaml``: what the coordinator and the sites agreed on."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$")
    method: str = Field(..., description="a methods.<key> of the coordinator's params file (its typed params come from there)")
    seed: int = 0
    train: TrainParams = Field(..., description="the model and the optimisation, as an experiment's train section")
    contract: Contract
    sites: tuple[SiteEntry, ...] = Field(..., min_length=2)
    tracking_uri: str = Field("", description="the MLflow tracking URI the ServerApp logs the run to, from the SuperLink's "
                              "machine (an `mlflow server` URL, or sqlite:///path); MLFLOW_TRACKING_URI in the SuperLink's "
                              "environment wins; neither: the results folder only. "
                              "Written into the App's run config (`tracking-uri`), not into deployment.json: where the "
                              "run is logged is not part of what the sites agreed to")


def load_federation(path: str | Path) -> Federation:
    import yaml
    from pydantic import ValidationError

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such federation file") from None
    try:
        fed = Federation.model_validate(raw or {})
    except ValidationError as err:
        raise ConfigError(f"{path}: {format_validation_error(err, '')}") from None
    check_host_policy(fed.train.augment.host, f"{path}: ")
    names = [s.name for s in fed.sites]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"{path}: sites: {', '.join(twice)} listed twice")
    first = next((k for k, s in enumerate(fed.sites) if s.joined), len(fed.sites))
    late = [s.name for s in fed.sites[first:] if not s.joined]
    if late:
        raise ConfigError(f"{path}: sites: {', '.join(late)} listed after {fed.sites[first].name}, which joined the run in "
                          "progress: the sites that joined come after every site the run started with (a site's place is "
                          "its client index)")
    if sum(not s.left for s in fed.sites) < 2:
        raise ConfigError(f"{path}: sites: {sum(s.left for s in fed.sites)} of the {len(names)} sites marked left; a "
                          "federation needs two sites that have not left")
    return fed


# ---------------------------------------------------------------------------------------------------------- the app
def resolve_deployment(fed: Federation, params: Params) -> dict[str, Any]:
    """Everything the apps build the method and model from, resolved and validated once (the content of
    ``deployment.json``)."""
    from fedsilo.methods import method_base, resolve_method

    if fed.method not in params.methods:
        raise ConfigError(f"method: {fed.method!r} is not a methods entry of the params file")
    train = fed.train
    algo = resolve_method(params, fed.method, train)
    out = {
        "federation": fed.name,
        "method": {"key": fed.method, "base": method_base(fed.method, params.methods[fed.method]),
                   "params": algo.params.model_dump(mode="json")},
        "train": train.model_dump(mode="json"),
        "seed": fed.seed,
        "contract": fed.contract.model_dump(mode="json"),
        "sites": [s.model_dump(mode="json") for s in fed.sites],
    }
    h, w, c = fed.contract.image_shape
    if h != w:
        raise ConfigError(f"contract.image_shape: {h} x {w}; fedsilo harmonizes to square images")
    why = train.normalize.channel_mismatch(c)
    if why is not None:  # here, not at every site's first batch
        raise ConfigError(f"train.normalize: {why} (contract.image_shape)")
    spec = deployment_spec(out)
    spec.check()
    spec.make_model()  # the apps' own model builder: a model that fits the contract, or its error now
    return out


# final_model.pt's entry for a hospital outside the run that adapts as a member would (`fedsilo site onboard
# --strategy as_member`): what the server sends a site that was not part of the run, computed after its last round
NEWCOMER = "newcomer"


def as_member_refusal(method: Any, last_round: int) -> Optional[str]:
    """Why a hospital outside a finished run of ``method`` (built and set up, as the run's) cannot adapt as one of its
    sites would (:data:`NEWCOMER`), or None: the method must take a site it did not start with (``joinable``), make
    no part of a site's evaluation model on the server from its uploads (``Method.newcomer_refusal``), share
    something, keep something of each site's own to adapt (its sites are not all evaluated with the global model),
    and still train in the run's last round."""
    key = method.key
    if method.stream_only or not type(method).joins_mid_run():
        return f"{key}: {method.name} takes no site it did not start with ({method.join_refusal})"
    if method.newcomer_refusal():
        return f"{key}: {method.newcomer_refusal()}"
    if method.shares_nothing():
        return f"{key}: its sites share nothing (each trains alone): there is nothing of the federation to adapt"
    if method.eval_is_global():
        return (f"{key}: its sites are all evaluated with the federation's global model, none with a model of its own: "
                "a member's training would leave its evaluation model unchanged (score the federation's model as it is, "
                "`fedsilo site predict --model final_model.pt`, or, where that model is the plain backbone, fine-tune it: "
                "finetune_all)")
    if not method.trains(last_round):
        return f"{key}: its sites trained nothing in the run's last round ({last_round}; methods.{key}.rounds)"
    return None


def newcomer_payloads(method: Any, server: dict[str, torch.Tensor], clients: list[Any], last_round: int) -> Optional[dict[str, Any]]:
    """What the server of a finished run would send a site that joined after its last round (``clients``: the run's
    sites, as the server knows them): the download of a round (``Method.download``, as round ``last_round``'s) and of
    an evaluation (``Method.eval_download``), for a site the server has heard nothing from (a card with the next
    index and no data): the server's shared tensors, and a part it keeps per site as a site it never heard from gets
    it (FedPAC's and FDSE's: no other site's). None where :func:`as_member_refusal` says a newcomer cannot adapt as a
    member. The server state is not changed (a method that makes a per-site part on first need makes it in a copy)."""
    from fedsilo.fl.flower import Card

    if as_member_refusal(method, last_round) is not None:
        return None
    card = Card(max(c.index for c in clients) + 1, NEWCOMER, "", 0, tuple(clients[0].x_train.shape[1:]))
    # the server's own tensors where the downloads are (no copy): final_model.pt stores a tensor the federation's
    # model and the downloads share once
    down = {k: v.detach().cpu() for k, v in method.download(dict(server), card, last_round).items()}
    evaluation = {k: v.detach().cpu() for k, v in method.eval_download(dict(server), card).items()}
    return {"index": card.index, "round": int(last_round), "download": down, "eval": evaluation}


def deployment_spec(dep: dict[str, Any]):
    """The FlowerSpec of a deployment file: the method's class and typed params, the train params, the seed, and a
    model built for the contract's image shape and classes."""
    from fedsilo.fl.flower import FlowerSpec
    from fedsilo.methods import method_class
    from fedsilo.models import build_model

    cls = method_class(dep["method"]["base"])
    train = TrainParams.model_validate(dep["train"])
    h, _, ch = dep["contract"]["image_shape"]
    n_cls, seed = len(dep["contract"]["classes"]), int(dep["seed"])

    def make_model() -> torch.nn.Module:
        return build_model(train.model, int(ch), n_cls, seed=seed, image_size=int(h), width=train.model_width)

    return FlowerSpec(cls, cls.params_cls.model_validate(dep["method"]["params"]), train, seed, make_model, dep["method"]["key"])


PYPROJECT = """\
# A Flower App written by `fedsilo deploy app` from {federation_file}: run it with
#   flwr run {out} <superlink connection> --stream
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedsilo-{name_dash}"
version = "1.0.0"
description = "fedsilo federation {name}: {method} ({base}), seed {seed}, {n} sites"
license = "Apache-2.0"
# every party runs the fedsilo it installed (the SuperLink and SuperNodes do not install anything at run time)
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedsilo"

[tool.flwr.app.components]
serverapp = "{module}:server"
clientapp = "{module}:client"

[tool.flwr.app.config]
results-dir = "{results}"
state-dir = "{state}"  # the ServerApp's checkpoint: a run started again resumes after its last round
tracking-uri = {tracking}  # MLflow, from the SuperLink's machine ("": none; MLFLOW_TRACKING_URI there wins)
wait-s = 600.0  # how long the ServerApp waits for every site to connect
rejoin-s = 600.0  # how long an evaluation / task end waits for a site whose SuperNode went away (0: the run ends)
min-train-sites = 0  # a round goes on without sampled sites gone during its training if this many trained (0: never)
min-eval-sites = 0  # an evaluation before the last goes on without sites gone during it if this many scored (0: never)
"""

MODULE_TEXT = '''"""The Flower apps of federation {name}, built from deployment.json beside this file (fedsilo.fl.deploy)."""

from pathlib import Path

from fedsilo.fl.deploy import apps

APPS = apps(Path(__file__).with_name("{app_file}"))
server = APPS[0]
client = APPS[1]
'''


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string: backslash, quote and control characters escaped, the rest as it is (UTF-8)."""
    def esc(ch: str) -> str:
        if ch in '"\\':
            return "\\" + ch
        return f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch

    return '"' + "".join(esc(c) for c in text) + '"'


def write_app(fed: Federation, params: Params, out: Path, federation_file: str = "federation.yaml",
              results: Optional[str] = None, state: Optional[str] = None) -> dict[str, Any]:
    """A Flower App folder for ``fed``: pyproject.toml, the apps' module and deployment.json; written whole or not
    at all. Returns the deployment."""
    dep = resolve_deployment(fed, params)
    from fedsilo.methods.registry import check_backbone

    spec = deployment_spec(dep)  # a method that cannot train the contract's backbone is refused before any site connects
    h, _, ch = dep["contract"]["image_shape"]
    check_backbone(spec.method(), spec.train.model, int(h), spec.train.model_width, int(ch))
    results = results or f"results/deploy/{fed.name}/{fed.method}/seed{fed.seed}"
    state = state or f"state/deploy/{fed.name}/{fed.method}/seed{fed.seed}"
    out = Path(out)
    with atomic_dir(out) as tmp:
        (tmp / "pyproject.toml").write_text(PYPROJECT.format(
            federation_file=federation_file, out=out, name=fed.name, name_dash=fed.name.replace("_", "-").replace(".", "-").lower(),
            method=fed.method, base=dep["method"]["base"], seed=fed.seed, n=len(fed.sites), module=MODULE, results=results, state=state,
            tracking=toml_string(fed.tracking_uri)), encoding="utf-8")
        (tmp / f"{MODULE}.py").write_text(MODULE_TEXT.format(name=fed.name, app_file=APP_FILE))
        write_json(tmp / APP_FILE, dep)
    return dep


# ---------------------------------------------------------------------------------------------------------- the apps
def site_client(context: Any):
    """The site's one client, from the SuperNode's ``--node-config``: ``params`` (the site's params file), ``experiment``
    (its one-client split) and ``root`` (the folder holding its data/, default the params file's folder)."""
    from fedsilo.client.data import pick_device
    from fedsilo.fl.params import load_params
    from fedsilo.fl.site import load_site

    params_file, experiment, root = _node(context)
    params = load_params(params_file)
    device = pick_device(params.experiments[experiment].train.device, f"experiments.{experiment}.train.device")
    return load_site(params, experiment, root, device)


def site_keep_dir(dep: dict[str, Any]):
    """The folder where a site keeps its stores for this deployment: under its root (``--node-config root``, default
    its params file's folder), ``state/deploy/<federation>/<first 16 hex of the deployment's key>``."""
    key = resume_key(dep, code=False)[:16]

    def keep_dir(context: Any) -> Path:
        return _node(context)[2] / "state" / "deploy" / dep["federation"] / key

    return keep_dir


def resume_key(dep: dict[str, Any], code: bool = True, code_print: Optional[dict[str, str]] = None) -> str:
    """What a resumed deployment must share with the run it resumes: the deployment (but ``checkpoint_every`` and
    ``keep_client_models``, which change what is written, not what is trained; each site's ``node_id``, which
    says which registered key may speak for the site, not what it trains on: a site given a new key mid-run, its
    new node pinned in a new App, resumes with the stores on its disk; each site's ``left``: a site leaving
    mid-run leaves the run in progress, which the other sites carry on from their disks; and the sites marked
    ``joined``, which join the run in progress) and, for the
    coordinator's checkpoint (``code``, or ``code_print``, a :func:`~fedsilo.fl.run.code_fingerprint` already
    computed), the fedsilo code that trains, as a train stage's checkpoint (fl/run.py)."""
    from fedsilo.fl.run import code_fingerprint

    train = {k: v for k, v in dep["train"].items() if k not in ("checkpoint_every", "keep_client_models")}
    # the sites the run started with (a site that joins later is not part of what it resumes)
    sites = [{k: v for k, v in s.items() if k not in ("node_id", "left", "joined")} for s in dep.get("sites", []) if not s.get("joined")]
    if code_print is None and code:
        code_print = code_fingerprint("cpu")
    return canonical_hash({"deployment": {**dep, "train": train, "sites": sites}, **({"code": code_print} if code_print is not None else {})})


def site_identity(context: Any) -> dict[str, Any]:
    """What a site registers with beyond its card: its data fingerprint and contract (hashes and names only)."""
    from fedsilo.fl.params import load_params
    from fedsilo.fl.site import site_card

    params_file, experiment, root = _node(context)
    card = site_card(load_params(params_file), experiment, root)
    return {"fingerprint": card["fingerprint"], "contract.task": card["contract"]["task"],
            "contract.classes": list(card["contract"]["classes"]), "contract.image_shape": list(card["contract"]["image_shape"])}


def _node(context: Any) -> tuple[Path, str, Path]:
    cfg = context.node_config
    missing = [k for k in ("params", "experiment") if k not in cfg]
    if missing:
        raise ConfigError(f"the SuperNode's --node-config lacks {', '.join(missing)} (e.g. --node-config "
                          "'params=\"/site/params.yaml\" experiment=\"site\"'; `fedsilo site supernode` writes it)")
    params_file = Path(str(cfg["params"])).expanduser()
    root = Path(str(cfg.get("root", params_file.parent))).expanduser()
    return params_file, str(cfg["experiment"]), root


class WireLog:
    """Appends one JSON line per message to ``path`` (flushed each line: what crossed so far survives a crash), each
    with the Flower run it crossed in (``flower_run``): the attempts of one results folder (a run that failed or was
    stopped, the run that resumed it) follow one another in one log."""

    def __init__(self, path: Path, flower_run: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(path, "a")
        self.flower_run = int(flower_run)

    def __call__(self, entry: dict[str, Any]) -> None:
        self.fh.write(json.dumps({**entry, "flower_run": self.flower_run}, sort_keys=True) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def apps(app_file: Path):
    """(ServerApp, ClientApp) of the deployment described by ``app_file`` (the App's deployment.json)."""
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp

    from fedsilo.fl.flower import FlowerRun, Roster, client_app
    from fedsilo.tracking import Tracker, flat_summary

    dep = json.loads(Path(app_file).read_text())
    spec = deployment_spec(dep)
    roster = Roster(tuple(s["name"] for s in dep["sites"]), tuple(s["fingerprint"] for s in dep["sites"]), dep["contract"],
                    tuple(s.get("node_id") for s in dep["sites"]), tuple(bool(s.get("left")) for s in dep["sites"]),
                    tuple(bool(s.get("joined")) for s in dep["sites"]))
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        from fedsilo.fl.run import run_lock

        _log_to_stderr()
        default = f"{dep['federation']}/{spec.key}/seed{spec.seed}"
        out = Path(str(context.run_config.get("results-dir", f"results/deploy/{default}")))
        state = Path(str(context.run_config.get("state-dir", f"state/deploy/{default}")))
        with run_lock(state / "run.lock", f"federation {dep['federation']} ({state})"):
            _main(grid, context, out, state)

    def _main(grid: Grid, context: Context, out: Path, state: Path) -> None:
        checkpoint, key = state / "checkpoint.pt", resume_key(dep)
        resumed = peek_checkpoint(checkpoint, key)  # None: a fresh run (no checkpoint, or another deployment's / code's)
        if resumed is None and checkpoint.exists():
            unmarked_joined(dep, checkpoint)
        staging = out.with_name(out.name + ".wire")  # the wire log as the run goes; moved into the results at the end
        # a run that fails leaves it there (what crossed before it ended); the next attempt adds to it
        wire = WireLog(staging / "wire.jsonl", context.run_id)
        tracker = Tracker(False, "")  # no run yet: fail() below is a no-op until _start_tracking has one
        round_log = _RoundLog(spec.train.rounds, dep["federation"])

        def on_round(entry: dict[str, Any]) -> None:
            tracker.log_round(entry)
            round_log.rounds = run.engine.total_rounds  # a stream's rounds are its tasks' (known once the sites registered)
            round_log(entry)

        try:
            try:
                # the MLflow run resumed with the checkpoint; an attempt SIGKILLed before its first is marked KILLED
                tracker = _start_tracking(dep, str(context.run_config.get("tracking-uri", "")), state,
                                          run_id=(resumed or {}).get("mlflow_run_id"))
                run = FlowerRun(spec, len(roster.sites), roster=roster, wire=wire, on_round=on_round,
                                wait_s=float(context.run_config.get("wait-s", 600)), checkpoint=checkpoint,
                                rejoin_s=float(context.run_config.get("rejoin-s", 600)),
                                min_train_sites=_int_config(context, "min-train-sites", 0),
                                min_eval_sites=_int_config(context, "min-eval-sites", 0),
                                config_hash=key, meta={"mlflow_run_id": tracker.run_id})
                run.main(grid, context)
            finally:
                wire.close()
            metrics = _write_results(out, staging, dep, run, tracker.run_id)
            tracker.tag({**{f"site.{n}.left_after_round": str(r) for n, r in metrics["sites_left"].items()},
                         **{f"site.{n}.joined_in_round": str(r) for n, r in metrics["sites_joined"].items()},
                         **{f"site.{n}.away_rounds": ",".join(f"{a}-{b}" for a, b in spans) for n, spans in metrics["sites_away"].items()}})
            # its work is done: running the App again trains again (and never resumes into results already moved)
            checkpoint.unlink(missing_ok=True)
            Tracker.forget(state)
            tracker.finish(flat_summary(metrics), [out / "metrics.json", out / "history.json", out / "wire.jsonl"])
        except (KeyboardInterrupt, SystemExit):
            tracker.fail("KILLED")
            raise
        except BaseException:  # a refused site, a lost node, a full disk
            tracker.fail("FAILED")
            raise

    keep_dir = site_keep_dir(dep)
    client = client_app(spec, site_client, identify=site_identity, keep_dir=keep_dir,
                        wire_log=lambda context: keep_dir(context) / "wire.jsonl",  # the site's own record of what crossed
                        model_meta={"deployment": dep})  # what rebuilds the model the site keeps (load_site_model)
    return server, client


# Methods whose papers adapt a new client by training its own part under the federation's (`fedsilo site onboard`,
# fl/onboard.py): what that part is
OWN_PART = {"fedbn": "its BatchNorm layers (FedBN)", "fedrep": "its head (FedRep)", "fedper": "its head (FedPer)",
            "lgfedavg": "its lower layers (LG-FedAvg's new devices)"}


def read_model_file(path: Path, device: str = "cpu", key: str = "--model") -> Any:
    """A model file's content (tensors and plain values only: ``weights_only``), or a ConfigError naming ``key`` and
    the file: missing, or not one torch can read (cut short in a copy, another kind of file). Torch's own advice to
    load it without ``weights_only`` is not passed on: that would run code from a file received from elsewhere."""
    try:
        return torch.load(Path(path), map_location=device, weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"{key}: {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{key}: {path}: a folder; name the model file (model.pt, final_model.pt)") from None
    except Exception as err:  # noqa: BLE001 - any unreadable file: say which and why, one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ConfigError(f"{key}: {path}: not a model file fedsilo wrote, or one cut short in a copy ({type(err).__name__}"
                          + (f": {first[:160]}" if first and "weights_only" not in first else "") + "); copy it again") from None


def load_site_model(path: Path, device: str = "cpu") -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model a site kept from a deployment (``model.pt`` beside its stores: the model it was evaluated with in
    its last evaluated round), or the federation's model (the coordinator's ``final_model.pt``) where that is a whole
    model (no site keeps any of its tensors for itself: FedAvg, FedProx, Ditto's global model, ...), rebuilt from the
    deployment it was trained in, in eval mode; and what the file says (round, site, deployment)."""
    kept = read_model_file(path, device)
    if not isinstance(kept, dict) or "deployment" not in kept or ("model" not in kept and "server" not in kept):
        raise ConfigError(f"{path}: not a model a fedsilo deployment wrote (a site's kept model.pt, or the coordinator's "
                          "final_model.pt)")
    dep = kept["deployment"]
    h, w, ch = (int(v) for v in dep["contract"]["image_shape"])
    # as the site built it (FlowerSpec.build): the backbone as the method transforms it (pFedDB's two branches,
    # pFedDR's dual BatchNorm, FedWon's weight-standardised convolutions, ...), from an example of the contract's shape
    _, model, _ = deployment_spec(dep).build(torch.zeros(2, ch, h, w), torch.device(device), [])
    state = kept.pop("model") if "model" in kept else kept.pop("server")
    lacking = sorted(set(model.state_dict()) - set(state))
    if lacking:  # the federation's model without what each site keeps (FedBN's BatchNorm, pFedDB's own branch, ...)
        method = dep["method"]["key"]
        onboard = dep["method"]["base"] == "pfeddb" or dep["method"]["base"] in OWN_PART or NEWCOMER in kept
        raise ConfigError(f"{path}: the federation's model of {method} lacks the {len(lacking)} tensors each site keeps for "
                          f"itself ({', '.join(lacking[:3])}{', ...' if len(lacking) > 3 else ''}): it scores nothing "
                          "alone; score a site's own kept model.pt" + (", or adapt it on this site's data first "
                                                                          "(`fedsilo site onboard`)" if onboard else ""))
    model.load_state_dict(state, strict=True)
    return model.eval(), kept


def unmarked_joined(dep: dict[str, Any], checkpoint: Path) -> None:
    """Refuses a deployment whose last sites joined the run in ``checkpoint`` but are no longer marked ``joined``: that
    would start the run afresh over it (the sites it started with are what it resumes by), losing what it trained."""
    from fedsilo.fl.run import code_fingerprint

    held = torch.load(checkpoint, map_location="cpu", weights_only=False, mmap=True).get("config_hash")  # mapped: no tensor read
    sites, code = dep["sites"], code_fingerprint("cpu")
    for k in range(len(sites) - 1, 1, -1):
        if any(s.get("joined") for s in sites[:k]):
            break
        as_joined = {**dep, "sites": [*sites[:k], *({**s, "joined": True} for s in sites[k:])]}
        if resume_key(as_joined, code_print=code) == held:
            names = ", ".join(s["name"] for s in sites[k:] if not s.get("joined"))
            raise ConfigError(f"sites: {names} joined the run in progress in {checkpoint.parent} and is no longer marked "
                              "`joined: true`: keep the mark for the rest of the run (without it the run would start afresh "
                              "over its checkpoint)")


def peek_checkpoint(path: Path, key: str) -> Optional[dict[str, Any]]:
    """The round and meta of the coordinator's checkpoint at ``path`` if it was written under ``key``
    (:func:`resume_key`), else None (no checkpoint, or one of another deployment or code: the run starts afresh and
    overwrites it)."""
    from fedsilo.fl.engine import checkpoint_meta

    held = checkpoint_meta(path, key)
    if held is None and path.exists():
        log.info("%s: written by another deployment or fedsilo; this run starts afresh", path)
    return held


def site_audit(root: Path) -> list[dict[str, Any]]:
    """What crossed a site's link, read from its own disk: for each deployment it took part in (the folders
    ``<root>/state/deploy/<federation>/<first 16 hex of the deployment's key>/`` its ClientApps write), its wire log
    summed up per message type, received and sent: messages, tensor bytes, the tensors by record with dtype and
    shape (their union over the log), the config and metric keys; the error replies (counted apart); each Flower run
    with its rounds; the line numbers of lines that cannot be read (one cut short when a SuperNode was killed); the stores it keeps there (rounds, tensors, bytes: what the method keeps at the site) and the model it
    was last evaluated with (``model.pt``: :func:`load_site_model`). Values never
    appear in a wire log, so none appear here."""
    base = Path(root) / "state" / "deploy"
    logs = sorted(base.glob("*/*/wire.jsonl")) if base.is_dir() else []
    if not logs:
        raise ConfigError(f"--root: {Path(root).resolve()} holds no site wire log (state/deploy/<federation>/<key>/wire.jsonl): "
                          "a site's ClientApps write it under the root its SuperNode's --node-config names")
    from fedsilo.fl.flower import KeptStores

    out = []
    for log in logs:
        summary: dict[str, Any] = {"federation": log.parent.parent.name, "deployment": log.parent.name, "wire_log": str(log),
                                   "runs": {}, "received": {}, "sent": {}, "errors": [], "unreadable_lines": [], "kept": {}}
        for n, line in enumerate(log.read_text().splitlines(), 1):
            try:
                w = json.loads(line)
                kind, to, run = w["message"], w["to"], int(w.get("flower_run", 0))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                # a line cut short (a SuperNode killed while writing, a full disk): named, the rest still read
                summary["unreadable_lines"].append(n)
                continue
            summary["runs"].setdefault(run, set())
            if w.get("round"):
                summary["runs"][run].add(int(w["round"]))
            side = summary["sent" if to == "server" else "received"].setdefault(
                kind, {"messages": 0, "tensor_bytes": 0, "arrays": {}, "config": set(), "metrics": set(), "errors": 0})
            if "error" in w:  # a reply that says why the site did not do what it was asked: counted apart
                side["errors"] += 1
                summary["errors"].append({"round": w.get("round"), "message": kind, "flower_run": run, "error": w["error"]})
                continue
            side["messages"] += 1
            side["tensor_bytes"] += sum(int(b) for b in w.get("tensor_bytes", {}).values())
            for rec, keys in w.get("arrays", {}).items():
                side["arrays"].setdefault(rec, {}).update(keys)
            for field in ("config", "metrics"):
                for rec, keys in w.get(field, {}).items():
                    side[field].update(f"{rec}.{k}" for k in keys)
        for folder in sorted(p for p in log.parent.iterdir() if p.is_dir()):
            files, model = sorted(f for f in folder.iterdir() if KeptStores.PATTERN.match(f.name)), folder / "model.pt"
            if not files and not model.is_file():
                continue
            newest = torch.load(files[-1], map_location="cpu", weights_only=True) if files else {}
            taken = torch.load(model, map_location="cpu", weights_only=True) if model.is_file() else None
            store = newest.get("store", {})
            summary["kept"][newest.get("site") or (taken or {}).get("site") or folder.name] = {
                "rounds": [int(f.stem[len("store-r"):]) for f in files], "folder": str(folder),
                "tensors": len(store), "tensor_bytes": sum(t.numel() * t.element_size() for t in store.values() if torch.is_tensor(t)),
                "keys": sorted(store),
                # the model it was evaluated with last: what it takes home (load_site_model)
                "model": {"path": str(model), "round": int(taken["round"])} if taken is not None else None}
        for side in ("received", "sent"):
            for v in summary[side].values():
                v["config"], v["metrics"] = sorted(v["config"]), sorted(v["metrics"])
        # each Flower run with the rounds it carried (a run started afresh counts from round 1 again)
        summary["runs"] = {str(r): sorted(rounds) for r, rounds in sorted(summary["runs"].items())}
        summary["sent_tensor_bytes"] = sum(v["tensor_bytes"] for v in summary["sent"].values())
        summary["received_tensor_bytes"] = sum(v["tensor_bytes"] for v in summary["received"].values())
        out.append(summary)
    return out


def deployment_status(app: Path, nodes: list[dict[str, Any]] | None, superlink_dir: Path = Path("."),
                      flower_run: Callable[[int], tuple[str | None, str | None]] | None = None) -> dict[str, Any]:
    """Where a deployment stands, for its coordinator: each site of the App's ``deployment.json`` with the status the
    SuperLink gives its pinned node (``nodes``: ``flwr supernode list --format json``'s list; None where the SuperLink
    did not answer: every site's status ``unknown``), the registered nodes no site is pinned to, the ServerApp's
    checkpoint (the round a run started again resumes after) and whether the results are written: what the disk
    holds is told with the SuperLink down too, when it is needed most. Relative ``state-dir`` / ``results-dir`` are
    the SuperLink's: under ``superlink_dir``.

    ``flower_run`` (run id -> (Flower's status of that run, or None and why not)) is asked, where no ServerApp holds
    the run lock, about the Flower run of the wire log's last message: a run still ``running`` without a holder of the
    lock lost its ServerApp (killed, out of memory), which Flower does not notice; ``flower_run.serverapp_died`` says
    so."""
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:  # 3.10: the same parser, as Flower's dependency
        import tomli as tomllib

    app = Path(app)
    if not (app / "deployment.json").is_file():
        raise ConfigError(f"--app: {app} holds no deployment.json (make the App with `fedsilo deploy app`)")
    dep = json.loads((app / "deployment.json").read_text())
    config = tomllib.loads((app / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["flwr"]["app"]["config"]
    by_id = {str(n["node-id"]): n for n in nodes or []}
    sites = []
    for s in dep["sites"]:
        node = by_id.pop(str(s["node_id"]), None) if s.get("node_id") is not None else None
        status = ("left" if s.get("left") else node["status"] if node else
                  "not pinned" if s.get("node_id") is None else "unknown" if nodes is None else "not registered")
        since = (node.get("online-at") if status == "online" else node.get("offline-at")) if node and status != "left" else None
        sites.append({"site": s["name"], "node_id": s.get("node_id"), "status": status,
                      "since": since if since and since != "N/A" else None,  # flwr writes N/A for a time not reached
                      **({"joined": True} if s.get("joined") else {})})  # joined the run in progress
    # a node whose key was unregistered is listed until the SuperLink forgets it: it is no one's
    other = [{"node_id": int(k), "status": n["status"]} for k, n in by_id.items() if n["status"] not in ("unregistered", "deleted")]

    def where(key: str) -> Path:
        path = Path(str(config[key]))
        return path if path.is_absolute() else Path(superlink_dir) / path

    state, results = where("state-dir"), where("results-dir")
    ckpt = state / "checkpoint.pt"
    held = peek_checkpoint(ckpt, resume_key(dep)) if ckpt.exists() else None
    checkpoint = ({"round": held["round"], "path": str(ckpt)} if held else
                  {"round": None, "path": str(ckpt), "other": True} if ckpt.exists() else None)
    from fedsilo.utils.locks import holder as lock_holder

    # a ServerApp running this deployment holds its run lock; the wire log it writes as it goes says what it last did
    wire = results.with_name(results.name + ".wire") / "wire.jsonl"
    last = None
    if wire.is_file() and wire.stat().st_size:
        with open(wire, "rb") as fh:
            fh.seek(max(0, wire.stat().st_size - 4096))
            line = fh.read().decode("utf-8", "replace").strip().splitlines()[-1]
        try:
            entry = json.loads(line)
            last = {"round": entry.get("round"), "message": entry.get("message"), "to": entry.get("to"),
                    "site": entry.get("site"), "flower_run": entry.get("flower_run"),
                    "seconds_ago": round(time.time() - wire.stat().st_mtime)}
        except json.JSONDecodeError:  # a line cut short by a stop
            pass
    running = lock_holder(state / "run.lock")
    # a stream's rounds are per task: known for a method that learns streams only (another learns a stream where its
    # sites hold one, which their cards tell the ServerApp, not this file), or from the results' task list
    done = read_json(results / "metrics.json") if (results / "metrics.json").exists() else {}
    stream = bool(deployment_spec(dep).method_cls.stream_only or done.get("tasks"))
    st = {"federation": dep["federation"], "method": dep["method"]["key"], "seed": dep["seed"], "rounds": dep["train"]["rounds"],
          "stream": stream, "sites": sites, "unlisted_nodes": other, "checkpoint": checkpoint, "running": running, "last_message": last,
          "results": str(results) if (results / "metrics.json").exists() else None}
    # the last message was written by a ServerApp holding the run lock: that lock free, its Flower run should be over
    if flower_run is not None and running is None and last and last.get("flower_run") is not None:
        run_id = int(last["flower_run"])
        status, why = flower_run(run_id)
        st["flower_run"] = {"run_id": run_id, "status": status, "error": why, "serverapp_died": status == "running"}
    return st


def _int_config(context: Any, key: str, default: int) -> int:
    """A whole-number key of the App's run config (``flwr run <app> --run-config '<key>=<n>'``), refused by key."""
    value = context.run_config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) and not (isinstance(value, float) and value.is_integer()):
        raise ConfigError(f"run config {key}: {value!r} is not a whole number")
    return int(value)


class _RoundLog:
    def __init__(self, rounds: int, name: str):
        self.rounds, self.name = rounds, name

    def __call__(self, entry: dict[str, Any]) -> None:
        from fedsilo.fl.run import round_summary

        log.info("%s round %d/%d: %s", self.name, entry["round"], self.rounds, round_summary(entry))


def _log_to_stderr() -> None:
    """The ServerApp runs in a process of its own: its round lines go to its stderr (the SuperLink's log)."""
    root = logging.getLogger("fedsilo")
    root.setLevel(logging.INFO)
    if not root.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("fedsilo: %(message)s"))
        root.addHandler(h)


def deploy_experiment(dep: dict[str, Any]) -> str:
    """The MLflow experiment a deployment's runs are in."""
    return f"deploy/{dep['federation']}"


def _start_tracking(dep: dict[str, Any], uri: str, state: Path, run_id: Optional[str] = None):
    """The deployed run in MLflow (when the App's ``tracking-uri`` or the SuperLink's ``MLFLOW_TRACKING_URI`` names a
    store): experiment ``deploy/<federation>``, the method's and the train params, and as tags the deployment's hash
    and every site's pinned fingerprint (and node id), so that the run is tied to the data each site hashed. A
    resumed run continues ``run_id``, the MLflow run its checkpoint names (``state``: the ServerApp's state folder,
    :meth:`~fedsilo.tracking.Tracker.start_in`)."""
    from fedsilo.tracking import Tracker

    tracker = Tracker(bool(uri or os.environ.get("MLFLOW_TRACKING_URI")), uri)
    tags = {"federation": dep["federation"], "method": dep["method"]["key"], "method_base": dep["method"]["base"],
            "seed": str(dep["seed"]), "deployment_sha256": canonical_hash(dep), "model": dep["train"]["model"],
            "contract.task": dep["contract"]["task"]}
    for site in dep["sites"]:
        tags[f"site.{site['name']}.fingerprint"] = site["fingerprint"]
        if site.get("node_id") is not None:
            tags[f"site.{site['name']}.node_id"] = str(site["node_id"])
    # the train the sites use: the federation's, with the method's own local_optimizer settings where it has them
    train = deployment_spec(dep).method().train.model_dump(mode="json")
    params = {"method": dep["method"]["params"], "train": train, "seed": dep["seed"], "contract": dep["contract"]}
    tracker.start_in(state, deploy_experiment(dep), f"{dep['method']['key']}-seed{dep['seed']}", params, tags, run_id=run_id)
    if tracker.enabled and run_id and tracker.run_id == run_id:
        # resumed, perhaps by a new App that pins a site's new node (resume_key leaves node ids out): the run's tags
        # say what it now runs under, and a node pin the new App dropped is no longer claimed
        stale = [k for k in tracker.client.get_run(run_id).data.tags if k.startswith("site.") and k.endswith(".node_id") and k not in tags]
        for k in stale:
            tracker.client.delete_tag(run_id, k)
        tracker.tag(tags)
    return tracker


def _write_results(out: Path, staging: Path, dep: dict[str, Any], run: Any, mlflow_run_id: Optional[str] = None) -> dict[str, Any]:
    from fedsilo.fl.continual import continual_summary
    from fedsilo.fl.run import summarize

    history = run.engine.history
    summary = summarize(history)
    if getattr(run.engine, "stream", False):  # the stream's accuracy matrix, accuracy after each task, forgetting, as a train stage
        summary.update(continual_summary(history, run.engine.task_names, run.engine.per_task))
        summary["mean_acc"] = summary["final_acc"]
    metrics = {
        **summary,
        "federation": dep["federation"],
        "method": dep["method"]["key"],
        "seed": dep["seed"],
        "clients": [c["name"] for c in run.cards],
        # a stream site: its tasks' domains in order
        "client_domains": {c["name"]: list(c["tasks"]) if "tasks" in c else c["domain"] for c in run.cards},
        "fingerprints": {c["name"]: c["fingerprint"] for c in run.cards},
        # the rounds each site was sampled for but left out of, gone during the training (min-train-sites)
        "dropped_rounds": {c["name"]: rounds for c in run.cards
                           if (rounds := [int(e["round"]) for e in history if c["name"] in e.get("dropped", {})])},
        "bytes_down_dropped_total": int(sum(sum(e.get("dropped", {}).values()) for e in history)),  # sent, never taken back
        # the evaluations each site was gone during, which went on without it (min-eval-sites)
        "unevaluated_rounds": {c["name"]: rounds for c in run.cards
                               if (rounds := [int(e["round"]) for e in history if c["name"] in e.get("eval_missing", ())])},
        # the sites that have left the federation, each with the last round it took part in (sites[k].left)
        "sites_left": dict(run.engine.left),
        # the sites that left and came back, each with the rounds it was gone ([first, last] per absence)
        "sites_away": {n: [list(span) for span in spans] for n, spans in run.engine.away.items() if spans},
        # the sites that joined the run in progress, each with the first round it took part in (sites[k].joined)
        "sites_joined": dict(run.engine.joined),
        "deployment_sha256": canonical_hash(dep),
        "mlflow_run_id": mlflow_run_id,
        "mlflow_experiment": deploy_experiment(dep) if mlflow_run_id else None,  # where the UI lists it
    }
    with atomic_dir(out) as tmp:
        write_json(tmp / "metrics.json", metrics)
        (tmp / "history.json").write_text(json.dumps(history, indent=1) + "\n")
        write_json(tmp / APP_FILE, dep)
        # the federation's model after the last round: the server state's model tensors that no site keeps private
        # (the global model, or the shared part: pFedDB's phi), never a part the server keeps per site (FedPAC's
        # heads, FDSE's erasers) or its bookkeeping; with the deployment it was trained in: what a hospital that was
        # not part of the run starts from (`fedsilo site onboard`)
        shared = set(run.engine.model.state_dict()) - set(run.engine.private)
        # and what the server would send a site joining after the last round (a method whose newcomer adapts as its
        # sites do: `fedsilo site onboard --strategy as_member`): what every site is sent, never a site's own part;
        # FedPAC's global prototypes among it (a class only one site holds: that site's mean feature of the class)
        newcomer = None if getattr(run.engine, "stream", False) else newcomer_payloads(
            run.engine.method, run.engine.server, run.engine.clients, run.engine.round)
        torch.save({"round": run.engine.round, "deployment": dep,
                    "server": {k: v.detach().cpu() for k, v in run.engine.server.items() if k in shared},
                    **({NEWCOMER: newcomer} if newcomer is not None else {})}, tmp / "final_model.pt")
        os.replace(staging / "wire.jsonl", tmp / "wire.jsonl")
    staging.rmdir()
    return metrics
