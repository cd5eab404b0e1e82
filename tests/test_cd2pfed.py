"""CD2-pFed (issue 14): the channel split and its schedule, the subnets, what travels, cyclic distillation, the
temporal average of the private weights, and its degenerate cases."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fedsilo.methods.cd2pfed as cd2
from fedsilo.config import TrainParams
from fedsilo.fl.engine import Engine
from fedsilo.methods import method_class
from fedsilo.methods.base import payload_bytes
from fedsilo.methods.channels import PRIVATE, SHARED, SLICE, ChannelPartition
from fedsilo.models import LayeredNet, build_model
from tests.tiny import CPU_TRAIN, label_skewed_federation, style_shifted_federation, tiny_net


@pytest.fixture(scope="module")
def clients():
    return style_shifted_federation(n_train=24, n_test=12, per_domain=1)


def _tp(**kw):
    base = dict(rounds=2, batch_size=8, lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4, device="cpu", count_flops=False)
    return TrainParams(**{**base, **kw})


def _engine(clients, name="cd2pfed", observer=None, tp=None, net=None, **params):
    tp = tp or _tp()
    cls = method_class(name)
    return Engine(cls(cls.params_cls(**params), tp), net or tiny_net(1, 4), clients, tp, seed=0, observer=observer)


def tiny_resnet(seed: int = 0) -> LayeredNet:
    """A stem, an identity BasicBlock and a downsampling one, and a linear head."""
    from torchvision.models.resnet import BasicBlock

    torch.manual_seed(seed)
    down = nn.Sequential(nn.Conv2d(8, 16, 1, 2, bias=False), nn.BatchNorm2d(16))
    return LayeredNet([
        ("stem", nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()), 1),
        ("b1", BasicBlock(8, 8), 2),
        ("b2", BasicBlock(8, 16, stride=2, downsample=down), 2),
        ("fc", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4)), 1),
    ])


def _method(**params):
    return cd2.CD2PFed(cd2.CD2PFedParams(**params), _tp(rounds=50))


def test_ratio_rounds_sets_the_t_of_eq_3_apart_from_the_run_length():
    """ratio_rounds: p_t reaches p after that many rounds (Table 5's LeNet rows), then stays, whatever train.rounds."""
    m = _method(p=0.5, ratio_rounds=10)  # a 50-round run
    assert m.ratio(5) == pytest.approx(0.25) and m.ratio(10) == 0.5 and m.ratio(30) == 0.5
    assert _method(p=0.5).ratio(5) == pytest.approx(0.05)  # without it: T is the run's 50 rounds


def test_private_ratio_grows_linearly_and_the_private_channels_are_nested():
    m = _method(p=0.5)
    net = build_model("lenet5", 3, 10, seed=0, image_size=32)
    m.setup(net)
    widths = [layer.width for layer in m.part.hidden]
    assert widths == [6, 16, 120, 84]
    assert m.ratio(1) == pytest.approx(0.01) and m.ratio(25) == pytest.approx(0.25) and m.ratio(50) == 0.5
    history = [m.part.counts_at(m.ratio(t)) for t in range(1, 51)]
    for t, counts in enumerate(history, 1):
        assert counts == [math.floor(0.5 * t / 50 * w + 1e-9) for w in widths]
    assert all(a <= b for prev, nxt in zip(history, history[1:]) for a, b in zip(prev, nxt)), "a private channel never turns shared"
    assert history[-1] == [3, 8, 60, 42] and history[0] == [0, 0, 1, 0]
    # LeNet's 6-channel conv gets its first private channel at t = T / (6 p) rounded up
    assert next(t for t, c in enumerate(history, 1) if c[0] > 0) == 17
    fixed = _method(p=0.5, progressive=False)
    assert fixed.ratio(1) == fixed.ratio(50) == 0.5
    assert 0.45 < m.resolved()["private_param_fraction_last_round"] < 0.55, "ownership by output channel: the private share is p"


def test_beta_ramps_up_as_eq_7():
    m = _method(beta=0.5, rampup=0.1)  # T = 50: t0 = 5
    assert [round(m.beta_t(t), 4) for t in range(1, 8)] == [0.0204, 0.0826, 0.2247, 0.4094, 0.5, 0.5, 0.5]


@pytest.mark.parametrize("make, ratio", [(lambda: tiny_net(1, 4), 0.5), (tiny_resnet, 0.5),
                                         # option-A shortcuts move channel c to c + 8 (16 -> 32) and c + 16 (32 -> 64):
                                         # at 0.5 the owners happen to line up, at 0.25 / 0.75 they do not
                                         (lambda: build_model("resnet32", 1, 4, seed=0), 0.25),
                                         (lambda: build_model("resnet32", 1, 4, seed=0), 0.75)],
                         ids=["conv-bn-chain", "resnet-blocks", "resnet32-0.25", "resnet32-0.75"])
def test_subnets_use_only_their_own_channels(make, ratio):
    net = make()
    part = ChannelPartition(net)
    part.set_ratio(ratio)
    assert part.subnets_complete()
    x = torch.randn(6, 1, 16, 16)
    net.train()  # batch statistics: a mask placed before BatchNorm would leak its beta into the other subnet

    def outputs():
        with torch.no_grad():
            full = net(x)
            with part.subnet(PRIVATE):
                zl = net(x)
            with part.subnet(SHARED):
                zg = net(x)
        return full, zl, zg

    full, zl, zg = outputs()
    sd = net.state_dict()
    with torch.no_grad():  # perturb every private weight
        for v in part.private_views({k: p.detach() for k, p in net.named_parameters()}, part.counts):
            v.add_(torch.randn_like(v))
    full2, zl2, zg2 = outputs()
    assert torch.equal(zg2, zg), "the shared subnet never reads a private channel"
    assert not torch.allclose(zl2, zl) and not torch.allclose(full2, full)
    with torch.no_grad():  # perturb every shared weight but the classifier's bias (both subnets use it)
        for key, v in part.shared_part(sd, part.counts).items():
            if key.endswith("bias" + SLICE) and key.startswith(part.layers[-1].name) or "running" in key:
                continue
            v.add_(torch.randn_like(v))
    full3, zl3, zg3 = outputs()
    assert torch.equal(zl3, zl2), "the private subnet never reads a shared channel"
    assert not torch.allclose(zg3, zg2) and not torch.allclose(full3, full2)
    # the subnets' forwards leave the running statistics as the full network's forwards set them
    before = {k: v.clone() for k, v in net.state_dict().items() if "running" in k or "num_batches" in k}
    for mode in (PRIVATE, SHARED):
        with torch.no_grad(), part.subnet(mode):
            net(x)
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())
    with torch.no_grad():
        net(x)
    assert not all(torch.equal(v, net.state_dict()[k]) for k, v in before.items()), "a full forward does update them"


