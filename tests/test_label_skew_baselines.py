"""The personalized baselines of FedeCouple and CD2-pFed (issue 14): each one's distinguishing mechanism."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsilo.config import NormalizeParams, TrainParams
from fedsilo.fl.engine import Engine
from fedsilo.methods import method_class
from tests.tiny import style_shifted_federation, tiny_net

HEAD = "units.2."  # tiny_net: conv1 (units.0), conv2 (units.1), fc (units.2)


@pytest.fixture(scope="module")
def clients():
    return style_shifted_federation(n_train=24, n_test=12, per_domain=1)


def _engine(name, clients, rounds=2, observer=None, local_epochs=1, client_fraction=1.0, **params):
    tp = TrainParams(rounds=rounds, batch_size=8, lr=0.05, momentum=0.5, local_epochs=local_epochs, device="cpu", count_flops=False,
                     client_fraction=client_fraction)
    cls = method_class(name)
    return Engine(cls(cls.params_cls(**params), tp), tiny_net(1, 4), clients, tp, seed=0, observer=observer)


def test_fedrep_trains_the_head_with_the_body_fixed_then_the_body_with_the_head_fixed(clients, monkeypatch):
    import fedsilo.methods.fedrep as fedrep

    calls = []
    real = fedrep.train_local

    def spy(model, data, cfg, gen, epochs=None, **kw):
        before = {k: v.clone() for k, v in model.state_dict().items() if "running" not in k and "num_batches" not in k}
        out = real(model, data, cfg, gen, epochs=epochs, **kw)
        after = model.state_dict()
        calls.append((epochs, {k for k, v in before.items() if not torch.equal(v, after[k])}))
        return out

    monkeypatch.setattr(fedrep, "train_local", spy)
    seen = []
    e = _engine("fedrep", clients, rounds=1, head_epochs=3, body_epochs=2, observer=lambda r, c, d, p: seen.append((d, set(p))))
    e.run()
    assert len(calls) == 2 * len(clients)
    for (ep_head, changed_head), (ep_body, changed_body) in zip(calls[::2], calls[1::2]):
        assert ep_head == 3 and changed_head and all(k.startswith(HEAD) for k in changed_head), changed_head
        assert ep_body == 2 and changed_body and not any(k.startswith(HEAD) for k in changed_body), changed_body
    ups = [keys for d, keys in seen if d == "up"]
    assert ups and all(not any(k.startswith(HEAD) for k in keys) for keys in ups), "the head never leaves the client"
    heads = [s[HEAD + "2.weight"] for s in e.stores]
    assert not torch.equal(heads[0], heads[1]), "each client keeps its own head"


@pytest.mark.parametrize("name", ["fedrep", "fedbabu", "lgfedavg"])
def test_the_server_mean_weighs_each_upload_as_client_weights_says(clients, name):
    """FedRep's paper and code average the sampled clients' representations alike, FedBABU's paper by sample count
    and its code alike, LG-FedAvg's FedPAC's code by sample count and its own code alike: ``client_weights`` picks."""
    import dataclasses

    small = [dataclasses.replace(clients[0], x_train=clients[0].x_train[:6], y_train=clients[0].y_train[:6]), *clients[1:]]
    for weights in ("uniform", "samples"):
        ups = []
        cheap = {"fedrep": {"head_epochs": 1}, "fedbabu": {"finetune_epochs": 0}, "lgfedavg": {}}[name]
        e = _engine(name, small, rounds=1, client_weights=weights, observer=lambda r, c, d, p, ups=ups: ups.append(p) if d == "up" else None,
                    **cheap)
        e.step()
        n = [float(c.n_train) if weights == "samples" else 1.0 for c in small]
        for k in ups[0]:
            if ups[0][k].is_floating_point():
                want = sum(w * u[k].double() for w, u in zip(n, ups)) / sum(n)
                assert torch.allclose(e.server[k].double(), want, atol=1e-6), (weights, k)
    assert method_class(name).params_cls().client_weights == ("uniform" if name == "fedrep" else "samples")


def test_fedrep_alternation_is_not_fedpers_joint_training(clients):
    """The same split and budget trained jointly (FedPer) moves the body differently: the schedule is the method."""
    rep = _engine("fedrep", clients, rounds=1, head_epochs=1, body_epochs=1)
    rep.run()
    per = _engine("fedper", clients, rounds=1, local_epochs=2)
    per.run()
    assert set(rep.server) == set(per.server)
    assert not torch.equal(rep.server["units.0.0.weight"], per.server["units.0.0.weight"])


def test_lgfedavg_shares_the_top_layers_and_keeps_each_clients_lower_layers(clients):
    ups: list[tuple[int, dict]] = []
    e = _engine("lgfedavg", clients, rounds=1, global_layers=2,
                observer=lambda r, c, d, p: ups.append((c, p)) if d == "up" else None)
    e.run()
    for _, p in ups:
        assert p and all(k.startswith(("units.1.", HEAD)) for k in p), "only conv2 and fc (the top two layers) travel"
    lower = [s["units.0.0.weight"] for s in e.stores]
    assert not torch.equal(lower[0], lower[1]), "each client's local representation is its own"
    sizes = {c.name: c.n_train for c in clients}
    total = sum(sizes.values())
    mean = sum(sizes[c] / total * p["units.1.0.weight"].double() for c, p in ups)
    assert torch.allclose(e.server["units.1.0.weight"].double(), mean, atol=1e-6)
    # every client is evaluated with its own lower layers under the one global top
    st = e.method.eval_state(e.server, e.stores[1], clients[1])
    assert torch.equal(st["units.0.0.weight"], e.stores[1]["units.0.0.weight"]) and torch.equal(st[HEAD + "2.weight"], e.server[HEAD + "2.weight"])
    with pytest.raises(ValueError, match="methods.lgfedavg.global_layers"):
        _engine("lgfedavg", clients, rounds=1, global_layers=3).run()


LOWER = "units.0."  # tiny_net's conv1: LG-FedAvg's local layer with global_layers 2


def test_lgfedavg_starts_from_the_fedavg_model_then_keeps_the_lower_layers(clients):
    """fedavg_rounds: R0 = 2 of 4: rounds 1-2 are FedAvg bit for bit (every layer travels both ways); a client's first
    download after R0 carries the FedAvg model's lower layers once, later ones the top only; from R0 + 1 no upload
    holds a lower layer."""
    seen: list[tuple[int, str, str, dict]] = []
    e = _engine("lgfedavg", clients, rounds=4, global_layers=2, fedavg_rounds=2,
                observer=lambda r, c, d, p: seen.append((r, c, d, p)))
    h = e.run()
    fa = _engine("fedavg", clients, rounds=2)
    hf = fa.run()
    keys = set(tiny_net(1, 4).state_dict())
    for r, c, d, p in seen:
        lower = {k for k in p if k.startswith(LOWER)}
        if r <= 2:
            assert set(p) == keys, (r, c, d, "FedAvg rounds move every layer")
        elif d == "up" or r == 4:
            assert not lower, (r, c, d, "after R0 the lower layers stay on the client")
        else:  # round 3: the start, once
            assert lower and all(torch.equal(p[k], fa.server[k]) for k in lower), "the FedAvg model of round R0"
    assert [x["eval"] for x in h[:2]] == [x["eval"] for x in hf], "rounds 1..R0 are FedAvg's, evaluation included"
    assert h[2]["bytes_down_total"] > h[3]["bytes_down_total"], "the start's bytes are counted, once"
    assert not torch.equal(e.stores[0][LOWER + "0.weight"], e.stores[1][LOWER + "0.weight"]), "then each its own"
    # a client that has not been sampled since R0 is evaluated with the start's lower layers under the current top,
    # and only such a client is sent them for evaluation
    server = dict(e.server)
    del server[f"lgfedavg:started::{clients[1].name}"]  # the server's record, per site, that it took the start
    st = e.method.eval_state(server, e.stores[1], clients[1])
    assert torch.equal(st[LOWER + "0.weight"], fa.server[LOWER + "0.weight"])
    assert torch.equal(st[HEAD + "2.weight"], e.server[HEAD + "2.weight"])
    assert any(k.startswith(LOWER) for k in e.method.eval_download(server, clients[1]))
    assert not any(k.startswith(LOWER) for k in e.method.eval_download(server, clients[0]))
    sent = e.method.eval_download(server, clients[1])
    assert torch.equal(e.method.eval_state(sent, e.stores[1], clients[1])[LOWER + "0.weight"], fa.server[LOWER + "0.weight"])


def test_lgfedavg_lower_layers_may_travel_in_the_fedavg_rounds_only(clients):
    from fedsilo.config import ConfigError
    from fedsilo.fl.engine import PrivacyViolation

    e = _engine("lgfedavg", clients, rounds=3, global_layers=2, fedavg_rounds=2)
    real = e.method.local_update

    def leaky(model, store, payload, client, rnd, seed):
        return {**real(model, store, payload, client, rnd, seed), LOWER + "0.weight": model.state_dict()[LOWER + "0.weight"]}

    e.method.local_update = leaky
    e.step()
    e.step()  # rounds 1-2: FedAvg, the lower layers are meant to travel
    with pytest.raises(PrivacyViolation, match=LOWER):
        e.step()
    with pytest.raises(ConfigError, match="methods.lgfedavg.fedavg_rounds"):
        _engine("lgfedavg", clients, rounds=2, fedavg_rounds=2)


def test_lgfedavg_resumed_across_the_fedavg_start_ends_with_the_same_numbers(clients, tmp_path):
    from tests.tiny import resume_mid_run, without_timing

    def make(ckpt):
        tp = TrainParams(rounds=4, batch_size=8, lr=0.05, momentum=0.5, local_epochs=1, device="cpu", count_flops=False, client_fraction=0.5)
        cls = method_class("lgfedavg")
        return Engine(cls(cls.params_cls(fedavg_rounds=2), tp), tiny_net(1, 4), clients, tp, seed=0, checkpoint=ckpt)

    resumed, full = resume_mid_run(make, tmp_path, rounds=3)
    assert without_timing(resumed.run()) == without_timing(full)


def test_fedbabu_never_trains_the_head_and_fine_tunes_only_to_evaluate(clients):
    ups = []
    e = _engine("fedbabu", clients, rounds=2, finetune_epochs=2, observer=lambda r, c, d, p: ups.append(set(p)) if d == "up" else None)
    init_head = {k: v.clone() for k, v in tiny_net(1, 4).state_dict().items() if k.startswith(HEAD)}
    h = e.run()
    assert ups and all(not any(k.startswith(HEAD) for k in keys) for keys in ups), "the head never travels"
    for s in e.stores:  # the head stays at the initialisation, the same on every client
        assert all(torch.equal(s[k], v) for k, v in init_head.items())
    # evaluation fine-tunes a copy: it changes neither the server nor the stores, and it is what is reported
    server = {k: v.clone() for k, v in e.server.items()}
    again = e.evaluate(2)
    assert all(torch.equal(server[k], e.server[k]) for k in server)
    assert again["eval"] == h[-1]["eval"], "fine-tuning is seeded by (seed, round, client)"
    plain = _engine("fedbabu", clients, rounds=2, finetune_epochs=0)
    hp = plain.run()
    assert hp[-1]["global"] == h[-1]["global"], "the same federated training"
    assert hp[-1]["eval"] != h[-1]["eval"], "the fine-tuning is what personalizes"
    assert {c: v["acc"] for c, v in hp[-1]["eval"].items()} == hp[-1]["global"], "without it every client has the global model"


def test_fedbabu_local_update_leaves_the_head_at_its_init_and_fine_tuning_trains_everything(clients, monkeypatch):
    import fedsilo.methods.fedbabu as babu

    calls: list[tuple[int | None, bool, bool]] = []  # (epochs, every parameter given, head unchanged)
    real = babu.train_local

    def spy(model, client, cfg, gen, epochs=None, params=None, **kw):
        head = {k: v.clone() for k, v in model.state_dict().items() if k.startswith(HEAD)}
        out = real(model, client, cfg, gen, epochs=epochs, params=params, **kw)
        same = all(torch.equal(v, model.state_dict()[k]) for k, v in head.items())
        calls.append((epochs, params is None, same))
        return out

    monkeypatch.setattr(babu, "train_local", spy)
    e = _engine("fedbabu", clients, rounds=1, finetune_epochs=3)
    e.run()
    local = [c for c in calls if not c[1]]
    tune = [c for c in calls if c[1]]
    assert local and all(same for _, _, same in local), "the body trains with the head fixed"
    assert tune and all(epochs == 3 and not same for epochs, _, same in tune), "fine-tuning: the whole model, tau_f epochs"


def test_fedbabus_head_is_its_weighted_layers_and_a_batchnorm_among_them_is_body(clients):
    """small_cnn's top unit is Linear, BatchNorm1d, Linear: with head_layers 2 the two Linear layers stay at their
    initialisation and never travel, while the BatchNorm between them trains and is averaged (its weights and running
    statistics in every upload): frozen at its initialisation it would normalize with mean 0 and variance 1 at every
    evaluation."""
    from tests.tiny import small_cnn

    tp = TrainParams(rounds=1, batch_size=8, lr=0.05, momentum=0.5, device="cpu", count_flops=False)
    cls = method_class("fedbabu")
    ups = []
    e = Engine(cls(cls.params_cls(head_layers=2, finetune_epochs=0), tp), small_cnn(1, 4), clients[:2], tp, seed=0,
               observer=lambda r, c, d, p: ups.append(p) if d == "up" else None)
    init = small_cnn(1, 4).state_dict()
    e.run()
    linear = {"units.3.2.weight", "units.3.2.bias", "units.3.5.weight", "units.3.5.bias"}
    norm = {k for k in init if k.startswith("units.3.3.")}
    assert set(e.method.private) == linear and all(not (set(u) & linear) and norm <= set(u) for u in ups)
    assert all(torch.equal(e.stores[0][k], init[k]) for k in linear)
    assert not torch.equal(e.server["units.3.3.running_mean"], init["units.3.3.running_mean"])
    assert not torch.equal(e.server["units.3.3.weight"], init["units.3.3.weight"]), "the BatchNorm trains"


@pytest.mark.parametrize("backbone", ["fedecouple_cnn", "lenet5", "simple_cnn"])
def test_fedbabus_head_on_the_presets_backbones_is_their_classifier(backbone):
    """The backbones FedBABU runs on in the presets end in a bare Linear unit (no Sequential around it): with
    head_layers 1 the head is exactly that classifier's weight and bias (a key built from the unit's own empty module
    name once matched nothing, and the head trained and travelled like the body)."""
    from fedsilo.client.features import classifier
    from fedsilo.models import build_model

    model = build_model(backbone, 3, 10, seed=0, image_size=32)
    cls = method_class("fedbabu")
    m = cls(cls.params_cls(head_layers=1), TrainParams(device="cpu"))
    m.setup(model)
    fc = classifier(model)
    want = {n for n, p in model.named_parameters() if any(p is q for q in fc.parameters())}
    assert set(m.private) == want and len(want) == 2


OFF = {"glf": False, "gfa": False, "gpc": False, "da": False, "aggregation": "fedavg", "reset": "before_classifier"}


def test_fedecouple_with_every_module_off_is_fedrep_tensor_for_tensor(clients):
    """glf, gfa, gpc, da off, FedAvg weights and the reset before the classifier phase: FedRep with head_epochs = E_cl,
    body_epochs = E_fe and FedAvg's weights (client_weights: samples) gives the same server representation and the same client heads after two rounds."""
    fc = _engine("fedecouple", clients, rounds=2, local_epochs=2, classifier_epochs=3, **OFF)
    fc.run()
    rep = _engine("fedrep", clients, rounds=2, head_epochs=3, body_epochs=2, client_weights="samples")
    rep.run()
    body = [k for k in rep.server]
    assert body and all(torch.equal(fc.server[k], rep.server[k]) for k in body)
    for s_fc, s_rep in zip(fc.stores, rep.stores):
        for k in (k for k in s_rep if k.startswith(HEAD)):
            assert torch.equal(s_fc["personal::" + k], s_rep[k]), k
    # each module, switched on alone, changes the result
    ref = _engine("fedecouple", clients, rounds=1, **OFF)
    ref.run()
    for switch, on in (("glf", True), ("gfa", True), ("gpc", True), ("da", True), ("aggregation", "similarity")):
        one = _engine("fedecouple", clients, rounds=1, **{**OFF, switch: on})
        one.run()
        assert not torch.equal(one.server["units.0.0.weight"], ref.server["units.0.0.weight"]) or not torch.equal(
            one.server[HEAD + "2.weight"], ref.server[HEAD + "2.weight"]), switch


