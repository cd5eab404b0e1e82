"""Which methods a site may join a run of in progress (``joinable``; deployments: ``sites[k].joined``)."""

from __future__ import annotations

import pytest
import torch

from fedsilo.config import TrainParams
from fedsilo.fl.engine import Engine
from fedsilo.methods import REGISTRY, method_class
from fedsilo.methods.registry import joinable_methods
from fedsilo.models import build_model
from tests.test_parallel_clients import PARAMS, RESNET, STATIC, _same_state
from tests.tiny import one_thread, style_shifted_federation, tiny_net, without_timing


def _engine(name: str, clients: list, **membership) -> Engine:
    cls = method_class(name)
    tp = TrainParams(model="resnet10" if name in RESNET else "simple_cnn", rounds=2, batch_size=6, lr=0.05, momentum=0.5,
                     device="cpu", count_flops=False)
    model = build_model("resnet10", 1, 4, seed=0, image_size=16) if name in RESNET else tiny_net(1, 4)
    return Engine(cls(cls.params_cls(**PARAMS.get(name, {})), tp), model, clients, tp, seed=0, **membership)


def _before_the_join_is_the_same(name: str) -> bool:
    """A site joining mid-run is, to the server, a federation told of one more client (of a new domain here) when the
    run resumes. The rounds before the join must not depend on it: the engine without the joiner and the engine told
    of it from the start, the joiner taking part from round 2, give the same round 1 (history, server state with its
    keys and shapes, the others' stores)."""
    clients = style_shifted_federation(n_train=12, n_test=6, per_domain=1)
    with one_thread():
        without, told = _engine(name, clients[:3]), _engine(name, clients, joined={clients[3].name: 2})
        a, b = without.step(), told.step()
    return (without_timing([a]) == without_timing([b]) and _same_state(without.server, told.server)
            and all(_same_state(x, y) for x, y in zip(without.stores, told.stores)))


@pytest.mark.parametrize("name", joinable_methods())
def test_a_joinable_methods_rounds_before_a_join_do_not_depend_on_the_site_that_joins(name):
    assert _before_the_join_is_the_same(name)


class _FederationAtStart:
    """A method that counts the federation it was told of at the start instead of the round's members (what F²DC's
    Q and FedHEAL's starting weight did before ``round_members``)."""

    def round_members(self, rnd, members):
        pass


@pytest.mark.parametrize("name", ["f2dc", "fedheal"])
def test_the_check_fails_for_a_method_that_counts_the_federation_it_started_with(name, monkeypatch):
    """F²DC's Q (domains) and FedHEAL's starting weight 1 / K count the round's members: counted over the
    federation told of the joiner from the start, the rounds before the join change, and the check says so."""
    cls = REGISTRY[name]
    monkeypatch.setattr(cls, "round_members", _FederationAtStart.round_members)
    assert not _before_the_join_is_the_same(name)


def _run_with_a_joiner(name: str, rounds: int = 3, first: int = 3, steps: int | None = None, **params) -> tuple[Engine, list]:
    clients = style_shifted_federation(n_train=12, n_test=6, per_domain=1)
    cls = method_class(name)
    tp = TrainParams(model="resnet10" if name in RESNET else "simple_cnn", rounds=rounds, batch_size=6, lr=0.05,
                     momentum=0.5, device="cpu", count_flops=False, eval_every=rounds)
    model = build_model("resnet10", 1, 4, seed=0, image_size=16) if name in RESNET else tiny_net(1, 4)
    engine = Engine(cls(cls.params_cls(**{**PARAMS.get(name, {}), **params}), tp), model, clients, tp, seed=0,
                    joined={clients[3].name: first})
    with one_thread():
        history = [engine.step() for _ in range(rounds if steps is None else steps)]
    return engine, history


