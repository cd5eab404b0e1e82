"""DANN + FL (methods/dann.py), pFedDIL's domain-adaptation baseline on the task stream: the gradient reversal, the
adaptation schedule, what travels, and a 3-task run."""

from __future__ import annotations

import math

import pytest
import torch

from fedsilo.config import TrainParams
from fedsilo.fl.continual import ContinualEngine
from fedsilo.fl.engine import PrivacyViolation
from fedsilo.methods.base import payload_bytes
from fedsilo.methods.continual import take
from fedsilo.methods.dann import adaptation_factor, grad_reverse
from fedsilo.methods.registry import REGISTRY
from tests.tiny import finite_stream_summary, resume_mid_run, style_stream, tiny_net, without_timing

NAMES = ["S0", "S1", "S2"]


def _train(**kw) -> TrainParams:
    base = {"rounds": 2, "local_epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.9, "count_flops": False, "device": "cpu"}
    return TrainParams(**{**base, **kw})


def _engine(name: str = "dann", train: TrainParams | None = None, checkpoint=None, observer=None, **params):
    cls = REGISTRY[name]
    train = train or _train()
    if name == "dann":
        params = {"disc_hidden": [8], **params}
    method = cls(cls.params_cls(**params), train)
    return ContinualEngine(method, tiny_net(1, 4), style_stream(), list(NAMES), train, 0, checkpoint=checkpoint,
                           config_hash="h", observer=observer)


# ---------------------------------------------------------------- the gradient reversal layer
def test_gradient_reversal_is_the_identity_forward_and_minus_lambda_backward():
    x = torch.randn(5, 3, requires_grad=True)
    y = grad_reverse(x, 0.7)
    assert torch.equal(y, x)
    g = torch.randn(5, 3)
    y.backward(g)
    assert torch.allclose(x.grad, -0.7 * g)


def test_the_extractor_is_pushed_to_confuse_the_domain_classifier_that_learns_to_separate():
    e = _engine()
    m = e.method
    torch.manual_seed(1)
    z = (torch.randn(32, 16) + 1.0).requires_grad_(True)  # target features (trained extractor)
    z_src = torch.randn(32, 16)  # source features (frozen previous model)
    m.domain_loss(z, z_src, 0.5).backward()
    through_grl = z.grad.clone()
    d_grad = [p.grad.clone() for p in m.disc.parameters()]
    # the same loss without the reversal: the direction that would help the domain classifier
    z.grad = None
    m.disc.zero_grad()
    zeros, ones = torch.zeros(32, dtype=torch.long), torch.ones(32, dtype=torch.long)
    (torch.nn.functional.cross_entropy(m.disc(z_src), zeros) + torch.nn.functional.cross_entropy(m.disc(z), ones)).backward()
    assert through_grl.abs().sum() > 0
    assert torch.allclose(through_grl, -0.5 * z.grad)  # opposite sign, scaled by lambda
    assert all(torch.allclose(a, p.grad) for a, p in zip(d_grad, m.disc.parameters()))  # G_d's own gradient unchanged
    # an SGD step on the features along the reversed gradient raises the domain classifier's loss on them,
    # a step of the classifier along its gradient lowers it
    def target_loss(feat):
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(m.disc(feat), ones))

    before = target_loss(z)
    assert target_loss(z.detach() - 0.5 * through_grl) > before
    with torch.no_grad():
        for p, g in zip(m.disc.parameters(), d_grad):
            p -= 0.5 * g
    assert target_loss(z) < before


# ---------------------------------------------------------------- the schedule
def test_adaptation_factor_is_ganins_schedule():
    assert adaptation_factor(0.0) == 0.0
    assert adaptation_factor(1.0) == pytest.approx(2 / (1 + math.exp(-10)) - 1)
    assert adaptation_factor(0.1) == pytest.approx(2 / (1 + math.exp(-1)) - 1)
    assert adaptation_factor(0.3, gamma=5) == pytest.approx(2 / (1 + math.exp(-1.5)) - 1)
    vals = [adaptation_factor(p / 20) for p in range(21)]
    assert all(a < b for a, b in zip(vals, vals[1:])) and vals[-1] < 1


