"""The engine and the first four methods on the harmonized mirror."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from fedsilo.client.data import load_clients
from fedsilo.config import DomainClientsSplit, NormalizeParams, TrainParams
from fedsilo.data.splits import make_split
from fedsilo.fl.engine import Engine, PrivacyViolation, payload_bytes
from fedsilo.methods import method_class
from fedsilo.methods.fedavg import FedAvg
from fedsilo.models import batchnorm_keys, build_model
from tests.tiny import small_cnn


@pytest.fixture(scope="module")
def clients(mirror_root):
    h = mirror_root / "data" / "harmonized" / "chest_xray4"
    split = make_split(pd.read_parquet(h / "records.parquet"), DomainClientsSplit(n_train=32, n_test=20), seed=0)
    return load_clients(h, split, torch.device("cpu"))


def _engine(name, clients, rounds=2, observer=None, model=None, **kw):
    cl, cin, nc = clients
    tp = TrainParams(**{"rounds": rounds, "batch_size": 16, "lr": 0.02, "device": "cpu", "count_flops": False, **kw})
    cls = method_class(name)
    model = build_model("simple_cnn", cin, nc, seed=0, width=0.25) if model is None else model
    return Engine(cls(cls.params_cls(), tp), model, cl, tp, seed=0, observer=observer)


def test_fedbn_on_a_backbone_without_batchnorm_is_refused_by_check_params():
    """FedBN keeps the BatchNorm layers home: on LeNet-5, which has none, it would train FedAvg under its name."""
    from fedsilo.config import ConfigError
    from fedsilo.fl.params import parse_params
    from fedsilo.methods.registry import check_pipeline_fits
    from tests.conftest import small_params

    with pytest.raises(ConfigError, match=r"p\.yaml: methods\.fedbn: FedBN keeps each client's BatchNorm layers at home, and this "
                       r"backbone has none.* \[fedbn on the backbone lenet5, experiments\.quick\.train\.model\]"):
        check_pipeline_fits(parse_params(small_params(model="lenet5")), "p.yaml")
    check_pipeline_fits(parse_params(small_params()), "p.yaml")  # Simple-CNN has BatchNorm


def test_fedbn_uploads_no_batchnorm_and_fedavg_does(clients):
    seen: dict[str, list] = {"fedbn": [], "fedavg": []}
    for name in seen:
        _engine(name, clients, rounds=1, observer=lambda r, c, d, p, n=name: seen[n].append((d, set(p)))).run()
    bn = batchnorm_keys(build_model("simple_cnn", 1, 2, width=0.25))
    ups_bn = [keys for d, keys in seen["fedbn"] if d == "up"]
    ups_avg = [keys for d, keys in seen["fedavg"] if d == "up"]
    assert ups_bn and all(not (k & bn) for k in ups_bn)
    assert all(bn <= k for k in ups_avg)


def test_bytes_are_the_tensors_moved(clients):
    log = []
    e = _engine("fedbn", clients, rounds=1, observer=lambda r, c, d, p: log.append((c, d, payload_bytes(p))))
    h = e.run()[0]
    m = build_model("simple_cnn", 1, 2, width=0.25)
    bn = batchnorm_keys(m)
    expected = sum(t.numel() * t.element_size() for k, t in m.state_dict().items() if k not in bn)
    assert all(b == expected for _, _, b in log)
    assert h["bytes_up_total"] == expected * len(clients[0]) == h["bytes_down_total"]
    assert h["bytes_up"] == {c: b for c, d, b in log if d == "up"}
    single = _engine("single", clients, rounds=1).run()[0]
    assert single["bytes_up_total"] == single["bytes_down_total"] == 0
    # FedAvg moves every tensor, BatchNorm's integer counters among them: each byte counted, up and down
    whole = sum(t.numel() * t.element_size() for t in m.state_dict().values())
    assert any(not t.is_floating_point() for t in m.state_dict().values())
    fedavg = _engine("fedavg", clients, rounds=1).run()[0]
    assert fedavg["bytes_down_total"] == whole * len(clients[0]) == fedavg["bytes_up_total"]


def test_a_client_fraction_draws_other_clients_from_round_to_round(clients):
    """client_fraction 0.5 of four clients: two a round, drawn anew each round (seeded by the round)."""
    h = _engine("fedavg", clients, rounds=6, client_fraction=0.5).run()
    picks = [tuple(e["sampled"]) for e in h]
    assert all(len(p) == len(clients[0]) // 2 for p in picks) and len(set(picks)) > 1, picks


def test_an_upload_of_private_state_is_refused(clients):
    class Leaky(FedAvg):
        name = "leaky"

        def private_keys(self, model):
            return {"units.0.0.weight"}

    cl, cin, nc = clients
    tp = TrainParams(rounds=1, batch_size=16, device="cpu", count_flops=False)
    with pytest.raises(PrivacyViolation, match="units.0.0.weight"):
        Engine(Leaky(Leaky.params_cls(), tp), build_model("simple_cnn", cin, nc, seed=0, width=0.25), cl, tp, seed=0).run()


def test_an_announce_of_private_state_is_refused_too(clients):
    """The guard covers a method's announce (what a client tells the server before training), not only uploads."""

    class Chatty(FedAvg):
        name = "chatty"

        def private_keys(self, model):
            return {"units.0.0.weight"}

        def shared_keys(self, model):
            return [k for k in super().shared_keys(model) if k != "units.0.0.weight"]

        def announce(self, model, store, client, rnd):
            return {"units.0.0.weight": model.state_dict()["units.0.0.weight"].detach().clone()}

    cl, cin, nc = clients
    tp = TrainParams(rounds=1, batch_size=16, device="cpu", count_flops=False)
    with pytest.raises(PrivacyViolation, match="units.0.0.weight"):
        Engine(Chatty(Chatty.params_cls(), tp), build_model("simple_cnn", cin, nc, seed=0, width=0.25), cl, tp, seed=0).run()