def test_models_the_split_does_not_fit_are_refused_by_name():
    with pytest.raises(ValueError, match="LayerNorm"):
        ChannelPartition(build_model("vit_tiny", 3, 10, image_size=32))
    with pytest.raises(ValueError, match="does not normalize"):
        ChannelPartition(build_model("densenet121", 3, 10))
    # in a params file: refused by check-params (the pipelines' first stage), naming the keys, not by a train's traceback
    from fedsilo.config import ConfigError
    from fedsilo.fl.params import parse_params
    from fedsilo.methods.registry import check_pipeline_fits
    from tests.conftest import small_params

    raw = small_params(model="vit_tiny")
    raw["methods"]["cd2pfed"] = {}
    raw["pipeline"]["methods"] = ["fedavg", "cd2pfed"]  # (FedBN refuses backbones without BatchNorm: test_engine's)
    with pytest.raises(ConfigError, match=r"p\.yaml: methods\.cd2pfed: channel decoupling: module 'units\.1\.ln_1' \(LayerNorm\)"
                       r".* \[cd2pfed on the backbone vit_tiny, experiments\.quick\.train\.model\]"):
        check_pipeline_fits(parse_params(raw), "p.yaml")
    raw["experiments"]["quick"]["train"]["model"] = "lenet5"
    check_pipeline_fits(parse_params(raw), "p.yaml")
    # F²DC's modules after a unit that gives no feature map: the key that names the unit
    raw["methods"]["f2dc"] = {"layers": ["fc2"]}
    raw["pipeline"]["methods"].append("f2dc")
    with pytest.raises(ConfigError, match=r"p\.yaml: methods\.f2dc\.layers: unit 'fc2' gives a 2-d output; DFD/DFC need feature "
                       r"maps.* \[f2dc on the backbone lenet5, experiments\.quick\.train\.model\]"):
        check_pipeline_fits(parse_params(raw), "p.yaml")