def _spy_fedecouple(monkeypatch):
    """Records, for every train_local call of FedeCouple, the model's state as the call starts and its epochs."""
    import fedsilo.methods.fedecouple as fc

    calls = []
    real = fc.train_local

    def spy(model, data, cfg, gen, epochs=None, **kw):
        calls.append((data.name, epochs, {k: v.detach().clone() for k, v in model.state_dict().items()}))
        return real(model, data, cfg, gen, epochs=epochs, **kw)

    monkeypatch.setattr(fc, "train_local", spy)
    return calls


@pytest.mark.parametrize("reset", ["before_extractor", "before_classifier"])
def test_fedecouple_resets_the_extractor_where_algorithm_1_does(clients, monkeypatch, reset):
    """Algorithm 1, line 24: theta_i <- theta^t after the classifier phase, which therefore trains phi_i on the
    client's own extractor of its last round; FedRep's order (reset first) is the other value. The extractor phase
    starts from theta^t in both."""
    calls = _spy_fedecouple(monkeypatch)
    downs: dict = {}
    e = _engine("fedecouple", clients, rounds=2, classifier_epochs=1,
                observer=lambda r, c, d, p: downs.__setitem__((r, c), p) if d == "down" else None,
                **{**OFF, "glf": True, "reset": reset})
    own = {}
    for rnd in (1, 2):
        if rnd == 2:  # each client's theta_i after round 1
            own = {c.name: {k[len("personal::"):]: v.clone() for k, v in s.items() if k.startswith("personal::")}
                   for c, s in zip(clients, e.stores)}
        calls.clear()
        e.step()
        for name, ep, at_start in calls[::3]:  # the classifier phase
            body = [k for k in at_start if not k.startswith(HEAD)]
            theta = own[name] if rnd == 2 and reset == "before_extractor" else downs[(rnd, name)]
            assert ep == 1  # classifier_epochs
            assert all(torch.equal(at_start[k], theta[k]) for k in body), (rnd, name)
        for name, ep, at_start in calls[1::3]:  # GLF's epoch: theta^t and the frozen global classifier phi^t (weights;
            # BatchNorm statistics follow the classifier phase's batches as in FedRep, the extractor being in train mode)
            weights = [k for k in at_start if "running_" not in k and "num_batches" not in k]
            assert ep == 1  # GLF trains one epoch
            assert all(torch.equal(at_start[k], downs[(rnd, name)][k]) for k in weights), (rnd, name)
    assert own and any(not torch.equal(own[c.name]["units.0.0.weight"], downs[(2, c.name)]["units.0.0.weight"]) for c in clients)


