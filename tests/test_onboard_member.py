"""`fedsilo site onboard --strategy as_member`: a hospital outside a finished run adapts as the method's own sites do,
from what the server would send a site joining after the last round (final_model.pt's ``newcomer`` entry)."""

from __future__ import annotations

import copy

import pytest
import torch

from fedsilo.config import ConfigError, TrainParams
from fedsilo.fl.deploy import as_member_refusal, newcomer_payloads
from fedsilo.fl.engine import Engine
from fedsilo.fl.flower import FlowerSpec
from fedsilo.fl.onboard import MEMBER, adapt_as_member
from fedsilo.methods import method_class
from fedsilo.methods.registry import joinable_methods
from fedsilo.models import build_model
from tests.test_parallel_clients import PARAMS, RESNET
from tests.tiny import one_thread, style_shifted_federation, tiny_net


def _finished(name: str, n_rounds: int = 2, **params) -> tuple[Engine, list, FlowerSpec]:
    """A run of ``name`` on three style-shifted sites, finished; the fourth site (another style) was not in it."""
    clients = style_shifted_federation(n_train=12, n_test=8, per_domain=1)
    cls = method_class(name)
    tp = TrainParams(model="resnet10" if name in RESNET else "simple_cnn", rounds=n_rounds, batch_size=6, lr=0.05,
                     momentum=0.5, device="cpu", count_flops=False, eval_every=n_rounds)

    def make_model():
        return build_model("resnet10", 1, 4, seed=0, image_size=16) if name in RESNET else tiny_net(1, 4)

    method = cls(cls.params_cls(**{**PARAMS.get(name, {}), **params}), tp)
    engine = Engine(method, make_model(), clients[:3], tp, seed=0)
    with one_thread():
        for _ in range(n_rounds):
            engine.step()
    return engine, clients, FlowerSpec.of(method, make_model, 0)


def _adaptable() -> list[str]:
    out = []
    for name in joinable_methods():
        cls = method_class(name)
        tp = TrainParams(model="simple_cnn", rounds=2, device="cpu")
        method = cls(cls.params_cls(**PARAMS.get(name, {})), tp)
        clients = style_shifted_federation(n_train=4, n_test=2, per_domain=1)[:1]
        model = build_model("resnet10", 1, 4, seed=0, image_size=16) if name in RESNET else tiny_net(1, 4)
        method.join(clients, 0)
        model = method.transform_model(model, torch.zeros(2, 1, 16, 16))
        method.setup(model)
        if as_member_refusal(method, 2) is None:
            out.append(name)
    return out


ADAPTABLE = _adaptable()


def test_as_member_is_for_the_methods_whose_sites_keep_something_of_their_own():
    personal = {"ditto", "pfedsd", "fedpac", "fedecouple", "fedbabu", "f2dc", "pfeddr"}
    own_part = {"fedbn", "fedrep", "fedper", "lgfedavg"}
    assert personal | own_part <= set(ADAPTABLE)
    # every site evaluated with the global model (nothing of its own to adapt), pFedDB (its own Fig. 6), a site's
    # evaluation model made on the server from its uploads (FDSE, CD2-pFed), Single (nothing shared)
    assert not {"fedavg", "fedprox", "moon", "fedheal", "pfeddb", "fdse", "cd2pfed", "single"} & set(ADAPTABLE)