def test_only_shared_channels_travel_and_the_server_averages_them(clients):
    ups, downs = [], []
    e = _engine(clients, p=0.5, progressive=False, observer=lambda r, c, d, p: (ups if d == "up" else downs).append((c, p)))
    before = [{k: v.clone() for k, v in s.items()} for s in e.stores]
    e.step()
    part = e.method.part
    counts = part.counts
    assert counts == [4, 8]
    sizes = {c.name: c.n_train for c in clients}
    for (_name, up), store in zip(ups, e.stores):
        assert all(k.endswith(SLICE) for k in up), "no whole tensor leaves the client"
        assert up["units.0.0.weight" + SLICE].shape[0] == 8 - 4 and up["units.1.0.weight" + SLICE].shape[0] == 16 - 8
        assert up["units.2.2.weight" + SLICE].shape == (4, 16 - 8), "the classifier's columns over the shared channels"
        shared_now = part.shared_part(store, counts)
        assert all(torch.equal(up[k], shared_now[k]) for k in up), "the upload is the client's own shared rows"
        assert payload_bytes(up) < payload_bytes(store) / 2 + 200
    for s, b in zip(e.stores, before):  # each client trained its own private rows
        assert not torch.equal(s["units.1.0.weight"][:8], b["units.1.0.weight"][:8])
    total = sum(sizes.values())
    for key in ups[0][1]:
        mean = sum(sizes[c] / total * up[key].double() for c, up in ups)
        assert torch.allclose(part.shared_part(e.server, counts)[key].double(), mean, atol=1e-6)
    # a client is evaluated with its own private rows and the global shared ones
    st = e.method.eval_state(e.server, e.stores[2], clients[2])
    assert torch.equal(st["units.1.0.weight"][:8], e.stores[2]["units.1.0.weight"][:8])
    assert torch.equal(st["units.1.0.weight"][8:], e.server["units.1.0.weight"][8:])


def test_with_a_growing_ratio_each_upload_is_exactly_the_rows_shared_this_round(clients):
    ups = []
    e = _engine(clients, tp=_tp(rounds=4), p=0.5, ratio_rounds=4, observer=lambda r, c, d, p: ups.append((r, p)) if d == "up" else None)
    e.run()
    part = e.method.part
    for rnd in range(1, 5):
        counts = part.counts_at(e.method.ratio(rnd))
        for r, up in ups:
            if r != rnd:
                continue
            assert up["units.0.0.weight" + SLICE].shape[0] == 8 - counts[0] and up["units.1.0.weight" + SLICE].shape[0] == 16 - counts[1]
            assert up["units.1.1.running_mean" + SLICE].shape[0] == 16 - counts[1], "BatchNorm follows its channel"
            assert up["units.2.2.weight" + SLICE].shape[1] == 16 - counts[1]
    assert part.counts_at(e.method.ratio(1)) != part.counts_at(e.method.ratio(4))