@pytest.mark.parametrize("setting, want", [(2, 2), ("local_epochs", 3)])
def test_fedecouple_classifier_epochs_are_their_own_or_follow_the_local_epochs(clients, monkeypatch, setting, want):
    """E_cl is ``classifier_epochs``, or with ``local_epochs`` the extractor phase's E_fe = train.local_epochs
    (Table XII's one "local epochs", as the paper preset reads it); E_fe follows train.local_epochs either way."""
    calls = _spy_fedecouple(monkeypatch)
    e = _engine("fedecouple", clients, rounds=1, local_epochs=3, classifier_epochs=setting, **{**OFF, "glf": True})
    e.step()
    assert [ep for _, ep, _ in calls[::3]] == [want] * len(clients)  # the classifier phase
    assert [ep for _, ep, _ in calls[2::3]] == [None] * len(clients)  # E_fe: train_local's default, train.local_epochs
    assert e.method.resolved()["classifier_epochs"] == want


def test_fedecouple_without_the_global_extractor_update_keeps_each_clients_own_extractor(clients, monkeypatch):
    """Table IX's "w/o global extractor update": no theta_i <- theta^t; in round 2 each client's extractor phase
    starts where its own classifier phase ended, on its own theta_i, not on the downloaded theta^t."""
    calls = _spy_fedecouple(monkeypatch)
    downs: dict = {}
    e = _engine("fedecouple", clients, rounds=2, classifier_epochs=1, global_update=False,
                observer=lambda r, c, d, p: downs.__setitem__((r, c), p) if d == "down" else None, **{**OFF, "reset": "before_extractor"})
    e.step()
    own = {c.name: {k[len("personal::"):]: v.clone() for k, v in s.items() if k.startswith("personal::")} for c, s in zip(clients, e.stores)}
    calls.clear()
    e.step()
    weights = [k for k in calls[0][2] if not k.startswith(HEAD) and "running_" not in k and "num_batches" not in k]
    for (name, _, cl_start), (_, _, fe_start) in zip(calls[::2], calls[1::2]):  # classifier phase, extractor phase
        assert all(torch.equal(cl_start[k], own[name][k]) for k in weights), name
        assert all(torch.equal(fe_start[k], cl_start[k]) for k in weights), name  # the body is frozen in between
        assert not all(torch.equal(fe_start[k], downs[(2, name)][k]) for k in weights), name
    assert "reset" in method_class("fedecouple").params_cls(global_update=False).unused_keys()