def test_lambda_ramps_over_each_task_from_its_first_step():
    e = _engine(train=_train(rounds=3))
    m = e.method
    assert m.progress(1, 0, 4) == 0.0 and m.progress(4, 0, 4) == 0.0  # every task starts at p = 0
    assert m.progress(3, 3, 4) == pytest.approx((2 + 3 / 4) / 3)
    assert m.progress(5, 2, 4) == pytest.approx((1 + 2 / 4) / 3)
    seen: dict[int, list[float]] = {}

    def on_round(entry):
        seen[entry["round"]] = list(m.lambdas)

    e.on_round = on_round
    e.run()
    assert all(not seen[r] for r in (1, 2, 3))  # task 0: no domain loss
    # a client has 40 images: 3 batches of <= 16 a round; lambda follows p = ((r-1) + s/S) / T within each task
    for r in range(4, 10):  # the last client of each round: its 3 steps
        assert seen[r] == pytest.approx([adaptation_factor(((r - 1) % 3 + s / 3) / 3) for s in range(3)])
    assert seen[4][0] == 0.0 and seen[7][0] == 0.0


def test_lambda_follows_the_configured_gamma():
    """The adaptation factor uses params.gamma, not the schedule's default 10: with gamma = 5 and one round a task,
    task 1's steps see lambda = adaptation_factor(s / S, 5)."""
    e = _engine(train=_train(rounds=1), gamma=5.0)
    m = e.method
    seen: dict[int, list[float]] = {}
    e.on_round = lambda entry: seen.__setitem__(entry["round"], list(m.lambdas))
    e.step()
    e.step()
    assert seen[2] == pytest.approx([adaptation_factor(s / 3, 5.0) for s in range(3)])
    assert seen[2] != pytest.approx([adaptation_factor(s / 3) for s in range(3)])


# ---------------------------------------------------------------- what travels
def test_uploads_hold_only_the_shared_keys_and_bytes_are_the_tensors_moved():
    moved: dict[str, int] = {}
    ups: list[tuple[int, set]] = []
    downs: list[tuple[int, str, set]] = []

    def observer(rnd, name, way, payload):
        moved[way] = moved.get(way, 0) + payload_bytes(payload)
        (ups.append((rnd, set(payload))) if way == "up" else downs.append((rnd, name, set(payload))))

    e = _engine(observer=observer, train=_train(rounds=3, client_fraction=0.67))  # two of three clients a round
    keys = set(e.model.state_dict())
    disc = {"disc." + k for k in e.method.disc.state_dict()}
    src = {"src." + k for k in keys}
    hist = e.run()
    assert moved["up"] == sum(h["bytes_up_total"] for h in hist)
    assert moved["down"] == sum(h["bytes_down_total"] for h in hist)
    for rnd, got in ups:
        if got == {"need_source"}:
            assert rnd > 3
        else:
            assert got == (keys if rnd <= 3 else keys | disc)  # the model, and G_d from task 1 on; never the source
    # the source comes down once per client and task: at its first round of the task, with the model and G_d
    first: dict[tuple[int, str], int] = {}
    for rnd, name, got in downs:
        task = (rnd - 1) // 3
        if task == 0:
            assert got == keys
            continue
        with_source = got == keys | disc | src
        assert with_source or got == keys | disc
        assert with_source == ((task, name) not in first)
        first.setdefault((task, name), rnd)
    assert any(rnd % 3 != 1 for rnd in first.values())  # a client that joined a task late got the source then
    assert all(v == 8 for h in hist[3:] for v in h["bytes_announce"].values())
    assert not any("bytes_announce" in h for h in hist[:3])
    assert e.method.private_keys(e.model) >= src | {"src_task"}


