"""pFedSD, FedLGF and FedWon: each method's defining mechanism, what it uploads, and that it learns."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from torch import nn

from fedsilo.client.data import load_clients
from fedsilo.client.local import make_generator
from fedsilo.config import DomainClientsSplit, TrainParams
from fedsilo.data.splits import make_split
from fedsilo.fl.engine import Engine
from fedsilo.methods import method_class
from fedsilo.methods.fedlgf import FedLGF, FedLGFParams
from fedsilo.methods.fedwon import adaptive_grad_clip, unitwise_norm
from fedsilo.methods.terms import distillation_kl
from fedsilo.models import WSConv2d, batchnorm_keys, build_model, normalization_free
from tests.tiny import close_states, style_shifted_federation, tiny_net


@pytest.fixture(scope="module")
def clients(mirror_root):
    h = mirror_root / "data" / "harmonized" / "chest_xray4"
    split = make_split(pd.read_parquet(h / "records.parquet"), DomainClientsSplit(n_train=32, n_test=20), seed=0)
    return load_clients(h, split, torch.device("cpu"))


def _run(name, clients, rounds=2, lr=0.02, local_epochs=1, width=0.25, **params):
    cl, cin, nc = clients
    tp = TrainParams(rounds=rounds, batch_size=16, lr=lr, local_epochs=local_epochs, device="cpu", count_flops=False)
    cls = method_class(name)
    ups: list[tuple[int, str, dict]] = []
    e = Engine(cls(cls.params_cls(**params), tp), build_model("simple_cnn", cin, nc, seed=0, width=width), cl, tp, seed=0,
               observer=lambda r, c, d, p: ups.append((r, c, {k: v.clone() for k, v in p.items()})) if d == "up" else None)
    return e, e.run(), ups


def test_distillation_kl_is_tau_squared_kl_of_softened_predictions():
    s, t = torch.randn(5, 3), torch.randn(5, 3)
    tau = 3.0
    p_t, p_s = torch.softmax(t / tau, 1), torch.softmax(s / tau, 1)
    expect = tau**2 * float((p_t * (p_t.log() - p_s.log())).sum(1).mean())
    assert math.isclose(float(distillation_kl(s, t, tau)), expect, rel_tol=1e-5)
    assert float(distillation_kl(t, t, tau)) == pytest.approx(0.0, abs=1e-7)


def test_pfedsd_distils_from_the_clients_own_last_model_and_keeps_it_home(clients):
    _, _, avg = _run("fedavg", clients)
    e0, _, off = _run("pfedsd", clients, lam=0.0)
    e1, h1, on = _run("pfedsd", clients, lam=1.0)
    assert all(close_states(a[2], b[2]) for a, b in zip(avg, off)), "lambda = 0 is FedAvg"
    first = [u for u in on if u[0] == 1]
    assert all(close_states(a[2], b[2]) for a, b in zip(avg, first)), "no teacher before a client's first training"
    second = [(a, b) for a, b in zip(avg, on) if b[0] == 2]
    assert second and all(not close_states(a[2], b[2], atol=1e-6) for a, b in second), "the teacher changes round 2"
    assert all(not any(k.startswith("personal::") for k in u[2]) for u in on)
    # the personalized model each client is evaluated with is the model it trained (and uploaded) last
    last = {c: p for r, c, p in on if r == 2}
    for client, store in zip(clients[0], e1.stores):
        assert close_states({k[len("personal::"):]: v for k, v in store.items()}, last[client.name])
    assert "global" in h1[-1]


def test_pfedsd_distils_at_its_temperature(clients, monkeypatch):
    """The self-distillation term is taken at params.tau (from round 2, when the client has its last model)."""
    import fedsilo.methods.pfedsd as sd

    taus: list[float] = []
    real = sd.distillation_kl
    monkeypatch.setattr(sd, "distillation_kl", lambda s, t, *a, **k: taus.append(a[0] if a else k.get("tau")) or real(s, t, *a, **k))
    _run("pfedsd", clients, rounds=2, tau=4.0)
    assert taus and set(taus) == {4.0}


def test_pfedsd_teacher_is_the_clients_own_last_model_in_the_mode_its_switch_names(clients, monkeypatch):
    """Round 2's teacher holds the weights the client uploaded in round 1 (its own model, not the download), in
    evaluation mode by default and in training mode (batch statistics) with ``teacher_bn: batch``."""
    from fedsilo.methods.base import Spares

    seen: list[tuple[bool, torch.Tensor]] = []
    real_of = Spares.of

    def of(self, model):
        spares = real_of(self, model)
        for t in spares:
            if not getattr(t, "_spied", False):
                t._spied = True
                t.register_forward_pre_hook(lambda m, _i: seen.append((m.training, next(m.parameters()).detach().clone())))
        return spares

    monkeypatch.setattr(Spares, "of", of)
    for mode in ("running", "batch"):
        seen.clear()
        e, _, ups = _run("pfedsd", clients, rounds=2, teacher_bn=mode)
        own = [next(iter(u.values())) for r, _, u in ups if r == 1]  # each client's round-1 model (first tensor)
        assert seen and all(training == (mode == "batch") for training, _ in seen), mode
        assert all(any(torch.equal(w, o) for o in own) for _, w in seen)


def test_fedlgf_perturbation_is_adversarial_and_zero_radius_is_fedavg(clients):
    _, _, avg = _run("fedavg", clients, rounds=1)
    _, _, flat = _run("fedlgf", clients, rounds=1, init_scale=0.0, grad_scale=0.0, global_smooth=0.0)
    # a zero radius rebuilds the classifier from its SVD (U diag(S) V^T = W to ~1e-7), so the KL term's gradient is
    # ~1e-7, not 0, and a round of SGD carries that a little: 1e-5 failed once in a 2-worker CI-like run, passing alone
    assert all(close_states(a[2], b[2], atol=1e-4) for a, b in zip(avg, flat)), "a zero radius leaves the local target clean"
    _, _, lgf = _run("fedlgf", clients, rounds=1)
    assert not all(close_states(a[2], b[2], atol=1e-4) for a, b in zip(avg, lgf))
    # the global flatness term by itself (the local one off) moves the update too
    _, _, glob_only = _run("fedlgf", clients, rounds=1, local_smooth=0.0)
    assert not all(close_states(a[2], b[2], atol=1e-4) for a, b in zip(avg, glob_only))
    assert not all(close_states(a[2], b[2], atol=1e-6) for a, b in zip(lgf, glob_only))

    torch.manual_seed(0)
    lin = nn.Linear(16, 4)
    z = torch.randn(64, 16)
    clean = lin(z).detach()

    def kl_to_clean(out):
        return float(nn.functional.kl_div(torch.log_softmax(out, 1), torch.softmax(clean, 1), reduction="batchmean"))

    m = FedLGF(FedLGFParams(init_scale=0.5, grad_scale=0.5), TrainParams(device="cpu"))
    adv = m._perturbed(nn.Sequential(lin), z, clean, make_generator(0))
    assert not adv.requires_grad
    # the same radius along random unit directions on the singular values does less harm
    u, s, vh = torch.linalg.svd(lin.weight.detach(), full_matrices=False)
    g = torch.Generator().manual_seed(1)
    rand = []
    for _ in range(20):
        d = torch.randn(s.shape, generator=g)
        w = u @ torch.diag(torch.relu(s + 0.5 * d / d.norm())) @ vh
        rand.append(kl_to_clean(nn.functional.linear(z, w, lin.bias.detach())))
    assert kl_to_clean(adv) > max(rand), (kl_to_clean(adv), max(rand))

    head = nn.Sequential(nn.BatchNorm1d(16), nn.Linear(16, 4)).train()
    stats = head[0].running_mean.clone()
    for kind in ("singular", "weight"):
        out = FedLGF(FedLGFParams(perturb=kind), TrainParams(device="cpu"))._perturbed(head, z, head(z).detach(), make_generator(0))
        assert out.shape == (64, 4) and kl_to_clean(out) > 0
    head(z)  # one real training pass moves the statistics once
    moved = head[0].running_mean.clone()
    assert not torch.equal(moved, stats)
    head[0].running_mean.copy_(stats)
    FedLGF(FedLGFParams(), TrainParams(device="cpu"))._perturbed(head, z, clean, make_generator(0))
    assert torch.equal(head[0].running_mean, stats), "perturbed passes leave BatchNorm statistics alone"


def test_fedlgf_global_flatness_term_perturbs_the_downloaded_models_features(monkeypatch):
    """The global flatness term perturbs the global classifier on z_G, the downloaded global model's features of the
    batch (evaluation mode), not on the local features z that the local term perturbs."""
    clients = style_shifted_federation(n_train=16, n_test=4, per_domain=1)[:2]
    tp = TrainParams(rounds=1, batch_size=8, lr=0.05, device="cpu", count_flops=False)
    e = Engine(FedLGF(FedLGFParams(), tp), tiny_net(1, 4), clients, tp, seed=0)
    glob = tiny_net(1, 4)
    glob.load_state_dict(e.server)  # what every client downloads in round 1
    glob.eval()
    batch, fed = [], []
    e.model.register_forward_pre_hook(lambda _m, inputs: batch.append(inputs[0].detach()))
    real = FedLGF._perturbed

    def spy(self, head, z, clean, gen):
        fed.append((z.detach().clone(), batch[-1]))
        return real(self, head, z, clean, gen)

    monkeypatch.setattr(FedLGF, "_perturbed", spy)
    e.step()
    assert fed and len(fed) % 2 == 0  # per batch: the local term, then the global one
    with torch.no_grad():
        for (z_local, x), (z_global, _) in zip(fed[0::2], fed[1::2]):
            assert torch.allclose(z_global, glob.feature_extractor()(x), atol=1e-5)
            assert not torch.allclose(z_global, z_local, atol=1e-3)


def test_fedwon_model_has_no_normalization_and_standardized_convolutions():
    for name in ("simple_cnn", "alexnet_bn", "resnet10"):
        base = build_model(name, 3, 5, seed=0)
        nf = normalization_free(base)
        assert batchnorm_keys(nf) == set()
        convs = [m for m in nf.modules() if isinstance(m, nn.Conv2d)]
        assert convs and all(isinstance(m, WSConv2d) for m in convs)
        assert batchnorm_keys(base), "the original is untouched"
        w = convs[0].standardized_weight().detach()
        fan_in = w[0].numel()
        assert torch.allclose(w.mean(dim=(1, 2, 3)), torch.zeros(w.shape[0]), atol=1e-6)
        var = w.var(dim=(1, 2, 3), unbiased=False)
        assert torch.allclose(var, torch.full_like(var, convs[0].gamma**2 / fan_in), rtol=1e-2)
        size = 64 if name != "simple_cnn" else 28
        assert nf.eval()(torch.randn(2, 3, size, size)).shape == (2, 5)


def test_wsconv2d_convolves_with_the_standardized_weight_not_the_raw_one():
    """FedWon's Eq. 1 acts in the forward: WSConv2d convolves with W_hat = gain * gamma * (W - mean(W)) / (std(W) *
    sqrt(N)) per output channel (its stride, padding and bias), while its stored ``weight`` stays the raw one."""
    torch.manual_seed(0)
    conv = WSConv2d(3, 4, 3, stride=2, padding=1)
    with torch.no_grad():
        conv.weight.mul_(3.0).add_(0.5)  # far from standardized: mean 0.5, a larger spread
        conv.gain.copy_(torch.tensor([0.5, 1.0, 2.0, 3.0]).view(4, 1, 1, 1))
    w = conv.weight.detach().clone()
    var, mean = torch.var_mean(w, dim=(1, 2, 3), keepdim=True, unbiased=False)
    w_hat = conv.gain.detach() * conv.gamma * (w - mean) / (var.sqrt() * math.sqrt(w[0].numel()))
    x = torch.randn(2, 3, 9, 9)
    with torch.no_grad():
        out = conv(x)
        want = nn.functional.conv2d(x, w_hat, conv.bias, stride=2, padding=1)
        raw = nn.functional.conv2d(x, w, conv.bias, stride=2, padding=1)
    assert torch.allclose(out, want, atol=1e-5)
    assert not torch.allclose(out, raw, atol=1e-2)
    assert torch.equal(conv.weight.detach(), w), "the stored weight is not standardized in place"


def test_agc_clips_each_unit_to_lambda_times_its_weight_norm():
    p = nn.Parameter(torch.ones(3, 4))
    p.grad = torch.tensor([[0.1] * 4, [10.0] * 4, [1.0] * 4])  # ||W_i|| = 2; ratios 0.1 (kept), 10 and 1 (clipped)
    b = nn.Parameter(torch.ones(4))
    b.grad = torch.full((4,), 100.0)
    adaptive_grad_clip([p, b], clip=0.5)
    ratio = (unitwise_norm(p.grad) / unitwise_norm(p.detach())).flatten()
    assert torch.allclose(ratio, torch.tensor([0.1, 0.5, 0.5]))
    assert float(unitwise_norm(b.grad) / unitwise_norm(b.detach())) == pytest.approx(0.5)


def test_fedwon_uploads_every_parameter_and_no_batchnorm(clients):
    e, h, ups = _run("fedwon", clients, rounds=1)
    keys = set(ups[0][2])
    assert keys == set(e.model.state_dict()) and any(k.endswith(".gain") for k in keys)
    assert not any("running_mean" in k for k in keys)
    assert h[-1]["bytes_up_total"] == sum(sum(v.numel() * v.element_size() for v in p.values()) for _, _, p in ups)


def test_fedwon_clips_each_training_step(clients, monkeypatch):
    """AGC acts inside local training: a tight clip changes the update, and the hook runs once per optimizer step on
    every clipped parameter but the final classifier."""
    import fedsilo.methods.fedwon as won

    calls: list[int] = []
    real = won.adaptive_grad_clip
    monkeypatch.setattr(won, "adaptive_grad_clip", lambda params, clip, eps: calls.append(len(params)) or real(params, clip, eps))
    e, _, loose = _run("fedwon", clients, rounds=1, clip=1e6)
    steps = sum(math.ceil(len(c.y_train) / 16) for c in clients[0])
    assert len(calls) == steps and set(calls) == {len(e.method.clipped)}
    last = [m for m in e.model.head().modules() if isinstance(m, nn.Linear)][-1]
    names = {id(p): n for n, p in e.model.named_parameters()}
    assert {names[id(p)] for p in last.parameters()}.isdisjoint(e.method.clipped) and len(e.method.clipped) > 2
    _, _, tight = _run("fedwon", clients, rounds=1, clip=1e-3)
    assert all(not close_states(a[2], b[2], atol=1e-6) for a, b in zip(loose, tight))


# simple_cnn at half width (a quarter learns too slowly here: pFedSD 0.42-0.74 over rounds 4-6). Over the last three
# rounds, with one or two torch threads: pFedSD 0.79-0.90, FedLGF 0.71-0.77; FedWon's curve swings (0.59 to 0.97 over
# rounds 4-8), so it keeps eight
@pytest.mark.parametrize("name,lr,rounds", [("pfedsd", 0.02, 6), ("fedlgf", 0.02, 6), ("fedwon", 0.05, 8)])
def test_recent_methods_learn_above_chance(clients, name, lr, rounds):
    _, h, _ = _run(name, clients, rounds=rounds, lr=lr, local_epochs=3, width=0.5)
    last = [x["mean_acc"] for x in h[-3:]]
    assert sum(last) / 3 > 0.6, (name, [round(x["mean_acc"], 3) for x in h])
