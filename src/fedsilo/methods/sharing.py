"""Partial sharing: a method that shares a fixed subset of the model's state_dict and keeps the rest on the client.

FedAvg shares everything, FedBN everything but BatchNorm, FedPer everything but the head, Single nothing. The local
update is the paper's ClientUpdate: load the download over the client's own tensors, train (with the method's extra
local terms), keep the private tensors, upload the shared ones; the server takes the mean weighted by sample size (or uniform, a method's ``client_weights``).

F²DC's decoupler and corrector plug into any partial-sharing method whose params carry ``decouple:`` (F²DC Table 3):
the model gets the modules, the local objective their loss, and the modules stay on the client unless
``decouple.share_modules`` says otherwise.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

from fedsilo.client.data import ClientData
from fedsilo.client.local import ExtraLoss, make_generator, train_local
from fedsilo.config import ConfigError, TrainParams
from fedsilo.methods import decoupling
from fedsilo.methods.base import MeanAggregation, State
from fedsilo.models import LayeredNet


def per_backbone(value: Any, model_name: str, what: str) -> Any:
    """A value given once or per backbone (``{simple_cnn: 3, resnet34: 1}``): the entry of ``train.model``; ``what``
    is the dotted params key, named when the backbone has no entry."""
    if not isinstance(value, dict):
        return value
    if model_name not in value:
        raise ConfigError(f"{what}: no entry for the backbone {model_name} (entries: {', '.join(value)})")
    return value[model_name]


def top_units(model: LayeredNet, layers: int, what: str) -> int:
    """Index of the first unit of the model's top ``layers`` weighted layers (a head, LG-FedAvg's global part);
    ``what`` is the dotted params key that set ``layers``, named when it leaves no layer below."""
    if layers >= model.num_layers:
        raise ConfigError(f"{what}: {layers} must be below the backbone's {model.num_layers} layers")
    try:
        return model.cut_index(model.num_layers - layers)
    except ValueError as err:  # the top `layers` end inside a unit (a ResNet block holds two)
        raise ConfigError(f"{what}: {layers} top layers of this backbone end inside a unit ({err})") from None


def unit_prefixes(first: int, last: int) -> tuple[str, ...]:
    """The state_dict key prefixes of units first..last-1 of a LayeredNet."""
    return tuple(f"units.{i}." for i in range(first, last))


def unit_parameters(model: LayeredNet, first: int, last: int) -> list:
    """The parameters of units first..last-1 of a LayeredNet."""
    return [p for i in range(first, last) for p in model.units[i].parameters()]


def head_and_body(model: LayeredNet, cut: int) -> tuple[list, list]:
    """The parameters of the head (units ``cut`` and above) and of the body below it, for the methods that train one
    with the other ``frozen`` (FedRep, FedPAC, FedeCouple)."""
    return unit_parameters(model, cut, len(model.units)), unit_parameters(model, 0, cut)


def head_and_body_keys(model: LayeredNet, cut: int) -> tuple[list[str], list[str]]:
    """The state_dict keys of the head (units ``cut`` and above) and of the body, in the model's order."""
    head = unit_prefixes(cut, len(model.units))
    keys = list(model.state_dict())
    return [k for k in keys if k.startswith(head)], [k for k in keys if not k.startswith(head)]


@contextmanager
def frozen(params: list) -> Iterator[None]:
    """No gradient for ``params`` inside the block (the backward pass stops at them), restored afterwards."""
    before = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, b in zip(params, before):
            p.requires_grad_(b)