def test_fedavg_server_is_the_size_weighted_mean(clients):
    """Each upload weighs by its client's training images (the first client cut to 12 of 32: with equal sizes any
    mean is the weighted one)."""
    import dataclasses

    cl, cin, nc = clients
    uneven = [dataclasses.replace(cl[0], x_train=cl[0].x_train[:12], y_train=cl[0].y_train[:12]), *cl[1:]]
    ups = []
    e = _engine("fedavg", (uneven, cin, nc), rounds=1, observer=lambda r, c, d, p: ups.append(p) if d == "up" else None)
    e.run()
    k = "units.0.0.weight"
    n = np.array([c.n_train for c in uneven], dtype=float)
    assert n[0] == 12 and len(set(n)) > 1
    expect = sum(u[k].double() * w for u, w in zip(ups, n / n.sum()))
    assert torch.allclose(e.server[k].double(), expect, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(e.server[k].double(), sum(u[k].double() for u in ups) / len(ups), atol=1e-6, rtol=1e-5)


def test_single_and_fedbn_learn_well_above_chance(clients):
    for name in ("single", "fedbn"):
        # Simple-CNN's 14 M parameters are not the point here: a 33 k one, 12 rounds (measured: 0.95 and 0.94)
        h = _engine(name, clients, rounds=12, local_epochs=3, momentum=0.9, model=small_cnn(clients[1], clients[2])).run()
        assert h[-1]["mean_acc"] > 0.75, (name, [round(x["mean_acc"], 3) for x in h])


def test_fedprox_term_pulls_towards_the_global_model(clients):
    cl, cin, nc = clients
    far = []
    for mu in (1e-6, 5.0):
        tp = TrainParams(rounds=1, batch_size=16, lr=0.02, device="cpu", count_flops=False)
        cls = method_class("fedprox")
        ups = []
        e = Engine(cls(cls.params_cls(mu=mu), tp), build_model("simple_cnn", cin, nc, seed=0, width=0.25), cl, tp, seed=0,
                   observer=lambda r, c, d, p, ups=ups: ups.append((d, p)))
        e.run()
        start = [p for d, p in ups if d == "down"][0]
        end = [p for d, p in ups if d == "up"][0]
        far.append(sum(float(((end[k].float() - start[k].float()) ** 2).sum()) for k in start if start[k].is_floating_point()))
    assert far[1] < far[0]


def test_same_seed_same_numbers(clients):
    a = _engine("fedavg", clients, rounds=2).run()
    b = _engine("fedavg", clients, rounds=2).run()
    assert [x["eval"] for x in a] == [x["eval"] for x in b]


def test_fedper_keeps_the_head_local(clients):
    seen = []
    e = _engine("fedper", clients, rounds=1, observer=lambda r, c, d, p: seen.append((d, set(p))))
    e.run()
    head = {k for k in e.model.state_dict() if k.startswith("units.5.")}
    assert head and all(not (keys & head) for d, keys in seen)
    assert all("units.0.0.weight" in keys for d, keys in seen)
    heads = [s["units.5.weight"] for s in e.stores]
    assert not torch.equal(heads[0], heads[1]), "each client trains its own head"


@pytest.mark.parametrize("name", ["fedper", "ditto"])
def test_each_client_is_scored_with_its_own_model(clients, name):
    """FedPer's clients are scored with their own head, Ditto's with their personal model: wreck one client's kept
    part and its score alone changes (scored with the global model, or another client's, every score would move or
    none)."""
    e = _engine(name, clients, rounds=1)
    e.run()
    before = e.evaluate()["eval"]
    first = clients[0][0].name
    e.stores[0] = {k: (torch.zeros_like(v) if v.is_floating_point() else v) for k, v in e.stores[0].items()}
    after = e.evaluate()["eval"]
    assert after[first] != before[first] and all(after[c] == before[c] for c in before if c != first), (before, after)


def test_ditto_personal_models_stay_home_and_follow_lambda(clients):
    cl, cin, nc = clients
    dist = {}
    for lam in (0.0, 50.0):
        seen = []
        tp = TrainParams(rounds=2, batch_size=16, lr=0.02, device="cpu", count_flops=False)
        cls = method_class("ditto")
        e = Engine(cls(cls.params_cls(lam=lam), tp), build_model("simple_cnn", cin, nc, seed=0, width=0.25), cl, tp, seed=0,
                   observer=lambda r, c, d, p, seen=seen: seen.append((d, set(p))))
        h = e.run()
        assert all(not any(k.startswith("personal::") for k in keys) for d, keys in seen)
        assert "global" in h[-1] and "eval" in h[-1]
        w = e.server["units.3.0.weight"]
        dist[lam] = float(sum(((s["personal::units.3.0.weight"] - w) ** 2).sum() for s in e.stores))
    assert dist[50.0] < dist[0.0]


def test_compiled_model_gives_the_same_numbers_and_keys(clients):
    """A compiled round scores as the eager one and the server's keys carry no ``_orig_mod`` prefix. (The tiny net: what
    inductor takes to compile grows with the graph, 19 s for Simple-CNN's on two cores, 10 s for this one.)"""
    from tests.tiny import tiny_net

    cl, cin, nc = clients
    evals = []
    for comp in (False, True):
        tp = TrainParams(rounds=1, batch_size=16, lr=0.02, device="cpu", count_flops=False, compile=comp)
        cls = method_class("fedavg")
        e = Engine(cls(cls.params_cls(), tp), tiny_net(cin, nc), cl, tp, seed=0)
        evals.append(e.run()[-1]["eval"])
        assert all(not k.startswith("_orig_mod") for k in e.server)
    for c in evals[0]:
        assert abs(evals[0][c]["loss"] - evals[1][c]["loss"]) < 1e-4


def test_a_compiled_model_runs_uncompiled_while_a_method_hooks_its_forward(caplog):
    """TorchDynamo does not see a forward hook registered after compilation (the features a method's loss reads, FedRCL's
    levels): while one is on, the model's own forward runs, once it is removed the compiled one again; hooks the model
    had when compiled (FedLGF's, registered in setup) keep the compiled forward. (torch.compile is lazy: nothing is
    compiled here.)"""
    from fedsilo.client.features import representation
    from fedsilo.client.local import compile_model, forward_fn
    from tests.tiny import tiny_net

    model = tiny_net(1, 4)
    model.units[0].register_forward_pre_hook(lambda m, i: None)  # before compilation
    compile_model(model)
    compiled = forward_fn(model)
    assert compiled is not model
    with caplog.at_level("WARNING", logger="fedsilo.client.local"):
        with representation(model) as rep:
            assert forward_fn(model) is model
            forward_fn(model)(torch.zeros(2, 1, 8, 8))
            assert rep.z is not None and rep.z.shape == (2, 16)
    assert forward_fn(model) is compiled
    assert sum("run the model uncompiled" in r.getMessage() for r in caplog.records) == 1


def test_fedavg_two_phase_is_single_then_fedavg_from_the_weighted_mean(clients):
    """pFedDB Fig. 5's "FedAvg under the two-phase protocol": rounds 1..E0 are exactly Single (same numbers, nothing
    sent); round E0 uploads every client's model and the server becomes their sample-size-weighted mean."""
    cl, cin, nc = clients
    tp = TrainParams(rounds=4, batch_size=16, lr=0.02, device="cpu", count_flops=False)
    ups: dict[str, dict] = {}

    def observer(rnd, name, direction, payload):
        if rnd == 2 and direction == "up":
            ups[name] = payload

    two = Engine(FedAvg(FedAvg.params_cls(local_rounds=2), tp), build_model("simple_cnn", cin, nc, seed=0, width=0.25), cl, tp, seed=0, observer=observer)
    h2 = two.run()
    single = _engine("single", clients, rounds=4).run()
    assert [h["eval"] for h in h2[:1]] == [h["eval"] for h in single[:1]]
    assert h2[0]["bytes_up_total"] == h2[0]["bytes_down_total"] == 0
    assert h2[1]["bytes_up_total"] > 0 and h2[1]["bytes_down_total"] == 0 and len(h2[1]["sampled"]) == len(cl)
    assert h2[2]["bytes_down_total"] > 0 and "global" in h2[3]
    # after round 2 the server held the size-weighted mean of the uploaded local models; round 3 started from it
    n = {c.name: c.n_train for c in cl}
    key = next(k for k in ups[cl[0].name] if k.endswith("weight"))
    mean = sum(ups[c][key].float() * n[c] for c in ups) / sum(n.values())
    assert not torch.equal(ups[cl[0].name][key], ups[cl[1].name][key])  # the clients trained apart in Phase 1
    two_b = Engine(FedAvg(FedAvg.params_cls(local_rounds=2), tp), build_model("simple_cnn", cin, nc, seed=0, width=0.25), cl, tp, seed=0)
    two_b.step()
    two_b.step()
    assert torch.allclose(two_b.server[key].float(), mean, atol=1e-6)


def test_two_phase_fedavg_resumed_inside_phase_one_matches_an_uninterrupted_run(clients, tmp_path):
    """A run stopped during Phase 1 and restarted from its checkpoint (a fresh method object, init_server skipped)
    must still start the clients that have no local model yet from the seeded initialisation."""
    cl, cin, nc = clients
    tp = TrainParams(rounds=3, batch_size=16, lr=0.02, device="cpu", count_flops=False)

    def engine(ck=None):
        return Engine(FedAvg(FedAvg.params_cls(local_rounds=2), tp), build_model("simple_cnn", cin, nc, seed=0, width=0.25), cl, tp,
                      seed=0, checkpoint=ck, config_hash="h")

    whole = engine().run()
    ck = tmp_path / "ck.pt"
    engine(ck).save()  # stopped before its first round: every client store is still empty
    resumed = engine(ck).run()
    assert [h["eval"] for h in resumed] == [h["eval"] for h in whole]


def test_a_run_resumed_after_its_last_round_evaluates_as_the_uninterrupted_one(tmp_path):
    """A run that died after its last checkpoint but before writing its outputs resumes at its last round: the
    method's round state (FT-FedAvg's phase: fine-tuning and the global model) is restored, so the evaluation and the
    spectra are the uninterrupted run's."""
    from tests.tiny import style_shifted_federation, tiny_net

    ck = tmp_path / "ck.pt"

    def engine():
        cl = style_shifted_federation(n_train=17, n_test=20, per_domain=1)
        tp = TrainParams(rounds=3, batch_size=8, count_flops=False, device="cpu")
        return Engine(FedAvg(FedAvg.params_cls(local_rounds=1, finetune_epochs=1), tp), tiny_net(1, 4, 0), cl, tp, seed=0,
                      checkpoint=ck, config_hash="h")

    whole = engine()
    whole.run()
    resumed = engine()
    assert resumed.round == 3
    ev_whole, ev_resumed = whole.evaluate(), resumed.evaluate()
    assert "global" in ev_resumed and ev_resumed["eval"] == ev_whole["eval"] and ev_resumed["global"] == ev_whole["global"]
    assert resumed.spectra() == whole.spectra()


def test_phase_one_trains_every_client_whatever_the_sampling_fraction(clients):
    cl, cin, nc = clients
    tp = TrainParams(rounds=4, batch_size=16, lr=0.02, device="cpu", count_flops=False, client_fraction=0.5)
    e = Engine(FedAvg(FedAvg.params_cls(local_rounds=2), tp), build_model("simple_cnn", cin, nc, seed=0, width=0.25), cl, tp, seed=0)
    h = e.run()
    assert [len(x["sampled"]) for x in h] == [len(cl), len(cl), max(1, len(cl) // 2), max(1, len(cl) // 2)]


def test_a_client_that_left_is_neither_sampled_nor_evaluated_after_its_last_round(clients):
    """``left`` (a deployment's site that left for good, the name -> its last round): from the round after, the
    round's fraction is drawn among the clients still in, a phase that trains every client trains those, and the
    evaluations score those; the rounds before are as without it."""
    cl, cin, nc = clients
    gone = cl[1].name
    tp = TrainParams(rounds=3, batch_size=16, lr=0.02, device="cpu", count_flops=False, client_fraction=0.5)

    def run(left=None):
        method = FedAvg(FedAvg.params_cls(local_rounds=2), tp)  # rounds 1-2 train every client, then half of them
        return Engine(method, build_model("simple_cnn", cin, nc, seed=0, width=0.25), cl, tp, seed=0, left=left).run()

    whole, h = run(), run({gone: 1})
    assert len(cl) >= 4 and [len(x["sampled"]) for x in h] == [len(cl), len(cl) - 1, (len(cl) - 1) // 2]
    assert gone in h[0]["sampled"] and gone in h[0]["eval"] and "left" not in h[0]
    assert all(gone not in x["sampled"] and gone not in x["eval"] and x["left"] == [gone] for x in h[1:])
    assert all(len(x["eval"]) == len(cl) - 1 for x in h[1:])
    assert h[0]["eval"] == whole[0]["eval"] and h[0]["bytes_up"] == whole[0]["bytes_up"]  # round 1 as without it


def test_a_client_away_for_some_rounds_takes_part_again_after_them():
    """``away`` (a deployment's site that left and came back: name -> the rounds it was gone): in those rounds it is
    neither sampled nor evaluated and is named as left; from the round after it takes part again (named ``back``),
    as a client that was not sampled in those rounds; gone again right after, it is not back."""
    from tests.tiny import style_shifted_federation, tiny_net

    cl = style_shifted_federation(n_train=12, n_test=6, per_domain=1)[:3]
    gone = cl[1].name
    tp = TrainParams(rounds=5, batch_size=6, lr=0.02, device="cpu", count_flops=False)
    h = Engine(FedAvg(FedAvg.params_cls(), tp), tiny_net(1, 4), cl, tp, seed=0, away={gone: [(2, 3)]}).run()
    assert [gone in x["sampled"] for x in h] == [gone in x["eval"] for x in h] == [True, False, False, True, True]
    assert [x.get("left") for x in h] == [None, [gone], [gone], None, None]
    assert [x.get("back") for x in h] == [None, None, None, [gone], None]
    again = Engine(FedAvg(FedAvg.params_cls(), tp), tiny_net(1, 4), cl, tp, seed=0, away={gone: [(2, 3)]}, left={gone: 3}).run()
    assert all("back" not in x for x in again) and [gone in x["sampled"] for x in again] == [True, False, False, False, False]


def test_a_last_batch_of_one_joins_the_previous_batch():
    from fedsilo.client.local import batches

    for n in (17, 33, 16, 1):
        got = batches(n, 16, torch.Generator().manual_seed(0))
        assert sorted(torch.cat(got).tolist()) == list(range(n))
        assert all(len(b) > 1 for b in got) or n == 1


def test_batches_per_epoch_counts_what_batches_makes():
    from fedsilo.client.local import batches, batches_per_epoch

    for n in range(1, 70):
        assert batches_per_epoch(n, 16) == len(batches(n, 16, torch.Generator().manual_seed(0))), n


def test_each_round_records_its_training_and_total_seconds(clients):
    from fedsilo.tracking import round_metrics

    h = _engine("fedavg", clients, rounds=2, eval_every=2).run()
    assert all(0 < e["train_seconds"] <= e["seconds"] for e in h)
    assert "eval" not in h[0] and "eval" in h[1]
    assert round_metrics(h[1])["train_seconds"] == h[1]["train_seconds"]


def test_flops_of_the_last_round_scale_with_the_work_and_change_no_number(clients):
    plain = _engine("fedavg", clients, rounds=2, count_flops=False).run()
    one = _engine("fedavg", clients, rounds=2, count_flops=True).run()
    two = _engine("fedavg", clients, rounds=2, local_epochs=2, count_flops=True).run()
    assert [x["eval"] for x in plain] == [x["eval"] for x in one], "counting must not change training"
    assert "train_flops" not in plain[-1] and "train_flops" not in one[0]  # only the last round is counted
    assert one[-1]["train_flops"] > 0
    assert two[-1]["train_flops"] == 2 * one[-1]["train_flops"]  # the same batches, twice
    moon = _engine("moon", clients, rounds=2, count_flops=True).run()  # forwards the global and the previous model beside the local one
    assert moon[-1]["train_flops"] > one[-1]["train_flops"]


def test_the_classifier_is_the_heads_last_linear_and_the_spectrum_is_the_covariances_eigenvalues():
    """The representation is the input of the head's last linear layer, even where another linear layer (a projection)
    is registered after the head; the spectrum is the eigenvalues of the representations' (centred, n - 1) covariance,
    d of them, zeros past n - 1; effective rank counts only the positive mass; one image has no covariance."""
    from fedsilo.client.features import classifier, covariance_spectrum, effective_rank, features_of

    class WithProjection(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
            self.proj = torch.nn.Linear(16, 16)

        def forward(self, x):
            z = x.flatten(1) + 0.5
            self.proj(z)
            return self.head(z)

    model = WithProjection()
    assert classifier(model) is model.head[2]
    x = torch.randint(0, 256, (6, 1, 4, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    z = features_of(model, x, NormalizeParams()).double()
    assert z.shape == (6, 8)
    want = torch.linalg.eigvalsh(torch.cov(z.T)).flip(0).clamp_min(0)
    s = covariance_spectrum(model, x, NormalizeParams(), batch_size=4)
    assert s.shape == (8,) and bool((s[6:] == 0).all()) and s[5] < 1e-9 * s[0]  # 6 images: 5 directions at most
    torch.testing.assert_close(s.double(), want, atol=1e-6, rtol=1e-4)
    assert effective_rank(torch.tensor([1.0, 1.0, 0.0, 0.0])) == pytest.approx(2.0)
    assert effective_rank(torch.tensor([1.0, 1.0, -0.5])) == pytest.approx(2.0)  # a rounding error below zero is none
    with pytest.raises(ValueError, match="needs at least 2 images, got 1"):
        covariance_spectrum(model, x[:1], NormalizeParams())


def test_spectra_count_the_directions_the_representations_span(clients):
    from fedsilo.client.features import covariance_spectrum, effective_rank

    class Rank3(torch.nn.Module):  # representations in a 3-d subspace of R^8
        def __init__(self):
            super().__init__()
            self.basis = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
            self.fc = torch.nn.Linear(8, 2)

        def forward(self, x):
            return self.fc(x.flatten(1)[:, :3] @ self.basis)

    x = torch.randint(0, 256, (50, 1, 4, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    s = covariance_spectrum(Rank3(), x, NormalizeParams(), batch_size=16)
    assert s.shape == (8,) and bool((s[:-1] >= s[1:]).all())
    assert bool((s[:3] > 1e-3).all()) and bool((s[3:] < 1e-9 * s[0]).all())
    assert 1.0 <= effective_rank(s) <= 3.0
    assert effective_rank(torch.ones(8)) == pytest.approx(8.0)
    e = _engine("fedavg", clients, rounds=1)
    e.run()
    before = {k: v.clone() for k, v in e.server.items()}
    sp = e.spectra()
    assert set(sp) == {c.name for c in clients[0]} and all(len(v) == 128 for v in sp.values())  # simple_cnn at width 0.25: fc2 -> 128
    assert all(torch.equal(before[k], e.server[k]) for k in before)


def test_checkpoint_every_k_rounds_resumes_from_the_last_one_with_the_same_numbers(tmp_path, monkeypatch):
    """train.checkpoint_every: 3 of 5 rounds writes after rounds 3 and 5 only; a run killed after round 4 resumes
    after round 3, trains round 4 again, and ends with the uninterrupted run's numbers. A stop asked for (a first
    SIGTERM) writes the round in flight."""
    import threading

    from fedsilo.methods import method_class
    from tests.tiny import style_shifted_federation, tiny_net, without_timing

    clients = style_shifted_federation(n_train=16, n_test=8, per_domain=1)
    tp = TrainParams(rounds=5, batch_size=8, lr=0.05, device="cpu", count_flops=False, checkpoint_every=3, client_fraction=0.5)

    def make(ck):
        cls = method_class("fedbn")
        return Engine(cls(cls.params_cls(), tp), tiny_net(1, 4), clients, tp, seed=0, checkpoint=ck, config_hash="h")

    written = []
    real = Engine.save
    monkeypatch.setattr(Engine, "save", lambda self: (written.append(self.round), real(self)))
    full = make(tmp_path / "a.pt").run()
    assert written == [3, 5], "every 3rd round and the last (no round 0: a run killed before round 3 starts again the same)"
    part = make(tmp_path / "b.pt")
    for _ in range(4):
        part.step()
    resumed = make(tmp_path / "b.pt")
    assert resumed.round == 3 and len(resumed.history) == 3
    assert without_timing(resumed.run()) == without_timing(full)
    # Engine.stop set during round 2 (a first SIGTERM): run() returns after it with round 2 written although no write
    # was due; the run resumed after it ends with the same numbers
    written.clear()
    stopped = make(tmp_path / "c.pt")
    stopped.stop = threading.Event()
    stopped.on_round = lambda entry: entry["round"] == 2 and stopped.stop.set()
    assert len(stopped.run()) == 2 and written == [2]
    resumed = make(tmp_path / "c.pt")
    assert resumed.round == 2 and without_timing(resumed.run()) == without_timing(full)
    # a stop asked for after a round's write check, before run() looks again: run() writes that round itself
    written.clear()
    late = make(tmp_path / "d.pt")
    late.stop = threading.Event()
    step = late.step
    late.step = lambda: (step(), late.stop.set())[0]
    assert len(late.run()) == 1 and written == [1]


def _tiny_engine(ck, config_hash="h", rounds=3):
    from tests.tiny import style_shifted_federation, tiny_net

    clients = style_shifted_federation(n_train=8, n_test=4, per_domain=1)
    tp = TrainParams(rounds=rounds, batch_size=8, lr=0.05, device="cpu", count_flops=False, checkpoint_every=1, eval_every=100)
    cls = method_class("fedbn")
    return Engine(cls(cls.params_cls(), tp), tiny_net(1, 4), clients, tp, seed=0, checkpoint=ck, config_hash=config_hash)


def test_a_checkpoint_of_another_configuration_is_not_resumed_and_is_overwritten(tmp_path):
    """A checkpoint written under another config hash (a changed params file, other code) is ignored: the run starts
    at round 0 with the initial server state, and its first write replaces the stale checkpoint."""
    ck = tmp_path / "ck.pt"
    old = _tiny_engine(ck, config_hash="old")
    old.step()
    old.step()
    fresh = _tiny_engine(ck, config_hash="new")
    assert fresh.round == 0 and fresh.history == []
    init = _tiny_engine(None).server
    assert fresh.server.keys() == init.keys() and all(torch.equal(fresh.server[k], init[k]) for k in init)
    fresh.step()
    held = torch.load(ck, weights_only=False)
    assert held["config_hash"] == "new" and held["round"] == 1
    assert _tiny_engine(ck, config_hash="new").round == 1


def test_a_checkpoint_write_that_fails_midway_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    """The checkpoint goes to a temporary sibling first: a write that fails partway (a full disk, a kill) leaves the
    last whole checkpoint in place, from which the run resumes, and no temporary beside it."""
    from fedsilo.fl import engine as engine_mod

    ck = tmp_path / "ck.pt"
    e = _tiny_engine(ck)
    e.step()
    before = ck.read_bytes()

    def half_then_fail(obj, f, *a, **k):
        Path(f).write_bytes(b"half a checkpoint")
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(engine_mod.torch, "save", half_then_fail)
    with pytest.raises(OSError, match="Input/output error"):
        e.step()
    monkeypatch.undo()
    assert ck.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["ck.pt"]
    resumed = _tiny_engine(ck)
    assert resumed.round == 1 and len(resumed.history) == 1


def test_auto_checkpoint_writes_once_the_time_since_the_last_write_reaches_twenty_writes(monkeypatch, tmp_path):
    """train.checkpoint_every: auto (the default) on a fake clock: rounds of 5 s, writes of 1 s. The first round is
    written (nothing measured yet); the next write comes with the first round ending 20 s (20 x 1 s) after the last
    write ended, and the last round is always written. Free writes: every round."""
    from fedsilo.fl import engine as engine_mod
    from fedsilo.methods import method_class
    from tests.tiny import style_shifted_federation, tiny_net

    clients = style_shifted_federation(n_train=8, n_test=4, per_domain=1)
    tp = TrainParams(rounds=6, batch_size=8, lr=0.05, device="cpu", count_flops=False, client_fraction=0.5, eval_every=100)
    assert tp.checkpoint_every == "auto"
    clock = [0.0]
    monkeypatch.setattr(engine_mod, "_now", lambda: clock[0])
    monkeypatch.setattr(engine_mod, "AUTO_CHECKPOINT_RATIO", 20)  # conftest sets 0 for the other tests
    written: list[int] = []

    def run(write_s: float) -> Engine:
        written.clear()
        cls = method_class("fedavg")
        e = Engine(cls(cls.params_cls(), tp), tiny_net(1, 4), clients, tp, seed=0, checkpoint=tmp_path / "never_written.pt", config_hash="h",
                   on_round=lambda entry: clock.__setitem__(0, clock[0] + 5.0))

        def write() -> None:
            written.append(e.round)
            clock[0] += write_s

        e._write_checkpoint = write
        e.run()
        return e

    run(1.0)
    # round k ends at 6 + 5 (k - 1) s, the first write having ended at 6 s: 26 s, the first >= 6 + 20, is round 5
    assert written == [1, 5, 6]
    clock[0] = 0.0
    run(0.0)
    assert written == list(range(1, 7))


def test_graceful_stop_defers_a_first_sigterm_only_while_the_rounds_run():
    import signal

    from fedsilo.fl.run import GracefulStop

    g = GracefulStop()
    with pytest.raises(SystemExit) as outside:  # loading data, writing outputs: at once
        g.handler(signal.SIGTERM, None)
    assert outside.value.code == 143 and not g.requested.is_set()
    with g.rounds():
        g.handler(signal.SIGTERM, None)  # the first: the engine's stop
        assert g.requested.is_set()
        with pytest.raises(SystemExit) as second:  # the second: at once
            g.handler(signal.SIGTERM, None)
        assert second.value.code == 143


def test_eval_summary_names_the_clients_left_out_of_mean_auc():
    from fedsilo.fl.engine import eval_summary

    out = eval_summary({"a": {"acc": 0.5, "auc": 0.8}, "b": {"acc": 1.0, "auc": float("nan")}, "c": {"acc": 0.0, "auc": 0.6}})
    assert out["mean_auc"] == pytest.approx(0.7) and out["auc_undefined"] == ["b"]
    assert out["std_acc"] == pytest.approx(np.std([0.5, 1.0, 0.0]))  # population std over clients (ddof 0)
    assert "auc_undefined" not in eval_summary({"a": {"acc": 0.5, "auc": 0.8}})


def test_deterministic_switch_turns_on_deterministic_kernels(monkeypatch):
    from fedsilo.fl import run

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        run.deterministic_kernels()
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
        import os

        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before)
    assert TrainParams(deterministic=True).deterministic and not TrainParams().deterministic


def test_generator_keys_with_a_trailing_zero_draw_the_same_stream_as_without():
    # documented in make_generator: what Ditto's and FedRep's first phase rely on to draw FedAvg's batches
    from fedsilo.client.local import make_generator

    draw = lambda *k: torch.rand(4, generator=make_generator(*k))  # noqa: E731
    assert torch.equal(draw(1, 2, 3, 0), draw(1, 2, 3)) and not torch.equal(draw(1, 2, 3, 1), draw(1, 2, 3))


@pytest.mark.parametrize("base", ["fedbn", "fedavg"])
def test_a_method_keeping_bookkeeping_beside_the_model_uses_the_partial_sharing_defaults(base):
    """The server state and a client's store may hold a method's own tensors beside the model's (a count per client,
    a record of the round): the base's local update hands the store to ``local_terms`` and loads the model's tensors
    only, the evaluation and the global model leave the bookkeeping out (a strict load took every key before), and
    ``RunningMean.count`` is the round's number of uploads. On FedBN (private BatchNorm) and on FedAvg (its own
    evaluation state and two-phase store)."""
    from tests.tiny import one_thread, style_shifted_federation, tiny_net

    seen: list = []

    class Counting(method_class(base)):  # type: ignore[misc, valid-type]
        name = "counting"

        def init_client(self, model, client):
            return {**super().init_client(model, client), "count::kept": torch.zeros(())}

        def private_keys(self, model):
            return super().private_keys(model) | {"count::kept"}

        def local_terms(self, model, payload, client, rnd, seed, store):
            seen.append((rnd, client.name, float(store["count::kept"]), "count::rounds" in payload))
            return super().local_terms(model, payload, client, rnd, seed, store)

        def local_update(self, model, store, payload, client, rnd, seed):
            up = super().local_update(model, store, payload, client, rnd, seed)
            store["count::kept"] = store["count::kept"] + 1
            return up

        def agg_end(self, server, acc, rnd):
            return {**super().agg_end(server, acc, rnd), "count::rounds": torch.tensor(acc.count)}

    clients = style_shifted_federation(n_train=8, n_test=4, per_domain=1)[:3]
    tp = TrainParams(rounds=2, batch_size=8, lr=0.05, device="cpu", count_flops=False, client_fraction=0.67)
    with one_thread():
        engine = Engine(Counting(Counting.params_cls(), tp), tiny_net(1, 4), clients, tp, seed=0)
        history = engine.run()
    assert "eval" in history[-1]  # evaluated with the store's and the server's bookkeeping beside the model
    first = {c for r, c, _, _ in seen if r == 1}
    assert [(r, kept, told) for r, c, kept, told in seen if r == 2] == [(2, float(c in first), True) for r, c, _, _ in seen if r == 2]
    assert all(kept == 0.0 and not told for r, _, kept, told in seen if r == 1)
    assert int(engine.server["count::rounds"]) == len(history[-1]["sampled"]) == 2
    model = tiny_net(1, 4)
    state = engine.method.eval_state(engine.server, engine.stores[0], clients[0])
    assert not any(k.startswith("count::") for k in state)
    model.load_state_dict(state, strict=True)
    glob = engine.method.global_state(engine.server)
    if base == "fedbn":
        assert glob is None  # FedBN keeps BatchNorm home: no global model
    else:
        assert not any(k.startswith("count::") for k in glob)
        model.load_state_dict(glob, strict=True)
        # FedAvg's two phases: Phase 1's own model lives in the store beside the count, and the federation's start
        # takes the model out of the store, not the count
        tp1 = tp.model_copy(update={"rounds": 3})
        with one_thread():
            two = Engine(Counting(Counting.params_cls(local_rounds=1), tp1), tiny_net(1, 4), clients, tp1, seed=0)
            assert "eval" in two.run()[-1]
        assert all(set(s) == {"count::kept"} for s in two.stores)
