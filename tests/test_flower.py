"""The Flower adapter (fl/flower.py): a method run as a ServerApp / ClientApp pair gives the in-process engine's
numbers, moves exactly the engine's payloads as Flower records, keeps each site's store on the site, and never lets a
private key reach the server.

The equivalence tests run the apps on Flower's simulation runtime (Ray: one worker per CPU, one thread each) for one
method and, for the others, in this process through a stand-in for Flower's Grid (the same ServerApp and ClientApp,
the same records; Ray's start takes 6-8 s of each ~15 s run on this machine, and most of a CI minute when the other
test worker keeps the second core busy); the engine they are compared with runs with one thread too, as does the
stand-in, since a convolution summed by a different number of threads differs in the last float bit (with the engine
on every core, losses differ by ~3e-7). The tests of the refusals drive the apps through the stand-in as well.
"""

from __future__ import annotations

import builtins
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Context, Error, Message, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fedsilo.config import ConfigError, TrainParams  # noqa: E402
from fedsilo.fl.engine import Engine, PrivacyViolation, payload_bytes  # noqa: E402
from fedsilo.fl.flower import CONFIG, STORE, Card, ClientFailed, FlowerRun, FlowerSpec, client_app, simulate, to_record  # noqa: E402
from fedsilo.methods import REGISTRY, method_class  # noqa: E402
from fedsilo.methods.fedbn import FedBN  # noqa: E402
from fedsilo.models import batchnorm_keys  # noqa: E402
from tests.tiny import one_thread, style_shifted_federation, tiny_net, without_timing  # noqa: E402

# method -> (its params, train params beyond _train's, the runtime): FedAvg samples two of the three clients a round
# and counts the last round's FLOPs, on Ray; pFedDB trains one local round (Phase 1, its upload of psi under phi's
# names) then federates; LG-FedAvg starts with one FedAvg round; both through the stand-in Grid below. FedBN (private BatchNorm on every site) is compared with the engine over a
# real deployment instead (tests/test_deploy_processes.py: SuperLink, SuperNodes, TLS) and through the apps below
# (test_each_store_lives_in_its_sites_context_...: its stores and server state equal the engine's, no BatchNorm leaves)
CASES = {
    "fedavg": ({}, {"client_fraction": 0.67, "count_flops": True}, "ray"),
    "pfeddb": ({"local_rounds": 1, "cut_depth": 2}, {}, "loop"),
    # a private set that changes with the round: round 1 is FedAvg (every layer travels), then two of the three sites a
    # round, so a site may be evaluated before it was sent the FedAvg start's lower layers; a learning-rate schedule
    # (each site trains a round at the rate the engine's clients do)
    "lgfedavg": ({"fedavg_rounds": 1}, {"client_fraction": 0.67, "lr_schedule": {"kind": "step", "gamma": 0.2, "milestones": [1]}}, "loop"),
}


def _clients() -> list:
    return style_shifted_federation(n_train=24, n_test=20, per_domain=1)[:3]


def _train(**kw) -> TrainParams:
    return TrainParams(**{"rounds": 3, "batch_size": 8, "lr": 0.05, "device": "cpu", "count_flops": False, **kw})


def _model():
    return tiny_net(1, 4)


def _recorder(log: list):
    return lambda rnd, client, way, payload: log.append((rnd, client, way, {k: v.detach().clone() for k, v in payload.items()}))


def _engine_history(method, clients, tp, observer=None) -> list:
    with one_thread():
        return Engine(method, _model(), clients, tp, seed=0, observer=observer).run()


@pytest.mark.parametrize("name", list(CASES))
def test_flower_simulation_gives_the_engines_metrics_and_payloads(name):
    params, extra, runtime = CASES[name]
    tp, cls, clients = _train(**extra), method_class(name), _clients()
    seen_engine: list = []
    seen_flower: list = []
    engine = _engine_history(cls(cls.params_cls(**params), tp), clients, tp, _recorder(seen_engine))
    if runtime == "ray":
        printer = builtins.print
        flower = simulate(cls(cls.params_cls(**params), tp), _model, clients, seed=0, observer=_recorder(seen_flower))
        assert builtins.print is printer  # Ray's start replaced it; simulate gives the caller's back
    else:
        flower = _loop_history(cls(cls.params_cls(**params), tp), clients, _recorder(seen_flower))

    # the same rounds: sampling, bytes, training losses, per-client and global evaluations, FLOPs, bit for bit
    assert len(flower) == len(engine) == tp.rounds
    for e, f in zip(without_timing(engine), without_timing(flower)):
        assert {k: f[k] for k in e} == e
        assert set(f) - set(e) == {"flower_record_bytes"} | ({"bytes_eval_down"} if "eval" in e else set())
    assert engine[-1]["eval"] != engine[0]["eval"]  # the numbers compared move (test losses at least)
    if extra.get("count_flops"):
        assert flower[-1]["train_flops"] == engine[-1]["train_flops"] > 0

    # the same payloads crossed: every download the server sent and every upload it received, tensor for tensor
    def by_key(log):
        return {(r, c, w): p for r, c, w, p in log}

    pe, pf = by_key(seen_engine), by_key(seen_flower)
    assert len(pe) == len(seen_engine) and pe.keys() == pf.keys()
    for k in pe:
        assert pe[k].keys() == pf[k].keys() and all(torch.equal(pe[k][t], pf[k][t]) for t in pe[k]), k

    # the bytes reported are the tensor bytes of the records Flower carried; Flower's own count adds .npy headers
    for f in flower:
        for c in f["sampled"]:
            down, up = pf[(f["round"], c, "down")], pf[(f["round"], c, "up")]
            assert f["bytes_down"][c] == payload_bytes(down)
            assert f["bytes_up"][c] == payload_bytes(up)
            wire = f["flower_record_bytes"]
            assert payload_bytes(up) < wire["up"][c] <= payload_bytes(up) + 256 * len(up)
            assert payload_bytes(down) <= wire["down"][c] <= payload_bytes(down) + 256 * len(down)

    # nothing the method declares private reached the server (LG-FedAvg: once its FedAvg rounds are over)
    spec = FlowerSpec.of(cls(cls.params_cls(**params), tp), _model, 0)
    _, built, private = spec.build(torch.zeros(2, 1, 16, 16), torch.device("cpu"), [Card.of(c) for c in clients])
    shared_all = params.get("fedavg_rounds", 0)
    uploaded = set().union(*(set(p) for (r, _, w), p in pf.items() if w == "up" and r > shared_all))
    assert not uploaded & private
    if shared_all:
        assert set().union(*(set(p) for (r, _, w), p in pf.items() if w == "up" and r <= shared_all)) >= private
    if name == "pfeddb":
        # the shared branch's BatchNorm (statistics and, by default, affine) stays home; its convolutions travel
        shared_bn = {k for k in batchnorm_keys(built) if k.startswith("shared.")}
        assert private and {k for k in private if k.startswith("shared.")} == shared_bn


