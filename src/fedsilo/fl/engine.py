"""The simulation engine: rounds, client sampling, payload transfer with byte accounting, evaluation, checkpoints.

One model lives on the device; each client's persistent tensors (its *store*) are swapped in and out of it. The
engine is the only thing that moves tensors between server and clients: a payload's size is the sum of
``numel * element_size`` of the tensors in it, and an upload holding a key the method declares private is refused.
Downloads are handed over without a copy (loading them into the model is the copy); uploads are consumed by a
streaming aggregator before the model changes, or copied when a method aggregates the whole list.

A checkpoint (server state, client stores, history) is written atomically after the last round and, by default
(``train.checkpoint_every: auto``), after any round that ends once the wall time since the last write reaches
:data:`AUTO_CHECKPOINT_RATIO` times what that write took (a small model's after every round, a large personal-model
store's every minute or so: the writes cost at most ~5 % of the run); ``checkpoint_every: k`` writes every k rounds.
A stop asked for through :attr:`Engine.stop` (a first SIGTERM) ends the round in flight, writes the checkpoint and
returns. A run restarted with the same configuration hash resumes after its last checkpointed round; since every
random draw of a round is seeded by (seed, round, client), the resumed run ends with exactly the numbers of an
uninterrupted one.
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from fedsilo.client.data import ClientData, to_float
from fedsilo.client.features import covariance_spectrum
from fedsilo.client.local import (
    compile_model,
    evaluate,
    evaluate_client,
    make_generator,
    predict,
    scheduled_lr,
    score,
    use_channels_last,
)
from fedsilo.config import TrainParams
from fedsilo.methods.base import Method, State, payload_bytes, spare_copy
from fedsilo.methods.registry import check_stream_fit
from fedsilo.utils.io import atomic_file

GC_EVERY = 10  # rounds between full garbage collections
# train.checkpoint_every: auto writes once the wall time since the last write is this many times what it took, so the
# writes take at most 1 / (1 + 20), ~5 %, of a run's time; a killed run loses at most ~20 writes' worth of rounds
AUTO_CHECKPOINT_RATIO = 20
_now = time.monotonic  # the clock of the checkpoint schedule (a test replaces it)
log = logging.getLogger(__name__)
Observer = Callable[[int, str, str, State], None]  # (round, client name, "down"|"up", payload)


def flop_counter() -> Any:
    """A fresh ``torch.utils.flop_counter.FlopCounterMode`` (not displayed). Imported here, when FLOPs are counted:
    the module pulls in Triton, half a second of every train process's start that counts none."""
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False)


class PrivacyViolation(RuntimeError):
    pass


def refuse_private(method: Method, client: ClientData, payload: State, private: set[str], rnd: int) -> None:
    """Raise :class:`PrivacyViolation` when client ``client``'s payload of round ``rnd`` holds a key the method keeps
    private in that round (``Method.private_in_round`` of the declared ``private`` set): the engine's and a Flower
    site's check."""
    leaked = sorted(set(payload) & method.private_in_round(rnd, private))
    if leaked:
        raise PrivacyViolation(f"{method.name}: client {client.name} tried to upload private tensors {leaked[:5]}")


__all__ = ["Engine", "Observer", "PrivacyViolation", "checkpoint_meta", "payload_bytes", "read_only", "refuse_private", "transfer"]


def checkpoint_meta(path: Optional[Path], key: str) -> Optional[dict[str, Any]]:
    """The round and meta of the checkpoint (the engine's, or a Flower server's) at ``path`` if it was written under ``key`` (the run's
    ``config_hash``), else None (no checkpoint, or one of another configuration: the run starts afresh). The
    tensors are mapped, not read."""
    if path is None or not Path(path).exists():
        return None
    ck = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    if ck.get("config_hash") != key:
        return None
    return {"round": int(ck["round"]), **ck.get("meta", {})}


