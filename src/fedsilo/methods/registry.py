"""Methods by name, and their resolution from params: a ``methods.<key>`` entry becomes one typed method object.

An entry's key is the method's registered name (``fedprox: {mu: 0.01}``) or a named variant that says which method it
configures (``fedavg_two_phase: {method: fedavg, local_rounds: 150}``). Its values are validated by the method's own
params class; an error names the dotted key (``methods.fedavg_two_phase.mu: unknown key``).
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Optional

from pydantic import BaseModel, ValidationError

from fedsilo.config import METHOD_ENTRY_HINT, ConfigError, Params, TrainParams, did_you_mean, format_validation_error
from fedsilo.config.errors import REGISTER_HINT
from fedsilo.methods.base import Method, MethodParams, check_rounds_fit
from fedsilo.methods.cd2pfed import CD2PFed
from fedsilo.methods.dann import DANN
from fedsilo.methods.disjoint import Disjoint
from fedsilo.methods.ditto import Ditto
from fedsilo.methods.f2dc import F2DC
from fedsilo.methods.fdse import FDSE
from fedsilo.methods.fedavg import FedAvg
from fedsilo.methods.fedbabu import FedBABU
from fedsilo.methods.fedbn import FedBN
from fedsilo.methods.fedcil import FedCIL
from fedsilo.methods.fedecouple import FedeCouple
from fedsilo.methods.fedheal import FedHEAL
from fedsilo.methods.fedlgf import FedLGF
from fedsilo.methods.fedpac import FedPAC
from fedsilo.methods.fedper import FedPer
from fedsilo.methods.fedprox import FedProx
from fedsilo.methods.fedrcl import FedRCL
from fedsilo.methods.fedrep import FedRep
from fedsilo.methods.fedsa import FedSA
from fedsilo.methods.fedtgp import FedTGP
from fedsilo.methods.fedwon import FedWon
from fedsilo.methods.fpl import FPL
from fedsilo.methods.lgfedavg import LGFedAvg
from fedsilo.methods.moon import MOON
from fedsilo.methods.multihead import MultiHead
from fedsilo.methods.pfeddb import PFedDB
from fedsilo.methods.pfeddil import PFedDIL
from fedsilo.methods.pfeddr import PFedDR
from fedsilo.methods.pfedsd import PFedSD
from fedsilo.methods.single import Single
from fedsilo.methods.source_only import SourceOnly

REGISTRY: dict[str, type[Method]] = {
    cls.name: cls
    for cls in (Single, FedAvg, FedProx, FedBN, FedPer, Ditto, PFedSD, FedLGF, FedWon, PFedDR, PFedDB, F2DC, MOON, FedHEAL, FPL, FedTGP, FedSA, FedRCL, FDSE, FedRep, LGFedAvg, FedBABU, FedeCouple, CD2PFed, FedPAC,
                PFedDIL, SourceOnly, Disjoint, MultiHead, DANN, FedCIL)
}


def joinable_methods() -> list[str]:
    """The methods a site may join a run of in progress (``Method.joins_mid_run``)."""
    return sorted(n for n, cls in REGISTRY.items() if cls.joins_mid_run())


def stream_methods() -> list[str]:
    """The methods that learn a stream of domain tasks (``Method.task_stream``)."""
    return sorted(n for n, cls in REGISTRY.items() if cls.task_stream)


def fits_data(cls: type[Method], stream: bool) -> bool:
    """Whether ``cls`` learns the data: a stream of domain tasks (``stream``) or static clients."""
    return cls.task_stream if stream else not cls.stream_only


def check_stream_fit(cls: type[Method], stream: bool, key: str, where: str) -> None:
    """Refuses, naming ``methods.<key>``, a method the data does not fit: a static method on a stream of domain
    tasks, a stream-only method (``Method.stream_only``) on static clients. ``where`` says what holds the data
    (engine, train stage, Flower sites each phrase it for their user)."""
    if stream and not cls.task_stream:
        raise ConfigError(f"methods.{key}: {cls.name} does not learn a stream of domain tasks; {where}: use one of "
                          f"{', '.join(stream_methods())}")
    if not stream and cls.stream_only:
        raise ConfigError(f"methods.{key}: {cls.name} learns a stream of domain tasks only; {where}")


def method_class(name: str) -> type[Method]:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown method {name!r}{did_you_mean(name, REGISTRY)} (registered: {', '.join(sorted(REGISTRY))})"
                          f"{REGISTER_HINT}") from None


def method_base(key: str, entry: Optional[dict[str, Any]]) -> str:
    """The registered method behind a ``methods.<key>`` entry: the key itself, or the entry's ``method``."""
    return str((entry or {}).get("method", key))


