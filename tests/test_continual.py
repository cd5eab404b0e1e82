"""The task stream of federated domain-incremental learning (fl/continual.py) and the methods of pFedDIL's tables:
pFedDIL, Source-only, Disjoint, Sharing (multihead), FedAvg/FedProx fine-tuned task after task."""

from __future__ import annotations

import math

import pytest
import torch

from fedsilo.config import ConfigError, NormalizeParams, TrainParams
from fedsilo.fl.continual import ContinualEngine, continual_summary
from fedsilo.methods.base import payload_bytes
from fedsilo.methods.continual import take
from fedsilo.methods.registry import REGISTRY
from tests.tiny import CPU_TRAIN, resume_mid_run, style_stream, tiny_net, without_timing

NAMES = ["S0", "S1", "S2"]


def _train(**kw) -> TrainParams:
    base = {"rounds": 2, "local_epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.9, "count_flops": False, "device": "cpu"}
    return TrainParams(**{**base, **kw})


def _engine(name: str, train: TrainParams | None = None, tasks=None, names=NAMES, checkpoint=None, observer=None, **params):
    cls = REGISTRY[name]
    train = train or _train()
    method = cls(cls.params_cls(**params), train)
    tasks = tasks if tasks is not None else style_stream(domains=len(names))
    return ContinualEngine(method, tiny_net(1, 4), tasks, list(names), train, 0, checkpoint=checkpoint, config_hash="h", observer=observer)


def _run(name: str, **kw):
    e = _engine(name, **kw)
    h = e.run()
    return e, h, continual_summary(h, e.task_names, e.per_task)


# ---------------------------------------------------------------- the stream
def test_tasks_run_in_order_and_every_task_end_scores_all_tasks_seen():
    e, h, s = _run("fedavg")
    assert [x["task"] for x in h] == [0, 0, 1, 1, 2, 2]
    assert [x["domain"] for x in h] == ["S0", "S0", "S1", "S1", "S2", "S2"]
    ends = [x for x in h if x.get("task_end")]
    assert [sorted(x["task_acc"]) for x in ends] == [["S0"], ["S0", "S1"], ["S0", "S1", "S2"]]
    m = s["accuracy_matrix"]
    assert [len(r) for r in m] == [1, 2, 3]
    assert s["acc_after_task"]["S1"] == pytest.approx((m[1][0] + m[1][1]) / 2)
    assert s["avg_acc"] == pytest.approx(sum(s["acc_after_task"].values()) / 3)
    assert s["forgetting"] == pytest.approx(((max(m[0][0], m[1][0]) - m[2][0]) + (m[1][1] - m[2][1])) / 2)
    # task t's rounds train on task t's data: the clients of a round are that task's
    assert len(s["rounds_to_best"]) == 3 and all(1 <= r <= 2 for r in s["rounds_to_best"])
    # the other reading of the paper's columns: each task right after learning it, the matrix's diagonal
    assert s["acc_on_task"] == {"S0": m[0][0], "S1": m[1][1], "S2": m[2][2]}
    assert s["avg_on_task"] == pytest.approx((m[0][0] + m[1][1] + m[2][2]) / 3)
    # pooled: correct over all clients' test images of a task, per task end; a mean over the tasks seen like the above
    p = s["accuracy_matrix_pooled"]
    assert [len(r) for r in p] == [1, 2, 3] and s["acc_after_task_pooled"]["S2"] == pytest.approx(sum(p[2]) / 3)


def test_pooled_accuracy_weighs_clients_by_their_test_images():
    """A task's accuracy is the mean over clients; pooled, correct over images: two clients with 1 and 99 test images,
    only the first right, give 0.5 and 0.01."""
    import dataclasses

    e = _engine("fedavg", train=_train(rounds=1))
    a, b = e.tasks[0][0], e.tasks[0][1]
    e.tasks[0][0] = dataclasses.replace(a, x_test=a.x_test[:1], y_test=a.y_test[:1])
    e.tasks[0][1] = dataclasses.replace(b, x_test=b.x_test[:1].repeat(99, 1, 1, 1), y_test=b.y_test[:1].repeat(99))
    e.tasks[0] = e.tasks[0][:2]
    e.stores = e.stores[:2]
    e.clients = e.clients[:2]
    right = {e.tasks[0][0].name: True, e.tasks[0][1].name: False}

    def predict_task(model, server, store, c, j, rnd):
        probs = torch.zeros(len(c.y_test), 4)
        wrong = (c.y_test + 1) % 4
        probs[torch.arange(len(c.y_test)), c.y_test if right[c.name] else wrong] = 1.0
        return probs

    e.method.predict_task = predict_task
    out = e.evaluate(1)
    assert out["task_acc"]["S0"] == pytest.approx(0.5) and out["task_acc_pooled"]["S0"] == pytest.approx(0.01)


def test_summary_of_a_task_relearned_at_the_end_forgets_nothing_of_it():
    hist = []
    rows = [{"A": 0.8}, {"A": 0.5, "B": 0.7}, {"A": 0.8, "B": 0.6, "A2": 0.8}]
    for t, row in enumerate(rows):
        hist.append({"round": t + 1, "task": t, "task_end": True, "task_acc": row, "seen_acc": sum(row.values()) / len(row)})
    s = continual_summary(hist, ["A", "B", "A2"], 1)
    # task A came back to its best: no drop on it; B lost 0.1
    assert s["forgetting"] == pytest.approx((0.0 + 0.1) / 2)


def test_a_task_relearned_at_the_end_is_forgotten_by_about_nothing_and_a_repeated_domain_is_refused():
    """FedAvg on S0 -> S1 -> S0 again (its own images; the engine's tasks need not be distinct domains): the first
    task's forgetting is about 0. A split naming a domain twice is refused naming the key (its columns would
    overwrite each other)."""
    from fedsilo.config import DomainIncrementalSplit

    stream = style_stream(domains=2)
    e = _engine("fedavg", train=_train(rounds=3), tasks=[stream[0], stream[1], stream[0]], names=["S0", "S1", "S0 again"])
    h = e.run()
    s = continual_summary(h, e.task_names, e.per_task)
    m = s["accuracy_matrix"]
    relearned = max(m[0][0], m[1][0]) - m[2][0]
    assert relearned <= 0.05, m
    with pytest.raises(ValueError, match="domain 'A' appears twice"):
        DomainIncrementalSplit(protocol="domain_incremental", clients=2, domain_order=("A", "B", "A"))


def test_fedprox_is_fine_tuned_task_after_task_and_its_proximal_term_acts_on_a_stream():
    """pFedDIL's FedProx baseline: FedAvg's stream protocol (one global model, fine-tuned task after task) with the
    proximal term, which changes the updates."""
    e_avg, _, _ = _run("fedavg")
    e1, h1, _ = _run("fedprox", mu=1.0)
    ends = lambda h: [x["task_acc"] for x in h if x.get("task_end")]  # noqa: E731
    assert not all(torch.equal(e1.server[k], e_avg.server[k]) for k in e_avg.server)
    assert [x["task"] for x in h1] == [0, 0, 1, 1, 2, 2] and len(ends(h1)) == 3


def test_a_static_method_is_refused_on_a_stream_naming_the_key():
    cls = REGISTRY["ditto"]
    with pytest.raises(ConfigError, match="methods.ditto: ditto does not learn a stream.*pfeddil"):
        ContinualEngine(cls(cls.params_cls(), _train()), tiny_net(1, 4), style_stream(), NAMES, _train(), 0)
    cls = REGISTRY["fedavg"]
    with pytest.raises(ConfigError, match="methods.fedavg.finetune_epochs"):
        ContinualEngine(cls(cls.params_cls(finetune_epochs=1), _train()), tiny_net(1, 4), style_stream(), NAMES, _train(), 0)


def test_a_run_killed_mid_task_resumes_to_the_same_numbers(tmp_path):
    # task 1's first round done, the second not: killed mid-task
    resumed, full = resume_mid_run(lambda ck: _engine("pfeddil", checkpoint=ck, lam=0.3), tmp_path)
    assert resumed.clients is resumed.tasks[1]
    assert without_timing(resumed.run()) == without_timing(full)


# ---------------------------------------------------------------- baselines
def test_source_only_never_changes_after_the_first_task():
    e = _engine("source_only")
    for _ in range(2):
        e.step()
    after_first = {k: v.clone() for k, v in e.server.items()}
    while e.round < e.total_rounds:
        entry = e.step()
        assert entry["bytes_up_total"] == 0 and entry["bytes_down_total"] == 0
    assert all(torch.equal(after_first[k], e.server[k]) for k in after_first)


def test_disjoint_scores_each_domain_with_its_own_model():
    e, _, _ = _run("disjoint")
    assert sorted({k.split(".")[0] for k in e.server}) == ["task0", "task1", "task2"]
    # every domain's federation starts from the run's initial parameters, not from the previous domain's model
    started = e.method.on_task_start({k: v for k, v in e.server.items() if not k.startswith("task2.")}, e.model, 2)
    init = e.method._init
    assert all(torch.equal(take(started, "task2.")[k], init[k]) for k in init)
    assert not all(torch.equal(take(started, "task1.")[k], init[k]) for k in init)
    store, c1 = e.stores[0], e.tasks[1][0]
    before = {j: e.method.predict_task(e.model, e.server, store, e.tasks[j][0], j, e.round) for j in range(3)}
    for k, v in e.server.items():  # spoil task 1's model only
        if k.startswith("task1.") and v.is_floating_point():
            v.zero_()
    after = {j: e.method.predict_task(e.model, e.server, store, e.tasks[j][0], j, e.round) for j in range(3)}
    assert torch.equal(before[0], after[0]) and torch.equal(before[2], after[2])
    assert not torch.equal(before[1], after[1]) and c1.domain == "S1"


def test_sharing_trains_one_trunk_and_scores_each_domain_with_its_head():
    e, _, _ = _run("multihead")
    heads = sorted({k.split(".")[0] for k in e.server if k.startswith("head")})
    assert heads == ["head0", "head1", "head2"]
    assert not torch.equal(take(e.server, "head0.")["units.2.2.weight"], take(e.server, "head2.")["units.2.2.weight"])
    x = e.tasks[0][0]
    p0 = e.method.predict_task(e.model, e.server, e.stores[0], x, 0, e.round)
    e.model.load_state_dict({**{k: v for k, v in e.server.items() if not k.startswith("head")}, **take(e.server, "head0.")})
    from fedsilo.client.local import predict

    assert torch.allclose(p0, predict(e.model, x.x_test, cfg=CPU_TRAIN).softmax(1))


def test_storage_counts_what_a_client_keeps_to_answer_every_task_seen():
    """Table 6's columns for the baselines: FedAvg keeps one model; Disjoint one per domain (growing task by task);
    Sharing one trunk and a head per domain; FedCIL its classifier plus the real/fake head and generator it replays from."""
    one = payload_bytes(tiny_net(1, 4).state_dict())
    _, h, s = _run("fedavg")
    assert s["models_per_client"] == 1.0 and s["bytes_kept_per_client"] == one
    _, h, s = _run("disjoint")
    ends = [next(iter(x["storage"].values())) for x in h if x.get("task_end")]
    assert [e["models"] for e in ends] == [1, 2, 3] and [e["bytes"] for e in ends] == [one, 2 * one, 3 * one]
    e, h, s = _run("multihead")
    head = sum(payload_bytes({k: v}) for k, v in tiny_net(1, 4).state_dict().items() if k in e.method.head)
    assert s["models_per_client"] == 1.0 and s["bytes_kept_per_client"] == one + 2 * head
    e, _, s = _run("fedcil", md_iter=0, gen_channels=4, noise_dim=4, gen_batch=4)
    assert s["models_per_client"] == 1.0 and s["bytes_kept_per_client"] > payload_bytes(e.method.global_state(e.server))


# ---------------------------------------------------------------- pFedDIL
def test_lambda_zero_keeps_one_model_and_lambda_above_one_a_model_per_task():
    one, _, s1 = _run("pfeddil", lam=0.0)
    assert s1["models_per_client"] == 1.0
    assert all(int(v) == 0 for st in one.stores for v in st["route"])
    many, _, s2 = _run("pfeddil", lam=1.01)
    assert s2["models_per_client"] == 3.0
    assert all(st["route"].tolist() == [0, 1, 2] for st in many.stores)
    # Table 6's storage: bytes kept = models and auxiliary heads, three times one model's
    assert s2["bytes_kept_per_client"] == pytest.approx(3 * s1["bytes_kept_per_client"])


@pytest.mark.parametrize("apart", [{"share_extractor": False}, {}], ids=["aux_apart", "aux_on_shared_features"])
def test_lambda_zero_without_migration_is_fedavg_task_after_task(apart):
    """Table 6: lambda = 0 "degenerates to the normal FedAvg". With one model and no migration, the auxiliary
    classifier apart or on the shared layers' features with their gradient stopped (the default ``aux_gradient:
    head``), each client's model after a task is the federation's (the task-end download), the next task starts from
    it, and the scores are FedAvg's, task by task."""
    dil, h_dil, s_dil = _run("pfeddil", lam=0.0, migration=False, **apart)
    e_avg, h_avg, s_avg = _run("fedavg")
    for a, b in zip(h_dil, h_avg):
        if "task_acc" in b:
            assert a["task_acc"] == pytest.approx(b["task_acc"], abs=1e-6), a["round"]
    assert [x for r in s_dil["accuracy_matrix"] for x in r] == pytest.approx([x for r in s_avg["accuracy_matrix"] for x in r], abs=1e-6)
    if apart:
        return
    # the federation's model is FedAvg's tensor for tensor; with Eq. 8 read literally (the auxiliary loss through the
    # shared layers) it is not
    joint, _, _ = _run("pfeddil", lam=0.0, migration=False, aux_gradient="trunk")
    assert all(torch.equal(take(dil.server, "family0.")[k], e_avg.server[k]) for k in e_avg.server)
    assert not torch.equal(take(joint.server, "family0.")["units.0.0.weight"], e_avg.server["units.0.0.weight"])
    # the task-end download is counted: one model per client at each task's end
    one, names = payload_bytes(e_avg.server), {c.name for c in e_avg.clients}
    ends = [x for x in h_dil if x.get("task_end")]
    assert len(ends) == 3 and all(x["bytes_task_end"] == dict.fromkeys(names, one) for x in ends)
    assert all(x["bytes_down_total"] == sum(x["bytes_down"].values()) + len(names) * one for x in ends)
    # partial participation: every selected client trains from the federation's current model of its family, so
    # the family's model is FedAvg's global model round after round (scores differ only for a client not yet sampled
    # in a task, which holds the models it received last); two of the three clients a round (max(1, floor(C n))), so
    # that every client has taken part in task 0 before task 1: a client with no model yet starts a family of its own
    part = _train(client_fraction=0.67)
    e_dil = _engine("pfeddil", train=part, lam=0.0, migration=False, share_extractor=False)
    e_fa = _engine("fedavg", train=part)
    for _ in range(6):
        e_dil.step()
        e_fa.step()
        assert e_dil.history[-1]["sampled"] == e_fa.history[-1]["sampled"]
        fam = take(e_dil.server, "family0.")
        assert all(torch.equal(fam[k], e_fa.server[k]) for k in e_fa.server), e_dil.round


def test_inside_a_task_a_client_is_scored_with_the_federations_model_of_its_family():
    """Between task ends the client's copy is its last local update; scoring uses the server's model of the family
    it trains (what it would receive), so a client's own update never inflates its score."""
    e = _engine("pfeddil", train=_train(rounds=3), lam=1.01)
    for _ in range(2):
        e.step()
    store, c = e.stores[0], e.tasks[0][0]
    fam = int(store["route"][0])
    assert not torch.equal(take(store, f"slot{fam}.")["units.0.0.weight"], take(e.server, f"family{fam}.")["units.0.0.weight"])
    _, probs = e.method.ensemble(e.model, store, c.x_test, e.server)
    e.model.load_state_dict(take(e.server, f"family{fam}."))
    e.model.eval()
    with torch.no_grad():
        from fedsilo.client.data import to_float

        expect = e.model(to_float(c.x_test, NormalizeParams())).softmax(1)
    assert torch.allclose(probs[0], expect, atol=1e-5)


def test_strategy_reuses_the_best_matching_model_at_or_above_lambda():
    e = _engine("pfeddil", lam=1.01)
    e.run()
    store, c = e.stores[0], e.tasks[2][0]
    rho = e.method.intensities(e.model, store, c)
    assert sorted(rho) == [0, 1, 2] and all(0 <= r <= 1 for r in rho.values())
    # Eq. 2 by hand for model 1: mean of the auxiliary head's largest probability on the task's images
    e.model.load_state_dict(take(store, "slot1."))
    e.method.aux.load_state_dict(take(store, "aux1."))
    from fedsilo.client.data import to_float
    from fedsilo.methods.continual import head_input

    e.model.eval()
    e.method.aux.eval()
    with torch.no_grad(), head_input(e.model) as seen:
        e.model(to_float(c.x_train, NormalizeParams()))
        by_hand = ((e.method.aux(seen.z).softmax(1).amax(1) - 0.25) / 0.75).mean()  # 4 classes: [1/4, 1] -> [0, 1]
    assert rho[1] == pytest.approx(float(by_hand), abs=1e-5)
    # with lambda just below the best intensity, a fresh task-3 decision reuses that model
    best = max(rho, key=rho.get)
    store = {k: v.clone() for k, v in store.items()}
    store["route"] = torch.tensor([0, 1, -1])
    e.method.params = e.method.params.model_copy(update={"lam": rho[best] - 1e-6})
    e.method.task = 2
    said = e.method.announce(e.model, store, c, 99)
    assert said["family"].tolist() == [best] and int(store["route"][2]) == best


def test_strategy_reuses_the_highest_intensity_model_when_it_is_not_the_current_tasks():
    """Eq. 4 reuses the model whose knowledge matching intensity is the *highest*: at task 3's first round a client
    holding models 0 and 1 (none of task 3 yet), with lambda between their two intensities, reuses the better-matching
    one; picking any other would fall below lambda and start a new model (family 2)."""
    e = _engine("pfeddil", train=_train(rounds=1), tasks=style_stream(n_clients=2, domains=3), lam=1.01)
    e.step()
    e.step()  # tasks 1 and 2 done: a model each
    c = e.tasks[2][0]
    store = {k: v.clone() for k, v in e.stores[0].items()}
    assert e.method.slots(store) == [0, 1] and int(store["route"][2]) == -1
    rho = e.method.intensities(e.model, store, c)
    assert sorted(rho) == [0, 1] and abs(rho[0] - rho[1]) > 1e-4, rho
    best = max(rho, key=rho.get)
    e.method.params = e.method.params.model_copy(update={"lam": (rho[0] + rho[1]) / 2})
    e.method.task = 2
    said = e.method.announce(e.model, store, c, 99)
    assert said["family"].tolist() == [best] and int(store["route"][2]) == best, rho


def test_auxiliary_output_spans_zero_to_one_whatever_the_number_of_classes():
    from fedsilo.methods.pfeddil import confidence

    for c in (4, 10, 31):
        out = confidence(torch.stack([torch.zeros(c), torch.full((c,), -30.0).index_fill(0, torch.tensor([1]), 30.0)]))
        assert out[0] == pytest.approx(0.0, abs=1e-6) and out[1] == pytest.approx(1.0, abs=1e-6), c


def test_ensemble_weights_are_normalized_auxiliary_outputs_or_equal_without_correlation():
    e, _, _ = _run("pfeddil", lam=1.01)
    x = e.tasks[0][0].x_test
    w, probs = e.method.ensemble(e.model, e.stores[0], x)
    assert w.shape == (3, len(x)) and (w >= 0).all()
    assert torch.allclose(w.sum(0), torch.ones(len(x)))
    assert not torch.allclose(w, torch.full_like(w, 1 / 3))
    pred = e.method.predict_task(e.model, e.server, e.stores[0], e.tasks[0][0], 0, e.round)
    assert torch.allclose(pred, (w[:, :, None] * probs).sum(0))  # Eq. 7: the weighted soft predictions
    e.method.params = e.method.params.model_copy(update={"correlation": False})
    assert torch.allclose(e.method.ensemble(e.model, e.stores[0], x)[0], torch.full_like(w, 1 / 3))
    assert torch.allclose(e.method.predict_task(e.model, e.server, e.stores[0], e.tasks[0][0], 0, e.round), probs.mean(0))


def test_migration_loss_is_eq5_and_absent_without_migration():
    e, _, _ = _run("pfeddil", lam=1.01)
    store = e.stores[0]
    e.method.task = 2
    store["rho"][2, 0], store["rho"][2, 1] = 0.6, 0.3
    e.model.load_state_dict(take(store, "slot2."))
    loss = e.method._migration(e.model, store, family=2)
    expected = 0.0
    live = dict(e.model.named_parameters())
    for j, rho in ((0, 0.6), (1, 0.3)):
        old = take(store, f"slot{j}.")
        expected += rho * sum(float((live[n].detach() - old[n]).pow(2).sum()) for n in e.method.weights)
    assert float(loss(e.model).detach()) == pytest.approx(expected, rel=1e-5)
    e.method.params = e.method.params.model_copy(update={"migration": False})
    assert e.method._migration(e.model, store, family=2) is None
    # and it is what training minimizes: the models of later tasks differ with it off
    off, _, _ = _run("pfeddil", lam=1.01, migration=False)
    on, _, _ = _run("pfeddil", lam=1.01)
    assert torch.equal(take(off.stores[0], "slot0.")["units.0.0.weight"], take(on.stores[0], "slot0.")["units.0.0.weight"])
    assert not torch.equal(take(off.stores[0], "slot1.")["units.0.0.weight"], take(on.stores[0], "slot1.")["units.0.0.weight"])


def test_migration_loss_leaves_out_the_familys_own_model():
    """Eq. 5 sums over the client's *other* models: the family being trained adds no pull to its own stored copy,
    even where its intensity is set and the live weights have moved away from that copy."""
    e, _, _ = _run("pfeddil", train=_train(rounds=1), lam=1.01)
    store = e.stores[0]
    e.method.task = 2
    store["rho"][2, 0], store["rho"][2, 1], store["rho"][2, 2] = 0.6, 0.3, 0.5
    e.model.load_state_dict(take(store, "slot2."))
    with torch.no_grad():
        for n in e.method.weights:
            dict(e.model.named_parameters())[n].add_(0.1)
    loss = e.method._migration(e.model, store, family=2)
    live = dict(e.model.named_parameters())
    expected = 0.0
    for j, rho in ((0, 0.6), (1, 0.3)):
        old = take(store, f"slot{j}.")
        expected += rho * sum(float((live[n].detach() - old[n]).pow(2).sum()) for n in e.method.weights)
    assert float(loss(e.model).detach()) == pytest.approx(expected, rel=1e-5)


def test_strategy_is_decided_once_per_task_not_every_round(monkeypatch):
    """Eq. 4's reuse-or-new decision (the intensities) runs at a task's first round only: with three rounds a task,
    each client computes them once per task."""
    from fedsilo.methods.pfeddil import PFedDIL

    calls = []
    real = PFedDIL.intensities

    def spy(self, model, store, client):
        calls.append((self.task, client.name))
        return real(self, model, store, client)

    monkeypatch.setattr(PFedDIL, "intensities", spy)
    e = _engine("pfeddil", train=_train(rounds=3), lam=1.01)
    e.run()
    n_clients = len(e.tasks[0])
    assert len(calls) == n_clients * len(e.tasks)
    assert sorted(set(calls)) == sorted({(t, c.name) for t in range(len(e.tasks)) for c in e.tasks[t]})


def test_sharing_starts_each_new_tasks_head_from_the_initial_head():
    """multihead: a new task's head is the initial head, not a copy of the previous task's trained head."""
    downs: dict = {}
    e = _engine("multihead", train=_train(rounds=1),
                observer=lambda r, c, d, p: downs.setdefault(r, p) if d == "down" else None)
    e.step()
    head0 = take(e.server, "head0.")
    e.step()  # task 1's first round: its download carries head1 as the task started
    init = e.method._init
    assert head0 and all(torch.equal(downs[2][k], init[k]) for k in head0), "head1 starts at the initial head"
    assert not all(torch.equal(head0[k], init[k]) for k in head0), "task 0 must have trained its head"


def test_without_sharing_the_auxiliary_classifier_is_a_network_of_its_own():
    shared = _engine("pfeddil")
    apart = _engine("pfeddil", share_extractor=False)
    head = sum(p.numel() for p in shared.model.units[-1].parameters())
    assert shared.method.resolved()["aux_params"] == head
    assert apart.method.resolved()["aux_params"] == sum(p.numel() for p in apart.model.parameters())
    _, _, s = _run("pfeddil", share_extractor=False, lam=1.01)
    assert s["models_per_client"] == 3.0


def test_pfeddil_uploads_only_the_trained_model_and_bytes_are_the_tensors_moved():
    moved: dict[str, int] = {}

    def observer(rnd, name, way, payload):
        assert way == "down" or set(payload) <= set(keys) | {"family"}
        moved[way] = moved.get(way, 0) + payload_bytes(payload)

    e = _engine("pfeddil", observer=observer, lam=0.5)
    keys = set(e.model.state_dict())
    hist = e.run()
    assert moved["up"] == sum(h["bytes_up_total"] for h in hist)
    assert moved["down"] == sum(h["bytes_down_total"] for h in hist)
    assert all(v == 8 for h in hist for v in h["bytes_announce"].values())  # one int64: the family it trains
    assert not any(k.startswith(("slot", "aux", "route", "rho")) for k in e.server)
    # which family each site trains in (the server's who.<index>) is not sent to any site to be evaluated
    assert any(k.startswith("who.") for k in e.server)
    assert not any(k.startswith("who.") for c in e.clients for k in e.method.eval_download(e.server, c))
    assert math.isfinite(continual_summary(hist, NAMES, 2)["avg_acc"])


# ---------------------------------------------------------------- the train stage and the report
def test_train_stage_runs_a_hospital_stream_and_the_report_prints_the_papers_table(mirror_root, tmp_path, capsys):
    """CheXpert -> OpenI -> RSNA -> VinBigData as a stream through `fedsilo split` / `train` / `report`: metrics.json
    holds the accuracy matrix, MLflow gets the per-task accuracies (a static method's refusal, naming its key, is
    test_a_static_method_is_refused_on_a_stream_naming_the_key's)."""
    import shutil

    import yaml

    from fedsilo.utils.io import read_json
    from tests.conftest import small_params

    root = tmp_path / "p"
    (root / "data").mkdir(parents=True)
    shutil.copytree(mirror_root / "data" / "harmonized", root / "data" / "harmonized")
    raw = small_params(rounds=1, local_epochs=1)
    raw["experiments"] = {"stream": {"dataset": "chest_xray4", "split": {"protocol": "domain_incremental", "clients": 3, "alpha": 1.0,
                                                                      "domain_order": ["CheXpert", "OpenI", "RSNA", "VinBigData"]},
                                     "train": {**raw["experiments"]["quick"]["train"], "client_fraction": 0.67}}}
    raw["methods"] = {"pfeddil": {"lam": 0.5}, "disjoint": {}}
    raw["pipeline"].update({"splits": {"stream": "chest_xray4"}, "experiments": ["stream"], "methods": ["pfeddil", "disjoint"]})
    raw["tracking"] = {"enabled": True, "uri": f"sqlite:///{root / 'mlflow.db'}"}
    (root / "params.yaml").write_text(yaml.safe_dump(raw))

    def cli(*args):  # in this process, as `fedsilo` runs them (a process each costs seconds of imports on two cores)
        from fedsilo.cli import main

        return main(["-q", "--root", str(root), "--params", str(root / "params.yaml"), *args])

    assert cli("split", "--experiment", "stream") == 0
    for m in ("pfeddil", "disjoint"):
        assert cli("train", "--experiment", "stream", "--method", m, "--seed", "0") == 0
    met = read_json(root / "results" / "stream" / "pfeddil" / "seed0" / "metrics.json")
    # what the command says at the end: the paper's Avg first; each round's progress line names its task
    assert f"stream pfeddil seed 0: Avg {met['avg_acc']:.3f} (accuracy after each task, averaged)" in capsys.readouterr().out
    from fedsilo.fl.run import round_summary

    history = read_json(root / "results" / "stream" / "pfeddil" / "seed0" / "history.json")
    assert round_summary(history[0]).startswith("task 1 (CheXpert), its last round, loss ")  # one round a task here
    assert f"acc on the tasks seen {history[1]['seen_acc']:.3f}" in round_summary(history[1])
    assert met["tasks"] == ["CheXpert", "OpenI", "RSNA", "VinBigData"] and [len(r) for r in met["accuracy_matrix"]] == [1, 2, 3, 4]
    assert met["mean_acc"] == met["final_acc"] and met["forgetting"] is not None and met["models_per_client"] >= 1
    assert cli("report", "--experiment", "stream") == 0
    table = (root / "results" / "report" / "stream" / "stream_stream.md").read_text()
    assert "CheXpert | OpenI | RSNA | VinBigData | Avg | Delta | forgetting" in table and "| disjoint |" in table
    runs = (root / "results" / "report" / "stream" / "stream_runs.md").read_text()  # each row's MLflow run, its hashes
    assert f"| pfeddil | 0 | `{met['mlflow_run_id']}` | `{met['params_hash'][:12]}` |" in runs
    readme = (root / "results" / "report" / "stream" / "README.md").read_text()
    assert runs in readme
    # trained on the offline mirrors (the data card's record, in each run's metrics.json): the report says so first
    assert met["data_sources"]["chexpert"]["mode"] == "mirror"
    assert "> **Data: offline mirrors** (chexpert: offline mirror (seed " in readme.split("|")[0]
    # every client learns each domain in turn; the images behind each task's column, from that task's test splits
    assert met["client_domains"] == {c: met["tasks"] for c in met["clients"]} and "test_sizes" not in met
    sizes = met["test_sizes_by_task"]
    assert list(sizes) == met["tasks"] and all(set(by) == set(met["clients"]) for by in sizes.values())
    assert sizes["OpenI"] != sizes["CheXpert"]  # each task's own (it held task 0's for every task)
    n = sum(sizes["OpenI"].values())
    assert f"OpenI {n} (±{100 * (0.25 / n) ** 0.5:.1f})" in table
    on = (root / "results" / "report" / "stream" / "stream_on_task.md").read_text()
    assert "CheXpert | OpenI | RSNA | VinBigData | Avg on task | Avg pooled" in on and "| pfeddil |" in on
    assert f"{100 * met['avg_on_task']:.2f}" in on and f"{100 * met['avg_acc_pooled']:.2f}" in on
    # an edit the run was not retrained for: the report refuses it (its numbers would stand under the edited row),
    # naming what differs and the stage that retrains it; the report it made before stays
    assert met["run"]["method"]["lam"] == 0.5
    raw["methods"]["pfeddil"]["lam"] = 0.6
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    assert cli("report", "--experiment", "stream") == 2
    err = capsys.readouterr().err
    assert ("1 run(s) trained with other params than the file sets now (stream/pfeddil/seed0: method.lam: 0.5 in the run, "
            "0.6 now); retrain them: dvc repro train@stream-pfeddil-0") in err
    assert (root / "results" / "report" / "stream" / "stream_stream.md").read_text() == table
    raw["methods"]["pfeddil"]["lam"] = 0.5
    raw["methods"]["fedavg"] = {}  # defined, trained by no stage of this pipeline
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    # a chosen set of methods, apart from the report stage's outputs; a method the pipeline does not train is
    # trained by hand first, as the refusal says
    assert cli("report", "--experiment", "stream", "--methods", "disjoint") == 0
    chosen = (root / "results" / "selected" / "stream" / "stream_stream.md").read_text()
    assert "| disjoint |" in chosen and "| pfeddil |" not in chosen
    assert (root / "results" / "report" / "stream" / "stream_stream.md").read_text() == table
    capsys.readouterr()
    assert cli("report", "--experiment", "stream", "--methods", "fedavg,disjoint") == 2
    assert (f"--methods: 1 run(s) not trained yet (stream/fedavg/seed0); train them: fedsilo --params {root / 'params.yaml'} "
            "train --experiment stream --method fedavg --seed 0") in capsys.readouterr().err
    assert cli("report", "--experiment", "stream", "--methods", "fedavgg") == 2
    assert "methods.fedavgg: not defined (did you mean 'fedavg'?)" in capsys.readouterr().err
    # an experiment the pipeline does not train (no stage to name): the commands that train its runs by hand, and the
    # report of the methods trained so far
    off = {**raw, "pipeline": {**raw["pipeline"], "experiments": [], "splits": {}, "methods": ["pfeddil", "disjoint", "fedavg"]}}
    (root / "params.yaml").write_text(yaml.safe_dump(off))
    assert cli("report", "--experiment", "stream") == 2
    err = capsys.readouterr().err
    assert (f"1 run(s) not trained yet (stream/fedavg/seed0); train them: fedsilo --params {root / 'params.yaml'} train --experiment "
            f"stream --method fedavg --seed 0 (or report the methods trained for every seed: fedsilo --params {root / 'params.yaml'} "
            "report --experiment stream --methods pfeddil,disjoint)") in err, err
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    # beside a published table: a row the paper ran at another lambda is named; a table of another task order is
    # not set beside ours (each column is the accuracy over the tasks seen so far: another order, another quantity)
    order = ["CheXpert", "OpenI", "RSNA", "VinBigData"]
    (root / "published.yaml").write_text(yaml.safe_dump({"accuracy": {
        "same": {"source": "a table", "selection": "task_end", "domains": order,
                 "methods": {"pfeddil": {"mean": [50, 50, 50, 50, 50], "params": {"lam": 0.8}}}},
        "other": {"source": "a table", "selection": "task_end", "domains": order[::-1],
                  "methods": {"pfeddil": {"mean": [50, 50, 50, 50, 50]}}}}}))
    for table in ("same", "other"):
        raw["experiments"]["stream"]["published"] = f"published.yaml#{table}"
        (root / "params.yaml").write_text(yaml.safe_dump(raw))
        assert cli("report", "--experiment", "stream") == 0
    vs = (root / "results" / "report" / "stream" / "stream_vs_paper.md").read_text()
    assert "**Not the paper's task order**: ours CheXpert → OpenI → RSNA → VinBigData, the paper's VinBigData → RSNA" in vs
    assert "| pfeddil |" not in vs and not (root / "results" / "report" / "stream" / "stream_vs_paper.csv").exists()
    raw["experiments"]["stream"]["published"] = "published.yaml#same"
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    assert cli("report", "--experiment", "stream") == 0
    vs = (root / "results" / "report" / "stream" / "stream_vs_paper.md").read_text()
    assert "**Not the paper's setting**: pfeddil ran with lam 0.5 (the paper's row: 0.8)" in vs and "| pfeddil |" in vs
    del raw["experiments"]["stream"]["published"]
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    import mlflow

    client = mlflow.tracking.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("stream").experiment_id], "tags.method = 'pfeddil'")[0]
    assert {"final.avg_acc", "final.acc_after.VinBigData", "final.acc_on.RSNA", "final.avg_on_task", "task_acc.CheXpert",
            "final.final_acc", "final.rounds_to_best_total", "final.models_per_client", "final.bytes_kept_per_client"} <= set(run.data.metrics)
    assert run.data.metrics["final.models_per_client"] == met["models_per_client"]


