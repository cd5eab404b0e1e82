"""Machinery of the methods that learn a stream of domain tasks (pFedDIL and its baselines; the engine is
fl/continual.py).

A continual run's tasks are domains, learned one after another for ``train.rounds`` rounds each; the engine sets
``method.task`` every round, calls ``on_task_start`` on the server at each task's first round, hands each client the
data of the current task, and evaluates every client on the test sets of every task seen so far through
``predict_task``. Several methods keep one model (or one classifier head) per task or per group of tasks; they keep
them side by side in one flat state under a prefix per copy (:func:`put`, :func:`take`), on the server or in a client's
store, so that checkpoints, byte counts and privacy checks see ordinary tensors.
"""

from __future__ import annotations

from torch import nn

from fedsilo.client.data import ClientData
from fedsilo.client.features import input_of
from fedsilo.client.local import make_generator, train_local
from fedsilo.methods.base import Method, State
from fedsilo.methods.sharing import head_and_body_keys
from fedsilo.models import LayeredNet


def fedavg_update(method: Method, model: nn.Module, payload: State, client: ClientData, rnd: int, seed: int) -> State:
    """FedAvg's ClientUpdate on the current task: load the download, train E epochs, upload the whole state_dict."""
    model.load_state_dict(payload, strict=True)
    method.last_loss = train_local(model, client, method.train, make_generator(seed, rnd, client.index))
    return {k: v.detach() for k, v in model.state_dict().items()}


def put(state: State, prefix: str, values: State) -> None:
    """Store a copy of ``values`` in ``state`` under ``prefix`` (``task2.`` + key)."""
    for k, v in values.items():
        state[prefix + k] = v.detach().clone()


def take(state: State, prefix: str) -> State:
    """The copy ``put`` stored under ``prefix``, with its own keys (no copy of the tensors)."""
    n = len(prefix)
    return {k[n:]: v for k, v in state.items() if k.startswith(prefix)}


def has(state: State, prefix: str) -> bool:
    return any(k.startswith(prefix) for k in state)


def head_keys(model: LayeredNet) -> list[str]:
    """The state_dict keys of the model's classifier head (its last unit)."""
    return head_and_body_keys(model, len(model.units) - model.head_units)[0]


def head_input(model: LayeredNet):
    """Inside the block, every forward pass of ``model`` leaves the input of its classifier head (the representation
    the target and auxiliary classifiers share) in the yielded ``.z``."""
    return input_of(model.units[len(model.units) - model.head_units])