def test_a_client_that_skipped_rounds_catches_up_on_every_row_it_does_not_hold(clients):
    downs = {}
    e = _engine(clients, tp=_tp(rounds=6, client_fraction=0.5), p=0.5, ratio_rounds=6,
                observer=lambda r, c, d, p: downs.setdefault((r, c), p) if d == "down" else None)
    e.run()
    last = [int(e.server.get(f"cd2pfed::last_round::{c.name}", 0)) for c in clients]  # per site, none before its first
    picked = {r: set(h["sampled"]) for r, h in zip(range(1, 7), e.history)}
    part = e.method.part
    for (r, name), payload in downs.items():
        before = [t for t in range(1, r) if name in picked[t]]
        n = part.counts_at(e.method.ratio(before[-1] if before else 0))[1]
        assert payload["units.1.0.weight" + SLICE].shape[0] == 16 - n, (r, name, before)
    for i, c in enumerate(clients):
        rounds = [t for t in picked if c.name in picked[t]]
        assert last[i] == (rounds[-1] if rounds else 0)
        n = part.counts_at(e.method.ratio(last[i]))[1]
        st = e.method.eval_state(e.server, e.stores[i], c)
        assert torch.equal(st["units.1.0.weight"][:n], e.stores[i]["units.1.0.weight"][:n])
        assert torch.equal(st["units.1.0.weight"][n:], e.server["units.1.0.weight"][n:])


def test_channels_that_turn_private_start_from_the_global_aggregate(clients, monkeypatch):
    starts = []
    real = cd2.train_local

    def spy(model, data, cfg, gen, **kw):
        starts.append({k: v.clone() for k, v in model.state_dict().items()})
        return real(model, data, cfg, gen, **kw)

    monkeypatch.setattr(cd2, "train_local", spy)
    downs = []
    e = _engine(clients, tp=_tp(rounds=4), p=0.5, ratio_rounds=4, observer=lambda r, c, d, p: downs.append((r, p)) if d == "down" else None)
    e.step()
    e.step()  # counts grow from round 1 to round 2
    part = e.method.part
    n1, n2 = part.counts_at(e.method.ratio(1)), part.counts_at(e.method.ratio(2))
    assert n1 == [1, 2] and n2 == [2, 4]
    server_after_1 = None
    for r, p in downs:
        if r == 2:
            assert p["units.1.0.weight" + SLICE].shape[0] == 16 - n1[1], "round 2 downloads the shared rows of round 1's split"
    # the rows private in round 2 but shared in round 1 equal the server's round-1 aggregate at the start of round 2
    e2 = _engine(clients, tp=_tp(rounds=4), p=0.5, ratio_rounds=4)
    e2.step()
    server_after_1 = {k: v.clone() for k, v in e2.server.items()}
    start = starts[len(clients)]  # first client's start of round 2
    assert torch.equal(start["units.1.0.weight"][n1[1]:n2[1]], server_after_1["units.1.0.weight"][n1[1]:n2[1]])
    assert not torch.equal(start["units.1.0.weight"][:n1[1]], server_after_1["units.1.0.weight"][:n1[1]]), "already-private rows stay the client's"


def test_cyclic_distillation_is_symmetric_kl_and_enters_the_loss(clients, monkeypatch):
    a, b = torch.randn(5, 4), torch.randn(5, 4)
    pa, pb = a.softmax(1), b.softmax(1)
    by_hand = 0.5 * ((pa * (pa.log() - pb.log())).sum(1).mean() + (pb * (pb.log() - pa.log())).sum(1).mean())
    assert torch.allclose(cd2.cyclic_distillation(a, b), by_hand, atol=1e-6)
    assert torch.allclose(cd2.cyclic_distillation(a, b), cd2.cyclic_distillation(b, a))
    assert float(cd2.cyclic_distillation(a, a)) == pytest.approx(0.0, abs=1e-7)

    # one full batch, one step: the reported loss is CE of the full network + lambda * L_CD at the starting weights
    one = clients[:1]
    n = one[0].n_train
    tp = _tp(rounds=1, batch_size=n, local_epochs=1)
    expected = []
    real = cd2.train_local

    def spy(model, data, cfg, gen, **kw):
        m = copy.deepcopy(model)
        m.train()
        x = data.x_train.float().div(127.5).sub(1.0)
        with torch.no_grad():
            ce = F.cross_entropy(m(x), data.y_train)
            e.method.part.model = m  # the subnets of the copy
            with e.method.part.subnet(PRIVATE):
                zl = m(x)
            with e.method.part.subnet(SHARED):
                zg = m(x)
            e.method.part.model = model
        expected.append(float(ce + 2.0 * cd2.cyclic_distillation(zl, zg)))
        return real(model, data, cfg, gen, **kw)

    monkeypatch.setattr(cd2, "train_local", spy)
    e = _engine(one, tp=tp, p=0.5, progressive=False, lam=2.0, temporal_averaging=False)
    e.step()
    assert e.method.last_loss == pytest.approx(expected[0], rel=1e-5)
    off = _engine(one, tp=tp, p=0.5, progressive=False, lam=2.0, temporal_averaging=False, cyclic_distillation=False)
    off.step()
    assert off.method.last_loss < expected[0] - 1e-4, "without CD the loss is the cross entropy alone"
    # its gradient reaches the weights of both subnets: the private rows train differently with and without it, and
    # so do the shared rows (a shared subnet's logits detached in the symmetric KL would leave them as without it)
    assert not torch.allclose(e.stores[0]["units.1.0.weight"][:8], off.stores[0]["units.1.0.weight"][:8])
    assert not torch.allclose(e.server["units.1.0.weight"][8:], off.server["units.1.0.weight"][8:])