# ------------------------------------------------------------------ in one process, through a stand-in for the Grid
class LoopGrid:
    """A stand-in for Flower's Grid: each message goes to its node's ClientApp in this process, one Context per node
    whose state persists across messages (as on a SuperNode); a ClientApp's exception comes back as an error reply,
    as the simulation runtime returns it. ``replies`` logs the record names and keys of every reply."""

    def __init__(self, app, n: int):
        self.app = app
        self.contexts = {100 + k: Context(run_id=1, node_id=100 + k, node_config={"partition-id": k}, state=RecordDict(),
                                          run_config={}) for k in range(n)}
        self.replies: list[tuple[str, dict[str, set]]] = []

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, timeout=None):
        out = []
        for m in messages:
            try:
                reply = self.app(m, self.contexts[m.metadata.dst_node_id])
            except Exception as ex:  # noqa: BLE001 - delivered as Flower delivers it
                reply = Message(Error(code=0, reason=f"{type(ex).__name__}: {ex}"), reply_to=m)
            if reply.has_content():
                self.replies.append((m.metadata.message_type, {n: set(r.keys()) for n, r in reply.content.array_records.items()}))
            out.append(reply)
        return out


@contextmanager
def _as_task() -> Iterator[None]:
    """Messages take their run and node from Flower's process-wide task identity (the runtime sets it)."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    try:
        yield
    finally:
        TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = None


@pytest.fixture()
def identity():
    with _as_task():
        yield


def _loop_history(method, clients: list, observer) -> list[dict]:
    """The history of ``method``'s ServerApp and ClientApp run through the stand-in Grid, on one thread as the engine
    it is compared with (and as each Ray worker runs)."""
    with one_thread(), _as_task():
        run, _ = _loop_run(FlowerSpec.of(method, _model, 0), clients, observer=observer)
    assert run.engine is not None and run.engine.round == run.engine.total_rounds
    return run.engine.history


def _loop_run(spec: FlowerSpec, clients: list, app=None, observer=None) -> tuple[FlowerRun, LoopGrid]:
    run = FlowerRun(spec, len(clients), observer=observer)
    grid = LoopGrid(app or client_app(spec, lambda ctx: clients[int(ctx.node_config["partition-id"])]), len(clients))
    run.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))  # type: ignore[arg-type]
    return run, grid


# every other static method (a new one once registered): the engine's history through the same apps, in one process
OTHERS = sorted(m for m, cls in REGISTRY.items() if not cls.stream_only and m not in CASES)
RESNET = {"f2dc", "fedrcl", "fdse"}  # methods built on a ResNet's blocks


@pytest.mark.parametrize("name", OTHERS)
def test_every_other_static_method_gives_the_engines_history_through_the_apps(name):
    """Two rounds, two of three sites sampled a round: sampling, bytes, losses, evaluations (personal and global)
    of the ServerApp / ClientApp pair equal the in-process engine's, bit for bit."""
    from fedsilo.models import build_model

    resnet = name in RESNET

    def make_model():
        return build_model("resnet10", 1, 4, seed=0, image_size=16) if resnet else tiny_net(1, 4)

    tp = _train(rounds=2, client_fraction=0.67, model="resnet10" if resnet else "simple_cnn")
    cls, clients = method_class(name), style_shifted_federation(n_train=12, n_test=8, per_domain=1)[:3]
    with one_thread():
        engine = Engine(cls(cls.params_cls(), tp), make_model(), clients, tp, seed=0).run()
    with one_thread(), _as_task():
        run, _ = _loop_run(FlowerSpec.of(cls(cls.params_cls(), tp), make_model, 0), clients)
    flower = run.engine.history
    assert len(flower) == len(engine) == 2 and any(len(h["sampled"]) == 2 for h in engine) and "eval" in engine[-1]
    for e, f in zip(without_timing(engine), without_timing(flower)):
        assert {k: f[k] for k in e} == e


class SilentAtRegistration(LoopGrid):
    """A node online whose registration reply never comes (a SuperNode still delivering a stopped run's replies):
    Flower's send_and_receive returns what came within its timeout."""

    timeouts: list

    def send_and_receive(self, messages, timeout=None):
        self.timeouts = [*getattr(self, "timeouts", []), timeout]
        messages = list(messages)
        if all(m.metadata.message_type == "query.register" for m in messages):
            messages = [m for m in messages if m.metadata.dst_node_id != 101]
        return super().send_and_receive(messages, timeout)


def test_registration_waits_for_the_sites_replies_no_longer_than_wait_s_and_says_why_a_site_may_be_silent(identity):
    spec, clients = FlowerSpec.of(FedBN(FedBN.params_cls(), _train(rounds=1)), _model, 0), _clients()
    run = FlowerRun(spec, len(clients), wait_s=0.5)
    grid = SilentAtRegistration(client_app(spec, lambda ctx: clients[int(ctx.node_config["partition-id"])]), len(clients))
    with pytest.raises(TimeoutError, match=r"sites 1 did not register within 0 s \(wait-s in the App's pyproject\.toml\); "
                       r"a site whose SuperNode is online but does not answer may still be delivering the replies of a run"):
        run.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))  # type: ignore[arg-type]
    assert grid.timeouts and all(t is not None and 0 < t <= 1.0 for t in grid.timeouts), grid.timeouts


class OneOffline(LoopGrid):
    """Node 102's SuperNode never connects."""

    def get_node_ids(self):
        return [n for n in self.contexts if n != 102]


def test_a_site_that_never_connects_is_named_by_its_pinned_node_and_the_wait_is_said(identity, monkeypatch, caplog):
    """No site is asked to register until enough nodes are online, so a timeout named no site ("1 of 2 connected")
    after minutes of silence: the sites whose pinned node is not online are named, and the wait says how far it is."""
    import logging

    import fedsilo.fl.flower as flower
    from fedsilo.fl.flower import Roster

    monkeypatch.setattr(flower, "WAIT_LINE_S", 0.2)
    spec, clients = FlowerSpec.of(FedBN(FedBN.params_cls(), _train(rounds=1)), _model, 0), _clients()
    app = client_app(spec, lambda ctx: clients[int(ctx.node_config["partition-id"])])
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    names = tuple(c.name for c in clients)
    roster = Roster(names, ("f",) * len(names), {}, node_ids=(100, 101, 102))
    with caplog.at_level(logging.WARNING, logger="fedsilo.fl.flower"):
        with pytest.raises(TimeoutError, match=rf"2 of 3 sites connected after 1 s; not connected: {names[2]} \(node 102\) "
                           r"\(their SuperNodes: running, and reaching the SuperLink\?\)"):
            FlowerRun(spec, len(clients), roster=roster, wait_s=0.7).main(OneOffline(app, len(clients)), ctx)  # type: ignore[arg-type]
    assert any(r.getMessage().startswith("waiting for the sites: 2 of 3 connected after 0 s (wait-s 1 s); not connected: "
                                         f"{names[2]} (node 102)") for r in caplog.records), caplog.text
    # no node pinned: which site is missing cannot be told before they register, and the message says so
    with pytest.raises(TimeoutError, match=r"2 of 3 sites connected after 0 s \(no site is asked to register until enough are online"):
        FlowerRun(spec, len(clients), wait_s=0.3).main(OneOffline(app, len(clients)), ctx)  # type: ignore[arg-type]