def transfer(payload: State) -> State:
    """What crosses the wire: an independent copy of each tensor."""
    return {k: v.detach().clone() for k, v in payload.items()}


def read_only(payload: State) -> State:
    """A download handed over without a copy: the client loads it into the model (that load is the copy) and must
    not modify it in place; methods that keep it (FedProx's anchor) clone what they keep."""
    return {k: v.detach() for k, v in payload.items()}


def eval_summary(per: dict[str, dict[str, float]]) -> dict[str, Any]:
    """A round's evaluation from its clients' scores: the scores, the mean and spread (population std, ddof 0) of the
    accuracies over clients, the mean of the validation accuracies (what best-validation selection ranks rounds by)
    and of the defined AUCs (``auc_undefined`` names the clients whose test split holds one class). The engine's and
    the Flower server's."""
    accs = np.array([v["acc"] for v in per.values()])
    out: dict[str, Any] = {"eval": per, "mean_acc": float(accs.mean()), "std_acc": float(accs.std())}
    vals = [v["val_acc"] for v in per.values() if "val_acc" in v]
    if vals:
        out["mean_val_acc"] = float(np.mean(vals))
    aucs = [v["auc"] for v in per.values() if "auc" in v and not math.isnan(v["auc"])]
    if aucs:
        out["mean_auc"] = float(np.mean(aucs))  # over the clients whose test split holds both classes
        undefined = [c for c, v in per.items() if "auc" in v and math.isnan(v["auc"])]
        if undefined:
            out["auc_undefined"] = undefined
    return out