def test_the_source_is_the_global_model_at_the_end_of_the_previous_task_and_stays_fixed():
    e = _engine()
    for _ in range(2):
        e.step()
    end_of_task0 = {k: v.clone() for k, v in e.server.items()}
    e.step()
    source = take(e.server, "src.")
    assert source.keys() == end_of_task0.keys() and all(torch.equal(source[k], end_of_task0[k]) for k in source)
    store, c = e.stores[0], e.clients[0]
    assert int(store["src_task"][0]) == 1 and torch.equal(take(store, "src.")["units.0.0.weight"], source["units.0.0.weight"])
    with pytest.raises(PrivacyViolation, match="src"):  # the client's copy is declared private: never uploaded
        e._refuse_private(c, {"src.units.0.0.weight": store["src.units.0.0.weight"]}, e.round)
    init = e.method._disc_init
    e.step()
    assert all(torch.equal(take(e.server, "src.")[k], end_of_task0[k]) for k in source)  # frozen through the task
    assert not torch.equal(take(e.server, "disc.")["0.weight"], init["0.weight"])  # G_d trained and averaged
    end_of_task1 = {k: v.clone() for k, v in e.server.items() if not k.startswith(("src.", "disc."))}
    fresh = e.method.on_task_start(e.server, e.model, 2)  # a new task starts a new adaptation: G_d from its init
    assert all(torch.equal(take(fresh, "disc.")[k], init[k]) for k in init)
    e.step()  # task 2: a new source and a fresh G_d
    assert all(torch.equal(take(e.server, "src.")[k], end_of_task1[k]) for k in end_of_task1)
    for c, store in zip(e.clients, e.stores):
        if c.name in e.history[-1]["sampled"]:
            assert int(store["src_task"][0]) == 2
            assert all(torch.equal(take(store, "src.")[k], end_of_task1[k]) for k in end_of_task1)


def test_the_source_features_are_the_trained_models_at_a_tasks_start_and_leave_its_statistics(monkeypatch):
    """At the first step of task 1 the model and the frozen source are the same weights: with the source in the trained
    model's BatchNorm mode (batch statistics) G_d sees the same features from both; its running statistics stay the
    end-of-task-0 model's."""
    import fedsilo.methods.dann as dann_mod

    e = _engine()
    for _ in range(2):
        e.step()
    pairs = []
    real = dann_mod.DANN.domain_loss

    def spy(self, z, z_src, lam):
        pairs.append((z.detach().clone(), z_src.detach().clone()))
        return real(self, z, z_src, lam)

    monkeypatch.setattr(dann_mod.DANN, "domain_loss", spy)
    e.step()
    assert torch.allclose(pairs[0][0], pairs[0][1], atol=1e-6), "the first batch: the same features"
    assert not torch.allclose(pairs[-1][0], pairs[-1][1]), "training moves the target's"
    source = e.method._source
    assert all(torch.equal(source.state_dict()[k], take(e.stores[0], "src.")[k]) for k in source.state_dict() if "running" in k)


def test_the_first_task_is_fedavg_and_the_domain_loss_acts_from_the_second():
    dann, fedavg = _engine(), _engine("fedavg")
    for _ in range(2):
        dann.step()
        fedavg.step()
    assert dann.server.keys() == fedavg.server.keys()
    assert all(torch.equal(dann.server[k], fedavg.server[k]) for k in fedavg.server)
    dann.step()
    fedavg.step()
    assert not torch.equal(dann.server["units.0.0.weight"], fedavg.server["units.0.0.weight"])


# ---------------------------------------------------------------- the stream
def test_three_task_stream_end_to_end_with_finite_metrics():
    e = _engine()
    hist = e.run()
    finite_stream_summary(hist, NAMES, 2)
    assert e.method.resolved()["disc_params"] == 16 * 8 + 8 + 8 * 2 + 2


def test_a_run_killed_mid_task_resumes_to_the_same_numbers(tmp_path):
    resumed, full = resume_mid_run(lambda ck: _engine(checkpoint=ck), tmp_path)  # task 1's first round done, the second not
    assert without_timing(resumed.run()) == without_timing(full)
