"""Which methods a site may join a run of in progress (``joinable``; deployments: ``sites[k].joined``)."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("name", ["f2dc", "fedheal", "cd2pfed"])
def test_the_check_tells_a_method_whose_server_state_is_sized_or_weighted_by_the_federation(name):
    """F²DC weighs its aggregation by the number of domains, FedHEAL keeps per-client server state, CD2-pFed a
    per-client round count: the check above fails for them, and they are not joinable."""
    assert not REGISTRY[name].joins_mid_run() and not _before_the_join_is_the_same(name)


def test_only_the_static_methods_declared_joinable_are():
    assert set(joinable_methods()) <= set(STATIC)
    assert {"fedecouple", "fedpac", "moon", "pfedsd", "pfeddr", "fpl", "fedtgp", "fedsa", "fedrcl", "fedlgf", "fedwon"} <= set(joinable_methods())
    # a protocol a joiner cannot follow: pFedDB's Phase 1 (the local model its branches start from), LG-FedAvg's
    # FedAvg-trained start and per-client record of it
    assert not {"pfeddb", "lgfedavg"} & set(joinable_methods())