def test_each_store_lives_in_its_sites_context_and_the_server_holds_only_cards(identity):
    tp, clients = _train(rounds=2), _clients()
    reference = Engine(FedBN(FedBN.params_cls(), tp), _model(), clients, tp, seed=0)
    reference.run()
    run, grid = _loop_run(FlowerSpec(FedBN, FedBN.params_cls(), tp, 0, _model, "fedbn"), clients)
    bn = batchnorm_keys(_model())
    for k, ctx in enumerate(grid.contexts.values()):
        store = ctx.state.array_records[STORE]
        assert set(store.keys()) == bn
        assert all(torch.equal(torch.from_numpy(store[key].numpy()), reference.stores[k][key]) for key in bn)
    server = run.engine
    assert server is not None and server.stores == [] and server.server.keys() == reference.server.keys()
    assert all(torch.equal(server.server[k], reference.server[k]) for k in reference.server)
    assert [(c.name, c.n_train, c.x_train.numel(), c.y_train.numel()) for c in server.method.federation] == \
        [(c.name, c.n_train, 0, 0) for c in clients]  # the server knows names and counts, no image or label
    ups = [keys["up"] for kind, keys in grid.replies if kind == "train"]
    assert len(ups) == 2 * len(clients) and all(u and not u & bn for u in ups)


class _SeenGrid(LoopGrid):
    """LoopGrid that also logs the array keys of every evaluate message it delivers, per node."""

    def __init__(self, app, n: int):
        super().__init__(app, n)
        self.sent_eval: list[tuple[int, set]] = []

    def send_and_receive(self, messages, timeout=None):
        for m in messages:
            if m.metadata.message_type == "evaluate":
                self.sent_eval.append((m.metadata.dst_node_id, set(m.content.array_records["server"].keys())))
        return super().send_and_receive(messages, timeout)


@pytest.mark.parametrize("name", ["fedpac", "fdse"])
def test_evaluation_sends_each_site_its_own_server_side_tensors_only(identity, name):
    """FedPAC's server combines a head per client, FDSE's keeps each client's personalized layers: a site is sent the
    shared state and its own part to be evaluated (Method.eval_download), never another site's, and scores as the
    engine scores it."""
    from fedsilo.models import build_model

    tp, clients = _train(rounds=2), _clients()
    cls = method_class(name)
    make = _model if name == "fedpac" else (lambda: build_model("resnet10_cifar", 1, 4, seed=0))  # FDSE: a BasicBlock ResNet
    reference = Engine(cls(cls.params_cls(), tp), make(), clients, tp, seed=0)
    ref_hist = reference.run()
    spec = FlowerSpec(cls, cls.params_cls(), tp, 0, make, name)
    grid = _SeenGrid(client_app(spec, lambda ctx: clients[int(ctx.node_config["partition-id"])]), len(clients))
    run = FlowerRun(spec, len(clients))
    run.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))  # type: ignore[arg-type]
    per_client = [k for k in reference.server if k.startswith(("head::", "fdse::"))]  # per client: <tag><client>::<key>
    assert per_client
    assert grid.sent_eval and len({n for n, _ in grid.sent_eval}) == len(clients)
    for node, keys in grid.sent_eval:
        c = clients[node - 100]
        theirs = {k for k in per_client if not k.startswith((f"head::{c.index}::", f"fdse::{c.name}::"))}
        assert not keys & theirs and keys & set(per_client)  # its own part, nobody else's
    hist = run.engine.history
    assert [without_timing([e])[0].get("eval") for e in hist] == [without_timing([e])[0].get("eval") for e in ref_hist]
    full = payload_bytes(reference.server)
    assert all(0 < b < full for b in hist[-1]["bytes_eval_down"].values())
    # metrics.json and the round's line count them beside the training's downloads
    from fedsilo.fl.run import round_summary, summarize

    summary = summarize(hist)
    sent = [sum(e["bytes_eval_down"].values()) for e in hist if "bytes_eval_down" in e]
    assert summary["bytes_eval_down_per_round"] == sent and summary["bytes_eval_down_total"] == sum(sent) > 0
    assert " to evaluate)" in round_summary({**hist[-1], "seconds": 1.0})


class _LeakyBN(FedBN):
    name = "fedbn"

    def keep_and_share(self, model, store):
        super().keep_and_share(model, store)
        return {k: v.detach() for k, v in model.state_dict().items()}  # BatchNorm too: private by FedBN's own word


def test_a_site_refuses_to_send_a_private_tensor(identity):
    tp, clients = _train(rounds=1), _clients()
    with pytest.raises(ClientFailed, match=r"PrivacyViolation: fedbn: client D0-0 tried to upload private tensors \['units.0.1"):
        _loop_run(FlowerSpec(_LeakyBN, FedBN.params_cls(), tp, 0, _model, "fedbn"), clients)


def test_the_server_refuses_a_record_holding_a_private_key(identity):
    tp, clients = _train(rounds=1), _clients()
    spec = FlowerSpec(FedBN, FedBN.params_cls(), tp, 0, _model, "fedbn")
    honest = client_app(spec, lambda ctx: clients[int(ctx.node_config["partition-id"])])

    def tampered(msg, ctx):  # a site whose software was altered: it adds a BatchNorm tensor to its upload
        reply = honest(msg, ctx)
        if msg.metadata.message_type == "train":
            up = {k: torch.from_numpy(a.numpy()) for k, a in reply.content.array_records["up"].items()}
            up["units.0.1.running_mean"] = torch.zeros(8)
            reply.content["up"] = to_record(up)
        return reply

    with pytest.raises(PrivacyViolation, match=r"client D0-0 tried to upload private tensors \['units.0.1.running_mean'\]"):
        _loop_run(spec, clients, app=tampered)


class _RelabelGrid(LoopGrid):
    """A server that sends round ``late``'s train messages as round 1: for LG-FedAvg with one FedAvg round, a round
    whose uploads may carry every layer."""

    late = 3

    def send_and_receive(self, messages, timeout=None):
        for m in messages:
            if m.metadata.message_type == "train" and m.content.config_records[CONFIG]["round"] == self.late:
                m.content.config_records[CONFIG]["round"] = 1
        return super().send_and_receive(messages, timeout)


