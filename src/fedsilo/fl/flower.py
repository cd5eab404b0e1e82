"""Any registered method as a Flower ServerApp / ClientApp pair (Flower's Message API, ``flwr`` >= 1.40).

Both apps build the method from the same class, params, train params and seed as the in-process engine
(:class:`FlowerSpec`); the method is not changed. What differs is where things live and how they move:

- **Server** (:class:`FlowerServer`, the ServerApp's ``main``): the method's server state, sampling, aggregation,
  the round history. It is the in-process :class:`~fedsilo.fl.engine.Engine` with its clients replaced by the
  *cards* the sites register (index, name, domain, training-sample count, image shape: what ``Method.join`` is told;
  no image, label or store): sampling, evaluation schedule, privacy check and round bookkeeping are the engine's own
  (inherited), the client half of a round is a Flower message to the site.
- **Client** (:func:`client_app`): one site's data, loaded on the site by ``load_client(context)``, and its
  *store* (the tensors the method keeps on the client: private layers, personal models), kept in Flower's per-node
  ``context.state`` as an ArrayRecord. The store never enters a message.

A round, as messages (``group_id`` = the round):

1. ``query.announce`` (only for a method that overrides ``Method.announce``): the site's announcement comes back as
   an ArrayRecord; the server hears it before that site's download.
2. ``train``: ArrayRecord ``down`` (``Method.download``) and ConfigRecord ``fedsilo`` (the round, the federation's
   cards, whether to count FLOPs). The site runs ``Method.local_update`` on its store and replies with ArrayRecord
   ``up`` and MetricRecord ``fedsilo`` (its training loss, the tensor bytes it received). The site refuses to send
   a key the method declares private (:class:`~fedsilo.fl.engine.PrivacyViolation` on the site: the reply is an
   error and nothing of the upload leaves it); the server checks every received record again.
3. ``evaluate`` (the rounds the engine evaluates, every site): ArrayRecord ``server`` (``Method.eval_download``: the
   server state, or for a method whose server keeps per-client tensors, FedPAC and FDSE, the site's own) goes to
   each site, which loads the model it is evaluated with (``Method.load_eval_model``) and, where the method has one,
   the global model, and replies with a MetricRecord of its test scores; the server combines them as the engine does.

The sampled sites of a round train in parallel; their uploads are aggregated in client order, as the engine does, so
a streaming mean adds the same numbers in the same order. Every download is computed before the round's first
upload is aggregated; the engine computes a client's download after the previous client's upload, which gives the
same payloads because a method's aggregation changes the server state only at its end (``agg_end`` /
``aggregate``).

Bytes: ``bytes_down`` / ``bytes_up`` / ``bytes_announce`` in a round's entry are the tensor bytes (``numel *
element_size``, the engine's :func:`~fedsilo.methods.base.payload_bytes`) of the Arrays in the records Flower
delivered: a download's as its site measured it on arrival, an upload's as the server measured it. Flower's own count
of the same records (``ArrayRecord.count_bytes``: the arrays' ``.npy`` serialisation with its headers, plus key
names) is recorded beside them as ``flower_record_bytes``; the server state sent for evaluation as
``bytes_eval_down`` (the engine moves nothing to evaluate).

Checkpoints and resume (a deployment: ``checkpoint`` given to :class:`FlowerRun`): the server writes its state and
history every ``train.checkpoint_every`` rounds, as the engine does, and each site keeps its own store on its own disk
after each round it trains (``keep_dir`` of :func:`client_app`; :class:`KeptStores`), since a store in Flower's
node state lives only as long as the run (or its SuperNode's process). Every message of a checkpointed run carries
``last_trained``, each site's last trained round in the server's history, and a site with no store in its node state
(the first message of a run started again after the SuperLink or the ServerApp went down, which resumes after the
server's last checkpoint; or after its SuperNode restarted between rounds) loads exactly that round's store, never one
of a later round than the message allows (:meth:`KeptStores.load`). ``checkpointed`` in every message lets the sites
drop the stores no resume can need.

A site that left (a deployment's ``sites[k].left``; :class:`Roster`): a resumed run goes on without it from the
round after its checkpoint (``Engine.active``), with the card it registered with when it took part, kept in the
checkpoint's meta; it is not waited for, and its SuperNode, if it still runs, is told it left (``query.refused``).
Its mark taken away, a later resume takes it back from the round after that checkpoint: it registers again and
carries on from the store on its disk, the rounds it was gone recorded (``Engine.away``); not a site of a task
stream (it missed the tasks' ends and evaluations of its absence: refused before any site connects).

Task streams (``fl/continual.py``): a site whose data is a stream (one client per task: its ``domain_incremental``
split) registers its tasks; the run is then a :class:`FlowerStream`, whose messages name each round's task and which
adds a ``query.task_end`` message and per-task evaluation (the :class:`~fedsilo.fl.continual.ContinualEngine`'s
numbers).

Not carried over from the engine: the ensemble "new test" and external test site (``train.ensemble_test``),
``spectra``.
"""

from __future__ import annotations

import builtins
import json
import logging
import math
import os
import re
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from fedsilo.client.data import ClientData, to_float
from fedsilo.client.local import compile_model, evaluate, evaluate_client, scheduled_lr, score, use_channels_last
from fedsilo.config import ConfigError, TrainParams
from fedsilo.fl.continual import TaskStream, stream_eval
from fedsilo.fl.engine import (
    Engine,
    Observer,
    PrivacyViolation,
    checkpoint_meta,
    eval_summary,
    flop_counter,
    refuse_private,
)
from fedsilo.methods.base import Method, MethodParams, State, payload_bytes
from fedsilo.methods.registry import check_rounds_fit, check_stream_fit, joinable_methods

try:  # the optional extra: pip install -e ".[flower]" in fedsilo's checkout
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("fedsilo.fl.flower needs Flower: in fedsilo's checkout, pip install -e '.[flower]' -c constraints.txt "
                      "(flwr[simulation])") from err

__all__ = ["Card", "ClientFailed", "FlowerRun", "FlowerServer", "FlowerSpec", "FlowerStream", "KeptStores", "Roster", "SiteLeft", "SiteRefused", "client_app",
           "describe", "record_tensor_bytes", "simulate", "site_wire_log"]

log = logging.getLogger("fedsilo.flower")
WAIT_LINE_S = 30.0  # how often a ServerApp waiting for its sites to connect says how many have
REJOIN_POLL_S = 2.0  # how often a run waiting for a site that went away asks the SuperLink which nodes are online
# the messages a run sends again to a site that went away and came back: they read the store the message names from
# the site's disk (evaluate) or write it there whole (task_end), or are repeated as they are (announce). Never a
# train message: a site that restarted after the round's announce lost what the announce changed (pFedDIL's route),
# and one whose link dropped after it trained has already trained the round (and refuses it again); the round is
# redone from the checkpoint by running the App again, as the error says
RESENDABLE = frozenset({"evaluate", "query.task_end", "query.announce"})


def _node_gone(reply: Message) -> bool:
    """The SuperLink's error reply for a node that missed its heartbeats (down, or its link lost)."""
    from flwr.common.constant import ErrorCode

    return reply.has_error() and reply.error.code == ErrorCode.NODE_UNAVAILABLE


def _app_gone(reply: Message) -> bool:
    """A SuperNode's error reply for its ClientApp process that missed its heartbeats ("ClientApp stopped responding")."""
    from flwr.common.constant import ErrorCode

    return reply.has_error() and reply.error.code == ErrorCode.CLIENT_APP_CRASHED

STORE = "fedsilo.store"  # the context.state record holding a site's store
TRAINED = "fedsilo.trained"  # the context.state record holding the last round a site trained
STORE_ROUND = "fedsilo.store_round"  # the context.state record holding the round the store in it is of
CONFIG = "fedsilo"  # the ConfigRecord / MetricRecord of every message


class ClientFailed(RuntimeError):
    """A site answered a message with an error (its exception, as Flower reports it)."""


# ---------------------------------------------------------------------------------------------------------- records
def to_record(state: State) -> ArrayRecord:
    """A state as Flower's ArrayRecord: one Array (NumPy serialisation) per tensor, keys kept."""
    out = {}
    for k, v in state.items():
        t = v.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16 or not hasattr(np, str(t.dtype).removeprefix("torch.")):
            raise TypeError(f"{k}: a {t.dtype} tensor has no NumPy dtype and cannot travel as a Flower Array")
        out[k] = Array(t)
    return ArrayRecord(out)


def from_record(record: ArrayRecord, device: torch.device) -> State:
    return {k: torch.from_numpy(a.numpy()).to(device) for k, a in record.items()}


def record_tensor_bytes(record: ArrayRecord) -> int:
    """The tensor bytes an ArrayRecord carries: numel * itemsize of each Array, from its shape and dtype (the
    engine's payload_bytes of the same tensors; the .npy headers and key names are not counted)."""
    return int(sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in record.values()))


def describe(content: RecordDict) -> dict[str, Any]:
    """What a message carries, without its values: each ArrayRecord's keys with dtype and shape and its tensor bytes,
    the keys of each ConfigRecord and MetricRecord (a deployment's wire log, one line per message)."""
    out: dict[str, Any] = {}
    for name, rec in content.array_records.items():
        out.setdefault("arrays", {})[name] = {k: [str(a.dtype), list(a.shape)] for k, a in rec.items()}
        out.setdefault("tensor_bytes", {})[name] = record_tensor_bytes(rec)
    for name, rec in content.config_records.items():
        out.setdefault("config", {})[name] = sorted(rec.keys())
    for name, rec in content.metric_records.items():
        out.setdefault("metrics", {})[name] = sorted(rec.keys())
    return out


