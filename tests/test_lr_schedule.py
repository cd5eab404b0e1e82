"""train.lr_schedule: the learning rate each round's local training starts from."""

from __future__ import annotations

import math

import pytest
import torch

from fedsilo.client.local import lr_now, scheduled_lr
from fedsilo.config import ConfigError, LRScheduleParams, TrainParams, parse_params
from fedsilo.fl.continual import ContinualEngine
from fedsilo.fl.engine import Engine
from fedsilo.methods import method_class
from fedsilo.tracking import round_metrics
from tests.conftest import small_params
from tests.tiny import one_thread, style_shifted_federation, style_stream, tiny_net, without_timing


def _factors(rounds: int, **sched) -> list[float]:
    s = LRScheduleParams(**sched)
    return [s.factor(r, rounds) for r in range(1, rounds + 1)]


def test_each_kind_gives_the_factor_of_its_rule():
    assert _factors(4) == [1.0] * 4
    assert _factors(4, kind="step", gamma=0.1, milestones=[2, 3]) == pytest.approx([1, 1, 0.1, 0.01])
    assert _factors(4, kind="exponential", gamma=0.5) == pytest.approx([1, 0.5, 0.25, 0.125])
    # torch's CosineAnnealingLR(T_max=rounds, eta_min=min_factor * lr) stepped once after each round
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5, eta_min=0.2)
    torch_rates = []
    for _ in range(5):
        torch_rates.append(opt.param_groups[0]["lr"])
        opt.step()
        cos.step()
    assert _factors(5, kind="cosine", min_factor=0.2) == pytest.approx(torch_rates)
    assert _factors(4, kind="exponential", gamma=0.5, warmup_rounds=2) == pytest.approx([0.5, 0.5, 0.25, 0.125])
    # a task stream's rounds count within the task: the schedule restarts
    s = LRScheduleParams(kind="step", gamma=0.1, milestones=[1])
    assert [s.factor(r, 2) for r in range(1, 7)] == pytest.approx([1, 0.1] * 3)


@pytest.mark.parametrize("sched, key", [
    ({"kind": "step", "milestones": [2]}, "gamma"),
    ({"kind": "step", "gamma": 0.1}, "milestones"),
    ({"kind": "exponential"}, "gamma"),
    ({"gamma": 0.5}, "gamma"),
    ({"milestones": [2]}, "milestones"),
    ({"kind": "step", "gamma": 0.1, "milestones": [3, 2]}, "milestones"),
    ({"kind": "exponential", "gamma": 0.9, "min_factor": 0.1}, "min_factor"),
    ({"kind": "step", "gamma": 0.1, "milestones": [2, 5]}, "lr_schedule.milestones"),
    ({"warmup_rounds": 5}, "lr_schedule.warmup_rounds"),
    ({"kind": "cosine", "warmup_rounds": 1}, "warmup_rounds"),
    ({"kind": "step", "gamma": 0.1, "milestones": [2], "warmup_rounds": 3}, "past the first milestone"),
])
def test_a_schedule_that_does_not_fit_its_kind_or_the_run_is_refused_by_key(sched, key):
    raw = small_params()
    raw["experiments"]["quick"]["train"].update(rounds=5, lr_schedule=sched)
    with pytest.raises(ConfigError) as err:
        parse_params(raw)
    assert "experiments.quick.train" in str(err.value) and key in str(err.value)


def test_an_empty_schedule_is_the_constant_rate_and_one_milestone_needs_no_list():
    assert TrainParams(lr_schedule=None).lr_schedule == LRScheduleParams()
    assert TrainParams(rounds=5, lr_schedule={"kind": "step", "gamma": 0.1, "milestones": 3}).lr_schedule.milestones == (3,)


def test_the_optimizers_of_a_round_start_at_the_scheduled_rate_and_outside_a_round_at_their_own():
    tp = TrainParams(rounds=4, lr=0.1, lr_schedule={"kind": "step", "gamma": 0.5, "milestones": [1, 2]})
    with scheduled_lr(tp, 3) as f:
        assert f == 0.25 and lr_now(0.1) == pytest.approx(0.025) and lr_now(2.0) == 0.5
    assert lr_now(0.1) == 0.1