@pytest.mark.parametrize("name", ADAPTABLE)
def test_a_newcomer_adapts_as_a_site_of_the_method_would_against_the_finished_federation(name):
    """The downloads are what the server sends a site it never heard from (the run's server state unchanged); the
    newcomer's rounds run the method's own local update and evaluation model: the model it keeps is not the one an
    untrained newcomer would be evaluated with (FedBABU's evaluation fine-tunes the federation's model whatever the
    site holds: there it is that fine-tuning, the same each round); the downloaded tensors are not modified; and the
    kept model loads into the model the deployment builds."""
    engine, clients, spec = _finished(name)
    before = {k: v.clone() for k, v in engine.server.items()}
    sent = newcomer_payloads(engine.method, engine.server, engine.clients, engine.round)
    assert sent is not None and sent["index"] == 3 and sent["round"] == 2
    assert set(engine.server) == set(before) and all(torch.equal(engine.server[k], v) for k, v in before.items())
    # what every member is sent, as it is sent to them, never a member's own part (FedPAC's per-site heads)
    for part, hook in (("download", lambda c: engine.method.download(engine.server, c, 2)),
                       ("eval", lambda c: engine.method.eval_download(engine.server, c))):
        theirs = [hook(c) for c in engine.clients]
        common = set.intersection(*(set(t) for t in theirs))
        assert set(sent[part]) <= common, sorted(set(sent[part]) - common)[:3]
        assert all(torch.equal(sent[part][k], theirs[0][k]) for k in sent[part])
    copies = {part: {k: v.clone() for k, v in sent[part].items()} for part in ("download", "eval")}
    newcomer = clients[3]
    with one_thread():
        res = adapt_as_member(spec, newcomer, sent, rounds=2)
    assert list(res["accuracy_per_round"]) == [MEMBER] and len(res["accuracy_per_round"][MEMBER]) == 2
    assert all(torch.equal(sent[p][k], v) for p, c in copies.items() for k, v in c.items())
    assert newcomer.index == 3 and newcomer.name == clients[3].name  # the caller's client is not renamed
    kept = res["models"][MEMBER]
    method, model, _ = spec.build(torch.zeros(2, 1, 16, 16), torch.device("cpu"), [])
    me = copy.copy(newcomer)
    me.index, me.name = 3, "newcomer"
    with one_thread():  # what an untrained newcomer is evaluated with: its initial store under the same downloads
        method.load_eval_model(model, sent["eval"], method.init_client(model, me), me, 2)
    untrained = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(kept, strict=True)  # the kept model is one the deployment's model holds
    moved = [k for k, v in untrained.items() if v.is_floating_point() and not torch.equal(v, kept[k])]
    if name == "fedbabu":
        assert not moved  # its evaluation model is the fine-tuning of the federation's model, whatever the site holds
    else:
        assert moved


def test_without_its_local_rounds_the_newcomer_would_be_evaluated_with_its_initial_part(monkeypatch):
    """Ditto: with the local update made a no-op the kept personal model is the newcomer's initial one; with it, the
    personal model moved towards its data (the mechanism the test above checks for every method)."""
    engine, clients, spec = _finished("ditto")
    sent = newcomer_payloads(engine.method, engine.server, engine.clients, engine.round)
    with one_thread():
        trained = adapt_as_member(spec, clients[3], sent, rounds=1)["models"][MEMBER]
        monkeypatch.setattr(method_class("ditto"), "local_update", lambda self, *a, **k: {})
        idle = adapt_as_member(spec, clients[3], sent, rounds=1)["models"][MEMBER]
    start = spec.make_model().state_dict()
    assert all(torch.equal(idle[k], start[k]) for k in start)
    assert any(not torch.equal(trained[k], start[k]) for k in start if start[k].is_floating_point())


@pytest.mark.parametrize("name, params, why", [
    ("fedavg", {}, "evaluated with the federation's global model"),
    ("pfeddb", {}, "pFedDB's newcomer adapts as its paper's Fig. 6 does"),
    ("fdse", {}, "the personalized layers the server mixes for it"),
    ("cd2pfed", {}, "the channels of the split the server recorded"),
    ("lgfedavg", {"fedavg_rounds": 1}, "once the server recorded that it took the FedAvg start"),
    ("fedbabu", {"finetune_epochs": 0}, "with finetune_epochs 0 every site is evaluated with the global body"),
    ("single", {}, "its sites share nothing")])
def test_a_method_without_a_members_part_to_adapt_writes_no_newcomer_download(name, params, why):
    engine, _, _ = _finished(name, n_rounds=2, **params)
    assert why in as_member_refusal(engine.method, engine.round)
    assert newcomer_payloads(engine.method, engine.server, engine.clients, engine.round) is None


def test_pfeddr_refuses_when_its_sites_trained_nothing_in_the_last_round():
    engine, _, _ = _finished("pfeddr", n_rounds=2, rounds=1)  # the authors' scripts stop training after `rounds`
    assert "trained nothing in the run's last round (2; methods.pfeddr.rounds)" in as_member_refusal(engine.method, engine.round)
    assert newcomer_payloads(engine.method, engine.server, engine.clients, engine.round) is None


def _dep(key: str, base: str | None = None, **params) -> dict:
    tp = TrainParams(model="simple_cnn", model_width=0.25, rounds=2, batch_size=6, lr=0.05, device="cpu", count_flops=False)
    return {"federation": "f", "method": {"key": key, "base": base or key, "params": params}, "train": tp.model_dump(mode="json"),
            "seed": 0, "contract": {"task": "t", "classes": ["a", "b", "c", "d"], "image_shape": [16, 16, 1]}, "sites": []}