def site_wire_log(path_of: Callable[[Context], Path]) -> Callable[..., Message]:
    """A ClientApp mod (Flower's middleware around every message a site handles) that appends the site's own record
    of what crossed its link to ``path_of(context)``: one JSON line per message received and per reply sent, as the
    coordinator's wire log writes them (round, message type, direction, :func:`describe`: keys, dtypes, shapes and
    tensor bytes, never values; an error reply's reason). A hospital audits what left it from its own disk, without
    trusting the coordinator's copy."""

    def write(path: Path, line: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:  # one write per line, appended: each message is a process of its own on a SuperNode
            fh.write(json.dumps(line, sort_keys=True) + "\n")

    def mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        path = path_of(context)
        group = msg.metadata.group_id
        head = {"round": int(group) if group.isdigit() else 0, "message": msg.metadata.message_type,
                "flower_run": int(context.run_id)}
        write(path, {**head, "to": "site", **(describe(msg.content) if msg.has_content() else {})})
        try:
            reply = call_next(msg, context)
        except BaseException as err:
            write(path, {**head, "to": "server", "error": f"{type(err).__name__}: {err}"})
            raise
        write(path, {**head, "to": "server", **(describe(reply.content) if reply.has_content() else {"error": reply.error.reason})})
        return reply

    return mod


# ---------------------------------------------------------------------------------------------------------- cards
class Card(ClientData):
    """A site as the federation knows it once registered: index, name, domain, training-sample count and image shape
    (``Method.join``'s view); its image and label tensors are empty, so a server-side hook that reads a client's data
    fails instead of reading it."""

    def __init__(self, index: int, name: str, domain: str, n_train: int, shape: tuple[int, ...]):
        none = torch.empty((0, *shape), dtype=torch.uint8)
        label = torch.empty(0, dtype=torch.long)
        super().__init__(int(index), str(name), none, label, none, label, str(domain))
        self.count = int(n_train)
        self.shape = tuple(int(s) for s in shape)

    @property
    def n_train(self) -> int:
        return self.count

    @staticmethod
    def of(client: ClientData) -> "Card":
        return Card(client.index, client.name, client.domain, client.n_train, tuple(client.x_train.shape[1:]))


def cards_config(cards: list[Card]) -> dict[str, Any]:
    return {
        "index": [c.index for c in cards],
        "name": [c.name for c in cards],
        "domain": [c.domain for c in cards],
        "n_train": [c.n_train for c in cards],
        "shape": list(cards[0].shape),
    }


def cards_from_config(cfg: ConfigRecord) -> list[Card]:
    shape = tuple(int(s) for s in cfg["shape"])
    return [Card(i, n, d, k, shape) for i, n, d, k in zip(cfg["index"], cfg["name"], cfg["domain"], cfg["n_train"])]


# ---------------------------------------------------------------------------------------------------------- spec
@dataclass(frozen=True)
class FlowerSpec:
    """What both apps build the method from: its class, typed params, ``methods.<key>``, the train params, the seed,
    and ``make_model()``, which returns the backbone initialised from the seed (the same weights at every call, as
    ``build_model(..., seed=seed)``)."""

    method_cls: type[Method]
    params: MethodParams
    train: TrainParams
    seed: int
    make_model: Callable[[], nn.Module]
    key: Optional[str] = None

    @staticmethod
    def of(method: Method, make_model: Callable[[], nn.Module], seed: int) -> "FlowerSpec":
        """The spec of a method object as ``resolve_method`` builds it (its class, params, train and key)."""
        return FlowerSpec(type(method), method.params, method.train, int(seed), make_model, method.key)

    def method(self) -> Method:
        return self.method_cls(self.params, self.train, key=self.key)

    def check(self, stream: Optional[bool] = None) -> None:
        """The engine's refusals, and what the adapter does not carry over, named by key. ``stream``: whether the
        sites hold task streams (None: not known yet, as when the apps are built before any site registered)."""
        m = self.method_cls
        if stream is not None:
            check_stream_fit(m, stream, self.key or m.name, "the sites hold task streams" if stream else
                             "these sites hold static data (a domain_incremental split at each site gives each a stream)")
        if self.train.ensemble_test:
            raise ConfigError("train.ensemble_test: the ensemble 'new test' is not run on Flower (it needs every "
                              "site's evaluation model in one place); set it to false")
        check_rounds_fit(self.method(), self.key or m.name, self.train.rounds, "train.rounds")

    def build(self, example: torch.Tensor, device: torch.device, cards: list[Card],
              tasks: Optional[list[str]] = None) -> tuple[Method, nn.Module, set[str]]:
        """A fresh method and model, in the engine's order: set_tasks (a stream's task names), join, transform_model,
        setup, private_keys."""
        method = self.method()
        if tasks is not None:
            method.set_tasks(list(tasks))
        method.join(list(cards), self.seed)
        torch.manual_seed(self.seed)
        model = self.make_model().to(device)
        model = method.transform_model(model, example)
        method.setup(model)
        return method, model, set(method.private_keys(model))


# ---------------------------------------------------------------------------------------------------------- server
def no_stream_come_back(name: str, last: int) -> ConfigError:
    """The refusal of a site that left a task stream and is no longer marked left."""
    return ConfigError(f"sites: {name} left the stream after round {last} (the run's checkpoint says so) and is no "
                       "longer marked left, but a site that left a task stream cannot come back to it (it missed the "
                       "tasks' ends and evaluations of its absence): mark it `left: true` again, or start a new run with it")


def still_listed(joined: dict[str, int], names: Sequence[str]) -> None:
    """Refuses a run whose checkpoint says sites joined it (``joined``: name -> first round) that the federation no
    longer lists: the rounds they took part in are the run's."""
    dropped = sorted(set(joined) - set(names))
    if dropped:
        raise ConfigError("sites: " + ", ".join(f"{n} joined in round {joined[n]}" for n in dropped) + " (the run's checkpoint "
                          "says so) and is no longer listed: keep its entry, marked `left: true` if it left")


def no_run_to_leave(names: Sequence[str], checkpoint: Optional[Path]) -> ConfigError:
    """The error for sites marked left when there is no run in progress to resume without them."""
    return ConfigError(f"sites: {', '.join(names)} marked left, but there is no checkpoint of this deployment to resume "
                       f"({checkpoint}): a site leaves a run in progress; to train without it from the start, take its "
                       "entry out of federation.yaml")


def check_min_train_sites(spec: FlowerSpec, n_sites: int, value: int, checkpointed: bool, stream: Optional[bool]) -> None:
    """What leaving a site gone during its training out of a round needs (``min-train-sites`` > 0), refused by key
    where it is missing: a number of sites a round can lose one of, a checkpointed run, static data (``stream``:
    whether the sites hold task streams; None: not known yet), and a method that says nothing before training."""
    key = "min-train-sites"
    if value == 0:
        return
    if value < 0 or value > n_sites:
        raise ConfigError(f"{key}: {value} is not a number of sites between 0 and the federation's {n_sites}")
    tp = spec.train
    fractions = tp.client_fraction_range[1] if tp.client_fraction_range is not None else tp.client_fraction
    most = min(n_sites, max(1, math.floor(fractions * n_sites + 1e-9)))  # as Engine.sample draws
    if value >= most:
        raise ConfigError(f"{key}: {value} leaves no round a site to lose: a round samples {most} of the {n_sites} sites "
                          f"(train.client_fraction{'_range' if tp.client_fraction_range is not None else ''}); set it below "
                          f"{most}, or 0")
    if not checkpointed:  # the site carries on from its kept store of the last round the server took from it
        raise ConfigError(f"{key}: {value} needs a checkpointed run (a site left out of a round carries on from the store "
                          "of the last round it trained, kept on its disk; a deployment is checkpointed)")
    if stream:
        raise ConfigError(f"{key}: not for a task stream yet (a site left out of a task's rounds changes what the task's "
                          "end hands out); set it to 0")
    if spec.method_cls.announce is not Method.announce:
        raise ConfigError(f"{key}: {spec.key or spec.method_cls.name} tells the server before each round's training what the "
                          "site trains (announce), which the server's aggregation counts on; a site cannot be left out "
                          "after it; set it to 0")


def check_min_eval_sites(n_sites: int, value: int, checkpointed: bool, stream: Optional[bool]) -> None:
    """What an evaluation going on without sites gone during it needs (``min-eval-sites`` > 0), refused by key where
    it is missing: a number of sites an evaluation can lose one of (below the sites still in), a checkpointed run,
    and static data (``stream``: whether the sites hold task streams; None: not known yet)."""
    key = "min-eval-sites"
    if value == 0:
        return
    if value < 0 or value >= n_sites:
        raise ConfigError(f"{key}: {value} is not a number of sites an evaluation can lose one of: between 1 and "
                          f"{n_sites - 1} (the federation's {n_sites} sites still in, less one), or 0")
    if not checkpointed:  # a site whose SuperNode restarted while it scored reads its store from its disk
        raise ConfigError(f"{key}: {value} needs a checkpointed run (a site whose SuperNode restarted while it scored "
                          "takes its store from its disk at its next message, which only a checkpointed run names; a "
                          "deployment is checkpointed)")
    if stream:
        raise ConfigError(f"{key}: not for a task stream yet (a stream's evaluation is its accuracy matrix, every site on "
                          "every task seen so far); set it to 0")


class FlowerServer(Engine):
    """The engine's server half over a Flower Grid: ``step`` / ``run`` / ``sample`` / ``eval_due`` /
    ``_refuse_private`` are the engine's; ``run_round`` and ``evaluate`` send the client half to the sites. The
    engine's constructor is not run (it builds every client's store, which only the sites hold)."""

    def __init__(self, spec: FlowerSpec, grid: Grid, nodes: dict[int, int], cards: list[Card],
                 observer: Optional[Observer] = None, on_round: Optional[Callable[[dict[str, Any]], None]] = None,
                 device: str = "cpu", wire: Optional[Callable[[dict[str, Any]], None]] = None,
                 checkpoint: Optional[Path] = None, config_hash: str = "", meta: Optional[dict[str, Any]] = None,
                 tasks: Optional[list[str]] = None, rejoin_s: float = 0.0, min_train_sites: int = 0,
                 min_eval_sites: int = 0, left: Sequence[str] = (), joined: Sequence[str] = ()):
        spec.check(stream=tasks is not None)
        # how long a message waits for a site whose SuperNode went away (a restart, a lost link) to come back online
        # before the run ends; only a checkpointed run waits: its sites keep their stores on disk, so a restarted site
        # answers the message again from the store the message names
        self.rejoin_s = rejoin_s if checkpoint is not None else 0.0
        # a round goes on without a sampled site whose SuperNode went away during its training, as long as this many
        # sampled sites trained (0: every sampled site must train; the run ends otherwise): see _dropped
        self.min_train_sites = int(min_train_sites)
        # an evaluation before the last goes on without sites whose SuperNode went away during it, as long as this many
        # sites scored (0: every site still in must score; the run ends otherwise): see _dropped, _partial
        self.min_eval_sites = int(min_eval_sites)
        self.spec, self.grid, self.nodes = spec, grid, nodes  # nodes: client index -> Flower node id
        self.wire = wire  # told of every message sent and received (describe(): keys, shapes, bytes; no values)
        self.train, self.seed = spec.train, spec.seed
        self.clients: list[ClientData] = list(cards)
        self.observer, self.on_round = observer, on_round
        # the engine's checkpoint (server state and history; the stores are the sites'), None: not checkpointed. A
        # checkpointed run writes it every round (one server state: cheap), whatever train.checkpoint_every says: a
        # site trains again no round before the last it trained (KeptStores.load), so a resume starts one round back
        self.checkpoint, self.config_hash, self.meta, self.external = checkpoint, config_hash, dict(meta or {}), None
        if checkpoint is not None:
            self.train = spec.train.model_copy(update={"checkpoint_every": 1})
        example = torch.zeros((2, *cards[0].shape))  # only its shape matters to transform_model
        self.method, self.model, self.private = spec.build(example, torch.device(device), cards, tasks=tasks)
        self.round, self.total_rounds = 0, spec.train.rounds * (len(tasks) if tasks is not None else 1)
        self.parallel = 1  # each site trains its own client (train.parallel_clients is the in-process engine's)
        self.history: list[dict[str, Any]] = []
        self.server: State = self.method.init_server(self.model)
        self.stores: list[State] = []  # the sites hold them
        self._config = cards_config(cards)
        self._announces = type(self.method).announce is not Method.announce
        resumed = self._resume()
        self.left, self.away = self._sites_left(left, resumed, tasks is not None)
        self.joined = self._sites_joined(joined, resumed, tasks is not None)
        check_min_train_sites(spec, len(self.clients) - len(self.left), self.min_train_sites, checkpoint is not None, tasks is not None)
        check_min_eval_sites(len(self.clients) - len(self.left), self.min_eval_sites, checkpoint is not None, tasks is not None)
        if resumed:
            self.meta.update(meta or {})  # this run's (its MLflow run), over what the checkpoint held
            if self.stores:
                raise RuntimeError(f"{checkpoint}: holds client stores; a Flower run's stores are the sites'")
            if self.round > 0:  # as the engine: the method's round state as it was after that round
                self.method.on_round_start(self.model, self.round)
        if self.checkpoint is not None and self.round == 0:
            self.save()  # round 0 with this run's meta (its MLflow run): a stop in round 1 resumes into the same run
        self.checkpointed = self.round  # the last round the checkpoint holds
        self._trained_now: tuple[int, list[str]] = (0, [])  # the round in progress and its sites, once they trained

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _sites_left(self, left: Sequence[str], resumed: bool, stream: bool) -> tuple[dict[str, int], dict[str, list[tuple[int, int]]]]:
        """The sites that have left the federation (``left``: the deployment's ``sites[k].left``), each with the
        last round it took part in: the round the checkpoint holds when it was first marked (kept in the checkpoint's
        meta from then on). From the round after, the engine neither samples nor evaluates it (``Engine.active``).
        A site the checkpoint says left that is no longer marked comes back: it takes part again from the round after
        the checkpoint's, carrying on from its store on its disk (as after rounds it was not sampled for), and the
        rounds it was gone go to ``away`` (name -> [(first, last)], kept in the checkpoint's meta). A site the
        checkpoint says joined is checked against the roster by :meth:`FlowerRun._held_cards`, before any site
        connects."""
        before: dict[str, int] = dict(self.meta.get("left", {})) if resumed else {}
        away: dict[str, list[tuple[int, int]]] = {n: [(int(a), int(b)) for a, b in spans]
                                                  for n, spans in (self.meta.get("away", {}) if resumed else {}).items()}
        for n in sorted(set(before) - set(left)):
            if stream:
                raise no_stream_come_back(n, before[n])
            last = before.pop(n)
            if self.round > last and self.round >= self.total_rounds:
                raise ConfigError(f"sites: {n} left after round {last} (the run's checkpoint says so) and is no longer "
                                  f"marked left, but the checkpoint holds the run's last round ({self.round}): no round is "
                                  "left to come back to; mark it `left: true` again")
            local = [r for r in range(last + 1, self.round + 1) if self.method.sample_all(r)]
            if local and not type(self.method).catches_up_local_phase():
                raise ConfigError(f"sites: {n} left after round {last} (the run's checkpoint says so) and is no longer "
                                  f"marked left, but it missed round(s) {local[0]}-{local[-1]} of "
                                  f"{self.spec.key or self.spec.method_cls.name}'s local phase, which every site trains (the "
                                  "federated rounds start from what each site trained in it): it cannot come back to this "
                                  "run; mark it `left: true` again, or start a new run with it")
            if self.round > last:
                away.setdefault(n, []).append((last + 1, self.round))
                log.warning("%s comes back to the federation in round %d (gone in rounds %d-%d): it carries on from "
                            "its store", n, self.round + 1, last + 1, self.round)
            else:  # marked left and back before a round went by: it missed none
                log.warning("%s is no longer marked left and missed no round: it takes part in round %d", n, self.round + 1)
        new = [n for n in left if n not in before]
        if new and not resumed:
            raise no_run_to_leave(new, self.checkpoint)
        out = {**before, **{n: self.round for n in new}}
        for n in new:
            log.warning("%s left the federation after round %d: the rounds from %d on go on without it", n, self.round, self.round + 1)
        self.meta["left"] = out
        self.meta["away"] = {n: [list(span) for span in spans] for n, spans in away.items()}
        return out, away

    def _sites_joined(self, joined: Sequence[str], resumed: bool, stream: bool) -> dict[str, int]:
        """The sites that joined the run in progress (``joined``: the deployment's ``sites[k].joined``), each with the
        first round it takes part in: the round after the checkpoint's when it was first marked (kept in the
        checkpoint's meta from then on). Before it, the engine neither samples nor evaluates it (``Engine.active``);
        it starts from a fresh store (``init_client``), as every site started."""
        before: dict[str, int] = dict(self.meta.get("joined", {})) if resumed else {}
        new = [n for n in joined if n not in before]
        if new and resumed and self.round >= self.total_rounds:
            raise ConfigError(f"sites: {', '.join(new)} marked joined, but the run's checkpoint holds its last round "
                              f"({self.round}): no round is left to join; start a new run with the site")
        if new and not resumed:
            raise ConfigError(f"sites: {', '.join(new)} marked joined, but there is no checkpoint of this deployment to "
                              f"resume ({self.checkpoint}): a site joins a run in progress; to start with it, leave "
                              "`joined` out")
        if new and stream:
            raise ConfigError(f"sites: {', '.join(new)} marked joined: not for a task stream yet (a site joining mid-stream "
                              "has not learnt the tasks before)")
        if new and not type(self.method).joins_mid_run():
            raise ConfigError(f"sites: {', '.join(new)} marked joined: {self.spec.key or self.spec.method_cls.name} takes no "
                              f"site mid-run ({type(self.method).join_refusal}; a site can join a run of "
                              f"{', '.join(joinable_methods())} in progress); start a new run with the site")
        # a local phase under way (the joiner's first round is one of it) with rounds behind it the joiner missed
        local = [r for r in range(1, self.round + 1) if self.method.sample_all(r)] if self.method.sample_all(self.round + 1) else []
        if new and local and not type(self.method).catches_up_local_phase():
            raise ConfigError(f"sites: {', '.join(new)} marked joined in round {self.round + 1}, but "
                              f"{self.spec.key or self.spec.method_cls.name}'s local phase, which every site trains from "
                              f"round 1 (its last round's uploads start the federation), has rounds {local[0]}-{local[-1]} "
                              f"behind it: join after round {max(r for r in range(1, self.total_rounds + 1) if self.method.sample_all(r))}, "
                              "or start a new run with the site")
        if new and not any(self.method.trains(r) for r in range(self.round + 1, self.total_rounds + 1)):
            raise ConfigError(f"sites: {', '.join(new)} marked joined, but {self.spec.key or self.spec.method_cls.name} trains "
                              f"no round after round {self.round} (methods.{self.spec.key or self.spec.method_cls.name}: its "
                              "training rounds end before the run's): the site would be scored untrained; start a new run "
                              "with the site")
        out = {**before, **{n: self.round + 1 for n in new}}
        for n in new:
            log.warning("%s joins the federation in round %d, from a fresh store", n, self.round + 1)
        self.meta["joined"] = out
        return out

    def last_trained(self) -> list[int]:
        """Per client index, the last round of the history in which that site trained (0: none): the store a site
        without one in its node state takes from its disk."""
        last = [0] * len(self.clients)
        index = {c.name: i for i, c in enumerate(self.clients)}
        # a round's trained sites, and in a stream the sites that kept a task's end in that round (their store changed)
        rounds = [(int(e["round"]), [*e["sampled"], *e.get("bytes_task_end", {})]) for e in self.history]
        for rnd, names in rounds + [self._trained_now]:
            for name in names:
                last[index[name]] = rnd
        return last

    def save(self) -> None:
        """The engine's checkpoint (server state, history, meta; no store: the sites keep theirs), when the run has
        one; the sites are told the round in the next message (``checkpointed``)."""
        super().save()
        self.checkpointed = self.round

    def spectra(self) -> dict[str, list[float]]:
        raise NotImplementedError("spectra need every client's representations in one place; not run on Flower")

    # ------------------------------------------------------------------ messages
    def _exchange(self, kind: str, rnd: int, contents: dict[int, RecordDict], may_drop: bool = False) -> dict[int, Message]:
        """Send one message per client index, return the replies by client index; a site's error is raised. A site
        whose SuperNode went away (the SuperLink answers for it) is waited for up to ``rejoin_s`` and sent the
        message again once it is back online. ``may_drop`` (a round's training, an evaluation before the last): such a
        site is left out of the replies instead, when ``min_train_sites`` / ``min_eval_sites`` allow it
        (:meth:`_dropped`)."""
        replies = self._send(kind, rnd, contents)
        deadline = time.monotonic() + self.rejoin_s
        while (gone := [i for i, r in replies.items() if r is not None and _node_gone(r)]) and kind in RESENDABLE:
            back = self._rejoined(gone, kind, rnd, deadline)
            if not back:
                break
            replies.update(self._send(kind, rnd, {i: contents[i] for i in back}))
        if may_drop:
            for i in self._dropped(replies, rnd, kind):
                del replies[i]
        out = {}
        for i, reply in replies.items():
            name = self.clients[i].name
            if reply is None:
                raise ClientFailed(f"client {name}: no reply to {kind} in round {rnd}")
            if reply.has_error():
                raise ClientFailed(f"client {name}: {kind} in round {rnd} failed: {reply.error.reason}{self._unavailable(reply, kind, rnd)}")
            if self.wire:
                self.wire({"round": rnd, "message": kind, "site": name, "to": "server", **describe(reply.content)})
            out[i] = reply
        return out

    def _send(self, kind: str, rnd: int, contents: dict[int, RecordDict]) -> dict[int, Optional[Message]]:
        """One message per client index; each reply matched to the message it answers (None: none came)."""
        order = list(contents)
        msgs = [Message(contents[i], dst_node_id=self.nodes[i], message_type=kind, group_id=str(rnd)) for i in order]
        if self.wire:
            for i, m in zip(order, msgs):
                self.wire({"round": rnd, "message": kind, "site": self.clients[i].name, "to": "site", **describe(m.content)})
        replies = list(self.grid.send_and_receive(msgs))
        # a reply answers its message; the SuperLink's own error replies (a node that stopped reporting) come from
        # the SuperLink's node id, so they are matched by the message they answer
        by_message = {m.metadata.reply_to_message_id: m for m in replies if m.metadata.reply_to_message_id}
        by_node = {m.metadata.src_node_id: m for m in replies}
        return {i: (by_message.get(sent.metadata.message_id) if sent.metadata.message_id else None) or by_node.get(self.nodes[i])
                for i, sent in zip(order, msgs)}

    def _rejoined(self, gone: list[int], kind: str, rnd: int, deadline: float) -> list[int]:
        """Waits until the SuperLink lists every site of ``gone`` online again or ``deadline`` passes; returns the
        sites of ``gone`` it lists online then (all of them, some when the deadline passed, none when there is no
        wait). A site that came back is sent the message again even when another one did not (min-eval-sites may let
        the evaluation go on without that one)."""
        if self.rejoin_s <= 0 or time.monotonic() > deadline:  # a node that keeps dropping is not sent the message forever
            return []
        names = ", ".join(self.clients[i].name for i in gone)
        log.warning("%s: gone in round %d (%s): the SuperLink heard nothing from its SuperNode; waiting up to %.0f s for it "
                    "to come back online", names, rnd, kind, max(0.0, deadline - time.monotonic()))
        while True:
            online = set(self.grid.get_node_ids())
            back = [i for i in gone if self.nodes[i] in online]
            if len(back) == len(gone) or time.monotonic() > deadline:
                break
            time.sleep(REJOIN_POLL_S)
        if len(back) < len(gone):
            log.warning("%s: not back online after %.0f s", ", ".join(self.clients[i].name for i in gone if i not in back), self.rejoin_s)
        if back:
            log.warning("%s: back online; %s of round %d sent again", ", ".join(self.clients[i].name for i in back), kind, rnd)
        return back

    def _dropped(self, replies: dict[int, Optional[Message]], rnd: int, kind: str = "train") -> list[int]:
        """The sites of a round's training (``kind`` "train") or of an evaluation ("evaluate") answered for by the
        SuperLink (their SuperNode went away: a reboot, a lost link) or by their SuperNode (its ClientApp process
        stopped reporting: killed for memory, a machine too loaded to send its heartbeat) that the round goes on
        without: all of them when at least ``min_train_sites`` of the sampled sites trained (``min_eval_sites`` of the
        sites evaluated scored), else none (the run then ends naming them). A site whose own code failed (an exception
        in its ClientApp, a refusal) always ends the run. A site dropped from a training is, for the rest of the run, as a site not sampled that round: the server
        aggregates without it and names the store of the last round it trained in every later message, which the
        site takes from its disk, leaving the untaken round's training aside (client_app's ``store``). A site dropped
        from an evaluation changes nothing but that evaluation (:meth:`_partial`)."""
        gone = [i for i, r in replies.items() if r is not None and (_node_gone(r) or _app_gone(r))]
        least, key = (self.min_train_sites, "min-train-sites") if kind == "train" else (self.min_eval_sites, "min-eval-sites")
        if not gone or not least:
            return []
        done = sum(r is not None and not r.has_error() for r in replies.values())
        names = ", ".join(self.clients[i].name for i in gone)
        if kind == "train":
            step, whole, sites, did = "training", "round", "sampled sites", "trained"
        else:
            step, whole, sites, did = "evaluation", "evaluation", "sites", "scored"
        if done < least:
            log.warning("%s: gone during round %d's %s; %d of %d %s %s, fewer than %s (%d): the %s cannot go on without "
                        "them", names, rnd, step, done, len(replies), sites, did, key, least, whole)
            return []
        log.warning("%s: gone during round %d's %s; the %s goes on with the %d of %d %s that %s (%s %d)", names, rnd, step,
                    whole, done, len(replies), sites, did, key, least)
        if self.wire:  # the coordinator's record of what crossed: the message sent to it, and no reply taken
            taken = "no upload taken" if kind == "train" else "no scores taken"
            for i in gone:
                self.wire({"round": rnd, "message": kind, "site": self.clients[i].name, "to": "server",
                           "dropped": f"{taken}: {replies[i].error.reason} ({key} {least})"})
        return gone

    def _quorum(self, kind: str, rnd: int) -> str:
        """Why a step that may lose a site (``min_train_sites`` / ``min_eval_sites``) did not go on without it."""
        if kind == "train" and self.min_train_sites:
            return ("; every site trains this round (a local phase), none is left out" if self.method.sample_all(rnd) else
                    f"; fewer than min-train-sites ({self.min_train_sites}) of the round's sampled sites trained")
        if kind == "evaluate" and self.min_eval_sites:
            return ("; the last evaluation, the run's result, scores every site still in" if rnd >= self.total_rounds else
                    f"; fewer than min-eval-sites ({self.min_eval_sites}) of the sites evaluated scored")
        return ""

    def _unavailable(self, reply: Message, kind: str, rnd: int) -> str:
        """What the coordinator does when the SuperLink answered for a site whose SuperNode stopped reporting, or the
        SuperNode for its ClientApp process."""
        if _app_gone(reply):
            quorum = self._quorum(kind, rnd)
            return (" (the site's ClientApp process stopped reporting to its SuperNode before it replied: it crashed, ran "
                    f"out of memory, or its machine was too loaded to send its heartbeat{quorum}; its reply, if it still "
                    "comes, is dropped. `flwr run` the App again" + (": it resumes after its last checkpoint" if self.checkpoint is not None
                                                           else " (it starts afresh: the deployment keeps no checkpoint)")
                    + "; a SuperNode still delivering this run's replies may hold up the next run's registration: restart it first)")
        if not _node_gone(reply):
            return ""
        waited = (f"; not back online within {self.rejoin_s:.0f} s" if self.rejoin_s > 0 and kind in RESENDABLE
                  else "; a site's training is not sent again within a run" if self.rejoin_s > 0 else "")
        waited += self._quorum(kind, rnd)
        again = ("`flwr run` the App again: it resumes after its last checkpoint; a site that left: mark it "
                 "`left: true` in federation.yaml, write the App again and `flwr run` it, which resumes without the site"
                 if self.checkpoint is not None else
                 "`flwr run` the App again (it starts afresh: the deployment keeps no checkpoint)")
        return (f" (the site's SuperNode went down or lost its connection{waited}; once `flwr supernode list` shows it "
                f"online again, {again})")

    def _content(self, rnd: int, arrays: Optional[tuple[str, State]] = None, **extra: Any) -> RecordDict:
        if self.checkpoint is not None:  # where each site's kept store is, and which ones a resume can still need
            extra = {"last_trained": self.last_trained(), "checkpointed": self.checkpointed, **extra}
        cfg = ConfigRecord({"round": int(rnd), **self._config, **extra})
        content = RecordDict({CONFIG: cfg})
        if arrays is not None:
            content[arrays[0]] = to_record(arrays[1])
        return content

    def _received(self, c: ClientData, reply: Message, name: str, rnd: int) -> tuple[State, int]:
        """An upload of round ``rnd`` as the server received it: privacy-checked, with its tensor bytes."""
        record = reply.content.array_records[name]
        self._refuse_private(c, dict.fromkeys(record.keys()), rnd)  # type: ignore[arg-type]
        return from_record(record, self._device()), record_tensor_bytes(record)

    # ------------------------------------------------------------------ a round
    def run_round(self) -> dict[str, Any]:
        start = self._clock()
        rnd = self.round + 1
        self.start_round(rnd)
        picked = self.active(rnd) if self.method.sample_all(rnd) else self.sample(rnd)
        entry: dict[str, Any] = {"round": rnd, "sampled": [self.clients[i].name for i in picked],
                                 "bytes_down": {}, "bytes_up": {}, "train_loss": {}}
        self.note_membership(entry, rnd)
        wire: dict[str, dict[str, int]] = {"down": {}, "up": {}}
        count_flops = bool(self.train.count_flops and rnd == self.total_rounds)
        if self._announces:  # counted with the training, as the engine counts a client's announce and update together
            heard = self._exchange("query.announce", rnd, {i: self._content(rnd, count_flops=count_flops) for i in picked})
        downs: dict[int, RecordDict] = {}
        for i in picked:
            c = self.clients[i]
            if self._announces and "said" in heard[i].content.array_records:
                said, n = self._received(c, heard[i], "said", rnd)
                entry.setdefault("bytes_announce", {})[c.name] = n
                if self.observer:
                    self.observer(rnd, c.name, "up", said)
                self.method.hear(c, said)
            down = self.method.download(self.server, c, rnd)
            if self.observer:
                self.observer(rnd, c.name, "down", {k: v.detach().clone() for k, v in down.items()})
            downs[i] = self._content(rnd, ("down", down), count_flops=count_flops)
            wire["down"][c.name] = downs[i]["down"].count_bytes()
            sent = record_tensor_bytes(downs[i]["down"])
            downs[i][CONFIG]["sent_bytes"] = sent
        # a site gone during its training is left out of the round where min-train-sites allows (never in a round
        # every site must train: a local phase whose last round's upload starts the federation)
        replies = self._exchange("train", rnd, downs, may_drop=not self.method.sample_all(rnd))
        if len(replies) < len(picked):  # as if not sampled; what was sent to it is counted apart
            entry["dropped"] = {self.clients[i].name: int(downs[i][CONFIG]["sent_bytes"]) for i in picked if i not in replies}
            picked = [i for i in picked if i in replies]
            entry["sampled"] = [self.clients[i].name for i in picked]
        self._trained_now = (rnd, list(entry["sampled"]))  # this round's evaluation finds these sites' stores at rnd
        acc = self.method.agg_begin(self.server, rnd) if self.method.streaming else None
        uploads: list[tuple[ClientData, State]] = []
        flops = 0
        for i in picked:  # client order, as the engine aggregates
            c, reply = self.clients[i], replies[i]
            metrics = reply.content.metric_records[CONFIG]
            entry["bytes_down"][c.name] = int(metrics["received_bytes"])
            up, n = self._received(c, reply, "up", rnd)
            wire["up"][c.name] = reply.content.array_records["up"].count_bytes()
            entry["bytes_up"][c.name] = n + entry.get("bytes_announce", {}).get(c.name, 0)
            entry["train_loss"][c.name] = float(metrics["train_loss"]) if "train_loss" in metrics else None
            flops += int(metrics.get("train_flops", 0))
            if self._announces and CONFIG in heard[i].content.metric_records:
                flops += int(heard[i].content.metric_records[CONFIG].get("announce_flops", 0))
            if self.observer:
                self.observer(rnd, c.name, "up", {k: v.clone() for k, v in up.items()})
            if acc is not None:
                self.method.agg_add(acc, c, up)
            else:
                uploads.append((c, up))
        if self.train.count_flops and rnd == self.total_rounds:
            entry["train_flops"] = flops
        self.close_round(entry, rnd, start, acc, uploads)
        entry["flower_record_bytes"] = wire
        return entry

    def _eval_contents(self, rnd: int, **extra: Any) -> tuple[dict[int, RecordDict], dict[str, int]]:
        """Each site's ``evaluate`` message content (``Method.eval_download`` as ArrayRecord ``server``) and its tensor
        bytes by site name. One record per distinct state: the whole server state (the default eval_download) is
        converted once and sent to every site."""
        built: dict[int, tuple[State, RecordDict]] = {}
        contents = {}
        for i in self.active(rnd):  # a site that left is not evaluated
            state = self.method.eval_download(self.server, self.clients[i])
            if id(state) not in built:  # the state is kept in `built`, so its id is not reused while we look
                built[id(state)] = (state, self._content(rnd, ("server", state), **extra))
            contents[i] = built[id(state)][1]
        return contents, {self.clients[i].name: record_tensor_bytes(content["server"]) for i, content in contents.items()}

    def evaluate(self, rnd: Optional[int] = None) -> dict[str, Any]:
        """Every site scores the model it is evaluated with on its test set (and the global model, where the method
        has one); the mean, spread and global accuracies are formed as in ``Engine.evaluate``. An evaluation before
        the last that went on without sites gone during it (``min_eval_sites``) is :meth:`_partial`."""
        rnd = self.round if rnd is None else rnd
        contents, eval_bytes = self._eval_contents(rnd)
        # the last evaluation is the run's result (metrics.json, the tables): every site still in scores it
        replies = self._exchange("evaluate", rnd, contents, may_drop=bool(self.min_eval_sites) and rnd < self.total_rounds)
        per: dict[str, dict[str, float]] = {}
        glob: dict[str, float] = {}
        for i in replies:
            c, m = self.clients[i], replies[i].content.metric_records[CONFIG]
            per[c.name] = {k.removeprefix("eval."): float(v) for k, v in m.items() if k.startswith("eval.")}
            if "global_acc" in m:
                glob[c.name] = float(m["global_acc"])
        if len(replies) < len(contents):
            return self._partial(per, glob, [self.clients[i].name for i in contents if i not in replies], eval_bytes)
        out = eval_summary(per)
        if glob:
            out["global"] = glob
        out["bytes_eval_down"] = eval_bytes
        return out

    @staticmethod
    def _partial(per: dict[str, dict[str, float]], glob: dict[str, float], missing: list[str],
                 eval_bytes: dict[str, int]) -> dict[str, Any]:
        """An evaluation that went on without the sites of ``missing`` (gone during it; ``min-eval-sites``): the
        scores of the sites that answered (``eval_partial``, and their global-model accuracies ``global_partial``)
        and the sites that did not (``eval_missing``). No mean, spread or mean validation accuracy: a mean over some
        of the sites is not the federation's, so what reads evaluated rounds (``eval``: curves, best-validation
        selection, targets reached) passes the round over. What was sent counts (``bytes_eval_down``)."""
        out: dict[str, Any] = {"eval_partial": per, "eval_missing": missing, "bytes_eval_down": eval_bytes}
        if glob:
            out["global_partial"] = glob
        return out


class FlowerStream(TaskStream, FlowerServer):
    """A stream of domain tasks over Flower (``fl/continual.py``'s protocol, the :class:`ContinualEngine`'s numbers):
    each site holds its data of every task (its ``domain_incremental`` split), and every message names the task of
    its round (``task`` in the config). Beside the static rounds' messages:

    - ``query.task_end`` (after a task's last aggregation, to each site the method sends something to keep of the
      task, ``Method.task_end_download``; pFedDIL: the federation's model of the family the site learned the task
      with): ArrayRecord ``keep``; the site adds it to its store (``Method.task_end_keep``) and keeps that store as
      the round's (on its disk too, in a deployment).
    - ``evaluate`` asks each site to score every task seen so far with the method's prediction for that task
      (``Method.predict_task``); the site replies per task its accuracy and test-image count, and at a task's end
      what it keeps (``Method.storage``: models and bytes). The server forms the stream's evaluation as the engine
      does (:func:`~fedsilo.fl.continual.stream_eval`).

    ``task_cards[t]`` are the sites' cards of task t (their training-sample counts of that task)."""

    def __init__(self, spec: FlowerSpec, grid: Grid, nodes: dict[int, int], task_cards: list[list[Card]],
                 task_names: list[str], **kw: Any):
        FlowerServer.__init__(self, spec, grid, nodes, task_cards[0], tasks=list(task_names), **kw)
        self._stream(self.method, task_cards, task_names, spec.train.rounds)
        self._storage: dict[str, dict[str, int]] = {}
        self._task_end_wire: dict[str, int] = {}  # Flower's count of the task-end records of the round in progress
        self._enter(self.task_of(max(self.round, 1)))

    def run_round(self) -> dict[str, Any]:
        entry = super().run_round()
        if self._task_end_wire:
            entry["flower_record_bytes"]["task_end"] = self._task_end_wire
            self._task_end_wire = {}
        return entry

    def _content(self, rnd: int, arrays: Optional[tuple[str, State]] = None, **extra: Any) -> RecordDict:
        return super()._content(rnd, arrays, task=int(self.method.task), **extra)

    def task_storage(self, rnd: int) -> dict[str, dict[str, int]]:
        return dict(self._storage)  # the sites' answers to this task end's evaluation

    def after_aggregation(self, entry: dict[str, Any], rnd: int) -> None:
        if rnd % self.per_task:
            return
        contents: dict[int, RecordDict] = {}
        for i in self.active(rnd):  # a site that has left is sent nothing more
            c = self.clients[i]
            down = self.method.task_end_download(self.server, c)
            if not down:  # nothing for this site (pFedDIL: it took no part in the task)
                continue
            entry.setdefault("bytes_task_end", {})[c.name] = payload_bytes(down)
            if self.observer:
                self.observer(rnd, c.name, "down", {k: v.detach().clone() for k, v in down.items()})
            contents[i] = self._content(rnd, ("keep", down))
            contents[i][CONFIG]["sent_bytes"] = record_tensor_bytes(contents[i]["keep"])
        if contents:
            replies = self._exchange("query.task_end", rnd, contents)
            for i, reply in replies.items():  # as a download's: the tensor bytes the site measured on arrival
                name = self.clients[i].name
                entry["bytes_task_end"][name] = int(reply.content.metric_records[CONFIG]["received_bytes"])
                self._task_end_wire[name] = contents[i]["keep"].count_bytes()
            # their stores are of this round now: this round's evaluation (and a resume) finds them there
            kept = [self.clients[i].name for i in contents]
            self._trained_now = (rnd, [*self._trained_now[1], *(n for n in kept if n not in self._trained_now[1])])

    def evaluate(self, rnd: Optional[int] = None) -> dict[str, Any]:
        rnd = self.round if rnd is None else rnd
        task, end = self.task_of(rnd), rnd % self.per_task == 0
        contents, eval_bytes = self._eval_contents(rnd, task_end=end)
        replies = self._exchange("evaluate", rnd, contents)
        scores: list[list[tuple[str, Optional[float], int]]] = [[] for _ in range(task + 1)]
        self._storage = {}
        here = sorted(contents)  # the sites still in: one that has left is not evaluated
        for i in here:
            c, m = self.clients[i], replies[i].content.metric_records[CONFIG]
            for j in range(task + 1):
                n = int(m[f"task.{j}.n_test"])
                scores[j].append((c.name, float(m[f"task.{j}.acc"]) if n else None, n))
            if end:
                self._storage[c.name] = {"models": int(m["storage.models"]), "bytes": int(m["storage.bytes"])}
        out = stream_eval([self.clients[i].name for i in here], self.task_names, scores)
        out["bytes_eval_down"] = eval_bytes
        return out


class SiteRefused(ConfigError):
    """A site registered with data the federation did not agree on (another fingerprint or contract), or under a
    name the federation does not list."""


class SiteLeft(SiteRefused):
    """A site the federation marks as having left (``sites[k].left``) registered: it is told so and takes no part;
    the run goes on without it."""


@dataclass(frozen=True)
class Roster:
    """The sites a deployment's coordinator admits, in client-index order, each with the fingerprint of the data it
    agreed to train on (``fedsilo site card``), and the contract they share (task, classes, image shape)."""

    sites: tuple[str, ...]
    fingerprints: tuple[str, ...]
    contract: dict[str, Any]
    node_ids: tuple[Optional[int], ...] = ()  # per site, the SuperLink node registered with its key (None: not pinned)
    left: tuple[bool, ...] = ()  # per site, whether it has left the federation (it takes no part while marked)
    joined: tuple[bool, ...] = ()  # per site, whether it joined the run in progress

    def joining(self) -> list[str]:
        """The sites that joined the run in progress (``sites[k].joined``)."""
        return [n for n, new in zip(self.sites, self.joined) if new]

    def gone(self) -> list[str]:
        """The sites that have left the federation (``sites[k].left``)."""
        return [n for n, out in zip(self.sites, self.left) if out]

    def left_note(self, name: str) -> str:
        """What a site that left is told when its SuperNode still runs."""
        return (f"site {name!r} left the federation (sites[{self.sites.index(name)}].left in federation.yaml): it takes no "
                "part in this run while marked left; its SuperNode can be stopped (its disk keeps its store, which it "
                "carries on from if the mark is taken away; a site of a task stream cannot come back to it)")

    def admit(self, card: dict[str, Any], node: Optional[int] = None) -> int:
        """The client index of a site registering from ``node``, or :class:`SiteRefused` naming what is wrong."""
        from fedsilo.fl.site import contract_mismatch

        name = str(card["name"])
        if name not in self.sites:  # the roster is not told to a node it does not list
            raise SiteRefused(f"site {name!r} is not one of the federation's {len(self.sites)} sites: refused")
        k = self.sites.index(name)
        pinned = self.node_ids[k] if k < len(self.node_ids) else None
        if pinned is not None and node != pinned:  # a name is only as good as the key it was registered with
            raise SiteRefused(f"site {name!r} refused: it connected as node {node}, but the federation pins {name} to node "
                              f"{pinned} (the node `flwr supernode register` created for {name}'s public key): another "
                              "site's key, or a re-registered key whose new node-id the coordinator has not pinned")
        if name in self.gone():  # after the node check: a name is only as good as the key it was registered with
            raise SiteLeft(self.left_note(name))
        got, want = str(card.get("fingerprint", "")), self.fingerprints[k]
        if got != want:
            site_contract = {key: card.get(f"contract.{key}") for key in ("task", "classes", "image_shape")}
            why = contract_mismatch(self.contract, site_contract)
            raise SiteRefused(
                f"site {name!r} refused: its data fingerprint {got[:16] or '(none)'} is not the one the federation "
                f"pins for it (sites[{k}], {name}: {want[:16]})"
                + (f"; its contract differs: {'; '.join(why)}" if why else "; same contract, other images or split")
                + ". The site re-runs the agreed harmonize and split (`fedsilo site card` prints its fingerprint), "
                "or the coordinator pins the new fingerprint")
        return k


class FlowerRun:
    """A ServerApp for a federation of ``num_clients`` sites: it waits for them, asks each for its card
    (``query.register``), builds :class:`FlowerServer` and runs every round. ``engine.history`` holds the rounds.

    With a ``roster`` (a deployment), a site's client index is its place in the roster and a site is admitted only
    under a listed name with the data fingerprint pinned for it; a refused site is told why (``query.refused``) and
    the run ends with :class:`SiteRefused` before any round. Without one (a simulation), each site reports its index
    (its partition)."""

    def __init__(self, spec: FlowerSpec, num_clients: int, observer: Optional[Observer] = None,
                 on_round: Optional[Callable[[dict[str, Any]], None]] = None, wait_s: float = 120.0,
                 roster: Optional[Roster] = None, wire: Optional[Callable[[dict[str, Any]], None]] = None,
                 checkpoint: Optional[Path] = None, config_hash: str = "", meta: Optional[dict[str, Any]] = None,
                 rejoin_s: float = 0.0, min_train_sites: int = 0, min_eval_sites: int = 0):
        spec.check()
        if roster is not None and len(roster.sites) != num_clients:
            raise ValueError(f"a roster of {len(roster.sites)} sites for a federation of {num_clients}")
        self.spec, self.num_clients, self.observer, self.on_round, self.wait_s = spec, num_clients, observer, on_round, wait_s
        self.roster, self.wire = roster, wire
        # with a checkpoint, the run resumes after the last round it holds under the same config_hash (FlowerServer)
        self.checkpoint, self.config_hash, self.meta, self.rejoin_s = checkpoint, config_hash, meta, rejoin_s
        self.min_train_sites = min_train_sites  # a round goes on without sites gone during its training (FlowerServer)
        self.min_eval_sites = min_eval_sites  # an evaluation before the last goes on without sites gone during it
        self.gone = roster.gone() if roster is not None else []  # the sites that have left the federation (while marked)
        self.joining = roster.joining() if roster is not None else []  # the sites that joined the run in progress
        # before any site connects
        check_min_train_sites(spec, num_clients - len(self.gone), min_train_sites, checkpoint is not None, None)
        check_min_eval_sites(num_clients - len(self.gone), min_eval_sites, checkpoint is not None, None)
        self.engine: Optional[FlowerServer] = None
        self.cards: list[dict[str, Any]] = []  # what each site registered with, in client order
        self.app = ServerApp()
        self.app.main()(self.main)

    def _held_cards(self) -> dict[str, dict[str, Any]]:
        """The cards the sites that left registered with when they took part, from the checkpoint of the run they
        left (what ``Method.join`` was told of them, and what the results list). Refused before any site connects:
        sites marked left without a run to resume, and a site the checkpoint says joined that is no longer listed (a
        site the checkpoint says left that is no longer marked comes back: :meth:`FlowerServer._sites_left`)."""
        held = checkpoint_meta(self.checkpoint, self.config_hash) if self.checkpoint is not None else None
        if held is not None and self.roster is not None:
            still_listed(held.get("joined", {}), self.roster.sites)
            self._same_joined(held)
            # a site that left a task stream, its mark taken away: refused here, not after waiting for it to register
            streams = {str(c["name"]) for c in held.get("cards", []) if c.get("tasks")}
            for name, last in held.get("left", {}).items():
                if name not in self.gone and name in streams:
                    raise no_stream_come_back(name, int(last))
        if not self.gone:
            return {}
        if held is None:
            raise no_run_to_leave(self.gone, self.checkpoint)
        cards = {str(c["name"]): c for c in held.get("cards", [])}
        missing = [n for n in self.gone if n not in cards]
        if missing:
            raise ConfigError(f"sites: {', '.join(missing)} marked left, but the checkpoint {self.checkpoint} holds no card "
                              "of them: the run cannot go on without them")
        return {n: cards[n] for n in self.gone}

    def _same_joined(self, held: dict[str, Any]) -> None:
        """A site that joined the run keeps the place and the data it joined with: its client index and pinned
        fingerprint are the ones it registered with (the checkpoint's cards), as a site the run started with keeps
        them through the resume key."""
        assert self.roster is not None
        place = {str(c["name"]): (k, str(c.get("fingerprint", ""))) for k, c in enumerate(held.get("cards", []))}
        for name in held.get("joined", {}):
            k, fingerprint = place.get(name, (None, ""))
            now = self.roster.sites.index(name)
            if k is not None and k != now:
                raise ConfigError(f"sites: {name} joined the run as sites[{k}] and is listed as sites[{now}] now: a site's "
                                  "place is its client index; list later sites after it")
            if k is not None and fingerprint and fingerprint != self.roster.fingerprints[now]:
                raise ConfigError(f"sites[{now}]: {name} joined the run with data fingerprint {fingerprint[:16]}, and the "
                                  f"federation pins {self.roster.fingerprints[now][:16]} now: its store was trained on the "
                                  "data it joined with; a site with other data joins a new run")

    def _register(self, grid: Grid, held: dict[str, dict[str, Any]]) -> tuple[dict[int, Card], dict[int, int], dict[int, dict[str, Any]]]:
        """Waits for the sites' nodes and asks each for its card (``query.register``) until every site still in the
        federation registered: (cards, nodes, registered configs) by client index. A refused site ends the run (every
        node asked is told why); a site that left and still runs its SuperNode is told so (by its pinned node, before
        it is asked; or once it registers) and the run waits for the sites still in."""
        expected = self.num_clients - len(held)
        # the nodes pinned to sites that left: never asked to register
        gone_nodes = {n: name for name, n in zip(self.roster.sites, self.roster.node_ids) if name in held and n is not None} if self.roster else {}
        cards: dict[int, Card] = {}
        where: dict[int, int] = {}
        registered: dict[int, dict[str, Any]] = {}
        asked: set[int] = set()
        start = time.monotonic()
        deadline, said = start + self.wait_s, start
        while len(cards) < expected:
            while True:
                online = [n for n in sorted(grid.get_node_ids()) if n not in asked]
                left_here = {n: self.roster.left_note(gone_nodes[n]) for n in online if n in gone_nodes}  # type: ignore[union-attr]
                if left_here:
                    self._tell_refused(grid, left_here)
                    asked |= set(left_here)
                nodes = [n for n in online if n not in gone_nodes]
                if len(nodes) >= expected - len(cards):
                    break
                if time.monotonic() > deadline:
                    silent = asked - set(where.values()) - set(gone_nodes)  # asked, online, never answered
                    if silent:
                        raise TimeoutError(self._silent(cards, held))
                    raise TimeoutError(f"{len(cards) + len(nodes)} of {expected} sites connected after {self.wait_s:.0f} s"
                                       + self._not_connected(cards, held, set(grid.get_node_ids())))
                if time.monotonic() - said >= WAIT_LINE_S:  # minutes of waiting (wait-s, default 600 s): said
                    said = time.monotonic()
                    log.warning("waiting for the sites: %d of %d connected after %.0f s (wait-s %.0f s)%s", len(cards) + len(nodes),
                                expected, said - start, self.wait_s, self._not_connected(cards, held, set(grid.get_node_ids())))
                time.sleep(0.1)
            asked |= set(nodes)
            refused, told_left = self._ask(grid, nodes, cards, where, registered, deadline)
            if refused:  # tell each refused site why, then end the run before any round
                self._tell_refused(grid, {**refused, **told_left})
                raise SiteRefused(" | ".join(refused.values()))
            if told_left:  # a site that left and still runs its SuperNode: told, and the run waits for the sites still in
                self._tell_refused(grid, told_left)
            if len(cards) < expected and time.monotonic() > deadline:
                raise TimeoutError(self._silent(cards, held))
        if self.roster is None and sorted(cards) != list(range(len(cards))):
            raise ConfigError(f"registered client indices {sorted(cards)} are not 0..{len(cards) - 1}")
        for i, name in enumerate(self.roster.sites if self.roster is not None else ()):
            if name in held:  # as it registered when it took part
                c = held[name]
                cards[i], registered[i] = Card(i, name, c["domain"], c["n_train"], tuple(c["shape"])), c
        return cards, where, registered

    def _not_connected(self, cards: dict[int, Card], held: dict[str, dict[str, Any]], online: set[int]) -> str:
        """Which sites are missing, as far as the SuperLink can tell before asking anyone: the sites whose pinned node
        (``federation.yaml``'s ``node_id``) is not online; without pins, the sites not yet registered (none are asked
        until enough nodes are online: who is missing is known by name only then)."""
        if self.roster is not None and any(n is not None for n in self.roster.node_ids):
            away = [f"{name} (node {n})" for i, (name, n) in enumerate(zip(self.roster.sites, self.roster.node_ids))
                    if name not in held and i not in cards and n is not None and n not in online]
            if away:
                return f"; not connected: {', '.join(away)} (their SuperNodes: running, and reaching the SuperLink?)"
        missing = self._missing(cards, held)
        if cards:
            return f" (not yet registered: {', '.join(missing)})"
        return (" (no site is asked to register until enough are online; `flwr ls` / the SuperLink's log name the nodes "
                "connected)") if missing else ""

    def _silent(self, cards: dict[int, Card], held: dict[str, dict[str, Any]]) -> str:
        return (f"sites {', '.join(self._missing(cards, held))} did not register within {self.wait_s:.0f} s (wait-s in the "
                "App's pyproject.toml); a site whose SuperNode is online but does not answer may still be delivering the "
                "replies of a run that was stopped or failed: restart its SuperNode, then `flwr run` the App again")

    def _missing(self, cards: dict[int, Card], held: dict[str, dict[str, Any]]) -> list[str]:
        names = self.roster.sites if self.roster is not None else [str(i) for i in range(self.num_clients)]
        return [n for i, n in enumerate(names) if n not in held and i not in cards]

    def _ask(self, grid: Grid, nodes: list[int], cards: dict[int, Card], where: dict[int, int],
             registered: dict[int, dict[str, Any]], deadline: float) -> tuple[dict[int, str], dict[int, str]]:
        """``query.register`` to ``nodes``: each admitted site's card into ``cards`` / ``where`` / ``registered``;
        returns the nodes refused and the nodes of sites that left, each with what they are told."""
        msgs = [Message(RecordDict(), dst_node_id=n, message_type="query.register", group_id="0") for n in nodes]
        if self.wire:
            for n in nodes:
                self.wire({"round": 0, "message": "query.register", "node": int(n), "to": "site"})
        refused: dict[int, str] = {}
        told_left: dict[int, str] = {}
        # the replies a node owes are waited for until the registration's deadline at most: a SuperNode still delivering
        # the replies of a run that ended may never answer this one's (the loop above then names the sites missing)
        replies = list(grid.send_and_receive(msgs, timeout=max(1.0, deadline - time.monotonic())))
        sent_to = {m.metadata.message_id: m.metadata.dst_node_id for m in msgs if m.metadata.message_id}
        for reply in replies:
            node = sent_to.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)  # the SuperLink answers for a node gone
            if reply.has_error():
                raise ClientFailed(f"node {node}: registration failed: {reply.error.reason}")
            cfg = dict(reply.content.config_records[CONFIG])
            if self.wire:
                self.wire({"round": 0, "message": "query.register", "site": str(cfg.get("name")), "to": "server", **describe(reply.content)})
            try:
                index = self.roster.admit(cfg, int(node)) if self.roster is not None else int(cfg["index"])
                if self.roster is not None and index in cards:  # a second node under an admitted name
                    raise SiteRefused(f"site {cfg['name']!r} refused: another node registered under that name first")
            except SiteLeft as err:
                told_left[node] = str(err)
                continue
            except SiteRefused as err:
                refused[node] = str(err)
                continue
            card = Card(index, cfg["name"], cfg["domain"], cfg["n_train"], tuple(cfg["shape"]))
            if card.index in cards:
                raise ConfigError(f"clients {cards[card.index].name} and {card.name} both registered as client index {card.index}")
            cards[card.index], where[card.index], registered[card.index] = card, node, cfg
        return refused, told_left

    def main(self, grid: Grid, context: Context) -> None:
        held = self._held_cards()
        cards, where, registered = self._register(grid, held)
        shapes = {c.shape for c in cards.values()}
        if len(shapes) > 1:
            raise ConfigError(f"the sites' images differ in shape {sorted(shapes)}; one model needs one input shape")
        ordered = [cards[i] for i in range(len(cards))]
        self.cards = [registered[i] for i in range(len(cards))]
        try:
            self.engine = self._server(grid, where, ordered)
        except ConfigError as err:  # the sites' data and the method do not fit together (streams): every site is told
            self._tell_refused(grid, {node: str(err) for node in where.values()})
            raise
        if self.engine.round:
            log.info("resuming after round %d of %d (checkpoint %s)", self.engine.round, self.engine.total_rounds, self.checkpoint)
        self.engine.run()

    def _tell_refused(self, grid: Grid, refused: dict[int, str]) -> None:
        """Each node in ``refused`` is told why the run ends before any round (``query.refused``)."""
        note = [Message(RecordDict({CONFIG: ConfigRecord({"reason": why})}), dst_node_id=n, message_type="query.refused",
                        group_id="0") for n, why in refused.items()]
        if self.wire:
            for n, why in refused.items():
                self.wire({"round": 0, "message": "query.refused", "node": int(n), "to": "site", "reason": why})
        grid.send_and_receive(note, timeout=60.0)  # a refused node that went away does not hold the run

    def _server(self, grid: Grid, where: dict[int, int], ordered: list[Card]) -> FlowerServer:
        """The server of the registered sites: static rounds, or a stream when the sites registered task streams."""
        # the checkpoint keeps every site's card: a site that leaves later is still part of the federation's past
        meta = {**(self.meta or {}), "cards": self.cards} if self.checkpoint is not None else self.meta
        common = {"observer": self.observer, "on_round": self.on_round, "wire": self.wire, "checkpoint": self.checkpoint,
                  "config_hash": self.config_hash, "meta": meta, "rejoin_s": self.rejoin_s,
                  "min_train_sites": self.min_train_sites, "min_eval_sites": self.min_eval_sites, "left": self.gone,
                  "joined": self.joining}
        # a stream site registers its tasks' domains and training counts (client_app's register)
        streams = {c.name: (list(r["tasks"]), list(r["n_train_tasks"])) if "tasks" in r else None for c, r in zip(ordered, self.cards)}
        if all(v is None for v in streams.values()):
            return FlowerServer(self.spec, grid, where, ordered, **common)
        if len({tuple(v[0]) if v else None for v in streams.values()}) > 1:  # one stream: the same domains, one order
            raise ConfigError("the sites' task streams differ: " + "; ".join(
                f"{n}: {' -> '.join(v[0]) if v else 'static data'}" for n, v in streams.items()))
        task_names = next(v for v in streams.values() if v)[0]
        task_cards = [[Card(c.index, c.name, task_names[t], streams[c.name][1][t], c.shape) for c in ordered]  # type: ignore[index]
                      for t in range(len(task_names))]
        return FlowerStream(self.spec, grid, where, task_cards, task_names, **common)


