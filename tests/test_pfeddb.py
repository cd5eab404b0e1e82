"""pFedDB: dual-branch transform, Eq. 6 initialisation, what is uploaded, shared fractions, learning."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from fedsilo.client.data import load_clients
from fedsilo.config import DomainClientsSplit, TrainParams
from fedsilo.data.splits import make_split
from fedsilo.fl.engine import Engine
from fedsilo.methods.pfeddb import DualBranch, PFedDB, PFedDBParams
from fedsilo.models import build_model


@pytest.fixture(scope="module")
def clients(mirror_root):
    h = mirror_root / "data" / "harmonized" / "chest_xray4"
    split = make_split(pd.read_parquet(h / "records.parquet"), DomainClientsSplit(n_train=24, n_test=20), seed=0)
    cl, cin, nc = load_clients(h, split, torch.device("cpu"))
    # unequal client sizes so that Eq. 6's weights matter
    cl[0].x_train, cl[0].y_train = cl[0].x_train[:12], cl[0].y_train[:12]
    return cl, cin, nc


def _engine(clients, observer=None, rounds=4, model="simple_cnn", **kw):
    cl, cin, nc = clients
    tp = TrainParams(rounds=rounds, batch_size=8, lr=0.02, device="cpu", count_flops=False)
    algo = PFedDB(PFedDBParams(**kw), tp)
    return Engine(algo, build_model(model, cin, nc, seed=0), cl, tp, seed=0, observer=observer)


def test_phi_init_is_the_size_weighted_mean_of_phase1_extractors(clients):
    ups = []
    e = _engine(clients, observer=lambda r, c, d, p: ups.append((r, c, d, p)), rounds=3, local_rounds=2, cut_depth=3)
    e.step()  # round 1: Phase 1, nothing sent
    assert all(not p for r, c, d, p in ups), "Phase 1 sends nothing before the transition"
    entry = e.step()  # round 2 = E0: every client uploads psi*
    psi = [p for r, c, d, p in ups if r == 2 and d == "up"]
    assert len(psi) == len(clients[0]) and entry["bytes_up_total"] > 0 and entry["bytes_down_total"] == 0
    n = torch.tensor([float(c.n_train) for c in clients[0]])
    assert set(e.server) - set(e.method.shared) == {f"pfeddb:local_model::{c.name}" for c in clients[0]}  # bookkeeping
    for k in e.method.shared:
        expect = sum(p[k].double() * w for p, w in zip(psi, n / n.sum()))
        if not e.server[k].is_floating_point():  # BatchNorm's batch counter is averaged and rounded
            expect = expect.round()
        assert torch.allclose(e.server[k].double(), expect, atol=1e-6), k
        # and psi* is exactly each client's private extractor at the end of Phase 1
        for store, p in zip(e.stores, psi):
            assert torch.equal(store["private." + k[len("shared."):]], p[k])


def test_only_phi_is_ever_uploaded(clients):
    ups = []
    e = _engine(clients, observer=lambda r, c, d, p: ups.append((r, d, p)), rounds=4, local_rounds=1, cut_depth=3)
    e.run()
    keys = {k for r, d, p in ups if d == "up" for k in p}
    assert keys and all(k.startswith("shared.") for k in keys)
    assert not any(k.startswith(("private.", "head.", "fusion.")) for r, d, p in ups for k in p)
    # after the transition the uploaded phi differs from every client's private psi
    last = [p for r, d, p in ups if r == 4 and d == "up"]
    for store, p in zip(e.stores, last):
        k = next(iter(p))
        assert not torch.equal(p[k], store["private." + k[len("shared."):]])
    phi_bytes = sum(t.numel() * t.element_size() for t in last[0].values())
    assert e.history[-1]["bytes_up_total"] == phi_bytes * len(clients[0])


@pytest.mark.parametrize("model, depth, ratio", [("densenet121", 88, 0.68), ("alexnet_bn", 6, 0.71)])
def test_shared_fraction_matches_the_paper(model, depth, ratio):
    base = build_model(model, 3, 2)
    algo = PFedDB(PFedDBParams(cut_depth=depth), TrainParams(rounds=300))
    dual = algo.transform_model(base, torch.randn(2, 3, 64, 64))
    shared = sum(p.numel() for n, p in dual.named_parameters() if n.startswith("shared."))
    full = sum(p.numel() for p in base.parameters())
    assert abs(shared / full - ratio) < 0.015


@pytest.mark.parametrize("fusion", ["add", "concat", "attention", "weighted"])
def test_fusion_variants_run_and_phase1_is_single_branch(fusion):
    base = build_model("simple_cnn", 1, 2, seed=0).eval()
    dual = DualBranch(base, 3, fusion, 0.3, torch.randn(2, 1, 28, 28)).eval()
    x = torch.randn(4, 1, 28, 28)
    with torch.no_grad():
        assert dual(x).shape == (4, 2)
        dual.phase = 1
        assert torch.allclose(dual(x), base(x), atol=1e-6)


def test_without_two_phase_federation_starts_at_round_one(clients):
    e = _engine(clients, rounds=2, two_phase=False, cut_depth=3)
    h = e.run()
    assert h[0]["bytes_up_total"] > 0 and h[0]["bytes_down_total"] > 0


def test_bad_cut_depth_and_schedule_are_refused(clients):
    with pytest.raises(ValueError, match="falls inside unit"):
        _engine(clients, model="resnet10", cut_depth=2)
    with pytest.raises(ValueError, match="local_rounds"):
        _engine(clients, rounds=3, local_rounds=3)


def test_pfeddb_beats_single_where_domains_share_signal():
    """Four clients, one per domain; the domains share the class signal (bar orientation) and differ in style.
    Same budget for both: 10 rounds of 2 local epochs; pFedDB spends 5 of them in Phase 1 (identical to Single
    there) and 5 federated, sharing the two conv layers. Measured: pFedDB 0.83, Single 0.72 (+0.08 and +0.11 on two
    other data seeds). With cut_depth 1 (only the first conv shared) the gain vanishes (-0.005): the shared extractor
    is what helps. On the CXR mirrors the same comparison gave +0.004 over three seeds in five minutes."""
    import numpy as np

    from fedsilo.methods.single import Single
    from tests.tiny import style_shifted_federation, tiny_net

    cl = style_shifted_federation(n_train=20, per_domain=1)
    final: dict[str, list[float]] = {"single": [], "pfeddb": []}
    for seed in (0, 1, 2):
        tp = TrainParams(rounds=10, local_epochs=2, batch_size=8, lr=0.05, momentum=0.9, device="cpu", eval_every=5, count_flops=False)
        hs = Engine(Single(Single.params_cls(), tp), tiny_net(1, 4, seed=seed), cl, tp, seed=seed).run()
        hp = Engine(PFedDB(PFedDBParams(local_rounds=5, cut_depth=2), tp), tiny_net(1, 4, seed=seed), cl, tp, seed=seed).run()
        assert hp[4]["eval"] == hs[4]["eval"], "Phase 1 is exactly local training"
        final["single"].append(hs[-1]["mean_acc"])
        final["pfeddb"].append(hp[-1]["mean_acc"])
    assert np.mean(final["pfeddb"]) > np.mean(final["single"]) + 0.05, final