class PartialSharing(MeanAggregation):
    """Share a fixed subset of the model's state_dict; everything else persists in the client store.

    FedAvg shares everything, FedBN everything but BatchNorm, Single nothing. Clients start from the same
    initialisation (the model built from the run's seed).

    The server state holds the shared tensors and a client's store the private ones; either may also hold the
    method's own bookkeeping under keys that are no tensor of the model (a record per site, a momentum, a client's
    kept gradient or prototypes). :meth:`model_state` takes the model's tensors out of them: the defaults load and
    evaluate those only. Bookkeeping is still sent where a method's ``download`` / ``eval_download`` send it (the
    default: the whole server state), and a client's own is private: a method lists its keys in ``private_keys``
    so that an upload holding one is refused."""

    shared: list[str]

    def shared_keys(self, model: LayeredNet) -> list[str]:
        raise NotImplementedError

    # --- F²DC's modules, when the method's params ask for them
    def decoupling(self) -> Optional[decoupling.DecouplingParams]:
        p = self.params
        return p if isinstance(p, decoupling.DecouplingParams) else getattr(p, "decouple", None)

    def transform_model(self, model, example):
        dc = self.decoupling()
        if dc is None:
            return model
        nested = not isinstance(self.params, decoupling.DecouplingParams)  # decouple: {...} beside a method's own keys
        return decoupling.insert_decoupling(model, example, dc, f"methods.{self.key}.{'decouple.' if nested else ''}layers")

    def check_backbone(self, model, example):
        """What the train stage builds first, on the meta device: the method's model (``transform_model``: F²DC's
        modules after units that give feature maps, pFedDB's two branches, pFedDR's two BatchNorm sets) and its shared
        part (``shared_keys``: a head no deeper than the backbone, a mapping with the backbone's entry)."""
        self.shared_keys(self.transform_model(model, example))

    def setup(self, model: LayeredNet) -> None:
        keys = list(model.state_dict().keys())
        dc = self.decoupling()
        kept = decoupling.module_keys(model) if dc is not None and not dc.share_modules else set()
        wanted = set(self.shared_keys(model))  # once: a method's shared_keys may walk the whole model
        self.model_keys = frozenset(keys)
        self.shared = [k for k in keys if k in wanted and k not in kept]
        shared = set(self.shared)
        self.private = [k for k in keys if k not in shared]
        sizes = {n: p.numel() for n, p in model.named_parameters()}
        self._param_share = sum(v for n, v in sizes.items() if n in shared) / max(sum(sizes.values()), 1)

    def private_keys(self, model: LayeredNet) -> set[str]:
        return set(self.private)

    def shares_nothing(self) -> bool:
        return not self.shared

    def resolved(self) -> dict[str, Any]:
        """How much of the trained model is shared: tensors and the fraction of its parameters (weights, biases,
        affine terms; buffers such as BatchNorm statistics are not parameters)."""
        if not hasattr(self, "shared"):
            return {}
        return {
            "shared_tensors": len(self.shared),
            "private_tensors": len(self.private),
            "shared_param_fraction": round(self._param_share, 6),
        }

    def init_server(self, model: LayeredNet) -> State:
        sd = model.state_dict()
        return {k: sd[k].detach().clone() for k in self.shared}

    def init_client(self, model: LayeredNet, client: ClientData) -> State:
        sd = model.state_dict()
        return {k: sd[k].detach().clone() for k in self.private}

    def download(self, server: State, client: ClientData, rnd: int) -> State:
        return dict(server)

    def model_state(self, *states: State) -> State:
        """The model's tensors among ``states`` (a later one's value winning), the methods' bookkeeping left out: what
        a strict ``load_state_dict`` takes (a missing tensor still fails it)."""
        return {k: v for s in states for k, v in s.items() if k in self.model_keys}

    def extra_loss(self, model: LayeredNet, payload: State) -> Optional[ExtraLoss]:
        return None

    def local_terms(self, model: LayeredNet, payload: State, client: ClientData, rnd: int, seed: int,
                    store: State) -> dict[str, Any]:
        """Keyword arguments for train_local beyond plain SGD (extra_loss, batch_loss, grad_hook); ``store`` is the
        client's own state (a term that reads what the client kept: a control variate, a past gradient)."""
        return {"extra_loss": self.extra_loss(model, payload)}

    def with_decoupling(self, model: LayeredNet, terms: dict[str, Any], client: ClientData, rnd: int, seed: int) -> dict[str, Any]:
        """train_local's keyword arguments with F²DC's lambda1 L_DFD + lambda2 L_DFC added to the batch loss (Eq. 9),
        the masks' noise seeded by (seed, round, client)."""
        if self.decoupling() is None:
            return terms
        decoupling.seed_noise(model, int(make_generator(seed, rnd, client.index, 9).initial_seed()), client.x_train.device)
        inner = terms.get("batch_loss")

        def batch_loss(x, y, logits):
            extra = decoupling.decoupling_loss(model, logits, y)
            return extra + inner(x, y, logits) if inner is not None else extra

        return {**terms, "batch_loss": batch_loss}

    def local_train(self, rnd: int) -> TrainParams:
        """The training settings of round ``rnd``'s local update (a two-phase method's per-phase optimizer)."""
        return self.train

    def load_round(self, model: LayeredNet, store: State, payload: State) -> None:
        """The model a client trains this round: its own tensors and the download's, the bookkeeping of either left
        out (:meth:`model_state`)."""
        model.load_state_dict(self.model_state(store, payload), strict=True)

    def local_update(self, model, store, payload, client, rnd, seed):
        self.load_round(model, store, payload)
        terms = self.with_decoupling(model, self.local_terms(model, payload, client, rnd, seed, store), client, rnd, seed)
        self.last_loss = train_local(model, client, self.local_train(rnd), make_generator(seed, rnd, client.index), **terms)
        return self.keep_and_share(model, store)

    def keep_and_share(self, model: LayeredNet, store: State) -> State:
        """The end of a local update: copies of the private tensors into the client's store, the shared ones as the
        upload."""
        sd = model.state_dict()
        for k in self.private:
            store[k] = sd[k].detach().clone()
        return {k: sd[k].detach() for k in self.shared}

    def agg_end(self, server, acc, rnd):
        return acc.result() if acc.weight > 0 and self.shared else server

    def eval_state(self, server, store, client):
        return self.model_state(store, server)

    def global_state(self, server):
        return self.model_state(server) if not self.private else None

    def eval_is_global(self):
        return not self.private