# ---------------------------------------------------------------------------------------------------------- client
class _Site:
    """A site's method and model, built once per process and node (the store is not here: it is in context.state).
    ``data``: the site's client, or its stream (one client per task, in task order; ``client`` is the current
    task's)."""

    def __init__(self, spec: FlowerSpec, data: "SiteData", cards: list[Card]):
        self.stream = as_stream(data)
        client = self.stream[0] if self.stream is not None else data
        self.spec, self.client = spec, client
        tasks = [c.domain for c in self.stream] if self.stream is not None else None
        self.method, self.model, self.private = spec.build(to_float(client.x_train[:2], spec.train.normalize), client.x_train.device, cards, tasks=tasks)
        if spec.train.compile:
            compile_model(self.model)
        if use_channels_last(spec.train, client.x_train.device):
            self.model.to(memory_format=torch.channels_last)
        self.rnd = -1

    def at_task(self, cfg: ConfigRecord) -> None:
        """The task a message's round belongs to: the method's and the site's current client. The site takes the task
        from the round itself (``train.rounds`` per task), not from the server's word: a server cannot make it train
        or score a round on another task's images."""
        if ("task" in cfg) != (self.stream is not None):
            raise RuntimeError(f"client {self.client.name}: " + ("the federation runs a task stream, but this site holds static data"
                                                                if "task" in cfg else "this site holds a task stream, but the federation runs static rounds"))
        if self.stream is not None:
            t, rnd = int(cfg["task"]), int(cfg["round"])
            if not 0 <= t < len(self.stream):
                raise PrivacyViolation(f"client {self.client.name}: asked for task {t}; its stream holds {len(self.stream)} tasks; refused")
            if t != (rnd - 1) // self.spec.train.rounds:
                raise PrivacyViolation(f"client {self.client.name}: round {rnd} belongs to task {(rnd - 1) // self.spec.train.rounds} "
                                       f"({self.spec.train.rounds} rounds per task), not task {t}; refused")
            self.client, self.method.task = self.stream[t], t

    def at_round(self, rnd: int) -> None:
        if rnd != self.rnd:  # once per round: a train and an evaluate message of the same round share it
            self.method.on_round_start(self.model, rnd)
            self.rnd = rnd

    def refuse_private(self, payload: State) -> None:
        refuse_private(self.method, self.client, payload, self.private, self.rnd)


