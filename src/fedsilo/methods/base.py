"""The method interface the engine calls, its typed params, and the helpers every method may use.

A method never holds client state itself: the engine keeps a *client store* per client (the tensors that persist on
that client between rounds) and the *server state*, and hands them to the hooks. What a client downloads and
uploads is exactly the dict a hook returns; the engine copies it across, counts its bytes, and refuses an upload
that contains a key the method declares private.
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

import torch
from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError, field_validator
from pydantic_core import PydanticCustomError
from torch import nn

from fedsilo.client.data import ClientData
from fedsilo.client.local import predict
from fedsilo.config import ConfigError, LocalOptimizer, Strict, TrainParams
from fedsilo.models import MODELS, LayeredNet

State = dict[str, torch.Tensor]


def payload_bytes(payload: State) -> int:
    """Bytes a payload occupies on the wire: the sum of numel * element_size of its tensors."""
    return int(sum(t.numel() * t.element_size() for t in payload.values()))


class MethodParams(Strict):
    """A method's hyper-parameters (``methods.<key>``): unknown keys, non-finite numbers and booleans given for
    numbers are refused, as everywhere in params (:class:`fedsilo.config.Strict`). Every method takes
    ``local_optimizer``: its local training's optimizer settings where they differ from the experiment's ``train``."""

    local_optimizer: Optional[LocalOptimizer] = Field(
        None, description="optimizer settings of this method's local training in place of the experiment's train "
        "(optimizer, lr, momentum, nesterov, betas, eps, weight_decay; a key left out keeps the experiment's)",
    )

    @field_validator("local_optimizer", mode="before")
    @classmethod
    def _empty_is_none(cls, v: Any) -> Any:
        return None if v == {} else v  # `local_optimizer: {}` changes nothing: the same run (and hash) as none

    def unused_keys(self) -> set[str]:
        """The keys these values make idle (pFedDB's Phase-1 settings under ``two_phase: false``): a report comparing
        a variant with its method passes over them."""
        return set()


def one_or_per_backbone(value: Any, one: TypeAdapter) -> Any:
    """A params value given once or per backbone (``{simple_cnn: 0.5, alexnet_bn: 0.0}``: the authors' settings of
    one method differ per dataset, and in a paper's runs each backbone serves one dataset), each value validated by
    ``one``. For a field validator (mode ``before``): an error names ``<field>.<backbone>`` inside a mapping, and an
    unknown backbone is refused with the known ones. :func:`fedsilo.methods.sharing.per_backbone` picks the run's."""
    if not isinstance(value, dict):
        return _one_value(value, one, None)
    for k in value:
        if k not in MODELS:
            raise PydanticCustomError("per_backbone", f"unknown backbone (known: {', '.join(MODELS)})", {"field": str(k)})
    return {k: _one_value(v, one, k) for k, v in value.items()}


def per_backbone_type(one: Any) -> Any:
    """The annotation of a params field given once or per backbone, each value of type ``one`` and every backbone
    name checked when params are read (:func:`one_or_per_backbone`): a misspelt backbone is refused by check-params,
    not taken for a backbone without an entry."""
    adapter = TypeAdapter(one)
    return Annotated[Union[one, dict[str, one]], BeforeValidator(lambda value: one_or_per_backbone(value, adapter))]


def _one_value(value: Any, one: TypeAdapter, backbone: Optional[str]) -> Any:
    try:
        return one.validate_python(value)
    except ValidationError as err:
        raise PydanticCustomError("per_backbone", err.errors()[0]["msg"], {"field": backbone} if backbone else {}) from None


class Method:
    """Hooks, in the order the engine calls them.

    join -> transform_model -> setup -> init_server / init_client (once) -> per round, per sampled client: download -> local_update ->
    (engine checks the upload against private_keys / private_in_round, counts its bytes, moves it) -> aggregate, or for a
    ``streaming`` method agg_begin / agg_add per upload / agg_end (aggregate is then not called) -> load_eval_model (by
    default eval_state) per client (and global_state where one exists); eval_download: what a deployed site receives
    to be scored. The defaults send the server state as it is: bookkeeping the server keeps beside the model (a
    momentum buffer, a record per site) is left out of download, eval_download, eval_state and global_state by the
    method that keeps it. README "Adding a method" says more.
    """

    name: ClassVar[str]
    params_cls: ClassVar[type[MethodParams]] = MethodParams
    # True for a method that can learn a stream of domain tasks (a ``domain_incremental`` split): it either knows the
    # stream (pFedDIL, Disjoint, ...) or is the plain fine-tuning the continual papers compare with (FedAvg, FedProx)
    task_stream: ClassVar[bool] = False
    # True for a method defined on a stream only (pFedDIL, Source-only, Disjoint, Sharing, DANN + FL): the per-round
    # engine of static clients refuses it
    stream_only: ClassVar[bool] = False
    # True when ``local_update`` may run for several clients at once, each on its own copy of the model, from several
    # threads (``train.parallel_clients``): it keeps nothing on the method object between or during calls (but
    # ``last_loss``, kept per thread, and spare models made with :class:`Spares`) and holds no reference to the model
    # it was set up with. A method that stores per-call state on itself (a hook's capture, what the server heard
    # from a client) sets it False and is trained one client at a time.
    client_parallel: ClassVar[bool] = True
    # a site may join a run in progress (a deployment's sites[k].joined): the server state holds nothing sized or
    # weighted by the federation at its start (a per-site server part is made when the site first needs it, a count
    # of sites or domains is taken from the round's members). Declared by each class for itself (a subclass that adds
    # such state does not inherit it): see joins_mid_run()
    joinable: ClassVar[bool] = False
    # a method whose local training uses an optimizer of its own params, not the train's (local_optimizer refused,
    # naming these): FedCIL's Adam
    own_optimizer: ClassVar[str] = ""
    # a site that missed rounds of a local phase every site trains (``sample_all``) trains them when it is back or
    # joins, as the server's download names them (pFedDB's Phase 1): declared by each class for itself, see
    # catches_up_local_phase()
    catches_up: ClassVar[bool] = False
    # why not, for a method that is not joinable: the refusal of a site marked joined names it
    join_refusal: ClassVar[str] = "its server keeps state sized or weighted by the federation it started with"

    def __init__(self, params: MethodParams, train: TrainParams, key: Optional[str] = None):
        self.params = params
        # the params.yaml entry this method was resolved from (``methods.<key>``): a named variant such as
        # fedavg_two_phase has its own key; errors name it
        self.key = key or self.name
        # the run's training settings: the experiment's, with this method's own optimizer settings where it has them
        # (applying them again, to a train that already holds them, changes nothing)
        lo = params.local_optimizer
        if lo is not None and self.own_optimizer:
            raise ConfigError(f"methods.{self.key}.local_optimizer: {self.name} does not train with the train's optimizer "
                              f"({self.own_optimizer}): set those instead")
        self.train = lo.applied(train, f"methods.{self.key}.local_optimizer") if lo is not None else train
        self._losses = threading.local()  # last_loss, per thread (a thread's value goes with the thread)
        self.federation: list[ClientData] = []
        self.members: list[ClientData] = []  # the sites in the federation in the round (round_members)
        self.run_seed = 0

    @property
    def last_loss(self) -> Optional[float]:
        """The mean training loss of the latest ``local_update`` of this thread: clients trained in parallel
        (``train.parallel_clients``) each report their own."""
        return getattr(self._losses, "value", None)

    @last_loss.setter
    def last_loss(self, value: Optional[float]) -> None:
        self._losses.value = value

    def __getstate__(self) -> dict[str, Any]:  # a thread-local does not pickle or copy: the copy starts without a loss
        state = dict(self.__dict__)
        state.pop("_losses", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._losses = threading.local()

    @classmethod
    def joins_mid_run(cls) -> bool:
        """Whether a site may join a run of this method in progress: declared (``joinable = True``) on this class
        itself, never inherited."""
        return bool(cls.__dict__.get("joinable", False))

    @classmethod
    def catches_up_local_phase(cls) -> bool:
        """Whether a site that missed rounds of a local phase every site trains may still take part: declared
        (``catches_up = True``) on this class itself, never inherited. Otherwise a site gone in such a round cannot
        come back, and one cannot join once such a round went by."""
        return bool(cls.__dict__.get("catches_up", False))

    def newcomer_refusal(self) -> str:
        """Why a hospital outside a finished run cannot adapt as one of this method's sites would (`fedsilo site
        onboard --strategy as_member`), or "": a site's evaluation model needs what the server makes for it from its
        uploads (FDSE's mixed layers, CD2-pFed's record of its channel split, LG-FedAvg's record that it took the
        FedAvg start), which a finished federation never makes for a newcomer, or it holds nothing of the site's own
        (FedBABU without fine-tuning). Called after ``setup``."""
        return ""

    def shares_nothing(self) -> bool:
        """Whether the sites share no tensor (each trains alone: Single), after ``setup``."""
        return False

    def trains(self, rnd: int) -> bool:
        """Whether clients train in round ``rnd`` (all rounds by default; pFedDR's scripts stop after their ``rounds``):
        a site that joins a run in progress needs a round left that trains."""
        return True

    def join(self, clients: list[ClientData], seed: int = 0) -> None:
        """The federation's clients as a server knows them at registration (name, domain, sample count) and the run's
        seed: called once, before the model is transformed and set up. Methods whose aggregation weighs domains or
        keeps per-client server state read ``self.federation`` (never a client's data); server-side randomness (a
        server network's initialisation, its batches) is seeded from ``self.run_seed``."""
        self.federation = list(clients)
        self.members = list(clients)
        self.run_seed = int(seed)

    def round_members(self, rnd: int, members: list[ClientData]) -> None:
        """Server side, before round ``rnd``'s training: the sites the federation holds in that round, every site that
        has joined by then (one that left or is away still counts, as everything the server holds of it stays). An
        aggregation that counts or weighs the federation (F²DC's domains, FedHEAL's starting weight) reads
        ``self.members``, so a site that joins a run in progress counts from its first round on, never before
        (``joinable``)."""
        self.members = list(members)

    # --- structure
    def transform_model(self, model: nn.Module, example: torch.Tensor) -> nn.Module:
        """The model the engine trains, built from the backbone (pFedDB's dual branch); default: the backbone."""
        return model

    def setup(self, model: LayeredNet) -> None:
        """Called once with the freshly initialised model before any state is created."""

    def private_keys(self, model: LayeredNet) -> set[str]:
        """Keys that must never leave a client (the engine checks every upload)."""
        return set()

    def private_in_round(self, rnd: int, private: set[str]) -> set[str]:
        """The keys round ``rnd``'s uploads may not hold, given what ``private_keys`` declared: all of them in every
        round by default. A method whose clients share every layer for a while before some become their own
        (LG-FedAvg's FedAvg-trained start) returns less in those rounds; from then on the check is the full one."""
        return private

    # --- state
    def init_server(self, model: LayeredNet) -> State:
        raise NotImplementedError

    def init_client(self, model: LayeredNet, client: ClientData) -> State:
        raise NotImplementedError

    def check_backbone(self, model: nn.Module, example: torch.Tensor) -> None:
        """Refuses (a ConfigError saying why) a backbone the method cannot work on; ``model`` is the experiment's
        backbone and ``example`` a batch of its images, both on PyTorch's meta device (shapes, no data). Run by
        check-params (the pipelines' first stage) for every experiment the pipeline trains the method on and by
        ``fedsilo deploy app``, so that no train stage or deployment starts on one. Default: every backbone."""

    # --- a stream of domain tasks (``domain_incremental`` splits; fl/continual.py)
    def check_stream(self) -> None:
        """Refuses (a ConfigError naming ``methods.<key>.<setting>``) settings that are not defined on a stream of
        domain tasks: run by ``set_tasks`` and by check-params for every stream experiment the method trains on."""

    def set_tasks(self, names: list[str]) -> None:
        """The task stream's domain names in order, before ``setup``; the engine sets ``self.task`` every round."""
        self.check_stream()
        self.tasks = list(names)
        self.task = 0

    def on_task_start(self, server: State, model: nn.Module, task: int) -> State:
        """Server side, at the first round of task ``task`` (a new task's head or model is created here)."""
        return server

    def task_end_download(self, server: State, client: ClientData) -> State:
        """Server side, after a task's last aggregation: what client ``client`` receives to keep of the task (counted
        as downloaded bytes). Default: nothing."""
        return {}

    def task_end_keep(self, store: State, client: ClientData, payload: State) -> None:
        """Client side: keep what ``task_end_download`` sent."""
        raise NotImplementedError(f"{self.name} sends a task-end download but does not say what the client keeps")

    def predict_task(self, model: nn.Module, server: State, store: State, client: ClientData, task: int, rnd: int) -> torch.Tensor:
        """Class probabilities of client ``client``'s test images of task ``task`` (``client`` is that task's data):
        by default the softmax of the model the client is evaluated with. Methods that choose a model by the task's
        identity (Disjoint, Sharing) or ensemble several (pFedDIL) override this."""
        self.load_eval_model(model, server, store, client, rnd)
        return predict(model, client.x_test, cfg=self.train).softmax(1)

    # --- a round
    def announce(self, model: nn.Module, store: State, client: ClientData, rnd: int) -> State:
        """Client side, before the download: what the client tells the server this round (pFedDIL: which of its
        models the current task trains). Counted as an upload and privacy-checked; default nothing."""
        return {}

    def hear(self, client: ClientData, said: State) -> None:
        """Server side: receives ``announce``'s payload before ``download`` for the same client."""

    def on_round_start(self, model: nn.Module, rnd: int) -> None:
        """Called before a round's local updates (and so before its evaluation): phase switches go here."""

    def sample_all(self, rnd: int) -> bool:
        """True forces every client into round ``rnd`` whatever the sampling fraction."""
        return False

    def download(self, server: State, client: ClientData, rnd: int) -> State:
        raise NotImplementedError

    def local_update(
        self, model: LayeredNet, store: State, payload: State, client: ClientData, rnd: int, seed: int
    ) -> State:
        raise NotImplementedError

    def aggregate(self, server: State, uploads: list[tuple[ClientData, State]], rnd: int) -> State:
        raise NotImplementedError

    # --- evaluation
    def eval_state(self, server: State, store: State, client: ClientData) -> State:
        raise NotImplementedError

    def storage(self, server: State, store: State) -> dict[str, int]:
        """What a client keeps to answer every task seen so far, at a task's end (pFedDIL's Table 6): the number of
        models and their bytes. Default: the one model it is evaluated with, the global one where the method has one,
        else its own store. Methods that keep several (Disjoint, Sharing's heads, pFedDIL) or more than a classifier
        (FedCIL's generator) override this."""
        state = self.global_state(server)
        return {"models": 1, "bytes": payload_bytes(state if state is not None else store)}

    def load_eval_model(self, model: nn.Module, server: State, store: State, client: ClientData, rnd: int) -> None:
        """Put the model client ``client`` is evaluated with into ``model`` (after round ``rnd``). Default: its
        ``eval_state``. A method that personalizes at evaluation time (FedBABU's fine-tuning) trains here, on the
        client's training data only, and changes neither ``server`` nor ``store``."""
        model.load_state_dict(self.eval_state(server, store, client), strict=True)

    def eval_download(self, server: State, client: ClientData) -> State:
        """What a site must receive to be evaluated where its data lives (the Flower adapter sends it; the engine,
        in one process, reads the server state directly): everything ``load_eval_model`` and ``global_state`` read
        for ``client``. Default: the whole server state. A method whose server keeps per-client tensors (FedPAC's
        combined heads, FDSE's personalized layers) sends each site its own only."""
        return server

    def global_state(self, server: State) -> Optional[State]:
        """A full model state that is the same for every client, or None where the method has none."""
        return None

    def eval_is_global(self) -> bool:
        """True when every client is evaluated with global_state (the engine then evaluates once, not twice)."""
        return False

    # --- optional streaming aggregation: a method that defines these is aggregated upload by upload
    streaming: ClassVar[bool] = False

    def agg_begin(self, server: State, rnd: int) -> Any:
        raise NotImplementedError

    def agg_add(self, acc: Any, client: ClientData, upload: State) -> None:
        raise NotImplementedError

    def agg_end(self, server: State, acc: Any, rnd: int) -> State:
        raise NotImplementedError

    def resolved(self) -> dict[str, Any]:
        """What the method derived from its params and the model, known after ``setup`` (a resolved cut depth, the
        layers kept private, the shared fraction): recorded in metrics.json and MLflow beside the params."""
        return {}


ClientWeights = Literal["samples", "uniform"]


def client_weights_field(default: ClientWeights, why: str) -> Any:
    """``client_weights`` for a method whose paper and authors' code weigh a round's uploads differently: ``samples``
    (each client by its training-set size, FedAvg's mean) or ``uniform`` (each sampled client alike); ``why`` says whose
    each is. :class:`MeanAggregation` reads it."""
    return Field(default, description=f"the server's mean of a round's uploads: samples (by training-set size) or uniform; {why}")


class MeanAggregation(Method):
    """FedAvg's server step, streamed: the sample-size-weighted mean of a round's uploads, accumulated upload by upload
    (:class:`RunningMean`); the subclass's ``agg_end`` says where the mean goes (the whole server state, a task's
    model, a trunk and a head). An empty upload (a client with nothing to send) adds nothing. A method whose params
    have ``client_weights`` (:func:`client_weights_field`) may weigh every upload alike instead."""

    streaming: ClassVar[bool] = True

    def agg_begin(self, server: State, rnd: int) -> "RunningMean":
        return RunningMean()

    def upload_weight(self, client: ClientData) -> float:
        """The weight of ``client``'s upload in the round's mean: its training-set size, or 1 under
        ``client_weights: uniform``."""
        return 1.0 if getattr(self.params, "client_weights", "samples") == "uniform" else client.n_train

    def agg_add(self, acc: "RunningMean", client: ClientData, upload: State) -> None:
        if upload:
            acc.add(self.upload_weight(client), upload)


def check_rounds_fit(algo: "Method", key: str, rounds: int, where: str, source: str = "") -> None:
    """A method whose first rounds are another's (a two-phase method's ``local_rounds``, LG-FedAvg's
    ``fedavg_rounds``) must leave rounds of its own in ``rounds`` (set at ``where``): a run that never federates is
    refused by key, in a pipeline's experiments (check-params) and in a Flower App (its federation's train)."""
    said = f"{source}: " if source else ""
    fedavg_start = getattr(algo.params, "fedavg_rounds", 0)  # LG-FedAvg's FedAvg-trained start
    if fedavg_start >= rounds:
        raise ConfigError(f"{said}methods.{key}.fedavg_rounds: {fedavg_start} FedAvg rounds leave no LG-FedAvg round in "
                          f"{where} ({rounds}); set it below {rounds}")
    e0 = algo.phase_one_rounds() if hasattr(algo, "phase_one_rounds") else 0
    if e0 >= rounds:
        raise ConfigError(f"{said}methods.{key}.local_rounds: {e0} local rounds leave no federated round in {where} "
                          f"({rounds}); set local_rounds below {rounds} or raise rounds")


class RunningMean:
    """Sample-size-weighted mean accumulated one upload at a time, so a round with many clients holds one
    accumulator instead of every upload. Floating tensors accumulate in float32 (or their own wider dtype), integer
    buffers (BatchNorm's num_batches_tracked) in float64 and are rounded. ``count``: the uploads added (a server
    update that divides by the round's participants, not by their samples)."""

    def __init__(self) -> None:
        self.sum: State = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.weight = 0.0
        self.count = 0

    def add(self, n: float, upload: State) -> None:
        for k, v in upload.items():
            if k not in self.sum:
                wide = torch.float64 if not v.is_floating_point() or v.dtype == torch.float64 else torch.float32
                self.sum[k] = torch.zeros_like(v, dtype=wide)
                self.dtypes[k] = v.dtype
            self.sum[k].add_(v.to(self.sum[k].dtype), alpha=float(n))
        self.weight += float(n)
        self.count += 1

    def result(self) -> State:
        out: State = {}
        for k, acc in self.sum.items():
            mean = acc / self.weight
            out[k] = mean.round().to(self.dtypes[k]) if not self.dtypes[k].is_floating_point else mean.to(self.dtypes[k])
        return out


class TakenMean(RunningMean):
    """A round's :class:`RunningMean` and the names of the sites that trained in it, whether they uploaded or not: for
    a server that records, by name, what a site has taken (LG-FedAvg's FedAvg start, pFedDB's local model)."""

    def __init__(self) -> None:
        super().__init__()
        self.took: list[str] = []


class Spares:
    """``count`` spare copies of the model a client trains (a teacher, the downloaded global model), made on first use
    and kept while that model lives, one set per model object: the engine's model (so for the whole run), or each of
    the copies made for a round when clients train in parallel (``train.parallel_clients``), so that two clients never
    share a spare."""

    def __init__(self, count: int):
        self.count = count
        self._sets: "weakref.WeakKeyDictionary[nn.Module, tuple[nn.Module, ...]]" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def of(self, model: nn.Module) -> tuple[nn.Module, ...]:
        with self._lock:
            got = self._sets.get(model)
            if got is None:
                got = self._sets[model] = tuple(spare_copy(model) for _ in range(self.count))
            return got


def spare_copy(model: nn.Module) -> nn.Module:
    """A deep copy of the model for a second set of weights on the client (a teacher, the downloaded global model),
    without the engine's compiled forward, which belongs to the original only."""
    compiled = model.__dict__.pop("_fedsilo_compiled", None)
    try:
        return copy.deepcopy(model)
    finally:
        if compiled is not None:
            model.__dict__["_fedsilo_compiled"] = compiled


def fresh_copy(module: nn.Module, seed: int) -> nn.Module:
    """A copy of ``module`` (same shapes, same device) whose parameters are drawn anew from PyTorch's default
    initialisation under ``seed``: a new head beside an existing one."""
    twin = spare_copy(module)
    cuda = sorted({p.device.index or 0 for p in twin.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):  # every generator the draws may use is put back afterwards
        torch.manual_seed(seed)
        for m in twin.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    return twin