def _run(rounds=3, k=1, **sched):
    tp = TrainParams(rounds=rounds, batch_size=6, lr=0.05, momentum=0.5, device="cpu", count_flops=False,
                     parallel_clients=k, **({"lr_schedule": sched} if sched else {}))
    cls = method_class("fedavg")
    clients = style_shifted_federation(n_train=12, n_test=6, per_domain=1)[:3]
    with one_thread():
        e = Engine(cls(cls.params_cls(), tp), tiny_net(1, 4), clients, tp, seed=0)
        return e, e.run()


def _distance(a: dict, b: dict) -> float:
    """Between the weights (BatchNorm's running statistics follow the data whatever the rate)."""
    weights = {k for k, _ in tiny_net(1, 4).named_parameters()}
    return math.sqrt(sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in weights))


def test_a_run_trains_each_round_at_its_scheduled_rate():
    """Rounds before a drop are the constant run's, bit for bit; after a drop to ~0 the model stops moving."""
    const, h_const = _run()
    before, _ = _run(rounds=2)
    dropped, h = _run(kind="step", gamma=1e-9, milestones=[2])
    assert all("lr_factor" not in e for e in h_const)
    assert [e["lr_factor"] for e in h] == pytest.approx([1, 1, 1e-9])
    assert round_metrics(h[2])["lr_factor"] == pytest.approx(1e-9)
    assert without_timing(h)[:2] == [{**e, "lr_factor": 1.0} for e in without_timing(h_const)[:2]]
    assert _distance(dropped.server, before.server) < 1e-6 < _distance(const.server, before.server)


def test_clients_trained_at_once_each_take_the_rounds_rate():
    (one, h1), (two, h2) = _run(k=1, kind="exponential", gamma=0.3), _run(k=2, kind="exponential", gamma=0.3)
    assert two.parallel == 2 and without_timing(h1) == without_timing(h2)
    assert all(torch.equal(one.server[k], two.server[k]) for k in one.server)
    const, _ = _run(k=2)
    assert _distance(const.server, two.server) > 1e-4


@pytest.mark.parametrize("name", ["pfeddb", "fedcil"])
def test_a_rate_of_a_methods_own_is_scheduled_too(name):
    """pFedDB's Phase-2 rate (phase2_lr, not train.lr) and FedCIL's Adam (methods.fedcil.lr): in a round whose factor
    is ~0 a client uploads what it downloaded; at the full rate it does not."""
    rounds, drop = (3, 2) if name == "pfeddb" else (2, 1)  # pFedDB: Phase 1, then Phase 2 at full rate, then ~0
    tp = TrainParams(rounds=rounds, batch_size=8, lr=0.05, device="cpu", count_flops=False,
                     lr_schedule={"kind": "step", "gamma": 1e-9, "milestones": [drop]})
    cls = method_class(name)
    seen: dict = {}

    def observe(rnd, client, way, payload):
        seen[(rnd, client, way)] = {k: v.detach().clone() for k, v in payload.items()}

    with one_thread():
        if name == "pfeddb":
            method = cls(cls.params_cls(local_rounds=1, cut_depth=2, phase2_lr=0.5), tp)
            e = Engine(method, tiny_net(1, 4), style_shifted_federation(n_train=12, n_test=6, per_domain=1)[:3], tp, seed=0, observer=observe)
        else:  # a two-task stream: the schedule restarts with the second task
            method = cls(cls.params_cls(gen_channels=8, md_iter=1, gen_batch=8, lr=2e-2), tp)
            e = ContinualEngine(method, tiny_net(1, 4), style_stream(domains=2), ["S0", "S1"], tp, 0, observer=observe)
        history = e.run()

    def moved(rnd: int) -> float:  # the largest change of a weight between a client's download and its upload
        out = [float((up[k].double() - seen[(r, c, "down")][k].double()).abs().max())
               for (r, c, w), up in seen.items() if r == rnd and w == "up" and (r, c, "down") in seen
               for k in up if k in seen[(r, c, "down")] and up[k].is_floating_point() and "running_" not in k]
        return max(out) if out else float("nan")

    factor = {h["round"]: h["lr_factor"] for h in history}
    full = [r for r in factor if factor[r] == 1.0 and moved(r) == moved(r)]  # rounds with a download to compare
    low = [r for r in factor if factor[r] < 1e-6]
    assert full and low and max(moved(r) for r in low) < 1e-6 < min(moved(r) for r in full)