class KeptStores:
    """A site's stores on its own disk, one file per round it trained (``store-r000007.pt``: the store after that
    round), in the site's folder under the deployment's (``keep_dir`` of :func:`client_app`). The private tensors
    never leave the site; a store here is also the site's personal model when the run is over.

    :meth:`load` gives the store of exactly the round the server names, and only a round the site may have reached
    before the message at hand (before round ``rnd`` for a train or announce message, up to ``rnd`` for an evaluation):
    a server naming a later round cannot make a site send, in a round whose rules share more (LG-FedAvg's FedAvg
    rounds), what it learnt after that round. Nor does a kept store serve a round before the last one the site
    trained (the newest file): a restarted run may train again the round whose upload the stop may have lost, and
    the rounds after it, never an earlier one (a deployment's server checkpoints every round, so a resume starts at
    most one round back). A run started afresh (the server names no round) starts from a fresh store, which holds
    nothing the site learnt. :meth:`drop_before` removes the files no resume can ask for. The files are readable by
    their owner only."""

    PATTERN = re.compile(r"^store-r(\d{6})\.pt$")

    def __init__(self, folder: Path, site: str):
        # one folder per site: two sites kept under one root do not mix their stores
        self.folder, self.site = Path(folder) / re.sub(r"[^A-Za-z0-9_.-]", "_", site), site

    def path(self, rnd: int) -> Path:
        return self.folder / f"store-r{rnd:06d}.pt"

    def rounds(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        return sorted(int(m.group(1)) for f in self.folder.iterdir() if (m := self.PATTERN.match(f.name)))

    def _write(self, path: Path, content: dict[str, Any]) -> None:
        """A file of this site's, whole or not at all, readable by its owner only (private tensors: the site's own,
        not other accounts' on its machine)."""
        from fedsilo.utils.io import atomic_file

        self.folder.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as tmp:
            torch.save({"site": self.site, **content}, tmp)
            os.chmod(tmp, 0o600)

    def save(self, rnd: int, state: State) -> None:
        self._write(self.path(rnd), {"round": rnd, "store": {k: v.detach().cpu() for k, v in state.items()}})
        for later in [r for r in self.rounds() if r > rnd]:  # of an attempt that did not reach them, or of an earlier run
            self.path(later).unlink(missing_ok=True)

    @property
    def model_path(self) -> Path:
        return self.folder / "model.pt"

    def save_model(self, rnd: int, model: torch.nn.Module, meta: dict[str, Any]) -> None:
        """The model the site was evaluated with in round ``rnd`` (``Method.load_eval_model``: its personal model, or
        the shared part with what it keeps), replacing the one of an earlier evaluation: when the run is over, the
        model the site takes home, with ``meta`` (the deployment it was trained in) to rebuild it."""
        self._write(self.model_path, {"round": rnd, **meta, "model": {k: v.detach().cpu() for k, v in model.state_dict().items()}})

    def load(self, rnd: int, limit: int, device: torch.device, trains: Optional[int] = None) -> State:
        """The store after round ``rnd`` (the server's word for this site's last trained round), where ``rnd`` <=
        ``limit``, the last round the message at hand allows, and where the message trains round ``trains`` (a
        train or announce message), no earlier than the last round this site trained."""
        if rnd > limit:
            raise PrivacyViolation(f"client {self.site}: asked to resume from its store of round {rnd} for a message that allows "
                                   f"round {limit} at most; refused")
        done = max(self.rounds(), default=0)
        if trains is not None and trains < done:
            raise PrivacyViolation(f"client {self.site}: asked to train round {trains} from its kept store of round {rnd}, but it "
                                   f"trained round {done} of this deployment already; a restarted run trains that round or a "
                                   "later one; refused (to run the deployment again from round 1, start it afresh)")
        f = self.path(rnd)
        if not f.exists():
            raise FileNotFoundError(f"client {self.site}: the federation resumes from this site's store "
                                    f"of round {rnd}, but {f} is missing (kept: rounds {self.rounds() or 'none'}); the run "
                                    "cannot resume with this site: start it afresh (remove the coordinator's checkpoint), or, "
                                    "for a site coming back after it left, mark it `left: true` again")
        kept = torch.load(f, map_location=device, weights_only=True)
        if kept.get("round") != rnd or kept.get("site") != self.site:
            raise RuntimeError(f"{f}: holds round {kept.get('round')} of site {kept.get('site')!r}, not round {rnd} of {self.site!r}")
        return kept["store"]

    def set_aside(self, last: int, before: int) -> None:
        """Set aside the stores of rounds after ``last`` (the server's word for this site's last trained round) and
        before ``before`` (the round of the message at hand, or after it for an evaluation): rounds this site trained
        whose upload the server never took (it went on without the site: ``min-train-sites``), which no resume names.
        Each is renamed ``untaken-r<round>.pt`` beside the others (kept, never read again), so the newest store is the
        one the federation counts, whatever the server says."""
        for r in self.rounds():
            if last < r < before:
                log.warning("client %s: the server took no upload of its round %d; its store of that round is set aside as "
                            "untaken-r%06d.pt", self.site, r, r)
                os.replace(self.path(r), self.folder / f"untaken-r{r:06d}.pt")

    def drop_before(self, checkpointed: int) -> None:
        """Remove the stores older than the newest one at or before the server's last checkpoint (a resume starts
        from that checkpoint, so it needs that store or a later one)."""
        rounds = self.rounds()
        floor = max((r for r in rounds if r <= checkpointed), default=None)
        for r in rounds:
            if floor is not None and r < floor:
                self.path(r).unlink(missing_ok=True)


SiteData = Union[ClientData, Sequence[ClientData]]  # a site's client, or its task stream (one client per task)


def as_stream(data: SiteData) -> Optional[list[ClientData]]:
    """A site's task stream (its clients in task order), or None for a site with static data."""
    return list(data) if isinstance(data, (list, tuple)) else None

# (app, run, node) -> the site's method and model, built once per process: a Ray worker keeps it across messages (the
# ClientApp itself is shipped anew with each message, so the cache cannot live in it)
_SITES: dict[tuple[str, int, int], _Site] = {}


def site_cache() -> dict[tuple[str, int, int], _Site]:
    """This process's site cache. The ClientApp's functions reach it through this module-level function: Ray ships a
    closure with the values of the globals it names, so naming ``_SITES`` there shipped every site this process had
    built (their data, methods and models: another app's too) with each message, and failed on what cannot be
    pickled (a method's spare models are held by weak reference)."""
    return _SITES


def client_app(spec: FlowerSpec, load_client: Callable[[Context], SiteData],
               identify: Optional[Callable[[Context], dict[str, Any]]] = None,
               keep_dir: Optional[Callable[[Context], Path]] = None,
               wire_log: Optional[Callable[[Context], Path]] = None,
               model_meta: Optional[dict[str, Any]] = None) -> ClientApp:
    """The ClientApp of a site: ``load_client(context)`` gives the site's own data (in a simulation, the partition
    named by ``context.node_config['partition-id']``; in a deployment, the site's split). ``identify(context)``, in a
    deployment, adds to the site's registration what the coordinator admits it by (its data fingerprint and
    contract: hashes and names, no data). ``keep_dir(context)``, in a deployment, is the site's folder for its
    stores (:class:`KeptStores`): written after each round it trains, read when its node state has none (a resumed
    run, a restarted SuperNode). The site takes its client index from the federation's cards, by name.

    ``load_client`` may give a task stream (a list of the site's clients, one per task in task order, each with its
    task's domain): the site then registers its tasks, and takes part in a :class:`FlowerStream`. ``wire_log(context)``,
    in a deployment, is the file of the site's own wire log (:func:`site_wire_log`). With ``keep_dir``, every
    evaluation also keeps the model the site was evaluated with (:meth:`KeptStores.save_model`, with ``model_meta``),
    so the site has its trained model when the run ends (a site of a task stream predicts with what its store holds)."""
    spec.check()
    app = ClientApp(mods=[site_wire_log(wire_log)] if wire_log is not None else None)
    token = uuid.uuid4().hex  # this app's sites in the cache, apart from another app's in the same process

    def site(context: Context, cfg: ConfigRecord) -> _Site:
        key = (token, int(context.run_id), int(context.node_id))
        sites = site_cache()
        if key not in sites:
            data, cards = load_client(context), cards_from_config(cfg)
            clients = as_stream(data) or [data]
            mine = [c.index for c in cards if c.name == clients[0].name]
            if len(mine) != 1:
                raise RuntimeError(f"client {clients[0].name}: not among the federation's sites {[c.name for c in cards]}")
            for c in clients:
                c.index = mine[0]
            sites[key] = _Site(spec, data, cards)
        s = sites[key]
        s.at_task(cfg)
        return s

    def store(context: Context, s: _Site, cfg: ConfigRecord, limit: int, trains: Optional[int] = None) -> tuple[State, int]:
        """The site's store and the round it is of: the one in its node state, else (a resumed run's first message
        here, or one after its SuperNode restarted) the one it kept on its disk after the round the server names,
        else (its first round, or a run started afresh) the engine's init_client on a fresh model. ``limit``: the
        last round whose store the message may use; ``trains``: the round a train or announce message is for (a
        kept store serves no round before the last this site trained: :meth:`KeptStores.load`)."""
        last = int(cfg["last_trained"][s.client.index]) if "last_trained" in cfg else 0
        if "last_trained" in cfg and keep_dir is not None:  # rounds it trained whose upload the server never took
            KeptStores(keep_dir(context), s.client.name).set_aside(last, before=trains if trains is not None else limit + 1)
        if STORE in context.state.array_records:
            of = int(context.state.config_records[STORE_ROUND]["round"]) if STORE_ROUND in context.state.config_records else 0
            if of > limit:  # e.g. an announce of a later round loaded it, and a train of an earlier round follows
                raise PrivacyViolation(f"client {s.client.name}: its store is of round {of}; this message may use round {limit} "
                                       "at most; refused")
            if "last_trained" not in cfg or of <= last:
                return from_record(context.state.array_records[STORE], s.client.x_train.device), of
            # the server took no upload of round `of` from this site (its link dropped as it replied, and the round
            # went on without it: min-train-sites): as a site not sampled that round, it carries on from the store
            # of the last round the server took, on its disk; the untaken round's training is set aside
            log.warning("client %s: the server took no upload of its round %d; it carries on from its store of round %d",
                        s.client.name, of, last)
            del context.state[STORE]
        if last > 0:
            if keep_dir is None:
                raise RuntimeError(f"client {s.client.name}: the server names its store of round {last}, but this ClientApp keeps none")
            kept = KeptStores(keep_dir(context), s.client.name)
            state = kept.load(last, limit, s.client.x_train.device, trains=trains)
            log.warning("client %s: resumed from its store of round %d (kept at %s)", s.client.name, last, kept.folder)
            return state, last
        first = s.stream[0] if s.stream is not None else s.client  # as the engine: a stream's stores start at task 0's client
        tasks = [c.domain for c in s.stream] if s.stream is not None else None
        method, model, _ = spec.build(to_float(first.x_train[:2], spec.train.normalize), first.x_train.device, cards_from_config(cfg), tasks=tasks)
        return method.init_client(model, first), 0

    def keep(context: Context, state: State, of: int) -> None:
        context.state[STORE] = to_record(state)
        context.state[STORE_ROUND] = ConfigRecord({"round": int(of)})

    def in_order(context: Context, s: _Site, rnd: int, trains: bool) -> None:
        """A site trains each round once and in order: an announce or train message for a round it has already
        trained, or one before it, is refused. The round decides what may leave the site (LG-FedAvg's FedAvg rounds
        share every layer, Method.private_in_round), so the site does not take the server's word for it once it has
        trained that round or a later one. ``trains``: record the round as trained."""
        last = int(context.state.config_records[TRAINED]["round"]) if TRAINED in context.state.config_records else 0
        if rnd <= last:
            raise PrivacyViolation(f"{s.method.name}: client {s.client.name} was asked to train round {rnd} after round {last}; refused")
        if trains:
            context.state[TRAINED] = ConfigRecord({"round": rnd})

    @app.query("register")
    def register(msg: Message, context: Context) -> Message:
        data = load_client(context)
        stream = as_stream(data)
        card = Card.of(stream[0] if stream is not None else data)
        tasks = {"tasks": [c.domain for c in stream], "n_train_tasks": [c.n_train for c in stream]} if stream is not None else {}
        cfg = ConfigRecord({"index": card.index, "name": card.name, "domain": card.domain, "n_train": card.n_train,
                            "shape": list(card.shape), **tasks, **(identify(context) if identify else {})})
        return Message(RecordDict({CONFIG: cfg}), reply_to=msg)

    @app.query("refused")
    def refused(msg: Message, context: Context) -> Message:
        log.error("the federation refused this site: %s", msg.content.config_records[CONFIG]["reason"])
        return Message(RecordDict(), reply_to=msg)

    @app.query("announce")
    def announce(msg: Message, context: Context) -> Message:
        cfg = msg.content.config_records[CONFIG]
        s = site(context, cfg)
        in_order(context, s, int(cfg["round"]), trains=False)
        s.at_round(int(cfg["round"]))
        mine, of = store(context, s, cfg, limit=int(cfg["round"]) - 1, trains=int(cfg["round"]))
        counter = flop_counter() if cfg.get("count_flops") else None
        with counter if counter is not None else nullcontext():  # pFedDIL's Eq. 2 passes are part of the round's work
            said = s.method.announce(s.model, mine, s.client, int(cfg["round"]))
        keep(context, mine, of)  # still the store of round `of`: this round's training follows
        s.refuse_private(said)
        content = RecordDict({"said": to_record(said)}) if said else RecordDict()
        if counter is not None:
            content[CONFIG] = MetricRecord({"announce_flops": int(counter.get_total_flops())})
        return Message(content, reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        cfg = msg.content.config_records[CONFIG]
        s, rnd = site(context, cfg), int(cfg["round"])
        in_order(context, s, rnd, trains=True)
        s.at_round(rnd)
        record = msg.content.array_records["down"]
        received = arrived(s, record, cfg)
        down = {k: v.detach() for k, v in from_record(record, s.client.x_train.device).items()}
        mine, _ = store(context, s, cfg, limit=rnd - 1, trains=rnd)
        counter = flop_counter() if cfg["count_flops"] else None
        s.method.last_loss = None  # as the engine: a method that reports no loss this round reports none, not the last one
        with counter if counter is not None else nullcontext(), scheduled_lr(spec.train, rnd):
            up = s.method.local_update(s.model, mine, down, s.client, rnd, spec.seed)
        s.refuse_private(up)  # before anything is sent: the reply carries no private key
        keep(context, mine, rnd)
        if keep_dir is not None:  # a deployment: the store after this round, on the site's disk, whatever the server says
            stores = KeptStores(keep_dir(context), s.client.name)
            stores.save(rnd, mine)
            if "checkpointed" in cfg:  # never below the store the server names (a round it took no upload of is newer)
                named = int(cfg["last_trained"][s.client.index]) if "last_trained" in cfg else rnd
                stores.drop_before(min(int(cfg["checkpointed"]), named))
        metrics: dict[str, Any] = {"received_bytes": received}
        if s.method.last_loss is not None:
            metrics["train_loss"] = float(s.method.last_loss)
        if counter is not None:
            metrics["train_flops"] = int(counter.get_total_flops())
        return Message(RecordDict({"up": to_record(up), CONFIG: MetricRecord(metrics)}), reply_to=msg)

    @app.query("task_end")
    def task_end(msg: Message, context: Context) -> Message:
        """A stream's task ended: keep what the server sends of it (Method.task_end_keep) in the store of this round."""
        cfg = msg.content.config_records[CONFIG]
        s, rnd = site(context, cfg), int(cfg["round"])
        if rnd % spec.train.rounds:
            raise PrivacyViolation(f"client {s.client.name}: a task end in round {rnd}, which ends no task "
                                   f"({spec.train.rounds} rounds per task); refused")
        kept = KeptStores(keep_dir(context), s.client.name) if keep_dir is not None else None
        if kept is not None and max(kept.rounds(), default=0) > rnd:  # it would replace the stores of later rounds
            raise PrivacyViolation(f"client {s.client.name}: a task end of round {rnd}, but it kept its store of round "
                                   f"{max(kept.rounds())} already; refused")
        s.at_round(rnd)
        record = msg.content.array_records["keep"]
        received = arrived(s, record, cfg)
        mine, _ = store(context, s, cfg, limit=rnd)
        s.method.task_end_keep(mine, s.client, from_record(record, s.client.x_train.device))
        keep(context, mine, rnd)
        if kept is not None:  # the store of this round now holds the task's end, on the site's disk too
            kept.save(rnd, mine)
        return Message(RecordDict({CONFIG: MetricRecord({"received_bytes": received})}), reply_to=msg)

    @app.evaluate()
    def evaluate_(msg: Message, context: Context) -> Message:
        cfg = msg.content.config_records[CONFIG]
        s, rnd = site(context, cfg), int(cfg["round"])
        s.at_round(rnd)
        server = from_record(msg.content.array_records["server"], s.client.x_train.device)
        mine, _ = store(context, s, cfg, limit=rnd)
        if s.stream is not None:
            return Message(RecordDict({CONFIG: MetricRecord(stream_scores(s, server, mine, cfg, rnd))}), reply_to=msg)
        m, c, train_p = s.method, s.client, spec.train
        m.load_eval_model(s.model, server, mine, c, rnd)
        scores = evaluate_client(s.model, c, cfg=train_p)
        if keep_dir is not None:
            KeptStores(keep_dir(context), c.name).save_model(rnd, s.model, model_meta or {})
        metrics: dict[str, Any] = {f"eval.{k}": float(v) for k, v in scores.items()}
        if m.eval_is_global():
            metrics["global_acc"] = float(scores["acc"])
        elif (g := m.global_state(server)) is not None:
            s.model.load_state_dict(g, strict=True)
            metrics["global_acc"] = float(evaluate(s.model, c.x_test, c.y_test, cfg=train_p)["acc"])
        return Message(RecordDict({CONFIG: MetricRecord(metrics)}), reply_to=msg)

    return app


def arrived(s: _Site, record: ArrayRecord, cfg: ConfigRecord) -> int:
    """The tensor bytes of a record as the site received it, checked against what the server says it sent."""
    received = record_tensor_bytes(record)
    if received != int(cfg["sent_bytes"]):
        raise RuntimeError(f"client {s.client.name}: received {received} tensor bytes of the {cfg['sent_bytes']} sent")
    return received


def stream_scores(s: _Site, server: State, store: State, cfg: ConfigRecord, rnd: int) -> dict[str, Any]:
    """A stream site's evaluation: its accuracy on the test images of every task seen so far, with the method's
    prediction for that task, and each task's test-image count; at a task's end, what it keeps (models, bytes)."""
    out: dict[str, Any] = {}
    assert s.stream is not None
    for j in range(int(cfg["task"]) + 1):
        c = s.stream[j]
        out[f"task.{j}.n_test"] = len(c.y_test)
        if len(c.y_test):
            probs = s.method.predict_task(s.model, server, store, c, j, rnd)
            out[f"task.{j}.acc"] = float(score(probs, c.y_test, probabilities=True)["acc"])
    if cfg.get("task_end"):
        kept = s.method.storage(server, store)
        out["storage.models"], out["storage.bytes"] = int(kept["models"]), int(kept["bytes"])
    return out


# ---------------------------------------------------------------------------------------------------------- simulation
def simulate(method: Method, make_model: Callable[[], nn.Module], clients: Sequence[SiteData], seed: int,
             observer: Optional[Observer] = None, backend_config: Optional[dict[str, Any]] = None) -> list[dict[str, Any]]:
    """Run ``method`` (its class, params, train and key; the object itself is not used) on Flower's simulation
    runtime (Ray): one SuperNode per client, the node with ``partition-id`` k holding ``clients[k]`` (Flower ships the
    ClientApp, and with it the clients' tensors, to its Ray workers; each node uses its own partition only). A
    client given as a list is a task stream (client k's data of each task, in task order: ``[tasks[t][k] for t]`` of
    a ``domain_incremental`` split), run as :class:`FlowerStream`. Returns the history, one entry per round with the
    engine's keys (plus ``flower_record_bytes`` and ``bytes_eval_down``)."""
    from flwr.simulation import run_simulation

    spec = FlowerSpec.of(method, make_model, seed)
    run = FlowerRun(spec, len(clients), observer=observer)
    data = list(clients)
    app = client_app(spec, lambda context: data[int(context.node_config["partition-id"])])
    # a Ray instance of its own ("local"), never a cluster that happens to run on this machine; one CPU per client
    config = backend_config or {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"address": "local"}}
    printer = builtins.print
    try:
        run_simulation(server_app=run.app, client_app=app, num_supernodes=len(clients), backend_config=config)
    finally:  # Ray's start replaces the process's print with its own (tqdm-safe) one and leaves it: give it back
        builtins.print = printer
    if run.engine is None or run.engine.round < run.engine.total_rounds:
        raise RuntimeError("the Flower simulation ended before its last round")
    return run.engine.history
