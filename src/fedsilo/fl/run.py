"""The train stage: one (experiment, method, seed) from split + harmonized arrays to results and an MLflow run.

Outputs (``results/<experiment>/<method>/seed<k>/``, written atomically at the end):
``metrics.json`` (final per-client accuracy / AUC, mean and std, global-model accuracy where one exists, bytes per
round, what the method resolved), ``history.json`` (every round), ``spectrum.json`` (per client, the singular values
of the covariance of the final representations of its test images: the dimensional-collapse measure of F²DC Fig. 1),
``final_model.pt`` (the server state; every client's store too with
``experiments.<e>.train.keep_client_models: true``).

Paths follow :class:`fedsilo.layout.Layout` (a paper's runs under ``results/<paper>/<scale>/``). The per-round
checkpoint lives in ``state/<experiment>/<method>/seed<k>/checkpoint.pt``, outside DVC's outputs
(DVC deletes a stage's outputs before running it). It carries the hash of everything the run's numbers depend on:
the resolved params, the data, the seed, the source of the package parts a train stage runs
(:data:`fedsilo.codehash.TRAIN_CODE`, whose hash every train stage of every dvc.yaml depends on through the root's
``code_fingerprint`` stage) and the versions of the libraries that compute. A rerun with
the same hash resumes after the last completed round; any other hash (a code edit included) starts afresh. The
checkpoint is deleted once the outputs are written: it exists to survive an interruption, so a finished run that
DVC reruns (``dvc repro -f``, a deleted output) trains again rather than rewriting old numbers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from fedsilo.client.data import load_clients, load_external, load_task_clients, pick_device
from fedsilo.client.hostaug import check_host_policy
from fedsilo.codehash import method_code_sha256, train_code_sha256
from fedsilo.config import ConfigError, Params
from fedsilo.config.errors import not_defined
from fedsilo.data.cards import data_record, refuse_changed_arrays
from fedsilo.data.splits import refuse_stale_split
from fedsilo.fl.continual import ContinualEngine, continual_summary
from fedsilo.fl.engine import Engine, Observer
from fedsilo.methods import Method, method_base, resolve_method
from fedsilo.methods.registry import check_stream_fit
from fedsilo.models import build_model
from fedsilo.tracking import Tracker, dvc_hashes, flat_summary, flatten, git_commit
from fedsilo.utils.io import atomic_dir, canonical_hash, clean_stale, read_json, write_json
from fedsilo.utils.locks import held
from fedsilo.utils.progress import Progress, mib
from fedsilo.utils.signals import exit_on_signal, on_sigterm

log = logging.getLogger("fedsilo.train")




def _test_set_owners(clients: list) -> dict[str, str]:
    """Client -> the first client whose test set is the same one (the loader hands clients that share a test set one
    tensor)."""
    first: dict[int, str] = {}
    return {c.name: first.setdefault(id(c.y_test), c.name) for c in clients}

def code_fingerprint(device: str, module: Optional[str] = None) -> dict[str, str]:
    """sha256 over the source files of :data:`fedsilo.codehash.TRAIN_CODE` (path and bytes), or with ``module`` (a
    method class's module) over the code that method's runs depend on (:func:`fedsilo.codehash.method_code_files`:
    what its train stages' ``data/code/...<key>.json`` holds), and the versions and device type that compute: a run
    resumed from a checkpoint was trained by exactly this code."""
    from importlib.metadata import version

    import numpy

    source = method_code_sha256(module) if module else train_code_sha256()
    # torchvision's version from its package metadata (importing it for __version__ costs seconds per run)
    return {"source_sha256": source, "torch": torch.__version__, "torchvision": version("torchvision"),
            "numpy": numpy.__version__, "device": device}


def summarize(history: list[dict[str, Any]]) -> dict[str, Any]:
    last = [h for h in history if "eval" in h][-1]
    out: dict[str, Any] = {
        "rounds": history[-1]["round"],
        "mean_acc": last["mean_acc"],
        "std_acc": last["std_acc"],
        "per_client": last["eval"],
        "bytes_up_per_round": [h["bytes_up_total"] for h in history],
        "bytes_down_per_round": [h["bytes_down_total"] for h in history],
        "bytes_up_total": int(sum(h["bytes_up_total"] for h in history)),
        "bytes_down_total": int(sum(h["bytes_down_total"] for h in history)),
    }
    if "mean_auc" in last:
        out["mean_auc"] = last["mean_auc"]
        if last.get("auc_undefined"):
            out["auc_undefined"] = last["auc_undefined"]
            log.warning("mean_auc leaves out %d client(s) whose test split holds one class (AUC undefined): %s",
                        len(last["auc_undefined"]), ", ".join(last["auc_undefined"]))
    if "global" in last:
        out["global_acc"] = last["global"]
    for key in ("ensemble", "external_ensemble", "external_global"):  # new test, external test (CD2-pFed Tables 1-4)
        if key in last:
            out[f"{key}_acc"] = last[key]["acc"]
    ens = [h["bytes_ensemble"] for h in history if "bytes_ensemble" in h]
    if ens:
        out["bytes_ensemble_total"] = int(sum(ens))
    evals = [h["bytes_eval_down"] for h in history if "bytes_eval_down" in h]
    if evals:  # a deployment sends each site what it is evaluated with (the engine, in one process, sends nothing)
        out["bytes_eval_down_per_round"] = [int(sum(e.values())) for e in evals]
        out["bytes_eval_down_total"] = int(sum(out["bytes_eval_down_per_round"]))
    counted = [h for h in history if "train_flops" in h]
    if counted:
        out["train_flops_per_round"] = counted[-1]["train_flops"]
    return out


def round_summary(entry: dict[str, Any]) -> str:
    """One round in a few words: a stream's task, mean local training loss (the method's whole objective), mean
    accuracy (evaluated rounds; a stream's over the tasks seen so far), seconds, bytes moved."""
    parts = []
    if "domain" in entry:  # a task stream's round
        parts.append(f"task {entry['task'] + 1} ({entry['domain']}){', its last round' if entry.get('task_end') else ''}")
    losses = [v for v in entry.get("train_loss", {}).values() if v is not None]
    if losses:
        parts.append(f"loss {sum(losses) / len(losses):.4f}")
    if "seen_acc" in entry:
        parts.append(f"acc on the tasks seen {entry['seen_acc']:.3f}")
    elif "mean_acc" in entry:
        parts.append(f"acc {entry['mean_acc']:.3f}")
    parts.append(f"{entry['seconds']:.1f} s")
    parts.append(f"up {mib(entry['bytes_up_total'])} down {mib(entry['bytes_down_total'])}"
                 + (f" (+ {mib(sum(entry['bytes_eval_down'].values()))} to evaluate)" if entry.get("bytes_eval_down") else ""))
    if entry.get("dropped"):
        parts.append("without " + ", ".join(entry["dropped"]) + " (gone during training)")
    if entry.get("eval_missing"):
        parts.append("evaluated without " + ", ".join(entry["eval_missing"]) + " (gone during the evaluation: no mean)")
    if entry.get("left"):
        parts.append("without " + ", ".join(entry["left"]) + " (left the federation)")
    if entry.get("joined"):
        parts.append(", ".join(entry["joined"]) + " joined")
    return ", ".join(parts)


def deterministic_kernels() -> None:
    """``train.deterministic``: the process uses deterministic kernels only (a train stage is one process)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts, before its first call
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def run_identity(params: Params, experiment: str, method: str, seed: int, algo: Optional[Method] = None) -> dict[str, Any]:
    """What a run is, as its params resolve it (its ``params_hash`` is this dict's hash, recorded in metrics.json
    with the dict itself as ``run``): the experiment, its dataset and split, the train settings the method trains
    with, the method's every parameter (defaults included) and the seed. What changes no number is not part of it
    (changing it keeps a checkpoint)."""
    exp = params.experiments[experiment]
    algo = algo or resolve_method(params, method, exp.train)
    return {
        "experiment": experiment,
        "dataset": exp.dataset,
        "split": exp.split.model_dump(mode="json"),
        "train": algo.train.model_dump(mode="json", exclude={"keep_client_models", "checkpoint_every"}),
        "method": {"name": method, "base": method_base(method, params.methods[method]), **algo.params.model_dump(mode="json")},
        "seed": seed,
    }


def trained_otherwise(params: Params, layout: Any, runs: list[tuple[str, str, int]]) -> dict[tuple[str, str, int], list[str]]:
    """The runs of ``runs`` (experiment, method, seed; each with its metrics.json) trained with other params than
    ``params`` resolves for them now: for each, what differs (``method.lam: 0.5 in the run, 0.6 now``), or one line
    saying its params hash differs where the run predates the record of its params. A run with no params hash at
    all (older still) is not judged."""
    out: dict[tuple[str, str, int], list[str]] = {}
    for e, m, k in runs:
        met = read_json(layout.run(e, m, k) / "metrics.json")
        if "params_hash" not in met:
            log.warning("%s/%s/seed%d: metrics.json predates params_hash: cannot tell whether it was trained with "
                        "these params", e, m, k)
            continue
        now = run_identity(params, e, m, k)
        if canonical_hash(now) == met["params_hash"]:
            continue
        if "run" not in met:
            out[(e, m, k)] = ["its params hash differs (the run predates the record of its params in metrics.json)"]
            continue
        was, is_ = flatten(met["run"]), flatten(now)
        out[(e, m, k)] = [f"{key}: {json.dumps(was[key]) if key in was else 'absent (a parameter added since)'} in the run, "
                          f"{json.dumps(is_[key]) if key in is_ else 'absent'} now"
                          for key in sorted(set(was) | set(is_)) if was.get(key, ...) != is_.get(key, ...)] or ["its params hash differs"]
    return out


def run_training(
    params: Params,
    experiment: str,
    method: str,
    seed: int,
    root: Path = Path("."),
    observer: Optional[Observer] = None,
    quiet: bool = False,
) -> dict[str, Any]:
    """Train one run to its outputs; progress per round on stderr unless ``quiet`` (see utils.progress)."""
    root = Path(root)
    if experiment not in params.experiments:
        raise not_defined("experiments", experiment, params)
    exp = params.experiments[experiment]
    check_host_policy(exp.train.augment.host, f"experiments.{experiment}.")
    algo = resolve_method(params, method, exp.train)  # the one typed method object of this run
    train = algo.train  # the experiment's train, with the method's own local_optimizer settings where it has them
    layout = params.layout(root)
    harmonized = layout.harmonized(exp.dataset)
    split_path = layout.split(experiment)
    for p in (harmonized / "images.npy", harmonized / "records.parquet", harmonized / "card.json", split_path):
        if not p.exists():  # the stage that writes it, which `dvc repro` of it builds with what it needs
            if p != split_path:
                raise FileNotFoundError(f"{p}: missing; build it first: dvc repro harmonize@{exp.dataset}")
            own = f" (or `fedsilo --params {params.paper.params_file} split --experiment {experiment}`)" if params.paper else ""
            raise FileNotFoundError(f"{p}: missing; build it first: dvc repro {params.stage_target(f'split@{experiment}')}{own}")
    split = read_json(split_path)
    stream = split.get("protocol") == "domain_incremental"
    if stream:
        check_stream_fit(type(algo), True, method, f"experiments.{experiment} has a domain_incremental split")
    card = read_json(harmonized / "card.json")
    # the arrays trained on are the card's (its hashes go into the config hash, metrics.json and MLflow), built with the
    # dataset settings params has now: a file edited after harmonize, or settings edited since, is refused (a stage run
    # by hand; `dvc repro` would rebuild them)
    rebuild = f"`dvc checkout harmonize@{exp.dataset}` (the arrays dvc.lock records) or `dvc repro harmonize@{exp.dataset}`"
    refuse_changed_arrays(harmonized, card, f"put them back with {rebuild}")
    # harmonize's module loads every source reader: imported where a run starts, not when this module is
    from fedsilo.data.harmonize import refuse_stale_rules

    refuse_stale_rules(card, params.datasets[exp.dataset], harmonized, exp.dataset, f"`dvc repro harmonize@{exp.dataset}`")
    if "data_sha256" in split and split["data_sha256"] != card["sha256"]:
        raise ConfigError(
            f"{split_path}: built for other arrays than {harmonized} now holds (re-harmonized since); rerun "
            f"`dvc repro split@{experiment}` (or `fedsilo split --experiment {experiment}`)"
        )
    # a split made before experiments.<e>.split was edited (a stage run by hand: dvc repro would rebuild it)
    refuse_stale_split(split, exp.split, split_path, experiment, f"`dvc repro {params.stage_target(f'split@{experiment}')}` "
                       f"(or `fedsilo split --experiment {experiment}`)")
    device = pick_device(exp.train.device, f"experiments.{experiment}.train.device")
    if exp.train.deterministic:
        deterministic_kernels()
    if exp.train.amp == "bf16" and device.type != "cuda":
        log.warning("experiments.%s.train.amp: bf16 autocast applies on CUDA only; this run trains in float32 on %s",
                    experiment, device.type)
    if stream:  # one list of clients per task (fl/continual.py)
        tasks, task_names, in_ch, num_classes = load_task_clients(harmonized, split, device)
        clients, external = tasks[0], None
    else:
        clients, in_ch, num_classes = load_clients(harmonized, split, device)
        external = load_external(harmonized, split, device)
    why = train.normalize.channel_mismatch(in_ch)
    if why is not None:  # before anything is written, naming the key (to_float would say train.normalize only)
        raise ConfigError(f"experiments.{experiment}.train.normalize: {why}")

    resolved = run_identity(params, experiment, method, seed, algo)
    data_hashes = data_record(card, split_path)
    params_hash = canonical_hash(resolved)
    code = code_fingerprint(device.type, type(algo).__module__)  # the code this method's runs depend on
    config_hash = canonical_hash({"params": resolved, "data": data_hashes, "code": code})

    out_dir, ckpt = layout.run(experiment, method, seed), layout.checkpoint(experiment, method, seed)
    stop = GracefulStop()
    with run_lock(ckpt.parent / "train.lock", f"{experiment}/{method}/seed{seed}"), stop.installed():
        for stale in clean_stale(out_dir):  # a run killed while writing its outputs
            log.info("removed %s (left by an interrupted run)", stale)
        torch.manual_seed(seed)
        model = build_model(exp.train.model, in_ch, num_classes, seed=seed, image_size=clients[0].x_train.shape[-1],
                            width=exp.train.model_width).to(device)
        tracker = Tracker(params.tracking.enabled, params.tracking.uri)
        common = {"checkpoint": ckpt, "config_hash": config_hash, "observer": observer}
        if stream:
            engine: Engine = ContinualEngine(algo, model, tasks, task_names, train, seed, **common)
        else:
            engine = Engine(algo, model, clients, train, seed, external=external, **common)
        commit, dirty = git_commit(root)
        locks = [root / "dvc.lock"]
        if params.paper is not None:  # a paper's splits are outputs of its own dvc.yaml
            locks.append(root / Path(params.paper.params_file).parent / "dvc.lock")
        dvc = dvc_hashes([str(harmonized.relative_to(root)), str(split_path.relative_to(root))], locks)
        tags = {
            "git_commit": commit,
            "git_dirty": str(dirty).lower(),
            "params_hash": params_hash,
            "config_hash": config_hash,
            "code.source_sha256": code["source_sha256"],
            "code.torch": code["torch"],
            "method": method,
            "method.base": resolved["method"]["base"],  # a variant's registered method (f2dc_code: f2dc)
            **({"paper": params.paper.name, "scale": params.paper.scale} if params.paper is not None else {}),
            "dataset": exp.dataset,
            "protocol": exp.split.protocol,
            "experiment": experiment,
            "seed": str(seed),
            "model": exp.train.model,
            "data.harmonized.sha256.images": card["sha256"]["images.npy"],
            "data.harmonized.sha256.records": card["sha256"]["records.parquet"],
            "data.split.sha256": data_hashes["split_sha256"],
        }
        for path, md5 in dvc.items():
            tags[f"dvc.md5.{path}"] = md5
        for src, how in card.get("sources", {}).items():  # which copy the data came from (the hashes say what it holds)
            tags[f"data.source.{src}"] = f"{how['mode']}: {how['origin']}"[:5000]  # MLflow's tag length limit
            if "sha256" in how:  # what the raw files held (the source's entry of data/fingerprints/<dataset>.json)
                tags[f"data.source.{src}.sha256"] = how["sha256"]
        # what the method derived from its params and the model (a resolved cut depth, private layers, shared fraction),
        # known once the engine has set it up; logged beside the params, not hashed (it follows from them)
        method_resolved = algo.resolved()
        # the MLflow run resumed with the checkpoint; one of an interrupted, not resumed, training is marked KILLED
        resumed = engine.meta.get("mlflow_run_id")
        run_id = tracker.start_in(ckpt.parent, layout.tracking_experiment(experiment), f"{method}-seed{seed}",
                                  {**resolved, "method_resolved": method_resolved}, tags, run_id=resumed)
        progress: Optional[Progress] = None
        try:  # from the MLflow run's start: whatever ends the process from here marks it (KILLED, FAILED) on the way out
            if run_id and resumed != run_id:
                engine.meta["mlflow_run_id"] = run_id
                engine.save()
            if engine.round:  # said without -v, as a deployment says it: the progress starts part-way
                log.warning("resuming %s/%s/seed%d after round %d of %d (checkpoint %s)", experiment, method, seed,
                            engine.round, engine.total_rounds, ckpt)
            progress = bar = Progress(engine.total_rounds, f"train {experiment}/{method}/seed{seed}", "round", quiet=quiet,
                                      initial=engine.round)

            def on_round(entry: dict[str, Any]) -> None:
                tracker.log_round(entry)
                bar.update(1, round_summary(entry), line="eval" in entry)

            engine.on_round = on_round
            engine.stop = stop.requested
            with stop.rounds():
                history = engine.run()
            if engine.round < engine.total_rounds:  # a first SIGTERM: the round in flight ended and was checkpointed
                log.warning("stopped after round %d of %d; `fedsilo train` again resumes after it", engine.round, engine.total_rounds)
                raise SystemExit(128 + signal.SIGTERM)
            summary = summarize(history)
            if stream:  # the stream's accuracy matrix, accuracy after each task, forgetting, rounds to best
                summary.update(continual_summary(history, task_names, exp.train.rounds))
                summary["mean_acc"] = summary["final_acc"]
            spectra = engine.spectra()
            metrics = {
                **summary,
                "experiment": experiment,
                "method": method,
                "seed": seed,
                "clients": [c.name for c in clients],
                # a stream's client learns every task's domain in turn (as a deployment's metrics.json lists them)
                "client_domains": {c.name: list(task_names) if stream else c.domain for c in clients},
                **({"test_sizes_by_task": {t: {c.name: int(len(c.y_test)) for c in tasks[i]} for i, t in enumerate(task_names)}}
                   if stream else {
                    "test_sizes": {c.name: int(len(c.y_test)) for c in clients},  # for the report's binomial standard errors
                    # the first client holding the same test set (F²DC's clients of a domain share one; label-skew
                    # clients each have their own): the report adds up distinct test sets only
                    "test_set_of": _test_set_owners(clients)}),
                # the held-out site's images the external test scores (CD2-pFed): its standard error in the report
                **({"external_test_size": int(len(external[1]))} if external is not None else {}),
                # the backbone the method was built from: the paper's "full network" for Param / Ratio (Table 3)
                "model_param_bytes": int(sum(p.numel() * p.element_size() for p in model.parameters())),
                "method_resolved": method_resolved,
                # clients trained at once, and each one's CPU threads (train.parallel_clients)
                "engine": engine.execution(),
                "params_hash": params_hash,
                "run": resolved,  # what params_hash is the hash of: a report names what a stale run was trained with
                # config_hash = canonical_hash({"params": run, "data": data, "code": code}), checkable from this file
                "config_hash": config_hash,
                "data": data_hashes,  # the arrays and split trained on (hashed anew above, not taken on trust)
                "code": code,
                "git": {"commit": commit, "dirty": dirty},  # --root's repository (code.source_sha256: the code that ran)
                "mlflow_run_id": run_id,
                "mlflow_experiment": layout.tracking_experiment(experiment) if run_id else None,  # where the UI lists it
                # which copy each source was fetched from (the data card's): a report says when it is an offline mirror
                "data_sources": card.get("sources", {}),
            }
            with atomic_dir(out_dir) as tmp:
                write_json(tmp / "metrics.json", metrics)
                (tmp / "history.json").write_text(json.dumps(history, indent=1) + "\n")
                write_json(tmp / "spectrum.json", {"representation": "input of the classifier, test images, final round", "clients": spectra})
                final = {"server": engine.server, "clients": [c.name for c in clients], "config_hash": config_hash}
                if exp.train.keep_client_models:  # every client's private tensors / personal model: large, kept only when asked
                    final["stores"] = engine.stores
                torch.save(final, tmp / "final_model.pt")
                tracker.finish(flat_summary(summary), [tmp / "metrics.json", tmp / "history.json"])
            ckpt.unlink(missing_ok=True)  # its work is done; a rerun of a finished run trains again
            Tracker.forget(ckpt.parent)
            return metrics
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM (a cancelled job, `kill`)
            tracker.fail("KILLED")
            raise
        except BaseException:  # an error, a full disk while writing the outputs
            tracker.fail("FAILED")
            raise
        finally:
            if progress is not None:
                progress.close()


class RunInProgress(ConfigError):
    """Another process is training the same (experiment, method, seed) in the same results folder."""


@contextlib.contextmanager
def run_lock(path: Path, name: str) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` for one run (:func:`fedsilo.utils.locks.held`): a second `fedsilo train` of
    the same run (two terminals, two DVC queue workers) is refused at once instead of writing into the same
    checkpoint and MLflow run."""
    with held(path, lambda holder: RunInProgress(f"{name} is already being trained by {holder}; wait for it to end or stop it, then rerun")):
        yield


class GracefulStop:
    """How one run answers SIGTERM (a cancelled job, `kill`, a scheduler's preemption, ``scripts/gpu_plan.py``'s
    budget). While the rounds run (:meth:`rounds`), a first SIGTERM only sets :attr:`requested`, the engine's
    ``stop``: the round in flight ends, its checkpoint is written, and the run then exits like a killed one (MLflow
    KILLED, exit status 143) having lost no finished round. Outside the rounds (loading data, writing the outputs),
    or at a second SIGTERM, it exits at once through the same path as Ctrl-C, the last checkpoint kept for a resume."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self._armed = False

    @contextlib.contextmanager
    def rounds(self) -> Iterator[None]:
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def handler(self, signum: int, frame: Any) -> None:
        if self._armed and not self.requested.is_set():
            self.requested.set()
            log.warning("SIGTERM: ending after the round in flight, with its checkpoint written (the last round: the "
                        "run ends with its outputs; a second SIGTERM stops at once, losing the rounds after the last checkpoint)")
            return
        exit_on_signal(signum, frame)

    def installed(self) -> contextlib.AbstractContextManager[None]:
        """The handler, for the calling block (the main thread only: a signal is delivered there)."""
        return on_sigterm(self.handler)
