"""train.lr_schedule: the learning rate each round's local training starts from."""

from __future__ import annotations

import math

import pytest
import torch

from fedsilo.client.local import lr_now, scheduled_lr
from fedsilo.config import ConfigError, LRScheduleParams, TrainParams, parse_params
from fedsilo.fl.engine import Engine
from fedsilo.methods import method_class
from fedsilo.tracking import round_metrics
from tests.conftest import small_params
from tests.tiny import one_thread, style_shifted_federation, tiny_net, without_timing


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
])
def test_a_schedule_that_does_not_fit_its_kind_or_the_run_is_refused_by_key(sched, key):
    raw = small_params()
    raw["experiments"]["quick"]["train"].update(rounds=5, lr_schedule=sched)
    with pytest.raises(ConfigError) as err:
        parse_params(raw)
    assert "experiments.quick.train" in str(err.value) and key in str(err.value)


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
    assert all("lr" not in e for e in h_const)
    assert [e["lr"] for e in h] == pytest.approx([0.05, 0.05, 5e-11])
    assert round_metrics(h[2])["lr"] == pytest.approx(5e-11)
    assert without_timing(h)[:2] == [{**e, "lr": 0.05} for e in without_timing(h_const)[:2]]
    assert _distance(dropped.server, before.server) < 1e-6 < _distance(const.server, before.server)


def test_clients_trained_at_once_each_take_the_rounds_rate():
    (one, h1), (two, h2) = _run(k=1, kind="exponential", gamma=0.3), _run(k=2, kind="exponential", gamma=0.3)
    assert two.parallel == 2 and without_timing(h1) == without_timing(h2)
    assert all(torch.equal(one.server[k], two.server[k]) for k in one.server)
    const, _ = _run(k=2)
    assert _distance(const.server, two.server) > 1e-4
