"""methods.<key>.local_optimizer: a method's local training with other optimizer settings than the experiment's."""

from __future__ import annotations

import pytest

from fedsilo.config import ConfigError, TrainParams
from fedsilo.fl.engine import Engine
from fedsilo.fl.params import parse_params
from fedsilo.methods import method_class, resolve_method
from tests.conftest import small_params
from tests.test_parallel_clients import _same_state
from tests.tiny import one_thread, style_shifted_federation, tiny_net, without_timing

TRAIN = dict(model="simple_cnn", rounds=2, batch_size=6, lr=0.05, momentum=0.5, device="cpu", count_flops=False)


def _run(train: TrainParams, **params) -> Engine:
    cls = method_class("fedavg")
    clients = style_shifted_federation(n_train=12, n_test=6, per_domain=1)[:3]
    engine = Engine(cls(cls.params_cls(**params), train), tiny_net(1, 4), clients, train, seed=0)
    with one_thread():
        engine.run()
    return engine


def test_a_methods_own_optimizer_settings_train_as_the_experiments_would_with_them():
    """FedAvg with local_optimizer {lr: 0.2, momentum: 0} on an experiment at lr 0.05, momentum 0.5 trains exactly as
    FedAvg on an experiment at lr 0.2, momentum 0 (history and server state bit for bit), and not as without them."""
    own = _run(TrainParams(**TRAIN), local_optimizer={"lr": 0.2, "momentum": 0.0})
    same = _run(TrainParams(**{**TRAIN, "lr": 0.2, "momentum": 0.0}))
    plain = _run(TrainParams(**TRAIN))
    assert without_timing(own.history) == without_timing(same.history) and _same_state(own.server, same.server)
    assert not _same_state(own.server, plain.server)
    assert (own.method.train.lr, own.method.train.momentum, own.method.train.rounds) == (0.2, 0.0, 2)


def test_a_key_left_out_keeps_the_experiments_and_a_bad_combination_names_the_key():
    p = small_params(rounds=3)
    p["methods"]["fedavg_fast"] = {"method": "fedavg", "local_optimizer": {"lr": 0.5}}
    p["pipeline"]["methods"] = ["fedavg", "fedavg_fast"]
    params = parse_params(p)
    exp = params.experiments["quick"].train
    fast = resolve_method(params, "fedavg_fast", exp)
    assert fast.train.lr == 0.5 and fast.train.model_dump(exclude={"lr"}) == exp.model_dump(exclude={"lr"})
    assert resolve_method(params, "fedavg", exp).train == exp
    # nesterov without momentum on the experiment's SGD: refused when the params are read, naming the entry
    p["methods"]["fedavg_fast"]["local_optimizer"] = {"nesterov": True, "momentum": 0.0}
    with pytest.raises(ConfigError, match=r"params.yaml: methods.fedavg_fast.local_optimizer: nesterov: Nesterov momentum needs "
                                          r"momentum > 0 \(the train it changes: sgd, lr .*a key left out keeps the train's value"):
        parse_params(p)
    p["methods"]["fedavg_fast"]["local_optimizer"] = {"learning_rate": 0.5}
    with pytest.raises(ConfigError, match=r"methods.fedavg_fast.local_optimizer.learning_rate"):
        parse_params(p)


def test_an_empty_entry_is_none_and_a_method_with_an_optimizer_of_its_own_refuses_it():
    from fedsilo.methods.fedavg import FedAvgParams

    assert FedAvgParams(local_optimizer={}) == FedAvgParams()
    fedcil, pfeddr = method_class("fedcil"), method_class("pfeddr")
    with pytest.raises(ConfigError, match=r"methods.fedcil.local_optimizer: fedcil does not train with the train's optimizer "
                                          r"\(its clients' Adam: methods.<key>.lr"):
        fedcil(fedcil.params_cls(local_optimizer={"lr": 0.5}), TrainParams(**TRAIN))
    # pFedDR's own per-backbone momentum beside local_optimizer's: one of them
    with pytest.raises(ConfigError, match=r"methods.pfeddr.local_optimizer.momentum: beside methods.pfeddr.momentum"):
        pfeddr(pfeddr.params_cls(momentum=0.5, local_optimizer={"momentum": 0.9}), TrainParams(**TRAIN))
    assert pfeddr(pfeddr.params_cls(local_optimizer={"momentum": 0.9}), TrainParams(**TRAIN)).local_train(1).momentum == 0.9