def test_fedecouple_anchor_coverage_pulls_only_the_covered_classes_images(clients):
    """Table IX's anchor coverage: at 50 % half the client's classes keep their anchor (a seeded draw each round); an
    image of another class adds no center loss, while the batch mean still counts it."""
    from types import SimpleNamespace

    from fedsilo.methods.fedecouple import FedeCouple, FedeCoupleParams

    z = torch.tensor([[1.0, 2.0], [0.0, 3.0], [2.0, 2.0], [1.0, 1.0]])
    anchors = {0: torch.zeros(2), 1: torch.ones(2), 2: torch.tensor([2.0, 0.0]), 3: torch.tensor([0.0, 1.0])}
    y = torch.tensor([0, 1, 2, 3])
    m = FedeCouple(FedeCoupleParams(mu=1.0, center_reduction="sum", anchor_coverage=0.5), TrainParams(device="cpu"))
    covered = m.covered_classes(anchors, torch.Generator().manual_seed(0))
    assert len(covered) == 2 and covered <= set(anchors)
    per_image = [5.0, 5.0, 4.0, 1.0]
    want = sum(p for c, p in enumerate(per_image) if c in covered) / 4
    assert float(m.center_loss(SimpleNamespace(z=z), anchors, covered)(None, y, None)) == pytest.approx(want)
    assert float(m.center_loss(SimpleNamespace(z=z), anchors)(None, y, None)) == pytest.approx(sum(per_image) / 4)
    full = FedeCouple(FedeCoupleParams(), TrainParams(device="cpu"))
    assert full.covered_classes(anchors, torch.Generator().manual_seed(0)) is None
    # the share reaches the training
    heads = []
    for share in (1.0, 0.5):
        e = _engine("fedecouple", clients, rounds=1, **{**OFF, "gfa": True, "mu": 5.0, "anchor_coverage": share})
        e.run()
        heads.append(e.stores[0]["personal::units.0.0.weight"])
    assert not torch.equal(*heads)


def test_fedecouple_server_model_is_the_similarity_weighted_mean_of_the_uploads(clients):
    """Eq. 7 is what the server applies: the new global model is sum_i iota_i w_i with the uploads' cosine weights."""
    from fedsilo.methods.fedecouple import similarity_weights

    ups = []
    e = _engine("fedecouple", clients, rounds=1, observer=lambda r, c, d, p: ups.append(p) if d == "up" else None)
    e.run()
    w = similarity_weights(ups, [c.n_train for c in clients])
    sizes = torch.tensor([float(c.n_train) for c in clients])
    assert w != pytest.approx((sizes / sizes.sum()).tolist()), "the tiny federation must tell the two rules apart"
    for k, v in e.server.items():
        if v.is_floating_point():
            assert torch.allclose(v, sum(wi * u[k] for wi, u in zip(w, ups)), atol=1e-6), k