def entry_values(entry: Optional[dict[str, Any]]) -> dict[str, Any]:
    """A ``methods.<key>`` entry's values for its params class (its ``method``, which names the class, left out)."""
    return {k: v for k, v in (entry or {}).items() if k != "method"}


def method_params(params: Params, key: str, source: Optional[str] = None) -> MethodParams:
    """The validated, typed params of ``methods.<key>``: validated on first use (at load time, by check_methods),
    then kept with the params. Errors name ``source`` (default: the file the params were loaded from)."""
    source = source or params.source
    if key in params._typed_methods:
        return params._typed_methods[key]
    if key not in params.methods:
        raise ConfigError(f"methods.{key}: not defined in {source}" + (METHOD_ENTRY_HINT.format(m=key) if key in REGISTRY else
                                                                       did_you_mean(key, list(params.methods)) or REGISTER_HINT))
    entry = params.methods[key]
    try:
        cls = method_class(method_base(key, entry))
    except ConfigError as err:
        raise ConfigError(f"{source}: methods.{key}: {err}") from None
    try:
        typed = cls.params_cls.model_validate(entry_values(entry))
    except ValidationError as err:
        msg = format_validation_error(err, f"methods.{key}.", model=cls.params_cls)
        for e in err.errors():  # a key of other methods given to this one (F²DC's `decouple:` on MOON): say whose it is
            if e["type"] == "extra_forbidden" and len(e["loc"]) == 1:
                k = str(e["loc"][0])
                takers = sorted(n for n, c in REGISTRY.items() if k in c.params_cls.model_fields)
                unknown = f"methods.{key}.{k}: unknown key"
                if takers:
                    msg = msg.replace(unknown, f"{unknown} ({cls.name} does not take it; a key of {', '.join(takers)})", 1)
        raise ConfigError(f"{source}: {msg}") from None
    params._typed_methods[key] = typed
    return typed


def check_methods(params: Params, source: str = "params.yaml") -> None:
    """Validate every ``methods`` entry (at load time, so that a bad value fails before any stage runs), then every
    trained (experiment, method) pair: a two-phase method's ``local_rounds`` must leave federated rounds."""
    for key in params.methods:
        method_params(params, key, source)
    for e in params.pipeline.experiments:
        train = params.experiments[e].train
        stream = params.experiments[e].split.protocol == "domain_incremental"
        for key in params.experiment_methods(e):
            if key not in params.methods:
                continue  # pipeline.methods names only defined entries (config checks it); a paper's groups too
            if not fits_data(method_class(method_base(key, params.methods[key])), stream):
                continue  # a pair the data does not fit: check-params and the train stage say so (check_stream_fit)
            try:
                algo = resolve_method(params, key, train)
                if stream:
                    algo.check_stream()  # what set_tasks refuses at the train stage (FedAvg's fine-tuning on a stream)
            except ConfigError as err:  # a per-backbone entry lacking this experiment's backbone, ...
                raise ConfigError(f"{source}: {err} (resolved for experiments.{e})") from None
            check_rounds_fit(algo, key, train.rounds, f"experiments.{e}.train.rounds", source)


@functools.lru_cache(maxsize=None)
def _meta_backbone(model: str, size: int, width: float, channels: int) -> tuple[Any, Any]:
    """A backbone and a batch of two images on the meta device (shapes, no data): built once per process and shape."""
    import torch

    from fedsilo.models import build_model

    with torch.device("meta"):
        return build_model(model, channels, 10, image_size=size, width=width), torch.zeros(2, channels, size, size)


def check_backbone(algo: Method, model: str, size: int, width: float = 1.0, channels: int = 3, where: str = "train.model") -> None:
    """A method that works on some backbones only (:meth:`Method.check_backbone`: CD2-pFed's channel decoupling, the
    units F²DC's modules follow) checks ``model`` at ``size`` px: a ConfigError saying why not, the method's key first
    (what to change), then the backbone and ``where`` it is set."""
    if type(algo).check_backbone is Method.check_backbone:
        return
    net, example = _meta_backbone(model, size, width, channels)
    try:
        algo.check_backbone(copy.deepcopy(net), example)  # a method's transform may change the model it is given
    except ConfigError as err:
        raise ConfigError(f"{err} [{algo.name} on the backbone {model}, {where}]") from None