@pytest.mark.parametrize("late", [2, 3])
def test_a_site_refuses_to_train_a_round_it_has_trained_or_one_before(identity, late):
    """The round decides what may leave a site (LG-FedAvg shares its lower layers in its FedAvg rounds only): a server
    that relabels a later round as the FedAvg round (a repeat of round 1, or a step back) gets an error, not the
    sites' own lower layers."""
    tp, clients = _train(rounds=3), _clients()
    cls = method_class("lgfedavg")
    spec = FlowerSpec(cls, cls.params_cls(fedavg_rounds=1), tp, 0, _model, "lgfedavg")
    grid = _RelabelGrid(client_app(spec, lambda ctx: clients[int(ctx.node_config["partition-id"])]), len(clients))
    grid.late = late
    run = FlowerRun(spec, len(clients))
    with pytest.raises(ClientFailed, match=rf"asked to train round 1 after round {late - 1}; refused"):
        run.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))  # type: ignore[arg-type]
    ups = [keys for kind, keys in grid.replies if kind == "train"]
    assert len(ups) == (late - 1) * len(clients) and not any(k.startswith("units.0.") for u in ups[len(clients):] for k in u["up"])


class _ShortDownGrid(LoopGrid):
    """A link that loses part of round 2's train messages: each record carries 4 tensor bytes fewer than the server
    says it sent (here the server's word is raised instead, which the site cannot tell apart)."""

    def send_and_receive(self, messages, timeout=None):
        for m in messages:
            if m.metadata.message_type == "train" and m.content.config_records[CONFIG]["round"] == 2:
                cfg = m.content.config_records[CONFIG]
                cfg["sent_bytes"] = int(cfg["sent_bytes"]) + 4
        return super().send_and_receive(messages, timeout)


def test_a_site_refuses_a_download_whose_tensor_bytes_are_not_what_the_server_sent(identity):
    tp, clients = _train(rounds=2), _clients()
    spec = FlowerSpec(FedBN, FedBN.params_cls(), tp, 0, _model, "fedbn")
    grid = _ShortDownGrid(client_app(spec, lambda ctx: clients[int(ctx.node_config["partition-id"])]), len(clients))
    with pytest.raises(ClientFailed, match=r"client D0-0: received (\d+) tensor bytes of the (?!\1)\d+ sent"):
        FlowerRun(spec, len(clients)).main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))  # type: ignore[arg-type]
    assert len([k for k, _ in grid.replies if k == "train"]) == len(clients)  # round 1's replies only


def test_a_site_scores_the_global_model_beside_its_personal_one_as_the_engine_does(identity):
    """Ditto: a site is evaluated with its personal model and, apart, with the global model the server sent it; the
    "global" accuracies are the engine's, and not the personal ones."""
    tp, clients = _train(rounds=2), _clients()
    cls = method_class("ditto")
    engine = _engine_history(cls(cls.params_cls(), tp), clients, tp)
    flower = _loop_history(cls(cls.params_cls(), tp), clients, None)
    assert [f["global"] for f in flower] == [e["global"] for e in engine]
    assert [f["eval"] for f in flower] == [e["eval"] for e in engine]
    assert any(e["global"][c] != e["eval"][c]["acc"] for e in engine for c in e["global"])  # the two models differ here


class _IdleInRoundTwo(FedBN):
    """FedBN whose sites train nothing in round 2 (they send back what they were sent) and so report no loss."""

    name = "fedbn"

    def local_update(self, model, store, payload, client, rnd, seed):
        if rnd == 2:
            return dict(payload)
        return super().local_update(model, store, payload, client, rnd, seed)


def test_a_site_that_reports_no_loss_in_a_round_reports_none_not_its_last_one(identity):
    tp, clients = _train(rounds=3), _clients()
    run, _ = _loop_run(FlowerSpec(_IdleInRoundTwo, FedBN.params_cls(), tp, 0, _model, "fedbn"), clients)
    losses = [h["train_loss"] for h in run.engine.history]
    names = [c.name for c in clients]
    assert losses[1] == dict.fromkeys(names)
    assert all(isinstance(losses[r][n], float) for r in (0, 2) for n in names)


class _GoneGrid(LoopGrid):
    """Message ids as a real grid sets them when it pushes. Node ``gone``'s SuperNode dies while it handles round
    ``at``'s ``kind`` message, after it acted on it (trained and kept its store; scored) but before its reply left:
    the SuperLink answers for it with its own error reply (from the SuperLink's node id, Flower's function) and
    lists it offline for ``away`` calls of ``get_node_ids``; it comes back with its node state gone (a restarted
    SuperNode) and only its disk."""

    gone, at, away, kind = 101, 2, 3, "evaluate"

    def __init__(self, app, n: int):
        super().__init__(app, n)
        self.asked, self.died = 0, False

    def get_node_ids(self):
        if self.died and self.asked < self.away:
            self.asked += 1
            return [n for n in self.contexts if n != self.gone]
        return list(self.contexts)

    def send_and_receive(self, messages, timeout=None):
        from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

        out = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = m.object_id
            cfg = m.content.config_records.get(CONFIG, {})
            if not self.died and m.metadata.dst_node_id == self.gone and m.metadata.message_type == self.kind and cfg.get("round") == self.at:
                super().send_and_receive([m], timeout)  # it acted on the message; the reply never left
                self.died, self.contexts[self.gone].state = True, RecordDict()
                out.append(create_message_error_unavailable_res_message(m.metadata, "node_unavail"))
            else:
                out.extend(super().send_and_receive([m], timeout))
        return out


def _gone_run(tmp_path: Path, name: str, grid_cls=_GoneGrid, **kw) -> tuple[FlowerRun, LoopGrid]:
    tp, clients = _train(rounds=3), _clients()
    spec = FlowerSpec(FedBN, FedBN.params_cls(), tp, 0, _model, "fedbn")
    app = client_app(spec, lambda ctx: clients[int(ctx.node_config["partition-id"])], keep_dir=lambda ctx: tmp_path / name / str(ctx.node_id))
    grid = grid_cls(app, len(clients))
    run = FlowerRun(spec, len(clients), **kw)
    run.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))  # type: ignore[arg-type]
    return run, grid