def test_temporal_average_of_the_private_weights_follows_eq_6(clients, monkeypatch):
    tp = _tp(rounds=50, local_epochs=1)
    on = _engine(clients[:2], tp=tp, p=0.5, progressive=False, ratio_rounds=50)
    off = _engine(clients[:2], tp=tp, p=0.5, progressive=False, ratio_rounds=50, temporal_averaging=False)
    start = {k: v.clone() for k, v in on.stores[0].items()}
    on.step()
    off.step()
    beta = on.method.beta_t(1)
    assert beta == pytest.approx(0.5 * math.exp(-5 * (1 - 1 / 5) ** 2))
    part = on.method.part
    assert part.counts == [4, 8]
    for key in ("units.0.0.weight", "units.1.0.weight", "units.1.1.weight"):
        n = 4 if key.startswith("units.0") else 8
        want = beta * off.stores[0][key][:n] + (1 - beta) * start[key][:n]
        assert torch.allclose(on.stores[0][key][:n], want, atol=1e-6), key
        assert torch.equal(on.stores[0][key][n:], off.stores[0][key][n:]), "shared rows are the raw update"
    cols = on.stores[0]["units.2.2.weight"][:, :8]
    assert torch.allclose(cols, beta * off.stores[0]["units.2.2.weight"][:, :8] + (1 - beta) * start["units.2.2.weight"][:, :8], atol=1e-6)

    # over several epochs the average is recursive: w^l = beta w'^l + (1 - beta) w^{l-1}, w^0 the round's start
    seen = []
    real = cd2.train_local

    def spy(model, data, cfg, gen, epoch_hook=None, **kw):
        key = "units.1.0.weight"
        w = dict(model.named_parameters())[key]
        seen.append(("start", w.detach()[:8].clone()))

        def hook(epoch):
            seen.append(("raw", w.detach()[:8].clone()))
            epoch_hook(epoch)
            seen.append(("avg", w.detach()[:8].clone()))

        return real(model, data, cfg, gen, epoch_hook=hook, **kw)

    monkeypatch.setattr(cd2, "train_local", spy)
    three = _engine(clients[:1], tp=_tp(rounds=50, local_epochs=3), p=0.5, progressive=False, ratio_rounds=50)
    three.step()
    assert [k for k, _ in seen] == ["start"] + ["raw", "avg"] * 3
    prev = seen[0][1]
    for (_, raw), (_, avg) in zip(seen[1::2], seen[2::2]):
        assert torch.allclose(avg, beta * raw + (1 - beta) * prev, atol=1e-6)
        prev = avg