def test_fedecouple_anchors_are_the_clients_class_means_and_never_travel(clients):
    from fedsilo.client.data import to_float
    from fedsilo.client.features import features
    from fedsilo.methods.fedecouple import FedeCouple, FedeCoupleParams

    ups = []
    e = _engine("fedecouple", clients, rounds=1, observer=lambda r, c, d, p: ups.append(set(p)) if d == "up" else None)
    e.run()
    model = tiny_net(1, 4)
    assert ups and all(keys == set(model.state_dict()) for keys in ups), "the whole model travels, nothing else"
    m = FedeCouple(FedeCoupleParams(), e.train)
    c = clients[0]
    an = m.anchors(model, c)
    model.eval()
    z = features(model, to_float(c.x_train, NormalizeParams()))
    assert set(an) == set(c.y_train.unique().tolist())
    for k, v in an.items():
        assert torch.allclose(v, z[c.y_train == k].mean(0), atol=1e-5)


def test_fedecouple_similarity_weights_are_normalized_cosines():
    from fedsilo.methods.fedecouple import similarity_weights

    a, b, far = {"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([1.0, 0.1])}, {"w": torch.tensor([-0.2, 1.0])}
    w = similarity_weights([a, b, far], [1, 1, 1])
    avg = (a["w"] + b["w"] + far["w"]) / 3
    cos = [float(torch.nn.functional.cosine_similarity(u["w"].double(), avg.double(), dim=0)) for u in (a, b, far)]
    assert w == pytest.approx([x / sum(cos) for x in cos]) and sum(w) == pytest.approx(1.0)
    assert w[2] < 1 / 3 < w[0], "the outlying model weighs less than FedAvg's third"


def test_fedecouple_teacher_and_distillation(clients):
    """GPC: the teacher starts from the downloaded classifier each round and is never uploaded; the fixed teacher and
    lambda = 0 differ from the adapted one only where they should."""
    from fedsilo.methods.terms import distillation_kl

    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    assert float(distillation_kl(logits, logits, 2.0)) == pytest.approx(0.0, abs=1e-7)
    base = {**OFF, "gpc": True}
    runs = {}
    for name, kw in (("adapted", {}), ("fixed", {"teacher": "fixed"}), ("lam0", {"lam": 0.0})):
        e = _engine("fedecouple", clients, rounds=1, **{**base, **kw})
        e.run()
        runs[name] = e.stores[0]["personal::" + HEAD + "2.weight"]
    off = _engine("fedecouple", clients, rounds=1, **OFF)
    off.run()
    # lambda = 0: the teacher still trains, but it no longer reaches phi_i: phi_i is the plain CE head
    assert torch.equal(runs["lam0"], off.stores[0]["personal::" + HEAD + "2.weight"])
    assert not torch.equal(runs["adapted"], runs["lam0"]) and not torch.equal(runs["adapted"], runs["fixed"])


def test_fedecouple_gpc_teacher_starts_from_the_downloaded_global_classifier_not_phi_i(clients, monkeypatch):
    """GPC (Eq. 2-4): the teacher is a copy of the downloaded global classifier phi^t, not of the client's personal
    phi_i. In round 2 the two differ; on each client's first distillation batch (before the teacher adapts) the
    teacher's logits are phi^t applied to the features the classifier sees, and not the student phi_i's."""
    from contextlib import contextmanager

    import fedsilo.methods.fedecouple as fc

    reps, firsts = [], {}
    real_rep, real_kl = fc.representation, fc.distillation_kl

    @contextmanager
    def rep_spy(model):
        with real_rep(model) as rep:
            reps.append(rep)
            yield rep

    def kl_spy(student, teacher, *a, **kw):  # the first call under each classifier phase's capture
        firsts.setdefault(len(reps), (student.detach().clone(), teacher.detach().clone(), reps[-1].z.detach().clone()))
        return real_kl(student, teacher, *a, **kw)

    monkeypatch.setattr(fc, "representation", rep_spy)
    monkeypatch.setattr(fc, "distillation_kl", kl_spy)
    e = _engine("fedecouple", clients, rounds=2, classifier_epochs=1, **{**OFF, "gpc": True})
    e.step()
    w, b = e.server[HEAD + "2.weight"].clone(), e.server[HEAD + "2.bias"].clone()  # phi^t of round 2
    firsts.clear()
    e.step()
    assert len(firsts) == len(clients)
    for student, teacher, z in firsts.values():
        assert torch.allclose(teacher, torch.nn.functional.linear(z, w, b), atol=1e-5)
        assert not torch.allclose(teacher, student, atol=1e-3), "phi_i and phi^t must differ in round 2"


def test_fedecouple_losses_are_eq_1_and_eq_3_as_written_with_the_conventions_as_switches(clients):
    """Eq. 3's distillation is lambda KL(p_T || p_S) (``kd_scale: tau2`` multiplies it by tau^2); Omega is the squared
    distance to the anchor averaged over batch and features (FedPAC's code; ``center_reduction: sum``, Eq. 1's
    notation, sums it over the features)."""
    from types import SimpleNamespace

    from fedsilo.methods.fedecouple import FedeCouple, FedeCoupleParams
    from fedsilo.methods.terms import distillation_kl

    s, t = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.5]]), torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 2.0]])
    p_t, p_s = torch.softmax(t / 2.0, 1), torch.softmax(s / 2.0, 1)
    kl = float((p_t * (p_t.log() - p_s.log())).sum(1).mean())
    assert float(distillation_kl(s, t, 2.0, tau2=False)) == pytest.approx(kl, rel=1e-5)
    assert float(distillation_kl(s, t, 2.0)) == pytest.approx(4 * kl, rel=1e-5)
    assert FedeCoupleParams().kd_scale == "none" and FedeCoupleParams().center_reduction == "mse"

    z = torch.tensor([[1.0, 2.0, 0.0, 0.0], [0.0, 0.0, 3.0, 1.0]])
    anchors = {0: torch.tensor([0.0, 0.0, 0.0, 0.0]), 1: torch.tensor([0.0, 0.0, 1.0, 1.0])}
    y = torch.tensor([0, 1])
    per_image = [1.0 + 4.0, 4.0]  # squared distances, summed over the four features
    for reduction, want in (("sum", 2.0 * np.mean(per_image)), ("mse", 2.0 * np.mean(per_image) / 4)):
        m = FedeCouple(FedeCoupleParams(mu=2.0, center_reduction=reduction), TrainParams(device="cpu"))
        assert float(m.center_loss(SimpleNamespace(z=z), anchors)(None, y, None)) == pytest.approx(want)
    # the switch reaches the training: tau^2 changes the personal classifier
    heads = []
    for scale in ("none", "tau2"):
        e = _engine("fedecouple", clients, rounds=1, **{**OFF, "gpc": True, "kd_scale": scale})
        e.run()
        heads.append(e.stores[0]["personal::" + HEAD + "2.weight"])
    assert not torch.equal(*heads)