def test_a_site_whose_supernode_went_away_is_waited_for_and_answers_again_from_its_disk(identity, tmp_path, monkeypatch, caplog):
    """FedBN, checkpointed, sites keeping their stores on disk: a site's SuperNode dies while it scores round 2,
    before its reply left. The run waits for the SuperLink to list it again and sends it round 2's evaluation again;
    the site, restarted with its node state gone, scores with its store of round 2 from its disk: the uninterrupted
    run's numbers. The SuperLink's error reply names no site (its sender is the SuperLink): it is matched to the
    message it answers."""
    import fedsilo.fl.flower as flower

    monkeypatch.setattr(flower, "REJOIN_POLL_S", 0.01)
    whole, _ = _gone_run(tmp_path, "whole", grid_cls=LoopGrid, checkpoint=tmp_path / "whole.pt", config_hash="h")
    with caplog.at_level("WARNING", logger="fedsilo.flower"):
        run, grid = _gone_run(tmp_path, "gone", checkpoint=tmp_path / "gone.pt", config_hash="h", rejoin_s=60)
    assert grid.died and grid.asked == grid.away
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("D1-0: gone in round 2 (evaluate)") for m in said) and "D1-0: back online; evaluate of round 2 sent again" in said
    assert any(m.startswith("client D1-0: resumed from its store of round 2") for m in said)  # from its disk
    for key in ("sampled", "eval", "bytes_up", "bytes_down", "train_loss"):
        assert [h[key] for h in run.engine.history] == [h[key] for h in whole.engine.history], key
    assert [k for k, _ in grid.replies].count("evaluate") == 3 * 3 + 1  # the lost reply's scoring ran twice at the site

    # a training is never sent again within a run (an announce's effect lives in node state, and a site whose link
    # dropped after it trained refuses the round again); not back in time; rejoin_s 0; a run without checkpoint (a
    # restarted site would have lost its store: never waited for): the run ends naming the site, the round, the
    # reason and what the coordinator does
    for kind, kw, waited, again in (
            ("train", {"rejoin_s": 60}, "; a site's training is not sent again within a run", "resumes after its last checkpoint"),
            ("evaluate", {"rejoin_s": 0.05}, "; not back online within 0 s", "resumes after its last checkpoint"),
            ("evaluate", {"rejoin_s": 0}, "", "resumes after its last checkpoint"),
            ("evaluate", {"rejoin_s": 60}, "", "starts afresh")):
        monkeypatch.setattr(_GoneGrid, "away", 10**6)
        monkeypatch.setattr(_GoneGrid, "kind", kind)
        folder = f"fail-{kind}-{kw['rejoin_s']}-{again[:3]}"
        checkpoint = {"checkpoint": tmp_path / f"{folder}.pt", "config_hash": "h"} if "afresh" not in again else {}
        with pytest.raises(ClientFailed, match=rf"client D1-0: {kind} in round 2 failed: Error: Node Unavailable .*"
                                               rf"lost its connection{re.escape(waited)}; once `flwr supernode list` shows it online "
                                               rf"again, `flwr run` the App again.*{again}"):
            _gone_run(tmp_path, folder, **checkpoint, **kw)


class _DropGrid(LoopGrid):
    """Message ids as a real grid sets them. Each node of ``drops`` (round -> nodes) goes away while it trains that
    round, after it trained and kept its store, before its reply left: the SuperLink answers for it. ``wipe``: its
    SuperNode restarts (node state gone); else only its link dropped and it keeps its node state (the store of the
    round whose upload the server never took). Back at once for the evaluation. ``crash_in``: the SuperLink goes
    down as that round's training is sent (nothing delivered; the coordinator's checkpoint holds the round before)."""

    drops: dict = {}
    wipe, crash_in, app_crash = True, None, False  # app_crash: the SuperNode answers, its ClientApp stopped responding

    def send_and_receive(self, messages, timeout=None):
        from flwr.app import Error
        from flwr.app import Message as FlwrMessage
        from flwr.common.constant import ErrorCode
        from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

        out = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = m.object_id
            rnd, node = m.content.config_records.get(CONFIG, {}).get("round"), m.metadata.dst_node_id
            if m.metadata.message_type == "train" and rnd == self.crash_in:
                raise ConnectionError("the SuperLink went down")
            if m.metadata.message_type == "train" and node in self.drops.get(rnd, ()):
                super().send_and_receive([m], timeout)  # it trained and kept its store; the reply never left
                if self.wipe:
                    self.contexts[node].state = RecordDict()
                if self.app_crash:
                    reply = FlwrMessage(Error(ErrorCode.CLIENT_APP_CRASHED, "ClientApp stopped responding."), reply_to=m)
                    reply.metadata.__dict__["_message_id"] = reply.object_id
                    out.append(reply)
                else:
                    out.append(create_message_error_unavailable_res_message(m.metadata, "node_unavail"))
            else:
                out.extend(super().send_and_receive([m], timeout))
        return out


def _engine_without(skip: set, rounds: int) -> list:
    """The in-process engine with the (round, client index) pairs of ``skip`` not sampled."""

    class Without(Engine):
        def sample(self, rnd):
            return [i for i in super().sample(rnd) if (rnd, i) not in skip]

    return Without(FedBN(FedBN.params_cls(), _train(rounds=rounds)), _model(), _clients(), _train(rounds=rounds), seed=0).run()


def _drop_run(tmp_path: Path, name: str, rounds: int, drops: dict, wipe: bool = True, crash_in=None, app_crash=False, **kw):
    tp, clients = _train(rounds=rounds), _clients()
    spec = FlowerSpec(FedBN, FedBN.params_cls(), tp, 0, _model, "fedbn")
    app = client_app(spec, lambda ctx: clients[int(ctx.node_config["partition-id"])], keep_dir=lambda ctx: tmp_path / name / str(ctx.node_id))
    grid = type("Grid", (_DropGrid,), {"drops": drops, "wipe": wipe, "crash_in": crash_in, "app_crash": app_crash})(app, len(clients))
    run = FlowerRun(spec, len(clients), checkpoint=tmp_path / f"{name}.pt", config_hash="h", rejoin_s=60, **kw)
    run.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))  # type: ignore[arg-type]
    return run, grid


@pytest.mark.parametrize("wipe", [True, False], ids=["supernode-restarted", "link-dropped"])
def test_a_site_gone_during_training_is_left_out_of_the_round_as_if_not_sampled(identity, tmp_path, monkeypatch, caplog, wipe):
    """FedBN on three sites with min-train-sites 2: D1-0 goes away while it trains round 2 (after it trained and kept
    its store). The round goes on with the two others; the run ends with the numbers of the in-process engine in
    which D1-0 was not sampled in round 2: its round-2 training (its BatchNorm statistics, kept in its node state
    when only its link dropped) is set aside, and it carries on from its store of round 1, on its disk. What was sent
    to it is counted apart (``dropped``; MLflow's ``sites_dropped``). Then a site dropped in two rounds running and
    the SuperLink down in the next round: ``flwr run`` again resumes to the engine's numbers without those two."""
    import fedsilo.fl.flower as flower
    from fedsilo.fl.run import round_summary
    from fedsilo.tracking import round_metrics

    monkeypatch.setattr(flower, "REJOIN_POLL_S", 0.01)
    expected = _engine_without({(2, 1)}, 3)
    wire: list = []
    with caplog.at_level("WARNING", logger="fedsilo.flower"):
        run, _ = _drop_run(tmp_path, "drop", 3, {2: {101}}, wipe, min_train_sites=2, wire=wire.append)
    history = run.engine.history
    for key in ("sampled", "eval", "bytes_up", "bytes_down", "train_loss"):
        assert [h[key] for h in history] == [h[key] for h in expected], key
    assert history[1]["sampled"] == ["D0-0", "D2-0"] and "dropped" not in history[0] and "dropped" not in history[2]
    assert history[1]["dropped"] == {"D1-0": history[0]["bytes_down"]["D1-0"]}  # the download it was sent
    assert round_metrics(history[1])["sites_dropped"] == 1 and "without D1-0" in round_summary(history[1])
    assert [w["dropped"].split(":")[0] for w in wire if "dropped" in w] == ["no upload taken"]  # the coordinator's record
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("D1-0: gone during round 2's training; the round goes on with the 2 of 3") for m in said)
    if not wipe:
        assert "client D1-0: the server took no upload of its round 2; it carries on from its store of round 1" in said
    kept = sorted(f.name for f in (tmp_path / "drop" / "101" / "D1-0").iterdir() if f.suffix == ".pt")
    # the untaken round set aside, never read again; round 1's store stays while a resume from the checkpoint of
    # round 2 could name it (drop_before keeps the store the server names)
    assert kept == ["model.pt", "store-r000001.pt", "store-r000003.pt", "untaken-r000002.pt"]

    # dropped in rounds 2 and 3, the SuperLink down as round 4's training is sent, the App run again
    with pytest.raises(ConnectionError):
        _drop_run(tmp_path, "twice", 5, {2: {101}, 3: {101}}, wipe, crash_in=4, min_train_sites=2)
    run, _ = _drop_run(tmp_path, "twice", 5, {}, wipe, min_train_sites=2)
    expected = _engine_without({(2, 1), (3, 1)}, 5)
    for key in ("sampled", "eval", "bytes_up", "bytes_down", "train_loss"):
        assert [h[key] for h in run.engine.history] == [h[key] for h in expected], key

    # fewer sites trained than min-train-sites: the run ends as without it, saying so
    with pytest.raises(ClientFailed, match=r"client D1-0: train in round 2 failed: Error: Node Unavailable .*fewer than "
                                           r"min-train-sites \(2\) of the round's sampled sites trained"):
        _drop_run(tmp_path, "quorum", 3, {2: {101, 102}}, min_train_sites=2)