def test_the_stream_tables_delta_is_the_references_avg_minus_the_rows_and_its_std_the_sample_std():
    """pFedDIL's last column: the reference row's Avg minus this row's, seed by seed; then mean and sample std
    (ddof = 1) over the seeds, as every other column."""
    from fedsilo.report.continual import stream_table

    def met(a, b):
        return {"tasks": ["S0", "S1"], "acc_after_task": {"S0": a, "S1": b}, "avg_acc": (a + b) / 2, "forgetting": 0.1, "final_acc": b}

    metrics = {("pfeddil", 0): met(0.8, 0.6), ("pfeddil", 1): met(0.9, 0.7), ("fedavg", 0): met(0.6, 0.4), ("fedavg", 1): met(0.5, 0.5)}
    tab = stream_table(metrics, ["pfeddil", "fedavg"], [0, 1], reference="pfeddil")
    assert tab["mean"].loc["fedavg", "Delta"] == pytest.approx((20.0 + 30.0) / 2)
    assert tab["mean"].loc["pfeddil", "Delta"] == pytest.approx(0.0)
    assert tab["std"].loc["pfeddil", "S0"] == pytest.approx(math.sqrt(50.0))  # 80 and 90: ddof = 1 (ddof = 0 gives 5)


def test_a_stream_only_method_is_refused_on_static_clients():
    from fedsilo.fl.engine import Engine
    from tests.tiny import style_shifted_federation

    for name in ("pfeddil", "source_only", "disjoint", "multihead", "dann", "fedcil"):
        cls = REGISTRY[name]
        with pytest.raises(ConfigError, match=f"methods.{name}: {name} learns a stream of domain tasks only"):
            Engine(cls(cls.params_cls(), _train()), tiny_net(1, 4), style_shifted_federation(), _train(), 0)