def test_ratio_zero_is_fedavg_upload_for_upload(clients):
    tp = _tp(rounds=2)
    ups_c, ups_f = [], []
    c = _engine(clients, tp=tp, p=0.0, observer=lambda r, n, d, p: ups_c.append(p) if d == "up" else None)
    f = _engine(clients, name="fedavg", tp=tp, observer=lambda r, n, d, p: ups_f.append(p) if d == "up" else None)
    c.run()
    f.run()
    assert len(ups_c) == len(ups_f)
    for uc, uf in zip(ups_c, ups_f):
        floats = {k for k in uf if "num_batches" not in k}
        assert {k[: -len(SLICE)] for k in uc} == floats
        assert all(torch.equal(uc[k + SLICE], uf[k]) for k in floats)
    for k in f.server:
        if "num_batches" not in k:
            assert torch.equal(c.server[k], f.server[k]), k
    assert c.history[-1]["mean_acc"] == f.history[-1]["mean_acc"]


def test_ratio_one_keeps_every_channel_home(clients):
    ups = []
    e = _engine(clients, p=1.0, progressive=False, observer=lambda r, n, d, p: ups.append(p) if d == "up" else None)
    e.step()
    for up in ups:
        assert all(v.numel() == 0 for k, v in up.items() if not k.startswith("units.2.2.bias")), "no channel is shared"
        assert payload_bytes(up) == 4 * 4, "only the classifier's bias travels"


def test_cd2pfed_personalizes_under_label_skew():
    """Each client sees two of the four classes: its private channels fit them, where FedAvg's one model cannot."""
    skewed = label_skewed_federation()
    cd = _engine(skewed, tp=_tp(rounds=4), p=0.5, ratio_rounds=4)
    cd.run()
    avg = _engine(skewed, name="fedavg", tp=_tp(rounds=4))
    avg.run()
    assert cd.history[-1]["mean_acc"] > avg.history[-1]["mean_acc"] + 0.1, (cd.history[-1]["mean_acc"], avg.history[-1]["mean_acc"])


def test_new_test_scores_the_mean_softmax_of_every_clients_model(clients):
    """LG-FedAvg's and CD2-pFed's "new test": the ensemble of all clients' evaluation models on the union of their
    test sets (each shared set once), and on an external site; the models' bytes are counted."""
    ext = style_shifted_federation(n_train=2, n_test=10, per_domain=1, seed=5)[3]
    e = _engine(clients, tp=_tp(rounds=1, ensemble_test=True), p=0.5, progressive=False)
    e.external = (ext.x_test, ext.y_test)
    entry = e.step()
    from fedsilo.client.local import predict

    x = torch.cat([c.x_test for c in clients])
    y = torch.cat([c.y_test for c in clients])
    probs, probs_ext, sent = 0, 0, 0
    for c, store in zip(clients, e.stores):
        e.method.load_eval_model(e.model, e.server, store, c, 1)
        sent += payload_bytes(e.model.state_dict())
        probs = probs + predict(e.model, x, cfg=CPU_TRAIN).softmax(1)
        probs_ext = probs_ext + predict(e.model, ext.x_test, cfg=CPU_TRAIN).softmax(1)
    assert entry["ensemble"]["acc"] == pytest.approx(float((probs.argmax(1) == y).float().mean()))
    assert entry["external_ensemble"]["acc"] == pytest.approx(float((probs_ext.argmax(1) == ext.y_test).float().mean()))
    assert entry["bytes_ensemble"] == sent and "external_global" not in entry, "no global model for CD2-pFed"
    mean = probs / len(clients)
    assert entry["ensemble"]["loss"] == pytest.approx(float(F.nll_loss(mean.log(), y)), rel=1e-5)
    single = predict(e.model, x, cfg=CPU_TRAIN).softmax(1)  # the last client's model alone: another score (the averaging is real)
    assert abs(entry["ensemble"]["loss"] - float(F.nll_loss(single.log(), y))) > 1e-5
    assert entry["ensemble"]["images"] == len(y)
    # clients sharing one test set (F²DC's protocol) count it once
    shared = style_shifted_federation(n_train=8, n_test=6, per_domain=2)
    f = _engine(shared, name="fedavg", tp=_tp(rounds=1, ensemble_test=True))
    ent = f.step()
    assert ent["ensemble"]["images"] == sum(len(c.y_test) for c in shared[::2])
    assert "external_global" not in ent and ent["bytes_ensemble"] == 0, "one global model: the ensemble is it, nothing sent"