def test_a_site_whose_clientapp_crashed_is_left_out_as_a_site_gone_where_min_train_sites_allows(identity, tmp_path):
    """Flower's CLIENT_APP_CRASHED (the SuperNode answers: its ClientApp process stopped reporting, killed for memory
    or starved of CPU): with min-train-sites 2 the round goes on without the site, to the numbers of the engine in
    which it was not sampled that round; without it the run ends saying what happened and what to do."""
    expected = _engine_without({(2, 1)}, 3)
    run, _ = _drop_run(tmp_path, "crash", 3, {2: {101}}, wipe=False, app_crash=True, min_train_sites=2)
    for key in ("sampled", "eval", "bytes_up", "bytes_down", "train_loss"):
        assert [h[key] for h in run.engine.history] == [h[key] for h in expected], key
    with pytest.raises(ClientFailed, match=r"client D1-0: train in round 2 failed: .*ClientApp stopped responding.* stopped "
                                           r"reporting to its SuperNode"):
        _drop_run(tmp_path, "crash-ends", 3, {2: {101}}, wipe=False, app_crash=True)
    with pytest.raises(ClientFailed, match=r"ClientApp stopped responding.*fewer than min-train-sites \(2\) of the round's"):
        _drop_run(tmp_path, "crash-quorum", 3, {2: {101, 102}}, wipe=False, app_crash=True, min_train_sites=2)


class _EvalGoneGrid(LoopGrid):
    """Message ids as a real grid sets them. Each node of ``gone`` (round -> nodes) goes away while it scores that
    round's evaluation, after it scored, before its reply left: the SuperLink answers for it; its SuperNode restarts
    (node state gone) and is back for the next round's training, which it starts from its store on its disk."""

    gone: dict = {}
    offline: set = set()  # nodes the SuperLink never lists online again once they went away (until the next round)

    def get_node_ids(self):
        return [n for n in self.contexts if n not in self.offline or not self.died]

    def send_and_receive(self, messages, timeout=None):
        from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

        out = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = m.object_id
            rnd, node = m.content.config_records.get(CONFIG, {}).get("round"), m.metadata.dst_node_id
            self.died = self.died and m.metadata.message_type == "evaluate"  # back for the next round's training
            if m.metadata.message_type == "evaluate" and node in self.gone.get(rnd, ()) and (node, rnd) not in self.dead:
                self.dead.add((node, rnd))
                self.died = True
                super().send_and_receive([m], timeout)  # it scored; the reply never left
                self.contexts[node].state = RecordDict()
                out.append(create_message_error_unavailable_res_message(m.metadata, "node_unavail"))
            else:
                out.extend(super().send_and_receive([m], timeout))
        return out


def _eval_gone_run(tmp_path: Path, name: str, gone: dict, offline: tuple = (), **kw) -> FlowerRun:
    tp, clients = _train(rounds=3), _clients()
    spec = FlowerSpec(FedBN, FedBN.params_cls(), tp, 0, _model, "fedbn")
    app = client_app(spec, lambda ctx: clients[int(ctx.node_config["partition-id"])], keep_dir=lambda ctx: tmp_path / name / str(ctx.node_id))
    grid = type("Grid", (_EvalGoneGrid,), {"gone": gone, "offline": set(offline), "died": False})(app, len(clients))
    grid.dead = set()
    run = FlowerRun(spec, len(clients), checkpoint=tmp_path / f"{name}.pt", config_hash="h", **kw)
    run.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))  # type: ignore[arg-type]
    return run


def test_an_evaluation_goes_on_without_a_site_gone_during_it_when_min_eval_sites_allow(identity, tmp_path, caplog):
    """FedBN on three sites with min-eval-sites 2: D1-0's SuperNode dies while it scores round 2 and is back, its node
    state gone, for round 3. Round 2's evaluation holds the two other sites' scores (the uninterrupted run's), names
    D1-0 and has no mean (MLflow's ``sites_not_evaluated``, no ``mean_acc`` that round); every training and the other
    evaluations are the uninterrupted run's. Without min-eval-sites the run ends naming the site; the last evaluation
    (the run's result) never goes on without a site; fewer sites scored than min-eval-sites ends the run."""
    from fedsilo.fl.run import round_summary, summarize
    from fedsilo.tracking import round_metrics

    whole = _eval_gone_run(tmp_path, "whole", {}).engine.history
    wire: list = []
    with caplog.at_level("WARNING", logger="fedsilo.flower"):
        history = _eval_gone_run(tmp_path, "gone", {2: {101}}, min_eval_sites=2, wire=wire.append).engine.history
    for key in ("sampled", "bytes_up", "bytes_down", "train_loss"):
        assert [h[key] for h in history] == [h[key] for h in whole], key
    assert history[0]["eval"] == whole[0]["eval"] and history[2]["eval"] == whole[2]["eval"]  # back from its disk
    assert "eval" not in history[1] and "mean_acc" not in history[1] and history[1]["eval_missing"] == ["D1-0"]
    assert history[1]["eval_partial"] == {c: v for c, v in whole[1]["eval"].items() if c != "D1-0"}
    assert history[1]["bytes_eval_down"] == whole[1]["bytes_eval_down"]  # sent to every site, D1-0's too
    logged = round_metrics(history[1])
    assert logged["sites_not_evaluated"] == 1 and "mean_acc" not in logged and set(logged) >= {"acc.D0-0", "acc.D2-0"}
    assert "acc.D1-0" not in logged and "evaluated without D1-0" in round_summary(history[1])
    assert summarize(history)["per_client"] == whole[2]["eval"]
    assert [w["dropped"].split(":")[0] for w in wire if "dropped" in w] == ["no scores taken"]
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("D1-0: gone during round 2's evaluation; the evaluation goes on with the 2 of 3 sites that scored") for m in said)

    for folder, gone, kw, why in (
            ("strict", {2: {101}}, {}, ""),
            ("last", {3: {101}}, {"min_eval_sites": 2}, "; the last evaluation, the run's result, scores every site still in"),
            ("quorum", {2: {101, 102}}, {"min_eval_sites": 2}, r"; fewer than min-eval-sites \(2\) of the sites evaluated scored")):
        with pytest.raises(ClientFailed, match=rf"client D1-0: evaluate in round {min(gone)} failed: Error: Node Unavailable .*"
                                               rf"\(the site's SuperNode went down or lost its connection{why};"):
            _eval_gone_run(tmp_path, folder, gone, **kw)