def test_a_stream_split_names_its_clients_one_name_each():
    """`names` gives a stream's clients their names (a deployment site's one-client stream carries its hospital's)."""
    from fedsilo.config import DomainIncrementalSplit

    assert DomainIncrementalSplit(protocol="domain_incremental", clients=1, names=("Hospital A",)).names == ("Hospital A",)
    for names, why in (((("A", "B"),), "2 names for 1 clients"), ((("A", "A"),), "each client needs a name of its own"),
                       ((("A", " "),), "each client needs a name of its own")):
        with pytest.raises(ValueError, match=why):
            DomainIncrementalSplit(protocol="domain_incremental", clients=1 if why.startswith("2") else 2, names=names[0])


@pytest.mark.parametrize("name, after", [("pfeddil", 2), ("fedavg", 3), ("disjoint", 4)])
def test_a_site_that_left_the_stream_is_not_scored_sent_a_task_end_or_counted_from_the_round_after(name, after):
    """A site that left after round ``after`` (at task 0's end, inside task 1, at task 1's end): from the next round
    it is in no evaluation, task end or storage count; it was in those up to then. The summary's matrix averages the
    sites of each evaluation, and beside it the same matrix and forgetting over the sites in at the end."""
    cls = REGISTRY[name]
    train = _train()
    e = ContinualEngine(cls(cls.params_cls(), train), tiny_net(1, 4), style_stream(n_train=24, n_test=12, domains=3), list(NAMES),
                        train, 0, left={"C2": after})
    h = e.run()
    gone = [x for x in h if x["round"] > after]
    assert all("C2" not in x["eval"] and x["left"] == ["C2"] for x in gone)
    assert all("C2" not in x.get("bytes_task_end", {}) and "C2" not in x.get("storage", {}) for x in gone)
    assert all("C2" in x["eval"] for x in h if x["round"] <= after)
    if after % 2 == 0:  # it left at a task's end: that end's evaluation and storage still hold it
        assert "C2" in h[after - 1]["storage"] and "C2" in h[after - 1]["task_acc_by_client"]["S0"]
    s = continual_summary(h, e.task_names, e.per_task)
    assert s["sites_at_end"] == ["C0", "C1"]
    ends = [x for x in h if x.get("task_end")]
    for t, row in enumerate(s["accuracy_matrix_sites_at_end"]):
        for j, acc in enumerate(row):
            mine = ends[t]["task_acc_by_client"][NAMES[j]]
            assert acc == pytest.approx((mine["C0"] + mine["C1"]) / 2)
    assert s["forgetting_sites_at_end"] is not None and math.isfinite(s["forgetting"])