@pytest.mark.parametrize("name", ["f2dc", "fedheal", "fdse", "cd2pfed"])
def test_a_site_that_joins_trains_from_the_start_every_site_had_and_is_scored(name):
    """The joiner of round 3 is sampled and scored from then on; what it downloads first is what every site's first
    download was: FDSE's erasers of the initial model (no mix made for it yet), CD2-pFed's shared part under round
    0's split (no split it trained under), F²DC's and FedHEAL's global model."""
    engine, history = _run_with_a_joiner(name)
    joiner = engine.clients[3]
    assert history[2]["joined"] == [joiner.name] and joiner.name in history[2]["sampled"]
    assert all(joiner.name not in h["sampled"] for h in history[:2])
    assert joiner.name in history[2]["eval"] and all(joiner.name not in h.get("eval", {}) for h in history[:2])
    if name == "fdse":  # the server mixed erasers for the joiner once it uploaded: its own from now on
        first = engine.method.download(engine.server, joiner, 4)
        assert any(not torch.equal(first[k], engine.server[f"fdse_start::{k}"]) for k in engine.method.personal)
    if name == "cd2pfed":
        assert int(engine.server[f"cd2pfed::last_round::{joiner.name}"]) == 3


def test_fdse_gives_a_site_it_has_not_mixed_for_the_initial_erasers():
    engine, _ = _run_with_a_joiner("fdse", steps=2)  # the joiner's first round (3) not run yet: never mixed for
    joiner, other = engine.clients[3], engine.clients[0]
    init = _run_with_a_joiner("fdse", steps=0)[0].server  # the server before any round: the initial erasers
    mine, theirs = engine.method.download(engine.server, joiner, 3), engine.method.download(engine.server, other, 3)
    for k in engine.method.personal:
        assert torch.equal(mine[k], init[f"fdse_start::{k}"]) and not torch.equal(theirs[k], init[f"fdse_start::{k}"])
    sent = engine.method.eval_download(engine.server, joiner)  # for its evaluation: its own part, no other site's
    assert not any(k.startswith("fdse_start::") or (k.startswith("fdse::") and joiner.name not in k) for k in sent)


def test_lgfedavg_gives_a_site_that_joins_after_the_fedavg_rounds_the_fedavg_start_once():
    """LG-FedAvg with its FedAvg-trained start (R0 = 1): a site joining in round 3 takes the lower layers of round
    R0's FedAvg model with its first download, as a site first sampled late does, and the server records it by name."""
    engine, history = _run_with_a_joiner("lgfedavg", rounds=3, first=3, fedavg_rounds=1)
    joiner = engine.clients[3]
    assert joiner.name in history[2]["sampled"]
    assert f"lgfedavg:started::{joiner.name}" in engine.server
    assert not engine.method.takes_start(engine.server, joiner)
    assert set(engine.method.download(engine.server, joiner, 4)) == set(engine.method.shared)


def test_only_the_static_methods_declared_joinable_are():
    assert set(joinable_methods()) <= set(STATIC)
    assert {"fedecouple", "fedpac", "moon", "pfedsd", "pfeddr", "fpl", "fedtgp", "fedsa", "fedrcl", "fedlgf", "fedwon"} <= set(joinable_methods())
    assert {"f2dc", "fedheal", "fdse", "cd2pfed", "lgfedavg", "pfeddb"} <= set(joinable_methods())


def test_a_site_that_left_or_is_away_still_counts_in_what_a_method_counts_of_the_federation():
    """F²DC's Q and FedHEAL's K count the sites that have joined: one that left (or is away) still counts, as
    everything the server holds of it stays (the federation's past is not rewritten); one that joins counts from its
    first round."""
    clients = style_shifted_federation(n_train=12, n_test=6, per_domain=1)
    engine = _engine("f2dc", clients, left={clients[2].name: 1}, joined={clients[3].name: 2})
    seen = []
    with one_thread():
        for _ in range(2):
            engine.step()
            seen.append({c.name for c in engine.method.members})
    names = [c.name for c in clients]
    assert seen == [set(names[:3]), set(names)]


def _pfeddb(joined: dict, local_rounds: int, rounds: int = 4) -> Engine:
    clients = style_shifted_federation(n_train=12, n_test=6, per_domain=1)
    cls = method_class("pfeddb")
    tp = TrainParams(rounds=rounds, batch_size=6, lr=0.05, momentum=0.5, device="cpu", count_flops=False,
                     augment={"hflip": True, "crop_pad": 2}, lr_schedule={"kind": "exponential", "gamma": 0.5})
    return Engine(cls(cls.params_cls(local_rounds=local_rounds), tp), tiny_net(1, 4), clients, tp, seed=0, joined=joined)