def test_fedecouple_scores_a_client_that_never_trained_with_the_global_model(clients):
    """A client the join ratio has not sampled yet holds only the initial classifier; it is scored with the global
    model (theta^t, phi^t), what it would start from, and once it trained with its own."""
    e = _engine("fedecouple", clients, rounds=1, client_fraction=0.5)
    e.run()
    trained = set(e.history[0]["sampled"])
    for i, c in enumerate(clients):
        state = e.method.eval_state(e.server, e.stores[i], c)
        if c.name in trained:
            assert torch.equal(state[HEAD + "2.weight"], e.stores[i]["personal::" + HEAD + "2.weight"])
        else:
            assert all(torch.equal(state[k], e.server[k]) for k in e.server), c.name
    assert trained and len(trained) < len(clients)


def test_one_random_op_augmentation_applies_one_seeded_op_per_image():
    from fedsilo.client.data import one_random_op

    x = torch.rand(200, 1, 12, 12, generator=torch.Generator().manual_seed(0)) * 2 - 1
    a = one_random_op(x, torch.Generator().manual_seed(5), NormalizeParams())
    b = one_random_op(x, torch.Generator().manual_seed(5), NormalizeParams())
    assert torch.equal(a, b) and a.shape == x.shape and float(a.abs().max()) <= 1.0
    inverted = sum(bool(torch.equal(a[i], -x[i])) for i in range(200))
    flipped = sum(bool(torch.equal(a[i], x[i].flip(2))) for i in range(200))
    assert 20 <= inverted <= 60 and 20 <= flipped <= 60, (inverted, flipped)  # each of five ops: about 40
    # only a crop whose offset lands back on the image's own position leaves it unchanged
    assert sum(bool(torch.equal(a[i], x[i])) for i in range(200)) < 20
    # the crop's padding is black (-1), as the rotation's fill: a white image never shows mid-grey (0)
    white = one_random_op(torch.ones(200, 1, 12, 12), torch.Generator().manual_seed(5), NormalizeParams())
    assert int((white == 0).sum()) == 0 and int((white == -1).sum()) > 0


def _one_random_op_per_image(x, gen, max_crop=4, max_degrees=30.0, max_brightness=0.5):
    """The augmentation image by image, with torchvision's rotate: what the batched one_random_op must equal."""
    from torchvision.transforms.v2 import functional as TF

    from fedsilo.client.data import ONE_OP_NAMES

    b, _, h, w = x.shape
    ops = torch.randint(0, len(ONE_OP_NAMES), (b,), generator=gen)
    strength = torch.rand(b, generator=gen).clamp_min(1e-3)
    sign = torch.where(torch.rand(b, generator=gen) < 0.5, -1.0, 1.0)
    offsets = torch.rand(b, 2, generator=gen)
    out = []
    for i in range(b):
        img, op, m = x[i], ONE_OP_NAMES[int(ops[i])], float(strength[i])
        if op == "crop":
            p = max(1, int(round(max_crop * m)))
            padded = torch.nn.functional.pad(img, (p, p, p, p), value=-1.0)
            oy, ox = int(offsets[i, 0] * (2 * p + 1)), int(offsets[i, 1] * (2 * p + 1))
            img = padded[:, min(oy, 2 * p) : min(oy, 2 * p) + h, min(ox, 2 * p) : min(ox, 2 * p) + w]
        elif op == "flip":
            img = img.flip(2)
        elif op == "rotate":
            img = TF.rotate(img, float(sign[i]) * max_degrees * m, fill=-1.0)
        elif op == "brightness":
            img = (img + 2.0 * max_brightness * m * float(sign[i])).clamp(-1.0, 1.0)
        else:
            img = -img
        out.append(img)
    return torch.stack(out)


def test_batched_one_random_op_equals_the_per_image_loop_with_torchvision_rotate_bit_for_bit():
    """The batched augmentation (one gather, one grid_sample) against the loop over images it replaced, on the CPU:
    the same generator draws, the same images, bit for bit, over batch sizes, channels, non-square images and other
    ranges; and its rotation against torchvision's at the quarter turns its shortcuts take."""
    from torchvision.transforms.v2 import functional as TF

    from fedsilo.client.data import _rotate_into, crop_windows, one_random_op

    data = torch.Generator().manual_seed(0)
    cases = [(50, 3, 32, 32, {}), (7, 1, 28, 28, {}), (33, 3, 20, 24, {}), (64, 3, 32, 32, {"max_crop": 6, "max_degrees": 90.0, "max_brightness": 0.3}),
             (1, 3, 16, 16, {}), (40, 1, 9, 13, {"max_crop": 0})]
    for seed, (b, c, h, w, kw) in enumerate(cases * 4):
        x = torch.rand(b, c, h, w, generator=data) * 2 - 1
        got = one_random_op(x, torch.Generator().manual_seed(seed), NormalizeParams(), **kw)
        want = _one_random_op_per_image(x, torch.Generator().manual_seed(seed), **kw)
        assert got.shape == want.shape and torch.equal(got, want), (seed, b, c, h, w, kw)
    # the crop window's start in float32, as the loop's int(u * (2 p + 1)) on a float32 draw: every p of max_crop 8
    # over offsets near each boundary k / (2 p + 1), among them the one that double precision moves (p = 5)
    u = torch.tensor([7626007 * 2**-24] + [k / (2 * q + 1) + d for q in range(1, 9) for k in range(2 * q + 2) for d in (-3e-8, 0.0, 3e-8)])
    u = u.clamp(0.0, 1.0 - 2**-24).float()
    for q in range(1, 9):
        m = torch.full((len(u),), q / 8, dtype=torch.float64)
        p, start = crop_windows(m, u[:, None].expand(-1, 2).contiguous(), 8)
        assert (p == max(1, int(round(8 * (q / 8))))).all()
        assert start[:, 0].tolist() == [min(int(v * (2 * int(p[0]) + 1)), 2 * int(p[0])) for v in u]
    x = torch.rand(5, 3, 16, 16, generator=data) * 2 - 1
    angles = [90.0, 180.0, -90.0, 360.0, 47.5]
    out = torch.empty_like(x)
    _rotate_into(out, x, torch.ones(5, dtype=torch.bool), angles)
    assert all(torch.equal(out[i], TF.rotate(x[i], a, fill=-1.0)) for i, a in enumerate(angles))