class Engine:
    stream = False  # the continual engine (fl/continual.py) runs task streams
    # set (a first SIGTERM, fl/run.py): the round in flight ends, is checkpointed, and run() returns; None: no stop
    stop: Optional[threading.Event] = None
    _last_save: Optional[tuple[float, float]] = None  # (when the last checkpoint write ended, its seconds)
    _saved_round: Optional[int] = None  # the round the last checkpoint write holds
    def __init__(
        self,
        method: Method,
        model: nn.Module,
        clients: list[ClientData],
        train: TrainParams,
        seed: int,
        checkpoint: Optional[Path] = None,
        config_hash: str = "",
        observer: Optional[Observer] = None,
        on_round: Optional[Callable[[dict[str, Any]], None]] = None,
        meta: Optional[dict[str, Any]] = None,
        external: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        left: Optional[dict[str, int]] = None,
        joined: Optional[dict[str, int]] = None,
        away: Optional[dict[str, list[tuple[int, int]]]] = None,
    ):
        if not self.stream:
            check_stream_fit(type(method), False, method.key, "these clients hold static data: train it on a domain_incremental split")
        self.method, self.model, self.clients, self.train = method, model, clients, train
        self.external = external  # (uint8 images, labels) of a site that never trains: the external test
        self.seed, self.checkpoint, self.config_hash = seed, checkpoint, config_hash
        self.observer, self.on_round = observer, on_round
        self.meta: dict[str, Any] = dict(meta or {})
        self.left, self.joined = dict(left or {}), dict(joined or {})  # see active()
        self.away = {n: [(int(a), int(b)) for a, b in spans] for n, spans in (away or {}).items()}
        self.method.join(clients, seed)
        model = self.model = method.transform_model(model, to_float(clients[0].x_train[:2], train.normalize))
        self.method.setup(model)
        self.private = self.method.private_keys(model)
        self.parallel = self._parallel_width()
        self.round = 0
        self.total_rounds = train.rounds  # a continual run: rounds per task x tasks
        self.history: list[dict[str, Any]] = []
        self.server: State = {}
        self.stores: list[State] = []
        if train.compile:
            compile_model(model)
        if use_channels_last(train, self._device()):
            model.to(memory_format=torch.channels_last)
        if not self._resume():  # no round-0 checkpoint: a run killed before its first one starts again identically
            self.server = self.method.init_server(model)
            self.stores = [self.method.init_client(model, c) for c in clients]
        elif self.round > 0:
            # the method's round state as it was after its last round (a phase, a channel ratio): what evaluating
            # the resumed run, or a run resumed after its last round, needs (the next round sets its own)
            self.method.on_round_start(model, self.round)
        self.store_device = self._choose_store_device()
        self.stores = [self._place(s) for s in self.stores]

    # ------------------------------------------------------------------ clients trained at once
    def _parallel_width(self) -> int:
        """How many clients train at once (``train.parallel_clients``): 1 for a method whose local update keeps
        state on the method object (``Method.client_parallel`` False), said in the log and in :meth:`execution`."""
        k = self.train.parallel_clients
        if k > 1 and not type(self.method).client_parallel:
            log.warning("%s trains its clients one at a time (its local update keeps state on the method object); "
                        "train.parallel_clients: %d does not apply to it", self.method.name, k)
            return 1
        return k

    def client_threads(self) -> Optional[int]:
        """The CPU threads each client of a parallel wave trains with: the run's torch threads shared among the
        wave's clients (None when clients train one at a time, or on a GPU, where each has its own CUDA stream)."""
        if self.parallel == 1 or self._device().type != "cpu":
            return None
        return max(1, torch.get_num_threads() // self.parallel)

    def execution(self) -> dict[str, Any]:
        """How the clients were run, for metrics.json: the clients trained at once and, on the CPU, the run's torch
        threads and each client's (the numbers equal a one-at-a-time run with that many threads; a CPU's float sums
        follow the thread count)."""
        out: dict[str, Any] = {"parallel_clients": self.parallel}
        if self._device().type == "cpu":
            out["threads"] = torch.get_num_threads()
        if self.client_threads() is not None:
            out["threads_per_client"] = self.client_threads()
        return out

    # ------------------------------------------------------------------ client state placement
    def _choose_store_device(self) -> torch.device:
        dev = self._device()
        if dev.type != "cuda" or self.train.store_device == "device":
            return dev
        if self.train.store_device == "host":
            return torch.device("cpu")
        need = sum(payload_bytes(s) for s in self.stores)
        free, _ = torch.cuda.mem_get_info(dev)
        return dev if need < 0.5 * free else torch.device("cpu")

    def _place(self, store: State) -> State:
        out: State = {}
        for k, v in store.items():
            if v.device != self.store_device:
                v = v.to(self.store_device, non_blocking=True)
                if self.store_device.type == "cpu" and torch.cuda.is_available():
                    v = v.pin_memory()
            out[k] = v
        return out

    # ------------------------------------------------------------------ checkpoints
    def _resume(self) -> bool:
        if self.checkpoint is None or not Path(self.checkpoint).exists():
            return False
        ck = torch.load(self.checkpoint, map_location=self._device(), weights_only=False)
        if ck.get("config_hash") != self.config_hash:
            return False  # another configuration: start afresh (the stale checkpoint is overwritten)
        self.round, self.history = ck["round"], ck["history"]
        self.server, self.stores = ck["server"], ck["stores"]
        self.meta.update(ck.get("meta", {}))
        return True

    def save(self) -> None:
        """Write the checkpoint (when the run has one), timing the write for ``checkpoint_every: auto``."""
        if self.checkpoint is None:
            return
        start = _now()
        self._write_checkpoint()
        end = _now()
        self._last_save = (end, end - start)
        self._saved_round = self.round

    def _write_checkpoint(self) -> None:
        with atomic_file(self.checkpoint) as tmp:
            torch.save(
                {
                    "config_hash": self.config_hash,
                    "round": self.round,
                    "history": self.history,
                    "server": self.server,
                    "stores": self.stores,
                    "meta": self.meta,
                },
                tmp,
            )

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ loop
    def active(self, rnd: int) -> list[int]:
        """The client indices that take part in round ``rnd``: all of them, but a site that has left the federation
        (``left``: its name -> the last round it took part in; a deployment's ``sites[k].left``, fl/flower.py),
        which from the round after is neither sampled nor evaluated, a site that joined a run in progress
        (``joined``: its name -> the first round it takes part in; ``sites[k].joined``), which is neither before it,
        and a site that left and came back (``away``: its name -> the (first, last) rounds it was gone, inclusive),
        which is neither in those rounds. What a site that left was (its data counts in the method's ``join``, its
        store, the server's state of it) stays as it was: the federation's past is not rewritten, and a site that
        comes back carries on from it as after rounds it was not sampled for; a site that joins starts from the
        store ``init_client`` gives it, as every site started."""
        return [i for i, c in enumerate(self.clients)
                if self.joined.get(c.name, rnd) <= rnd <= self.left.get(c.name, rnd) and not self.was_away(c.name, rnd)]

    def start_round(self, rnd: int) -> None:
        """Before round ``rnd``'s sampling: the method's round state (a phase, a channel ratio) and the sites the
        federation holds in it (``Method.round_members``): every site that has joined by then, a site that left or
        is away too (the federation's past is not rewritten: what its server holds is not sized anew when a site goes)."""
        self.method.on_round_start(self.model, rnd)
        self.method.round_members(rnd, [c for c in self.clients if self.joined.get(c.name, rnd) <= rnd])

    def was_away(self, name: str, rnd: int) -> bool:
        """Whether site ``name`` had left in round ``rnd`` and came back after it (``away``)."""
        return any(a <= rnd <= b for a, b in self.away.get(name, ()))

    def sample(self, rnd: int) -> list[int]:
        """The round's clients: m = max(1, floor(C n)) of the n active ones (:meth:`active`), drawn without
        replacement (McMahan et al.'s max(C K, 1), floored as FedAvg's and PFLlib's code do); with
        ``client_fraction_range: [lo, hi]`` the count is drawn uniformly among the integers floor(lo n) .. floor(hi n)
        each round (PFLlib's random join ratio)."""
        pool = self.active(rnd)
        n = len(pool)
        if self.train.client_fraction_range is not None:  # a join ratio drawn for this round
            lo, hi = (max(1, math.floor(f * n + 1e-9)) for f in self.train.client_fraction_range)
            m = int(torch.randint(lo, hi + 1, (), generator=make_generator(self.seed, rnd, 1_000_005)))
        else:
            m = max(1, math.floor(self.train.client_fraction * n + 1e-9))
        if m >= n:
            return pool
        perm = torch.randperm(n, generator=make_generator(self.seed, rnd, 1_000_003))
        return sorted(pool[int(i)] for i in perm[:m])

    def gone(self, rnd: int) -> list[str]:
        """The sites that have left the federation by round ``rnd`` (named in the round's history entry): still gone
        (``left``), or gone in rounds they came back after (``away``)."""
        return [c.name for c in self.clients if rnd > self.left.get(c.name, rnd) or self.was_away(c.name, rnd)]

    def note_membership(self, entry: dict[str, Any], rnd: int) -> None:
        """A round's history entry names the sites that have left (``left``, every round they are gone) and those
        that join in it (``joined``, their first round) or come back in it (``back``), and under a learning-rate
        schedule the factor of the round's learning rates (``lr_factor``)."""
        if self.gone(rnd):
            entry["left"] = self.gone(rnd)
        new = [c.name for c in self.clients if self.joined.get(c.name) == rnd]
        if new:
            entry["joined"] = new
        here = {self.clients[i].name for i in self.active(rnd)}
        back = [c.name for c in self.clients if c.name in here and any(b == rnd - 1 for _, b in self.away.get(c.name, ()))]
        if back:
            entry["back"] = back
        sched = self.train.lr_schedule
        if sched.kind != "constant" or sched.warmup_rounds:  # what the round's local learning rates were multiplied by
            entry["lr_factor"] = sched.factor(rnd, self.train.rounds)

    def _clock(self) -> float:
        """Wall-clock seconds, after the device has finished its queued work (CUDA runs asynchronously)."""
        if self._device().type == "cuda":
            torch.cuda.synchronize(self._device())
        return time.perf_counter()

    def run_round(self) -> dict[str, Any]:
        start = self._clock()
        rnd = self.round + 1
        self.start_round(rnd)
        picked = self.active(rnd) if self.method.sample_all(rnd) else self.sample(rnd)
        entry: dict[str, Any] = {
            "round": rnd,
            "sampled": [self.clients[i].name for i in picked],
            "bytes_down": {},
            "bytes_up": {},
            "train_loss": {},
        }
        self.note_membership(entry, rnd)
        uploads: list[tuple[ClientData, State]] = []
        acc = self.method.agg_begin(self.server, rnd) if self.method.streaming else None
        flops = flop_counter() if self.train.count_flops and rnd == self.total_rounds else None
        with flops if flops is not None else nullcontext():
            elsewhere = self._clients_round(rnd, picked, entry, uploads, acc, count_flops=flops is not None)
        if flops is not None:  # the last round's local training, every picked client, forward and backward
            entry["train_flops"] = int(flops.get_total_flops()) + elsewhere
        self.close_round(entry, rnd, start, acc, uploads)
        # the per-client optimizers of a round are reference cycles (their tensors are already released by
        # train_local): a full collection every few rounds keeps host memory level without paying its cost (a fifth
        # of a second in a process that has imported torch, MLflow and DVC) every round
        if rnd % GC_EVERY == 0 or rnd == self.total_rounds:
            gc.collect()
        return entry

    def eval_due(self, rnd: int) -> bool:
        return rnd % self.train.eval_every == 0 or rnd == self.total_rounds

    def _clients_round(self, rnd: int, picked: list[int], entry: dict[str, Any], uploads: list[tuple[ClientData, State]], acc: Any,
                       count_flops: bool = False) -> int:
        """The picked clients in turn: download, local update, upload (byte-counted, privacy-checked), into the
        streaming aggregator ``acc`` or the ``uploads`` list. With ``train.parallel_clients: K`` the clients go in
        waves of K: the server hears and serves the wave's clients in order, they train at once on K copies of the
        model, and their uploads are received in order, so sums are added in the same order as one at a time.
        Returns the FLOPs counted in worker threads (FlopCounterMode counts the thread it is entered in only)."""
        k = self.parallel
        if k == 1:
            for i in picked:
                down = self._serve(rnd, i, entry)
                up, loss = self._update(self.model, i, down, rnd)
                self._receive(rnd, i, up, loss, entry, uploads, acc)
                del up, down
            return 0
        counted = 0
        with _Wave(self, min(k, len(picked))) as wave:
            for start in range(0, len(picked), k):
                group = picked[start : start + k]
                downs = [self._serve(rnd, i, entry) for i in group]
                results = wave.train(rnd, group, downs, count_flops)
                for i, (up, loss, flops) in zip(group, results):
                    counted += flops
                    self._receive(rnd, i, up, loss, entry, uploads, acc)
                del results, downs
        return counted

    def _update(self, model: nn.Module, i: int, down: State, rnd: int) -> tuple[State, Optional[float]]:
        """Client ``i``'s local update on ``model`` (the engine's, or a wave's copy in a worker thread): its upload and
        the loss it reported (None when it reported none this round, never an earlier update's)."""
        self.method.last_loss = None
        with scheduled_lr(self.train, rnd):
            up = self.method.local_update(model, self.stores[i], down, self.clients[i], rnd, self.seed)
        return up, self.method.last_loss

    def _serve(self, rnd: int, i: int, entry: dict[str, Any]) -> State:
        """Server side, for client ``i``: what it announces is heard (pFedDIL: which of its models this task trains; an
        upload like any other, byte-counted and privacy-checked), and its download is made."""
        c = self.clients[i]
        said = self.method.announce(self.model, self.stores[i], c, rnd)
        if said:
            self._refuse_private(c, said, rnd)
            said = transfer(said)
            entry.setdefault("bytes_announce", {})[c.name] = payload_bytes(said)
            if self.observer:
                self.observer(rnd, c.name, "up", transfer(said))
            self.method.hear(c, said)
        down = read_only(self.method.download(self.server, c, rnd))
        entry["bytes_down"][c.name] = payload_bytes(down)
        if self.observer:  # observers get copies: payloads may alias live model or server tensors
            self.observer(rnd, c.name, "down", transfer(down))
        return down

    def _receive(self, rnd: int, i: int, up: State, loss: Optional[float], entry: dict[str, Any], uploads: list[tuple[ClientData, State]], acc: Any) -> None:
        """Client ``i``'s upload after its local update: refused if it holds a private key, counted, and handed to the
        aggregator; its store goes back to where stores live."""
        c = self.clients[i]
        self.stores[i] = self._place(self.stores[i])
        self._refuse_private(c, up, rnd)
        # a streaming aggregator consumes the upload before the model is touched again, so no copy is needed;
        # a method that aggregates the whole list gets independent copies
        up = read_only(up) if acc is not None else transfer(up)
        entry["bytes_up"][c.name] = payload_bytes(up) + entry.get("bytes_announce", {}).get(c.name, 0)
        entry["train_loss"][c.name] = loss
        if self.observer:
            self.observer(rnd, c.name, "up", transfer(up))
        if acc is not None:
            self.method.agg_add(acc, c, up)
        else:
            uploads.append((c, up))

    def after_aggregation(self, entry: dict[str, Any], rnd: int) -> None:
        """Between the round's aggregation and its evaluation (the task stream sends each client its task's final
        model here)."""

    def close_round(self, entry: dict[str, Any], rnd: int, start: float, acc: Any, uploads: list[tuple[ClientData, State]]) -> None:
        """The end of a round, after every picked client trained (here or on its site): the server aggregates (the
        streaming accumulator, or the uploads), the round's totals are written, and the clients are evaluated when due."""
        self.server = self.method.agg_end(self.server, acc, rnd) if acc is not None else self.method.aggregate(self.server, uploads, rnd)
        self.after_aggregation(entry, rnd)
        # wall-clock seconds of the round's local training, transfers and aggregation (Table 4-style "train time"),
        # and of the whole round with its evaluation; they describe the machine, not the result (never compared)
        entry["train_seconds"] = round(self._clock() - start, 4)
        entry["bytes_down_total"] = int(sum(entry["bytes_down"].values()) + sum(entry.get("bytes_task_end", {}).values()))
        entry["bytes_up_total"] = int(sum(entry["bytes_up"].values()))
        if self.eval_due(rnd):
            entry.update(self.evaluate(rnd))
        entry["seconds"] = round(self._clock() - start, 4)

    def _refuse_private(self, client: ClientData, payload: State, rnd: int) -> None:
        refuse_private(self.method, client, payload, self.private, rnd)

    def evaluate(self, rnd: Optional[int] = None) -> dict[str, Any]:
        rnd = self.round if rnd is None else rnd
        per: dict[str, dict[str, float]] = {}
        shared_model = self.method.eval_is_global()
        here = self.active(rnd)  # a site that left is not evaluated
        clients, stores = [self.clients[i] for i in here], [self.stores[i] for i in here]
        ens = _Ensemble(self, clients) if self.train.ensemble_test or self.external is not None else None
        if shared_model:
            self.method.load_eval_model(self.model, self.server, stores[0], clients[0], rnd)
        for c, store in zip(clients, stores):
            if not shared_model:
                self.method.load_eval_model(self.model, self.server, store, c, rnd)
            per[c.name] = evaluate_client(self.model, c, cfg=self.train)
            if ens is not None:
                ens.add(self.model, once=shared_model)
        out = eval_summary(per)
        g = self.method.global_state(self.server)
        if shared_model:
            out["global"] = {name: v["acc"] for name, v in per.items()}
        elif g is not None:
            self.model.load_state_dict(g, strict=True)
            out["global"] = {c.name: evaluate(self.model, c.x_test, c.y_test, cfg=self.train)["acc"] for c in clients}
        if self.external is not None and g is not None:
            self.model.load_state_dict(g, strict=True)
            out["external_global"] = evaluate(self.model, *self.external, cfg=self.train)
        if ens is not None:
            out.update(ens.result())
        return out

    def spectra(self) -> dict[str, list[float]]:
        """Per client: the singular values of the covariance of the representations that the model it is evaluated
        with gives its test images (F²DC Fig. 1's dimensional-collapse measure). Changes no state."""
        out: dict[str, list[float]] = {}
        for c, store in zip(self.clients, self.stores):
            if len(c.x_test) < 2:  # a covariance needs two images: no spectrum (small label-skew clients), not a failed run
                out[c.name] = []
                continue
            self.method.load_eval_model(self.model, self.server, store, c, self.round)
            out[c.name] = [round(float(v), 8) for v in covariance_spectrum(self.model, c.x_test, self.train.normalize)]
        return out

    def step(self) -> dict[str, Any]:
        """One round with its bookkeeping: report it, append it to the history, checkpoint when due."""
        entry = self.run_round()
        if self.on_round:
            self.on_round(entry)
        self.history.append(entry)
        self.round = entry["round"]
        if self.checkpoint_due() or self.stopping():
            self.save()
        return entry

    def checkpoint_due(self) -> bool:
        """Whether the round just ended is checkpointed (``train.checkpoint_every``): the last round always; every
        k-th with an integer k; with ``auto`` once the wall time since the last write has reached
        :data:`AUTO_CHECKPOINT_RATIO` times that write's seconds (the first round when nothing was written yet)."""
        every = self.train.checkpoint_every
        if self.round == self.total_rounds:
            return True
        if every != "auto":
            return self.round % every == 0
        if self._last_save is None:
            return True
        ended, took = self._last_save
        return _now() - ended >= AUTO_CHECKPOINT_RATIO * took

    def stopping(self) -> bool:
        """A stop was asked for (:attr:`stop`): the round in flight ends, is checkpointed, and :meth:`run` returns."""
        return self.stop is not None and self.stop.is_set()

    def run(self) -> list[dict[str, Any]]:
        """The rounds left; the whole history, or the history so far when a stop was asked for (the caller tells the
        two apart by ``round < total_rounds``)."""
        while self.round < self.total_rounds and not self.stopping():
            self.step()
        if self.stopping() and self._saved_round != self.round:  # a stop asked for between a round's write check and here
            self.save()
        return self.history


class _Wave:
    """The clients of a round trained at once (``train.parallel_clients``): as many copies of the engine's model as
    a wave has clients, made when the round's training starts (after ``on_round_start``, so a phase's frozen layers
    are copied with it) and dropped at its end, each trained by its own thread: on a GPU on its own CUDA stream, which
    waits for the work queued before the wave and which the default stream waits for after it; on the CPU with the
    run's torch threads shared among them (``Engine.client_threads``)."""

    def __init__(self, engine: Engine, width: int):
        self.engine, self.width = engine, width
        self.device = engine._device()

    def __enter__(self) -> "_Wave":
        self.models: list[nn.Module] = []
        for _ in range(self.width):
            m = spare_copy(self.engine.model)
            for p in m.parameters():
                p.grad = None  # the engine model's last gradients are not the copy's to keep
            self.models.append(m)
        cuda = self.device.type == "cuda"
        self.streams = [torch.cuda.Stream(self.device) if cuda else None for _ in range(self.width)]
        self.threads = torch.get_num_threads()
        per = self.engine.client_threads()
        if per is not None:
            torch.set_num_threads(per)  # before the pool exists: each worker thread takes it up on its first op
        self.pool = ThreadPoolExecutor(self.width, thread_name_prefix="fedsilo-client")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.pool.shutdown(wait=True)
        torch.set_num_threads(self.threads)
        self.models.clear()

    def train(self, rnd: int, group: list[int], downs: list[State], count_flops: bool) -> list[tuple[State, Optional[float], int]]:
        """The local updates of ``group``'s clients, at once; returns (upload, loss, FLOPs) per client in the group's
        order. When one fails, the others are waited for and the first failure in client order is raised."""
        current = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        for s in self.streams:
            if s is not None:
                s.wait_stream(current)
        futures = [self.pool.submit(self._one, j, rnd, i, down, count_flops) for j, (i, down) in enumerate(zip(group, downs))]
        wait(futures)
        for s in self.streams:
            if s is not None:
                current.wait_stream(s)
        return [f.result() for f in futures]

    def _one(self, j: int, rnd: int, i: int, down: State, count_flops: bool) -> tuple[State, Optional[float], int]:
        e = self.engine
        stream = self.streams[j]
        where = nullcontext() if stream is None else torch.cuda.device(self.device)
        with where, (nullcontext() if stream is None else torch.cuda.stream(stream)):
            if stream is not None:
                # the client's store and download were made on other streams (an earlier round's worker, the
                # server's): when this update replaces or drops one, its memory must wait for this stream's reads
                for t in (*e.stores[i].values(), *down.values()):
                    if t.is_cuda:
                        t.record_stream(stream)
            counter = flop_counter() if count_flops else None
            with counter if counter is not None else nullcontext():
                up, loss = e._update(self.models[j], i, down, rnd)
        return up, loss, int(counter.get_total_flops()) if counter is not None else 0


class _Ensemble:
    """The "new test" of LG-FedAvg and CD2-pFed, gathered during an evaluation: every client uploads the model it is
    evaluated with (counted in ``bytes_ensemble``: its whole state_dict, an upload made for this evaluation only), and
    the mean of their softmax predictions (``train.ensemble_mean: log_probabilities``: of their log-probabilities, the
    prediction the softmax of that mean, as LG-FedAvg's code averages its nets' log_softmax outputs) is scored on the
    union of the clients' test sets (a set several clients share counted once) and on the external test site, if any. When every client is evaluated with the one global
    model, nothing is uploaded and the ensemble is that model."""

    def __init__(self, engine: Engine, clients: list[ClientData]):
        self.cfg = engine.train
        tests: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for c in clients:
            tests.setdefault(id(c.x_test), (c.x_test, c.y_test))
        self.sets = {"ensemble": (torch.cat([x for x, _ in tests.values()]), torch.cat([y for _, y in tests.values()]))}
        if engine.external is not None:
            self.sets["external_ensemble"] = engine.external
        self.sums: dict[str, torch.Tensor] = {}
        self.models = 0
        self.sent = 0

    def add(self, model: nn.Module, once: bool = False) -> None:
        if once and self.models:
            return
        if not once:
            self.sent += payload_bytes(model.state_dict())
        log = self.cfg.ensemble_mean == "log_probabilities"
        for k, (x, _) in self.sets.items():
            logits = predict(model, x, cfg=self.cfg)
            p = logits.log_softmax(1) if log else logits.softmax(1)
            self.sums[k] = p if k not in self.sums else self.sums[k] + p
        self.models += 1

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"bytes_ensemble": int(self.sent)}
        for k, (_, y) in self.sets.items():
            mean = self.sums[k] / self.models
            if self.cfg.ensemble_mean == "log_probabilities":
                mean = mean.softmax(1)  # the normalized geometric mean of the models' probabilities
            out[k] = {**score(mean, y, probabilities=True), "images": int(len(y))}
        return out