def test_a_streams_evaluation_weighs_pooled_by_images_and_its_seen_accuracy_is_the_mean_over_tasks():
    """stream_eval: a task's accuracy is the mean over its scored clients, pooled correct over images; the accuracy
    over the tasks seen is the mean over tasks (not over the clients' own means: a client may hold no test image of
    a task); the std over the clients' means is the population std, as a static run's."""
    from fedsilo.fl.continual import stream_eval

    scores = [[("a", 0.5, 2), ("b", 1.0, 6)], [("a", None, 0), ("b", 0.2, 4)]]
    out = stream_eval(["a", "b"], ["S0", "S1"], scores)
    assert out["task_acc"] == {"S0": pytest.approx(0.75), "S1": pytest.approx(0.2)}
    assert out["task_acc_pooled"] == {"S0": pytest.approx((1 + 6) / 8), "S1": pytest.approx(0.2)}
    assert out["seen_acc"] == out["mean_acc"] == pytest.approx((0.75 + 0.2) / 2)
    assert out["eval"] == {"a": {"acc": 0.5}, "b": {"acc": pytest.approx(0.6)}}
    assert out["std_acc"] == pytest.approx(0.05)
    assert out["task_acc_by_client"] == {"S0": {"a": 0.5, "b": 1.0}, "S1": {"b": 0.2}}