def check_pipeline_fits(params: Params, source: str = "params.yaml") -> None:
    """``fedsilo check-params``: every (experiment, method) pair the pipeline trains fits the experiment's data, as
    the train stage will check (a static method on a stream of domain tasks, a stream-only one on static clients), and
    its backbone (:func:`check_backbone`), and each experiment's host augmentation policy builds. Not part of loading params: the commands of a site (card, supernode) load a file whose local baseline need not
    fit a stream the federation learns, and a train stage refuses only its own pair."""
    from fedsilo.client.hostaug import check_host_policy

    for e in params.pipeline.experiments:
        try:
            check_host_policy(params.experiments[e].train.augment.host, f"experiments.{e}.")
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None
        stream = params.experiments[e].split.protocol == "domain_incremental"
        for key in params.experiment_methods(e):
            if key not in params.methods:
                continue
            try:
                check_stream_fit(method_class(method_base(key, params.methods[key])), stream, key,
                                 f"experiments.{e} has a domain_incremental split" if stream else
                                 f"experiments.{e} has static clients ({params.experiments[e].split.protocol})")
            except ConfigError as err:
                raise ConfigError(f"{source}: {err} (a run of the pipeline)") from None
            train = params.experiments[e].train
            size = params.datasets[params.experiments[e].dataset].image_size  # config checked the dataset is defined
            try:
                check_backbone(resolve_method(params, key, train), train.model, size, train.model_width,
                               where=f"experiments.{e}.train.model")
            except ConfigError as err:
                raise ConfigError(f"{source}: {err}") from None


def _summary(cls: type[Method]) -> str:
    """The first paragraph of a method's module docstring, on one line."""
    import sys

    return " ".join((sys.modules[cls.__module__].__doc__ or "").strip().split("\n\n")[0].split())


def list_methods() -> str:
    """``fedsilo methods``: every registered method, one line each: its name, what data it learns (static clients, a
    task stream, or both), whether a site may join a run of it in progress, and its module's one-line summary."""

    lines = []
    for name in sorted(REGISTRY):
        cls = REGISTRY[name]
        data = "stream" if cls.stream_only else "static + stream" if cls.task_stream else "static"
        first = _summary(cls)
        summary = first if len(first) <= 100 else first[:99].rsplit(" ", 1)[0] + " …"
        lines.append(f"{name:<14} {data:<15} {'joinable' if cls.joins_mid_run() else '-':<9} {summary}")
    return (f"{'method':<14} {'learns':<15} {'mid-run':<9} summary\n" + "\n".join(lines)
            + "\n\n`fedsilo check-params --method <name>` prints a method's parameters; `methods: {<name>: {}}` in a params "
            "file trains it with its defaults.")


def describe_method(params: Params, key: str, source: str = "params.yaml") -> str:
    """``methods.<key>`` as a run would take it: the registered method (its module's one-line summary), then every
    parameter with its value, whether the entry sets it or it is the default, and what it means."""

    if key not in params.methods and key not in REGISTRY:
        raise ConfigError(f"{source}: methods.{key}: not defined (methods: {', '.join(params.methods) or 'none'}; "
                          f"registered methods: {', '.join(sorted(REGISTRY))}){REGISTER_HINT}")
    if key in params.methods:
        typed = method_params(params, key, source)
        base = method_base(key, params.methods[key])
        given = set(entry_values(params.methods[key]))
        head = f"methods.{key}"
    else:  # a registered method the file has no entry for: its defaults, and what trains it
        base, typed, given = key, REGISTRY[key].params_cls(), set()
        head = f"methods.{key} (not in {source}: `{key}: {{}}` under methods trains it with these defaults)"
    first = _summary(method_class(base))
    lines = [head + (f" (method: {base})" if base != key else "") + (f": {first}" if first else "")]
    fields = type(typed).model_fields
    own = [n for n in fields if n not in MethodParams.model_fields] + list(MethodParams.model_fields)  # the method's first
    for name in own:
        field, value = fields[name], getattr(typed, name)
        note = "set" if name in given else "default"
        shown = value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value
        lines.append(f"  {name}: {shown!r} ({note})" + (f"  {field.description}" if field.description else ""))
    return "\n".join(lines)


def resolve_method(params: Params, key: str, train: TrainParams) -> Method:
    """The method object a run uses: its class, its typed params and its key, resolved once."""
    mp = method_params(params, key)
    return method_class(method_base(key, params.methods[key]))(mp, train, key=key)