def test_a_site_back_online_is_sent_the_evaluation_again_while_another_is_left_out(identity, tmp_path, monkeypatch):
    """Two sites go away while they score round 2, D1-0's SuperNode is back online at once and D2-0's is not: D1-0 is
    sent the evaluation again (from its disk) while the run waits up to rejoin-s, then the evaluation goes on
    without D2-0 alone (min-eval-sites 2: two of three scored). Waiting for all of them or none would leave both out
    and end the run."""
    import fedsilo.fl.flower as flower

    monkeypatch.setattr(flower, "REJOIN_POLL_S", 0.01)
    whole = _eval_gone_run(tmp_path, "whole", {}).engine.history
    history = _eval_gone_run(tmp_path, "both", {2: {101, 102}}, offline=(102,), min_eval_sites=2, rejoin_s=0.3).engine.history
    assert history[1]["eval_missing"] == ["D2-0"] and history[1]["eval_partial"] == {c: whole[1]["eval"][c] for c in ("D0-0", "D1-0")}
    assert history[2]["eval"] == whole[2]["eval"]


def test_a_partial_evaluation_counts_only_for_the_sites_that_scored_it():
    """What reads a history with an evaluation that went on without a site: a site's own best-validation round counts
    the rounds it scored, best-mean-validation selection and the curves over seeds pass the round over (the curves
    match rounds by number, never pairing one seed's round 3 with another's round 2), and MLflow gets the answering
    sites' accuracies and global-model accuracies."""
    from fedsilo.report.tables import best_validation_round, own_best_validation_acc, seed_curve
    from fedsilo.tracking import round_metrics

    def entry(rnd, scores, missing=()):
        e = {"round": rnd, "bytes_up": {}, "bytes_down": {}, "bytes_up_total": 0, "bytes_down_total": 0, "train_loss": {}}
        per = {c: {"acc": a, "val_acc": v} for c, (a, v) in scores.items()}
        if missing:
            return {**e, "eval_partial": per, "eval_missing": list(missing), "global_partial": {c: a for c, (a, _) in scores.items()}}
        return {**e, "eval": per, "mean_acc": float(np.mean([a for a, _ in scores.values()])),
                "mean_val_acc": float(np.mean([v for _, v in scores.values()]))}

    run = [entry(1, {"A": (0.5, 0.5), "B": (0.5, 0.5)}), entry(2, {"A": (0.9, 0.9)}, missing=["B"]),
           entry(3, {"A": (0.6, 0.6), "B": (0.7, 0.7)})]
    assert own_best_validation_acc(run, "A") == 0.9 and own_best_validation_acc(run, "B") == 0.7
    assert best_validation_round(run)["round"] == 3
    other = [entry(1, {"A": (0.1, 0.1), "B": (0.1, 0.1)}), entry(2, {"A": (0.2, 0.2), "B": (0.2, 0.2)}), entry(3, {"A": (0.3, 0.3)}, missing=["B"])]
    assert seed_curve({("m", 0): run, ("m", 1): other}, "m", [0, 1], lambda e: e["mean_acc"]) == ([1], [pytest.approx(0.3)])
    logged = round_metrics(run[1])
    assert logged["global_acc.A"] == logged["acc.A"] == 0.9 and logged["sites_not_evaluated"] == 1 and "mean_acc" not in logged


def test_min_eval_sites_is_refused_by_key_where_an_evaluation_cannot_go_on_without_a_site(identity, tmp_path):
    """A number no evaluation can lose a site under (every site still in, or more), no checkpoint (a restarted site
    reads its store from its disk), and a task stream: refused by key before any site connects."""
    from fedsilo.fl.flower import check_min_eval_sites

    spec = FlowerSpec(FedBN, FedBN.params_cls(), _train(), 0, _model, "fedbn")
    for bad in (3, 4, -1):
        with pytest.raises(ConfigError, match=rf"min-eval-sites: {bad} is not a number of sites an evaluation can lose one "
                                              r"of: between 1 and 2 \(the federation's 3 sites still in, less one\), or 0"):
            FlowerRun(spec, 3, checkpoint=tmp_path / "c.pt", min_eval_sites=bad)
    with pytest.raises(ConfigError, match=r"min-eval-sites: 2 needs a checkpointed run"):
        FlowerRun(spec, 3, min_eval_sites=2)
    FlowerRun(spec, 3, checkpoint=tmp_path / "c.pt", min_eval_sites=2)
    with pytest.raises(ConfigError, match=r"min-eval-sites: not for a task stream yet"):
        check_min_eval_sites(3, 2, True, True)


def test_a_site_may_not_join_a_run_whose_method_trains_no_round_after_the_join(tmp_path):
    """pFedDR as its scripts run it trains in its first ``rounds`` rounds only: a site joining after them would never
    train and be scored untrained; refused by key. Before them, or with a method that trains every round, it joins."""
    from types import SimpleNamespace

    from fedsilo.fl.flower import FlowerServer

    cls = method_class("pfeddr")

    def server(rnd: int, rounds) -> SimpleNamespace:
        method = cls(cls.params_cls(rounds=rounds), _train(rounds=6))
        spec = SimpleNamespace(key="pfeddr", method_cls=cls)
        return SimpleNamespace(meta={}, round=rnd, total_rounds=6, checkpoint=tmp_path / "c.pt", method=method, spec=spec)

    with pytest.raises(ConfigError, match=r"sites: X marked joined, but pfeddr trains no round after round 4 \(methods.pfeddr: its "):
        FlowerServer._sites_joined(server(4, 3), ["X"], True, False)
    assert FlowerServer._sites_joined(server(2, 3), ["X"], True, False) == {"X": 3}
    assert FlowerServer._sites_joined(server(4, None), ["X"], True, False) == {"X": 5}