def test_fedpac_combination_weights_pick_the_clients_with_the_same_label_distribution():
    from fedsilo.methods.fedpac import combination_weights

    h_a = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]])  # classes 0, 1
    h_b = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [-1.0, 1.0]])  # classes 2, 3
    # the optimum weighs each head by 1 / (V_j + ||H_0 - H_j||^2): client 2's 1/6.01 falls under the 1e-3 cut
    alpha = combination_weights([0.01, 0.01, 0.01], [h_a, h_a.clone(), h_b], 0)
    assert alpha is not None and alpha[2] == 0 and alpha[0] == pytest.approx(0.5, abs=1e-3) and alpha[1] == pytest.approx(0.5, abs=1e-3)
    # a large own variance moves weight to the like client (the variance term of Eq. 10)
    alpha = combination_weights([1.0, 0.01, 0.1], [h_a, h_a.clone(), h_b], 0)
    assert alpha[1] > 0.9 and alpha[2] < 0.01


@pytest.mark.parametrize("align_loss", ["mse", "squared_l2"])
def test_fedpac_classifier_is_the_alpha_weighted_mean_and_features_align_to_global_prototypes(clients, monkeypatch, align_loss):
    import numpy as np

    import fedsilo.methods.fedpac as fedpac

    ups = []
    e = _engine("fedpac", clients, rounds=1, align_loss=align_loss, observer=lambda r, c, d, p: ups.append((c, p)) if d == "up" else None)
    e.step()
    names = [c for c, _ in ups]
    assert {"fedpac::v", "fedpac::h", "fedpac::counts"} <= set(ups[0][1]) and any(k.startswith("proto::") for k in ups[0][1])
    variances = [float(p["fedpac::v"]) for _, p in ups]
    means = [p["fedpac::h"] for _, p in ups]
    w = HEAD + "2.weight"
    for i, c in enumerate(clients):
        alpha = fedpac.combination_weights(variances, means, names.index(c.name))
        want = sum(float(a) / alpha.sum() * ups[j][1][w].double() for j, a in enumerate(alpha))
        got = e.method.eval_state(e.server, e.stores[i], c)[w]
        assert torch.allclose(got.double(), want, atol=1e-6)
        assert not np.allclose(alpha, np.eye(len(clients))[names.index(c.name)]), "heads are combined, not kept"
    # round 2 aligns features to the global prototypes: the extractor phase's loss carries the MSE term
    from fedsilo.client.features import features
    from fedsilo.methods.prototypes import from_payload

    seen = []
    checked: list[tuple[float, float]] = []  # (the term, lambda * MSE(z, c_y) recomputed) at each client's first step
    protos = from_payload(e.server)  # the global prototypes round 2 downloads
    real = fedpac.train_local

    def spy(model, data, cfg, gen, batch_loss=None, **kw):
        seen.append(batch_loss)
        first = [True]

        def wrapped(x, yb, logits):
            val = batch_loss(x, yb, logits)
            if first[0]:
                first[0] = False
                with torch.no_grad():
                    z = features(model, x).float()
                target = torch.stack([protos[int(c)] for c in yb]).float()
                # the code's MSELoss, or the paper's R_i: each sample's squared distance summed over the features
                gap = ((z - target) ** 2).mean() if align_loss == "mse" else ((z - target) ** 2).sum(1).mean()
                checked.append((float(val.detach()), e.method.params.lam * float(gap.detach())))
            return val

        return real(model, data, cfg, gen, batch_loss=wrapped if batch_loss is not None else None, **kw)

    monkeypatch.setattr(fedpac, "train_local", spy)
    e.train = e.train.model_copy(update={"rounds": 2})
    e.method.train = e.train
    e.step()
    assert all(b is None for b in seen[0::2]) and all(b is not None for b in seen[1::2])
    assert any(k.startswith("proto::") for k in e.server)
    assert checked and all(v == pytest.approx(w, rel=1e-4) and v > 0 for v, w in checked), checked


def test_fedpac_classifier_epoch_keeps_its_rate_when_the_schedule_decays_the_rest(clients, monkeypatch):
    """The authors' code trains FedPAC's classifier at lr 0.1 whatever the schedule; the extractor's rate decays."""
    import fedsilo.client.local as local
    from fedsilo.config import LRScheduleParams

    made = []
    real = local.make_optimizer
    monkeypatch.setattr(local, "make_optimizer", lambda params, cfg: made.append(real(params, cfg).param_groups[0]["lr"]) or real(params, cfg))
    tp = TrainParams(rounds=2, batch_size=8, lr=0.05, momentum=0.5, local_epochs=1, device="cpu", count_flops=False,
                     lr_schedule=LRScheduleParams(kind="step", gamma=0.1, milestones=[1]))
    cls = method_class("fedpac")
    e = Engine(cls(cls.params_cls(), tp), tiny_net(1, 4), clients, tp, seed=0)
    e.step()
    assert sorted(set(made)) == pytest.approx([0.05, 0.1])
    made.clear()
    e.step()  # round 2: the schedule's 0.1 factor reaches the extractor only
    assert sorted(set(made)) == pytest.approx([0.005, 0.1])