def test_new_test_with_log_probabilities_scores_their_normalized_geometric_mean(clients):
    """``train.ensemble_mean: log_probabilities`` (LG-FedAvg's code averages its nets' log_softmax outputs, CD2-pFed's
    presets run it): the ensemble's prediction is the softmax of the mean log-probability over the clients' models."""
    from fedsilo.client.local import predict

    e = _engine(clients, tp=_tp(rounds=1, ensemble_test=True, ensemble_mean="log_probabilities"), p=0.5, progressive=False)
    entry = e.step()
    x, y = torch.cat([c.x_test for c in clients]), torch.cat([c.y_test for c in clients])
    logs, probs = 0, 0
    for c, store in zip(clients, e.stores):
        e.method.load_eval_model(e.model, e.server, store, c, 1)
        logs = logs + predict(e.model, x, cfg=CPU_TRAIN).log_softmax(1)
        probs = probs + predict(e.model, x, cfg=CPU_TRAIN).softmax(1)
    geometric = (logs / len(clients)).softmax(1)
    assert entry["ensemble"]["loss"] == pytest.approx(float(F.nll_loss(geometric.log(), y)), rel=1e-5)
    assert entry["ensemble"]["acc"] == pytest.approx(float((geometric.argmax(1) == y).float().mean()))
    arithmetic = probs / len(clients)
    assert abs(entry["ensemble"]["loss"] - float(F.nll_loss(arithmetic.log(), y))) > 1e-6, "not the mean of the probabilities"


def test_external_site_is_loaded_from_a_holdout_split(tmp_path):
    import numpy as np
    import pandas as pd

    from fedsilo.client.data import load_external

    np.save(tmp_path / "images.npy", np.arange(6 * 4 * 4 * 1, dtype=np.uint8).reshape(6, 4, 4, 1))
    pd.DataFrame({"label": [0, 1, 0, 1, 1, 0]}).to_parquet(tmp_path / "records.parquet")
    client = {"client": 1, "name": "site-b", "domain": "b", "train": [], "test": [4, 5]}
    x, y = load_external(tmp_path, {"holdout": {"domain": "b", "role": "external_test", "client": client}}, torch.device("cpu"))
    assert x.shape == (2, 1, 4, 4) and y.tolist() == [1, 0]
    assert load_external(tmp_path, {"holdout": {"domain": "b", "role": "newcomer", "client": client}}, torch.device("cpu")) is None
    assert load_external(tmp_path, {"clients": []}, torch.device("cpu")) is None
    # clients listing the same test images share one tensor (the ensemble's union counts it once)
    from fedsilo.client.data import load_clients

    split = {"num_classes": 2, "clients": [{"client": 0, "name": "a", "train": [0, 1], "test": [4, 5]},
                                           {"client": 1, "name": "b", "train": [2, 3], "test": [4, 5]}]}
    a, b = load_clients(tmp_path, split, torch.device("cpu"))[0]
    assert a.x_test is b.x_test and a.x_train is not b.x_train


def test_a_client_with_one_test_image_gets_no_spectrum_instead_of_failing_the_run(clients):
    """Small label-skew clients can hold a single test image: its covariance is undefined, the run still finishes."""
    from dataclasses import replace

    from fedsilo.report.tables import collapse_table

    few = [replace(clients[0], x_test=clients[0].x_test[:1], y_test=clients[0].y_test[:1])] + list(clients[1:])
    e = _engine(few, name="fedavg", tp=_tp(rounds=1))
    e.run()
    spectra = e.spectra()
    assert spectra[few[0].name] == [] and all(len(v) > 1 for k, v in spectra.items() if k != few[0].name)
    tab = collapse_table({("fedavg", 0): spectra}, ["fedavg"], [0])
    assert tab.loc["fedavg", "dim"] == 16 and tab.loc["fedavg", "effective_rank"] > 1
