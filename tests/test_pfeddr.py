"""pFedDR: the dual BatchNorm transform on fedsilo's backbones, the code's objective (its D term included), what
travels and what stays, the global BatchNorm set's aggregation, evaluation by the mean of the two logits, the presets'
per-dataset values, and resume. Tiny in-memory federation (tests/tiny.py): seconds each."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedsilo.client.data import to_float
from fedsilo.client.local import predict
from fedsilo.config import ConfigError, NormalizeParams, TrainParams
from fedsilo.fl.engine import Engine, PrivacyViolation
from fedsilo.methods import method_class
from fedsilo.methods.pfeddr import DualBatchNorm, DualBNNet, PFedDR, PFedDRParams, code_divergence
from fedsilo.models import batchnorm_keys, build_model
from tests.tiny import CPU_TRAIN, style_shifted_federation, tiny_net

LOCAL = ".local_bn."


@pytest.fixture(scope="module")
def fed():
    return style_shifted_federation(n_train=24, n_test=24, per_domain=1)


def _train(**kw) -> TrainParams:
    base = dict(rounds=2, batch_size=8, lr=0.05, device="cpu", count_flops=False)
    return TrainParams(**{**base, **kw})


def _engine(fed, tp=None, observer=None, checkpoint=None, **params):
    tp = tp or _train()
    return Engine(PFedDR(PFedDRParams(**params), tp), tiny_net(1, 4), fed, tp, seed=0, observer=observer,
                  checkpoint=checkpoint, config_hash="h")


def _recording(log):
    return lambda r, c, d, p: log.append((r, c, d, {k: v.clone() for k, v in p.items()}))


# ------------------------------------------------------------------------------------------------ the code's D term
def test_the_divergence_is_the_codes_kl_div_call_on_probabilities_and_not_a_kl():
    torch.manual_seed(0)
    og, ol = torch.randn(6, 5, requires_grad=True), torch.randn(6, 5, requires_grad=True)
    d = code_divergence(og, ol)
    ref = F.kl_div(og.softmax(1), ol.softmax(1), reduction="batchmean")  # the authors' call, as their scripts make it
    assert math.isclose(d.item(), ref.item(), rel_tol=1e-5, abs_tol=1e-7)
    g = torch.autograd.grad(d, (og, ol))
    g_ref = torch.autograd.grad(ref, (og, ol))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g, g_ref)), "gradients reach both logits, as in the code"
    kl = F.kl_div(og.log_softmax(1), ol.softmax(1), reduction="batchmean")  # KL(p_l || p_g), what the name promises
    assert abs(d.item() - kl.item()) > 0.1
    assert abs(code_divergence(og, og).item()) > 0.1, "a KL would vanish for identical predictions; D does not"


# ------------------------------------------------------------------------------------------------ the model transform
@pytest.mark.parametrize("backbone,size", [("simple_cnn", 28), ("alexnet_bn", 64), ("densenet121", 32)])
def test_every_batchnorm_of_fedsilos_backbones_becomes_a_global_and_a_local_set(backbone, size):
    base = build_model(backbone, 3, 10, seed=0)
    n_bn = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in base.modules())
    net = DualBNNet(base)
    assert net.dual_batchnorms == n_bn > 0
    plain = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(plain) == 2 * n_bn, "no BatchNorm outside a dual slot"
    sd = net.state_dict()
    assert sum(LOCAL in k for k in sd) == sum(".global_bn." in k for k in sd) == len(batchnorm_keys(base))
    assert len(sd) == len(base.state_dict()) + len(batchnorm_keys(base)), "the weights are not duplicated"
    assert isinstance(net.head, nn.Linear), "one classifier for both passes"
    with torch.no_grad():  # make the two sets differ, then the default (evaluation) output is the mean of the two
        for m in net.modules():
            if isinstance(m, DualBatchNorm):
                m.local_bn.weight.uniform_(0.5, 1.5)
                m.local_bn.bias.normal_(0, 0.3)
    x = torch.randn(2, 3, size, size)
    net.eval()
    with torch.no_grad():
        with net.mode_as("global"):
            g = net(x)
        with net.mode_as("local"):
            lo = net(x)
        mean = net(x)
    assert (g - lo).abs().max() > 1e-3
    assert torch.allclose(mean, (g + lo) / 2, atol=1e-5)


def test_a_backbone_without_batchnorm_is_refused():
    tp = _train(model="lenet5")
    with pytest.raises(ConfigError, match="no BatchNorm"):
        PFedDR(PFedDRParams(), tp).transform_model(build_model("lenet5", 1, 4, image_size=16), torch.zeros(1, 1, 16, 16))


# ------------------------------------------------------------------------------------------------ the objective
@pytest.mark.parametrize("params", [dict(alpha=0.3, beta=2.0), dict(alpha=0.5, beta=1.0, ce_sum=True), dict(alpha=0.0, beta=0.0), dict(alpha=0.7, beta=0.0)])
def test_the_reported_loss_is_the_codes_objective(fed, params):
    """One batch holding the client's whole training set and one step: the reported loss is the objective at the
    downloaded weights, computed here by hand from two forwards (local set perturbed so the passes differ)."""
    c = fed[0]
    tp = _train(rounds=1, batch_size=c.n_train)
    e = Engine(PFedDR(PFedDRParams(**params), tp), tiny_net(1, 4), [c], tp, seed=0, config_hash="h")
    torch.manual_seed(1)
    for k in e.stores[0]:
        if k.endswith("weight"):
            e.stores[0][k] = e.stores[0][k] + 0.5 * torch.rand_like(e.stores[0][k])
    start = {**e.stores[0], **e.server}
    h = e.run()
    net = DualBNNet(tiny_net(1, 4))
    net.load_state_dict(start)
    net.train()
    x, y = to_float(c.x_train, NormalizeParams()), c.y_train
    with net.mode_as("global"):
        og = net(x)
    with net.mode_as("local"):
        ol = net(x)
    a, b = params["alpha"], params["beta"]
    ce_g, ce_l = F.cross_entropy(og, y), F.cross_entropy(ol, y)
    if a == 0:
        ce = ce_g
    elif params.get("ce_sum"):
        ce = ce_g + ce_l
    else:
        ce = (1 - a) * ce_g + a * ce_l
    expect = (ce - b * code_divergence(og, ol)).item()
    assert h[0]["train_loss"][c.name] == pytest.approx(expect, rel=1e-5)


def test_the_divergence_term_changes_training(fed):
    """Fails when the beta * D term is dropped: everything else equal, beta moves every uploaded tensor."""
    ups = {}
    for beta in (0.0, 2.0):
        log: list = []
        _engine(fed, observer=_recording(log), beta=beta).run()
        ups[beta] = [p for r, c, d, p in log if d == "up"]
    for a, b in zip(ups[0.0], ups[2.0]):
        assert any(not torch.allclose(a[k].float(), b[k].float(), atol=1e-6) for k in a if a[k].is_floating_point())


def test_two_logits_differ_after_training_and_evaluation_uses_their_mean(fed):
    e = _engine(fed, tp=_train(rounds=3, momentum=0.9))
    h = e.run()
    for c, store in zip(fed, e.stores):
        e.method.load_eval_model(e.model, e.server, store, c, 3)
        assert e.model.mode == "mean"
        with e.model.mode_as("global"):
            g = predict(e.model, c.x_test, cfg=CPU_TRAIN)
        with e.model.mode_as("local"):
            lo = predict(e.model, c.x_test, cfg=CPU_TRAIN)
        mean = predict(e.model, c.x_test, cfg=CPU_TRAIN)
        assert (g - lo).abs().max() > 1e-2, "the local set has drifted from the global one"
        assert torch.allclose(mean, (g + lo) / 2, atol=1e-5)
        acc = float(((g + lo) / 2).argmax(1).eq(c.y_test).float().mean())
        assert h[-1]["eval"][c.name]["acc"] == pytest.approx(acc)
        # the global model reported beside: the global set in both passes, i.e. the global pass with the server's tensors
        e.model.load_state_dict(e.method.global_state(e.server), strict=True)
        with e.model.mode_as("global"):
            g_server = predict(e.model, c.x_test, cfg=CPU_TRAIN)
        assert torch.allclose(predict(e.model, c.x_test, cfg=CPU_TRAIN), g_server, atol=1e-5)
        assert h[-1]["global"][c.name] == pytest.approx(float(g_server.argmax(1).eq(c.y_test).float().mean()))


# ------------------------------------------------------------------------------------------------ what travels
def test_local_batchnorms_never_travel_and_the_rest_does(fed):
    log: list = []
    e = _engine(fed, observer=_recording(log))
    e.run()
    local = {k for k in e.model.state_dict() if LOCAL in k}
    assert local and e.method.private_keys(e.model) == local
    assert set(e.method.shared) == set(e.model.state_dict()) - local, "weights, classifier and the global set all travel"
    assert log and all(not (set(p) & local) for r, c, d, p in log)
    assert all(set(p) == set(e.method.shared) for r, c, d, p in log)
    w = "body.0.1.local_bn.weight"
    assert not torch.equal(e.stores[0][w], e.stores[1][w]), "each client keeps its own local set"

    class Leaky(PFedDR):
        def keep_and_share(self, model, store):
            up = super().keep_and_share(model, store)
            up[w] = model.state_dict()[w]
            return up

    tp = _train(rounds=1)
    with pytest.raises(PrivacyViolation, match="local_bn"):
        Engine(Leaky(PFedDRParams(), tp), tiny_net(1, 4), fed, tp, seed=0).run()


def test_the_global_batchnorm_set_is_the_size_weighted_mean_of_the_uploads(fed):
    uneven = [type(c)(c.index, c.name, c.x_train[: 12 + 4 * i], c.y_train[: 12 + 4 * i], c.x_test, c.y_test, c.domain) for i, c in enumerate(fed)]
    log: list = []
    e = _engine(uneven, tp=_train(rounds=1), observer=_recording(log))
    e.run()
    ups = [p for r, c, d, p in log if d == "up"]
    n = torch.tensor([c.n_train for c in uneven], dtype=torch.float64)
    for k in ("body.0.1.global_bn.weight", "body.0.1.global_bn.running_mean", "body.1.1.global_bn.running_var", "body.0.0.weight"):
        expect = sum(u[k].double() * w for u, w in zip(ups, n / n.sum()))
        assert torch.allclose(e.server[k].double(), expect, atol=1e-6)
    assert not torch.allclose(ups[0]["body.0.1.global_bn.running_mean"], ups[1]["body.0.1.global_bn.running_mean"])


# ------------------------------------------------------------------------------------------------ schedule and settings
def test_training_stops_after_the_scripts_rounds(fed):
    log: list = []
    e = _engine(fed, tp=_train(rounds=3), observer=_recording(log), rounds=2)
    h = e.run()
    assert all(not p for r, c, d, p in log if r == 3) and all(p for r, c, d, p in log if r < 3), "round 3 sends nothing"
    assert h[2]["bytes_up_total"] == h[2]["bytes_down_total"] == 0
    assert h[2]["eval"] == h[1]["eval"] and all(v is None for v in h[2]["train_loss"].values())
    with pytest.raises(ConfigError, match=r"methods\.pfeddr\.rounds: 5 exceeds train\.rounds \(3\)"):
        PFedDR(PFedDRParams(rounds=5), _train(rounds=3))


def test_per_backbone_values_resolve_and_name_the_key():
    p = PFedDRParams(beta={"simple_cnn": 0.0, "alexnet_bn": 2.0}, momentum={"simple_cnn": 0.5, "alexnet_bn": None})
    digits = PFedDR(p, _train(model="simple_cnn", momentum=0.0))
    office = PFedDR(p, _train(model="alexnet_bn", momentum=0.0))
    assert (digits.beta, digits.momentum, digits.local_train(1).momentum) == (0.0, 0.5, 0.5)
    assert (office.beta, office.momentum) == (2.0, 0.0)
    with pytest.raises(ConfigError, match=r"methods\.pfeddr\.beta: no entry for the backbone densenet121"):
        PFedDR(p, _train(model="densenet121"))
    from pydantic import ValidationError

    from fedsilo.config import format_validation_error

    for bad, msg in (({"beta": {"simple_cnn": -1}}, "beta.simple_cnn: Input should be greater than or equal to 0"), ({"alpha": 2}, "alpha: Input should be less than or equal to 1"),
                     ({"momentum": {"alexnet": 0.5}}, "momentum.alexnet: unknown backbone"), ({"alpha": True}, "alpha: expected a number")):
        with pytest.raises(ValidationError) as err:
            PFedDRParams.model_validate(bad)
        assert msg in format_validation_error(err.value, "methods.pfeddr.")


def test_the_momentum_setting_reaches_the_local_optimizer(fed):
    ups = {}
    for m in (None, 0.5):
        log: list = []
        _engine(fed, tp=_train(rounds=1), observer=_recording(log), momentum=m).run()
        ups[m] = [p for r, c, d, p in log if d == "up"]
    assert any(not torch.equal(a[k], b[k]) for a, b in zip(ups[None], ups[0.5]) for k in a)


@pytest.mark.parametrize("scale", ["quickstart", "paper"])
def test_the_pfeddb_presets_train_pfeddr_with_the_scripts_values(scale):
    from fedsilo.methods.registry import check_methods, resolve_method
    from tests.test_presets import _load

    p = _load(scale)
    check_methods(p)
    assert "pfeddr" in p.experiment_methods("pfeddb_cxr4") and "pfeddr" in p.experiment_methods("pfeddb_digits5")
    digits = resolve_method(p, "pfeddr", p.experiments["pfeddb_digits5"].train)
    assert (digits.alpha, digits.beta, digits.momentum, digits.ce_sum) == (0.5, 0.0, 0.5, False)  # digits_pfedDR.py
    if scale == "paper":
        assert digits.rounds == 120
        office = resolve_method(p, "pfeddr", p.experiments["pfeddb_office"].train)
        assert (office.alpha, office.beta, office.momentum, office.rounds) == (0.5, 2.0, 0.0, 300)  # office_pfedDR.py
        dn = resolve_method(p, "pfeddr_domainnet", p.experiments["pfeddb_domainnet"].train)
        assert (dn.ce_sum, dn.beta, dn.momentum, dn.rounds) == (True, 0.0, 0.0, 300)  # domainnet_pFedDR.py


def test_registered_and_resumed_runs_match_uninterrupted_ones(fed, tmp_path):
    assert method_class("pfeddr") is PFedDR
    whole = _engine(fed, tp=_train(rounds=3)).run()
    ck = tmp_path / "ck.pt"
    first = _engine(fed, tp=_train(rounds=3), checkpoint=ck)
    first.step()
    resumed = _engine(fed, tp=_train(rounds=3), checkpoint=ck)
    assert resumed.round == 1
    rest = resumed.run()
    assert [r["eval"] for r in rest] == [r["eval"] for r in whole]