def test_ft_fedavg_fine_tunes_the_global_model_per_client_only_to_evaluate(clients):
    ft = _engine("fedavg", clients, rounds=1, finetune_epochs=2)
    plain = _engine("fedavg", clients, rounds=1)
    e_ft, e_plain = ft.step(), plain.step()
    assert all(torch.equal(ft.server[k], plain.server[k]) for k in plain.server), "training is FedAvg's; evaluating changes nothing"
    assert not ft.method.eval_is_global()
    ft.method.load_eval_model(ft.model, ft.server, ft.stores[0], clients[0], 1)
    tuned = {k: v.clone() for k, v in ft.model.state_dict().items()}
    assert not torch.equal(tuned["units.0.0.weight"], ft.server["units.0.0.weight"]), "each client evaluates its fine-tuned copy"
    assert e_ft["global"] == e_plain["global"] and e_ft["eval"] != e_plain["eval"]


def test_a_join_ratio_range_draws_each_rounds_share_of_clients(clients):
    """FedeCouple Fig. 12: rho drawn per round from [low, high], seeded by (seed, round)."""
    many = style_shifted_federation(n_train=4, n_test=2, per_domain=5)  # 20 clients
    tp = TrainParams(rounds=30, batch_size=8, device="cpu", count_flops=False, client_fraction_range=(0.1, 1.0))
    cls = method_class("fedavg")
    e = Engine(cls(cls.params_cls(), tp), tiny_net(1, 4), many, tp, seed=0)
    sizes = [len(e.sample(r)) for r in range(1, 31)]
    assert min(sizes) >= 2 and max(sizes) <= 20 and len(set(sizes)) > 5, sizes
    # the count is an integer drawn uniformly from floor(0.1 * 20) = 2 .. 20 (PFLlib's random join ratio): over many
    # rounds both ends come up about as often as any other count
    counts = np.bincount([len(e.sample(r)) for r in range(1, 3801)], minlength=21)[2:]
    assert counts.min() > 0.6 * 200 and counts.max() < 1.4 * 200, counts
    assert sizes == [len(e.sample(r)) for r in range(1, 31)], "the same draws on a rerun or resume"
    fixed = TrainParams(rounds=30, batch_size=8, device="cpu", count_flops=False, client_fraction=0.5)
    f = Engine(cls(cls.params_cls(), fixed), tiny_net(1, 4), many, fixed, seed=0)
    assert {len(f.sample(r)) for r in range(1, 31)} == {10}
    seven = many[:7]  # max(1, floor(C n)): 0.5 of 7 clients is 3 (rounding half to even gave 4 here, 2 for 5 clients)
    g = Engine(cls(cls.params_cls(), fixed), tiny_net(1, 4), seven, fixed, seed=0)
    assert {len(g.sample(r)) for r in range(1, 11)} == {3}
    with pytest.raises(ValueError, match="client_fraction_range"):
        TrainParams(client_fraction_range=(0.6, 0.5))


def test_fedecouple_similarity_weights_use_the_size_weighted_mean_and_signed_cosines():
    """Eq. 7 by hand with sizes [1, 1, 8]: the reference is the sample-size-weighted mean (not the plain mean), and a
    model pointing away from it keeps its negative cosine, hence a negative weight (no abs)."""
    from fedsilo.methods.fedecouple import similarity_weights

    vecs = [torch.tensor([-1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0])]
    avg = torch.tensor([(-1.0 * 1 + 0.0 * 1 + 1.0 * 8) / 10, (0.0 * 1 + 1.0 * 1 + 1.0 * 8) / 10])  # [0.7, 0.9]
    norm = float(avg.norm())
    cos = [float(v @ avg) / (float(v.norm()) * norm) for v in vecs]
    assert cos[0] < 0
    w = similarity_weights([{"w": v} for v in vecs], [1, 1, 8])
    assert w == pytest.approx([c / sum(cos) for c in cos], rel=1e-6)
    assert w[0] < 0


def test_fedecouple_anchors_come_from_the_downloaded_extractor_not_the_clients_own(clients, monkeypatch):
    """GFA (Eq. 1): in round 2 a trained client first loads its own theta_i for the classifier phase (reset:
    before_extractor); the anchors must still be computed with the downloaded theta^t, before that load."""
    from fedsilo.methods.fedecouple import FedeCouple

    seen = {}
    real = FedeCouple.anchors

    def spy(self, model, client):
        seen[client.name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return real(self, model, client)

    monkeypatch.setattr(FedeCouple, "anchors", spy)
    downs: dict = {}
    e = _engine("fedecouple", clients, rounds=2, classifier_epochs=1,
                observer=lambda r, c, d, p: downs.__setitem__((r, c), p) if d == "down" else None,
                **{**OFF, "gfa": True, "reset": "before_extractor"})
    e.step()
    own = {c.name: {k[len("personal::"):]: v.clone() for k, v in s.items() if k.startswith("personal::")}
           for c, s in zip(clients, e.stores)}
    seen.clear()
    e.step()
    assert len(seen) == len(clients)
    for name, at in seen.items():
        body = [k for k in at if not k.startswith(HEAD) and "running_" not in k and "num_batches" not in k]
        assert all(torch.equal(at[k], downs[(2, name)][k]) for k in body), name
        assert not all(torch.equal(at[k], own[name][k]) for k in body), name


def test_fedecouple_da_adds_an_augmented_copy_of_each_image_not_the_image_again(clients, monkeypatch):
    """DA: the batch_transform doubles each batch with one augmented copy of each image (the second half differs from
    the images themselves), the labels repeated."""
    import fedsilo.methods.fedecouple as fc
    from fedsilo.client.data import to_float

    transforms = []
    real = fc.train_local

    def spy(model, data, cfg, gen, epochs=None, **kw):
        transforms.append(kw.get("batch_transform"))
        return real(model, data, cfg, gen, epochs=epochs, **kw)

    monkeypatch.setattr(fc, "train_local", spy)
    e = _engine("fedecouple", clients, rounds=1, classifier_epochs=1, **{**OFF, "da": True})
    e.step()
    assert transforms and all(t is not None for t in transforms)
    x = to_float(clients[0].x_train[:8], NormalizeParams())
    y = clients[0].y_train[:8]
    xx, yy = transforms[0](x, y)
    assert xx.shape[0] == 16 and torch.equal(yy, torch.cat([y, y]))
    assert torch.equal(xx[:8], x)
    assert not torch.equal(xx[8:], x)