def test_freeze_global_keeps_the_federations_batchnorm_statistics_as_downloaded():
    """``freeze_global`` (FedPer's newcomer: the federation's body frozen, its own head trained): the body's BatchNorm
    running statistics are part of what is frozen, so they stay the federation's exactly while its batches still
    normalize with their own; ``finetune_all`` moves them with the rest."""
    from fedsilo.fl.deploy import deployment_spec
    from fedsilo.fl.onboard import adapt_federation_model
    from fedsilo.models import batchnorm_keys

    tp = TrainParams(model="simple_cnn", model_width=0.25, rounds=2, batch_size=6, lr=0.05, device="cpu", count_flops=False)
    dep = {"federation": "f", "method": {"key": "fedper", "base": "fedper", "params": {}}, "train": tp.model_dump(mode="json"),
           "seed": 0, "contract": {"task": "t", "classes": ["a", "b", "c", "d"], "image_shape": [16, 16, 1]}, "sites": []}
    newcomer = style_shifted_federation(n_train=12, n_test=8, per_domain=1)[3]
    method, model, private = deployment_spec(dep).build(torch.zeros(2, 1, 16, 16), torch.device("cpu"), [])
    torch.manual_seed(1)  # the federation's trained body: other weights, statistics away from their 0 / 1 start
    shared = {k: (v + torch.rand_like(v) if v.is_floating_point() else v + 3) for k, v in model.state_dict().items() if k not in private}
    stats = [k for k in batchnorm_keys(model) if k in shared and k.endswith(("running_mean", "running_var"))]
    assert stats
    with one_thread():
        out = adapt_federation_model(dep, newcomer, shared, rounds=1, strategies=["freeze_global", "finetune_all"])
    frozen, tuned = out["models"]["freeze_global"], out["models"]["finetune_all"]
    assert all(torch.equal(frozen[k], shared[k]) for k in shared)
    assert all(not torch.equal(tuned[k], shared[k]) for k in stats)
    assert any(not torch.equal(frozen[k], model.state_dict()[k]) for k in private if frozen[k].is_floating_point())  # its head trained


def test_a_federation_model_that_cannot_be_adapted_on_the_backbone_is_refused_naming_why():
    """Refused before any training: a model with no whole tensor, one holding other tensors than the deployment
    builds, freeze_global where the sites keep nothing (FedAvg) or are evaluated with a model of their own (Ditto),
    LG-FedAvg whose sites' own layers started from the FedAvg rounds' model."""
    from fedsilo.fl.deploy import deployment_spec
    from fedsilo.fl.onboard import adapt_federation_model

    newcomer = style_shifted_federation(n_train=4, n_test=2, per_domain=1)[3]

    def shared_of(dep: dict) -> dict:
        _, model, private = deployment_spec(dep).build(torch.zeros(2, 1, 16, 16), torch.device("cpu"), [])
        return {k: v for k, v in model.state_dict().items() if k not in private}

    def refused(dep: dict, shared: dict, strategies=("finetune_all",)) -> str:
        with pytest.raises(ConfigError) as e:
            adapt_federation_model(dep, newcomer, shared, rounds=1, strategies=list(strategies))
        return str(e.value)

    fedper = _dep("fedper")
    shared = shared_of(fedper)
    assert "holds no whole tensor" in refused(fedper, {})
    assert "holds other tensors than fedper builds for a site" in refused(fedper, {**shared, "extra.weight": torch.zeros(1)})
    some = dict(list(shared.items())[1:])  # a tensor of the model that is no site's own part is missing
    assert "holds other tensors than fedper builds for a site" in refused(fedper, some)
    fedavg = _dep("fedavg")
    assert "freeze_global: fedavg's sites keep no part of their own" in refused(fedavg, shared_of(fedavg), ["freeze_global"])
    ditto = _dep("ditto")
    assert "freeze_global: ditto's sites are evaluated with a model their own training makes" in refused(
        ditto, shared_of(ditto), ["freeze_global"])
    lg = _dep("lg", "lgfedavg", fedavg_rounds=1)
    assert "lg: with fedavg_rounds its sites' own layers started from the FedAvg model" in refused(lg, shared_of(lg))
    lg_plain = _dep("lg", "lgfedavg")
    with one_thread():  # without fedavg_rounds it adapts
        assert len(adapt_federation_model(lg_plain, newcomer, shared_of(lg_plain), rounds=1, strategies=["finetune_all"])["final"]) == 1