def test_every_tasks_last_round_is_evaluated_whatever_eval_every():
    e, h, s = _run("fedavg", train=_train(eval_every=3))
    assert [x["round"] for x in h if "seen_acc" in x] == [2, 3, 4, 6]  # the ends of the tasks, and round 3
    assert [len(r) for r in s["accuracy_matrix"]] == [1, 2, 3]


@pytest.mark.parametrize("per_task", [1, 3])
def test_a_task_starts_at_its_first_round_and_ends_at_its_last_whatever_the_rounds_per_task(per_task):
    """on_task_start at rounds 1, 1 + R, 1 + 2R; the task-end downloads, storage and evaluation at R, 2R, 3R only."""
    e = _engine("fedavg", train=_train(rounds=per_task, eval_every=10))
    started, sent = [], []
    on_start, end_down = e.method.on_task_start, e.method.task_end_download
    e.method.on_task_start = lambda server, model, task: started.append((e.round + 1, task)) or on_start(server, model, task)
    e.method.task_end_download = lambda server, c: sent.append(e.round + 1) or end_down(server, c)
    h = e.run()
    assert started == [(1 + t * per_task, t) for t in range(3)]
    assert sorted(set(sent)) == [per_task, 2 * per_task, 3 * per_task]  # (the engine's round counts the rounds finished)
    assert [x["round"] for x in h if x.get("task_end")] == [x["round"] for x in h if "storage" in x] == [per_task * (t + 1) for t in range(3)]
    assert [x["round"] for x in h if "seen_acc" in x] == [per_task * (t + 1) for t in range(3)]
    assert [x["task"] for x in h] == [t for t in range(3) for _ in range(per_task)]