def test_min_train_sites_is_refused_by_key_where_a_round_cannot_go_on_without_a_site(identity, tmp_path):
    """No checkpoint (the site could not take its last taken store from its disk), a number no round can lose a site
    under (every sampled site, or more than the federation has), a task stream, and a method that announces before
    training (the server's aggregation counts on it): refused by key before any site connects."""
    from fedsilo.fl.flower import check_min_train_sites

    spec = FlowerSpec(FedBN, FedBN.params_cls(), _train(), 0, _model, "fedbn")
    with pytest.raises(ConfigError, match=r"min-train-sites: 2 needs a checkpointed run"):
        FlowerRun(spec, 3, min_train_sites=2)
    with pytest.raises(ConfigError, match=r"min-train-sites: 4 is not a number of sites between 0 and the federation's 3"):
        FlowerRun(spec, 3, checkpoint=tmp_path / "c.pt", min_train_sites=4)
    with pytest.raises(ConfigError, match=r"min-train-sites: 3 leaves no round a site to lose: a round samples 3 of the 3 sites"):
        FlowerRun(spec, 3, checkpoint=tmp_path / "c.pt", min_train_sites=3)
    half = FlowerSpec(FedBN, FedBN.params_cls(), _train(client_fraction=0.5), 0, _model, "fedbn")
    with pytest.raises(ConfigError, match=r"min-train-sites: 2 leaves no round a site to lose: a round samples 2 of the 4 sites \(train.client_fraction\)"):
        FlowerRun(half, 4, checkpoint=tmp_path / "c.pt", min_train_sites=2)
    FlowerRun(half, 4, checkpoint=tmp_path / "c.pt", min_train_sites=1)  # one of the two may go
    with pytest.raises(ConfigError, match=r"min-train-sites: not for a task stream yet"):
        check_min_train_sites(spec, 3, 2, True, True)
    announcing = type("Announcing", (FedBN,), {"announce": lambda self, model, store, client, rnd: {}})
    with pytest.raises(ConfigError, match=r"min-train-sites: fedbn tells the server before each round's training"):
        FlowerRun(FlowerSpec(announcing, FedBN.params_cls(), _train(), 0, _model, "fedbn"), 3, checkpoint=tmp_path / "c.pt", min_train_sites=2)


def test_what_the_adapter_does_not_run_is_refused_by_key():
    tp = _train()
    with pytest.raises(ConfigError, match=r"methods.pfeddil: .* stream of domain tasks only; these sites hold static data"):
        cls = method_class("pfeddil")
        FlowerSpec(cls, cls.params_cls(), tp, 0, _model, "pfeddil").check(stream=False)
    with pytest.raises(ConfigError, match=r"train.ensemble_test"):
        FlowerSpec(FedBN, FedBN.params_cls(), _train(ensemble_test=True), 0, _model, "fedbn").check()
    # a run whose rounds are all another phase's (a site federation's train.rounds, not an experiment's)
    pfeddb, lg = method_class("pfeddb"), method_class("lgfedavg")
    with pytest.raises(ConfigError, match=r"methods.pd.local_rounds: 3 local rounds leave no federated round in train.rounds \(3\)"):
        FlowerSpec(pfeddb, pfeddb.params_cls(local_rounds=3), _train(rounds=3), 0, _model, "pd").check()
    with pytest.raises(ConfigError, match=r"methods.lg.fedavg_rounds: 4 FedAvg rounds leave no LG-FedAvg round in train.rounds"):
        FlowerSpec(lg, lg.params_cls(fedavg_rounds=4), _train(rounds=3), 0, _model, "lg").check()
    FlowerSpec(pfeddb, pfeddb.params_cls(local_rounds=2), _train(rounds=3), 0, _model, "pd").check()


def test_a_client_app_ships_without_the_sites_this_process_built():
    """Ray pickles the ClientApp with each message (closures by value, with the globals they name): after sites were
    built in this process (here a pFedSD run, whose sites hold spare models by weak reference), a new app pickles,
    and small, carrying none of them."""
    cloudpickle = pytest.importorskip("ray.cloudpickle")
    from fedsilo.fl.flower import site_cache

    tp, clients = _train(rounds=1), _clients()
    cls = method_class("pfedsd")
    with one_thread(), _as_task():
        _loop_run(FlowerSpec.of(cls(cls.params_cls(), tp), _model, 0), clients)
    assert site_cache()  # built, and kept for the process's next messages
    app = client_app(FlowerSpec.of(cls(cls.params_cls(), tp), _model, 0), lambda ctx: clients[0])
    assert len(cloudpickle.dumps(app)) < 100_000  # the code and the spec, not the cached sites' data and models


def test_who_is_missing_is_said_by_pinned_node_then_by_registration(identity):
    """_not_connected: a site already registered is never named as not connected, whatever its node does now;
    without pinned nodes the sites not registered yet are named once some have registered, and nothing is said
    when no site is missing."""
    from fedsilo.fl.flower import Roster

    spec = FlowerSpec.of(FedBN(FedBN.params_cls(), _train(rounds=1)), _model, 0)
    names = ("A", "B", "C")
    pinned = FlowerRun(spec, 3, roster=Roster(names, ("f",) * 3, {}, node_ids=(100, 101, 102)), wait_s=1)
    card = Card(2, "C", "C", 4, (1, 8, 8))
    assert pinned._not_connected({}, {}, {100, 101}).startswith("; not connected: C (node 102)")
    assert pinned._not_connected({2: card}, {}, {100, 101}) == " (not yet registered: A, B)"
    bare = FlowerRun(spec, 3, wait_s=1)
    assert bare._not_connected({0: card}, {}, set()) == " (not yet registered: 1, 2)"
    assert bare._not_connected({}, {"0": {}, "1": {}, "2": {}}, set()) == ""


def test_the_wait_for_the_sites_is_said_every_thirty_seconds_until_wait_s(identity, monkeypatch, caplog):
    """A ServerApp waiting for its sites says how many are connected every WAIT_LINE_S (30 s) of the wait (600 s by
    default), not at every look at the SuperLink (ten a second). On a fake clock: twenty lines in ten minutes."""
    import logging
    import time as time_module

    import fedsilo.fl.flower as flower

    clock = [0.0]

    class Clock:
        def __getattr__(self, name):  # the rest of the time module as it is
            return getattr(time_module, name)

        def monotonic(self):
            return clock[0]

        def sleep(self, s):
            clock[0] += s

    monkeypatch.setattr(flower, "time", Clock())
    spec, clients = FlowerSpec.of(FedBN(FedBN.params_cls(), _train(rounds=1)), _model, 0), _clients()
    app = client_app(spec, lambda ctx: clients[int(ctx.node_config["partition-id"])])
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    with caplog.at_level(logging.WARNING, logger="fedsilo.fl.flower"):
        with pytest.raises(TimeoutError, match=r"2 of 3 sites connected after 600 s"):
            FlowerRun(spec, len(clients), wait_s=600).main(OneOffline(app, len(clients)), ctx)  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for the sites")]
    assert 19 <= len(lines) <= 20, len(lines)
    assert lines[0].startswith("waiting for the sites: 2 of 3 connected after 30 s (wait-s 600 s)"), lines[0]