def test_a_site_joining_pfeddb_in_phase_1_trains_the_rounds_it_missed_and_the_run_ends_as_if_it_had_been_there():
    """Phase 1 sends nothing, so a site joining in round 2 of 3 Phase-1 rounds that first trains round 1 on its own
    (as the server's download tells it; round 1's batches, augmentation and decayed learning rate) holds the local
    model it would hold from round 1: its Eq. 6 upload, phi and
    every later round are those of the run it was part of from the start."""
    from fedsilo.methods.pfeddb.method import CATCH_UP, LOCAL_MODEL

    joiner = "D3-0"
    ref, late = _pfeddb({}, local_rounds=3), _pfeddb({joiner: 2}, local_rounds=3)
    with one_thread():
        a = [ref.step() for _ in range(4)]
        b = [late.step()]
        down = late.method.download(late.server, late.clients[3], 2)
        assert set(down) == {CATCH_UP} and down[CATCH_UP].tolist() == [1, 1]
        b += [late.step() for _ in range(3)]
    assert joiner not in b[0]["sampled"] and b[1]["joined"] == [joiner]
    assert b[1]["bytes_down"][joiner] == 16 and set(b[1]["bytes_down"]) == {joiner} | set(a[1]["bytes_down"])
    for k in ("eval", "mean_acc", "bytes_up"):  # from the join on, the run it was part of from the start
        assert [h[k] for h in b[1:]] == [h[k] for h in a[1:]], k
    assert _same_state(ref.server, late.server) and all(_same_state(x, y) for x, y in zip(ref.stores, late.stores))
    assert int(late.server[LOCAL_MODEL + joiner]) == 3 and CATCH_UP not in late.method.download(late.server, late.clients[3], 4)
    assert not any(k.startswith("pfeddb:") for k in late.method.eval_download(late.server, late.clients[3]))


def test_a_site_joining_pfeddb_in_phase_2_trains_phase_1_first_and_keeps_its_local_model(monkeypatch):
    """Joining in round 4 of a run whose Phase 1 is rounds 1-2: the site trains rounds 1 and 2 on its own first and
    keeps psi_c* as every site did at round E0 (the psi_c* it would have had), then trains phi with the federation;
    the catch-up is asked for once."""
    from fedsilo.methods.pfeddb.method import CATCH_UP, LOCAL_MODEL, PFedDB

    kept: dict[str, list] = {}
    keep = PFedDB.keep_phase_one

    def spy(self, model, store):
        phi = keep(self, model, store)
        kept.setdefault(type(self).__name__ + str(id(self)), []).append({k: v.clone() for k, v in phi.items()})
        return phi

    monkeypatch.setattr(PFedDB, "keep_phase_one", spy)
    joiner = "D3-0"
    ref, late = _pfeddb({}, local_rounds=2), _pfeddb({joiner: 4}, local_rounds=2)
    with one_thread():
        [ref.step() for _ in range(2)]
        [late.step() for _ in range(3)]
        down = late.method.download(late.server, late.clients[3], 4)
        assert down[CATCH_UP].tolist() == [1, 2] and set(down) == set(late.method.shared) | {CATCH_UP}
        last = late.step()
    ref_kept, late_kept = (kept["PFedDB" + str(id(e.method))] for e in (ref, late))
    assert len(ref_kept) == 4 and len(late_kept) == 4  # every site once: three at round 2, the joiner in round 4
    assert all(torch.equal(ref_kept[3][k], late_kept[3][k]) for k in ref_kept[3])  # the joiner's psi_c*
    assert last["joined"] == [joiner] and joiner in last["eval"] and int(late.server[LOCAL_MODEL + joiner]) == 2
    assert CATCH_UP not in late.method.download(late.server, late.clients[3], 5)


def test_a_pfeddb_site_refuses_a_catch_up_outside_the_rounds_gone_by():
    """The site checks the span the server names: Phase-1 rounds already behind, never a round to come or past E0."""
    e = _pfeddb({}, local_rounds=2)
    with one_thread():
        e.step()
        c, store = e.clients[0], e.stores[0]
        for span in ([1, 2], [0, 1], [2, 1]):  # round 2 may catch up round 1 only
            with pytest.raises(ValueError, match=rf"{c.name}: the server asked round 2 to train Phase-1 rounds .* rounds 1 to 1 only"):
                e.method.local_update(e.model, store, {"pfeddb:catch_up": torch.tensor(span)}, c, 2, 0)


def test_one_phase_pfeddb_keeps_no_record_of_local_models():
    e = _pfeddb({}, local_rounds=0)
    with one_thread():
        e.step()
    assert set(e.server) == set(e.method.shared)