def test_forgetting_is_negative_where_the_last_task_left_a_task_better_known_and_none_before_the_streams_end():
    hist = []
    rows = [{"A": 0.5}, {"A": 0.4, "B": 0.7}, {"A": 0.9, "B": 0.7, "C": 0.5}]
    for t, row in enumerate(rows):
        hist.append({"round": t + 1, "task": t, "task_end": True, "task_acc": row, "seen_acc": sum(row.values()) / len(row)})
    assert continual_summary(hist, ["A", "B", "C"], 1)["forgetting"] == pytest.approx((0.5 - 0.9 + 0.0) / 2)
    hist[2]["task_acc"]["B"] = float("nan")  # no client holds B's test images at the end: B is left out, not NaN
    assert continual_summary(hist, ["A", "B", "C"], 1)["forgetting"] == pytest.approx(0.5 - 0.9)
    mid = continual_summary(hist[:2], ["A", "B", "C"], 1)  # a run two tasks in: nothing to say of forgetting yet
    assert mid["forgetting"] is None and mid["accuracy_matrix"] == [[0.5], [0.4, 0.7]]


def test_rounds_to_the_best_accuracy_take_the_first_of_equal_rounds_counted_inside_the_task():
    hist = [{"round": r, "task": (r - 1) // 3, "seen_acc": a, "task_acc": {"A": a, "B": a}, **({"task_end": True} if r % 3 == 0 else {})}
            for r, a in zip(range(1, 7), (0.4, 0.6, 0.6, 0.7, 0.5, 0.7))]
    assert continual_summary(hist, ["A", "B"], 3)["rounds_to_best"] == [2, 1]
