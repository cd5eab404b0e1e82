"""MLflow tracking (DESIGN §6): one experiment per pipeline experiment, one run per (method, seed).

The tracking URI is ``$MLFLOW_TRACKING_URI`` when set, else ``tracking.uri`` from params.yaml
(default ``sqlite:///mlflow.db`` at the repository root). Logged: every resolved parameter (flattened), per-round
metrics with step = round (mean/std accuracy, AUC, per-client accuracy and AUC, bytes up and down per client and
in total, training loss), tags (git commit, the DVC hashes of the data the run read, params hash, method, dataset,
protocol, seed) and artifacts (metrics.json, history.json). No image is ever logged.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Optional

import yaml

log = logging.getLogger("fedsilo.tracking")

RUN_SIDECAR = "mlflow_run.json"  # in a run's state folder: the MLflow run it last served (Tracker.start_in)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def git_commit(repo: Path = Path(".")) -> tuple[str, bool]:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
        # dvc.lock files are DVC's record of what the running `dvc repro` has produced so far (it rewrites them stage
        # by stage), not code or params: a fresh clone under `dvc repro` is clean
        status = ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)dvc.lock", ":(exclude,glob)**/dvc.lock"]
        dirty = bool(subprocess.run(status, cwd=repo, capture_output=True, text=True).stdout.strip())
        return sha, dirty
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False


def dvc_hashes(paths: list[str], locks: list[Path]) -> dict[str, str]:
    """md5 recorded in the dvc.lock files for each path that some stage outputs (DVC writes a stage's lock entry as
    soon as the stage completes, so upstream data is there when a train stage runs under ``dvc repro``). Paths are
    relative to the repository root; a lock beside a paper's dvc.yaml records its outputs relative to its wdir, the
    repository root too."""
    found: dict[str, str] = {}
    for lock in locks:
        if not lock.exists():
            continue
        data = yaml.safe_load(lock.read_text()) or {}
        for stage in (data.get("stages") or {}).values():
            for out in stage.get("outs", []) or []:
                if out.get("path") in paths and out.get("md5"):
                    found[out["path"]] = out["md5"]
    return found


def metric_key(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "_-./ " else "_" for ch in name)


def _site_scores(per: dict[str, dict[str, float]], glob: Optional[dict[str, float]]) -> dict[str, float]:
    """Each evaluated site's accuracy, its AUC where defined, and its global-model accuracy where the method has one."""
    m = {f"acc.{c}": v["acc"] for c, v in per.items()}
    m.update({f"auc.{c}": v["auc"] for c, v in per.items() if "auc" in v and v["auc"] == v["auc"]})
    m.update({f"global_acc.{c}": v for c, v in (glob or {}).items()})
    return m


def round_metrics(entry: dict[str, Any]) -> dict[str, float]:
    m: dict[str, float] = {
        "bytes_up_total": entry["bytes_up_total"],
        "bytes_down_total": entry["bytes_down_total"],
    }
    for k in ("train_seconds", "seconds", "train_flops", "bytes_ensemble"):
        if k in entry:
            m[k] = entry[k]
    for c, b in entry["bytes_up"].items():
        m[f"bytes_up.{c}"] = b
    for c, b in entry["bytes_down"].items():
        m[f"bytes_down.{c}"] = b
    for c, b in entry.get("bytes_task_end", {}).items():  # a task stream's end-of-task download (pFedDIL)
        m[f"bytes_task_end.{c}"] = b
    if "dropped" in entry:  # a deployment's sites gone during the round's training (min-train-sites), and what they were sent
        m["sites_dropped"] = len(entry["dropped"])
        for c, b in entry["dropped"].items():
            m[f"bytes_down_dropped.{c}"] = b
    if "eval_partial" in entry:  # a deployment's evaluation without sites gone during it (min-eval-sites): no mean
        m["sites_not_evaluated"] = len(entry["eval_missing"])
        m.update(_site_scores(entry["eval_partial"], entry.get("global_partial")))
    if "left" in entry:  # a deployment's sites gone from the federation in the round (sites[k].left)
        m["sites_left"] = len(entry["left"])
    if "lr_factor" in entry:  # a learning-rate schedule's factor of the round (train.lr_schedule)
        m["lr_factor"] = entry["lr_factor"]
    for c, v in entry["train_loss"].items():
        if v is not None:
            m[f"train_loss.{c}"] = v
    if "eval" in entry:
        m["mean_acc"] = entry["mean_acc"]
        m["std_acc"] = entry["std_acc"]
        if "mean_auc" in entry:
            m["mean_auc"] = entry["mean_auc"]
        if "mean_val_acc" in entry:
            m["mean_val_acc"] = entry["mean_val_acc"]
        m.update(_site_scores(entry["eval"], entry.get("global")))
        for d, v in (entry.get("task_acc") or {}).items():  # a task stream: accuracy on each task seen so far
            m[f"task_acc.{d}"] = v
        for k in ("ensemble", "external_ensemble", "external_global"):  # new test, external test
            if k in entry:
                m[f"{k}_acc"] = entry[k]["acc"]
    return {metric_key(k): float(v) for k, v in m.items()}


def flat_summary(summary: dict[str, Any]) -> dict[str, float]:
    """A run's final numbers as MLflow metrics (``final.<key>``): mean and spread of accuracy (and AUC), each client's
    accuracy, and the method-specific summaries the run has."""
    flat = {"mean_acc": summary["mean_acc"], "std_acc": summary["std_acc"]}
    if "mean_auc" in summary:
        flat["mean_auc"] = summary["mean_auc"]
    # a stream's: the tables' Avg and its readings, forgetting, the accuracy after the last task, the rounds to the
    # best accuracy summed over the tasks (pFedDIL's Table 5), what a client keeps (Table 6)
    for key in ("train_flops_per_round", "ensemble_acc", "external_ensemble_acc", "external_global_acc", "avg_acc", "avg_on_task",
                "avg_acc_pooled", "forgetting", "final_acc", "rounds_to_best_total", "models_per_client", "bytes_kept_per_client"):
        if summary.get(key) is not None:
            flat[key] = summary[key]
    for c, v in summary["per_client"].items():
        flat[f"acc.{c}"] = v["acc"]
    for d, v in summary.get("acc_after_task", {}).items():
        flat[f"acc_after.{d}"] = v
    for d, v in summary.get("acc_on_task", {}).items():
        flat[f"acc_on.{d}"] = v
    return flat


def init_store(uri: Optional[str]) -> None:
    """Create the tracking store at ``uri`` once, before parallel runs log to it: MLflow builds a new sqlite store's
    tables on first use, and two runs doing that at the same time fail ("duplicate column name")."""
    if uri:
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)


def artifact_location(uri: str, experiment: str) -> Optional[str]:
    """Where a new experiment of a sqlite store keeps its runs' artifacts: ``mlruns/`` beside the database, whatever
    the folder the run starts in. MLflow's default, ``./mlruns`` of the current folder, put a grid's experiments in
    the temporary copy of the repository its first queue worker ran in, where every later run's artifacts went and
    were lost with it. One folder per experiment (its name made a folder name, with a hash of the name); None for
    other stores (a tracking server decides)."""
    m = re.fullmatch(r"sqlite:///(.+)", uri or "")
    if not m:
        return None
    db = Path(m.group(1))
    folder = re.sub(r"[^A-Za-z0-9._-]+", "_", experiment).strip("_") or "experiment"
    digest = hashlib.sha256(experiment.encode()).hexdigest()[:8]
    return ((db if db.is_absolute() else Path.cwd() / db).resolve().parent / "mlruns" / f"{folder}-{digest}").as_uri()


def relocate_artifacts(uri: str) -> list[tuple[str, str]]:
    """A sqlite store moved or copied with its repository (``cp -a``, a checkout moved to a larger disk): its
    experiments' artifact folders, absolute ``file://`` addresses fixed when each was made (:func:`artifact_location`),
    still named the old place, and every later run wrote its artifacts there, outside the repository (making the old
    folder again where it was gone). Each experiment whose folder is the one :func:`artifact_location` gives it, under
    another ``mlruns/``, is pointed at ``mlruns/`` beside the database as it is now; so is each of its runs whose
    artifacts came along (its folder is in the new place, or gone from the old one: a database copied without
    ``mlruns/`` keeps its earlier runs' artifacts where they are). The same folder reached by another path (a bind
    mount, a network share mounted twice) is no move; other stores, and experiments whose artifacts were put elsewhere
    on purpose, are left as they are. Returns (old, new) per experiment moved."""
    import sqlite3
    from urllib.parse import unquote, urlparse

    m = re.fullmatch(r"sqlite:///(.+)", uri or "")
    db = Path(m.group(1)) if m else None
    if db is None or not db.is_file():
        return []

    def folder(file_uri: str) -> Path:
        return Path(unquote(urlparse(file_uri).path))

    def same_place(a: str, b: str) -> bool:
        try:
            return os.path.samefile(folder(a), folder(b))
        except OSError:
            return False

    con = sqlite3.connect(db, timeout=60)
    try:
        try:
            rows = con.execute("SELECT experiment_id, name, artifact_location FROM experiments").fetchall()
        except sqlite3.DatabaseError:  # not an MLflow store (yet): MLflow says what it is when it opens it
            return []
        moved = []
        for exp_id, name, location in rows:
            new, old = artifact_location(uri, name), str(location or "").rstrip("/")
            old_parent, _, old_folder = old.rpartition("/")
            if new and old != new and old_parent.startswith("file://") and old_parent.endswith("/mlruns") \
                    and old_folder == new.rpartition("/")[2] and not same_place(old, new):
                moved.append((exp_id, old, new))
        with con:  # one transaction: a run starting beside this one sees the store before or after, never half of it
            for exp_id, old, new in moved:
                con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?", (new, exp_id))
                for run_id, art in con.execute("SELECT run_uuid, artifact_uri FROM runs WHERE experiment_id = ?", (exp_id,)).fetchall():
                    if str(art or "").startswith(old + "/") and ((folder(new) / run_id).exists() or not (folder(old) / run_id).exists()):
                        con.execute("UPDATE runs SET artifact_uri = ? WHERE run_uuid = ?", (new + art[len(old):], run_id))
    finally:
        con.close()
    if moved:
        log.warning("%s: moved or copied from %s: the artifact folders of %d MLflow experiment(s) now point into %s",
                    db, folder(moved[0][1]).parent.parent, len(moved), folder(moved[0][2]).parent)
    return [(old, new) for _, old, new in moved]


# who trains a run: a RUNNING run whose process is gone (SIGKILL, a queue worker's copy removed) is found by these
PROCESS_TAGS = ("fedsilo.host", "fedsilo.host_id", "fedsilo.pid", "fedsilo.pid_started")


def host_id() -> str:
    """This machine's boot and process namespace (Linux's boot_id and the pid namespace): what a pid means. Two
    machines of one image share a hostname, a container on the host's network shares its hostname but not its
    pids; "" where /proc does not say (then no run is judged gone from here)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def process_tags() -> dict[str, str]:
    """This process, as tags of the run it trains: its host (name and :func:`host_id`), pid and start time (a pid
    reused later is another process)."""
    import socket

    import psutil

    me = psutil.Process()
    return dict(zip(PROCESS_TAGS, (socket.gethostname(), host_id(), str(me.pid), f"{me.create_time():.3f}")))


def process_of(tags: dict[str, str]) -> Optional[tuple[int, float]]:
    """A run's process (pid, start time) from its tags, or None (started by an older fedsilo, or its tags edited)."""
    try:
        return int(tags["fedsilo.pid"]), float(tags["fedsilo.pid_started"])
    except (KeyError, ValueError):
        return None


def _process_alive(pid: int, started: float) -> bool:
    """Whether the process that started a run still runs: the pid with its start time, and not a zombie (a killed
    process its parent has not reaped, as Flower's SuperExec leaves a SIGKILLed ServerApp: it trains nothing more)."""
    import psutil

    try:  # the start time within a second: psutil derives it from the boot time, which moves when the clock is stepped
        proc = psutil.Process(pid)
        return abs(proc.create_time() - started) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.ZombieProcess:  # where psutil says so by raising (a subclass of NoSuchProcess): gone too
        return False
    except psutil.NoSuchProcess:
        try:  # /proc mounted hidepid: another user's process is not listed, yet signal 0 finds it
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    except psutil.AccessDenied:  # another user's process of that pid: alive, and not ours to judge
        return True


def stale_runs(client: Any) -> tuple[list[Any], list[Any]]:
    """The tracking store's RUNNING runs whose process on this host is gone (SIGKILLed, a lost queue worker), and the
    RUNNING runs this host cannot judge (started on another host or in another container, by its :func:`host_id`,
    or by a fedsilo before runs were tagged with their process: :data:`PROCESS_TAGS`)."""
    here = host_id()
    exps, token = [], None
    while True:
        page = client.search_experiments(max_results=1000, page_token=token)
        exps += [e.experiment_id for e in page]
        token = page.token
        if not token:
            break
    gone, unknown = [], []
    for i in range(0, len(exps), 100):  # MLflow searches up to 100 experiments at a time
        token = None
        while True:
            page = client.search_runs(exps[i : i + 100], filter_string="attributes.status = 'RUNNING'", max_results=1000,
                                      page_token=token)
            for run in page:
                tags = run.data.tags
                process = process_of(tags)
                if process is None or not here or tags.get("fedsilo.host_id") != here:
                    unknown.append(run)
                elif not _process_alive(*process):
                    gone.append(run)
            token = page.token
            if not token:
                break
    return gone, unknown


def end_stale_runs(uri: str) -> list[Any]:
    """Mark KILLED every RUNNING run of the store at ``uri`` whose process on this host is gone (:func:`stale_runs`);
    returns them. A checkpoint of such a run still resumes it (its run RUNNING again)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    gone, _ = stale_runs(client)
    mark_killed(client, gone)
    return gone


def mark_killed(client: Any, runs: list[Any]) -> None:
    """End ``runs`` (of :func:`stale_runs`) as KILLED: the MLflow view stops showing them as running."""
    for run in runs:
        client.set_terminated(run.info.run_id, "KILLED")


def _run_exists(client: Any, run_id: str) -> bool:
    """Whether the tracking store holds ``run_id``: False for a run it does not know (a checkpoint from another
    store); any other failure (the store unreachable, locked, refused) propagates, not taken for a missing run."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_run(run_id)
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise
    return True


class Tracker:
    """A thin wrapper over ``MlflowClient``; ``enabled=False`` makes every call a no-op (tests, dry runs)."""

    def __init__(self, enabled: bool, uri: str):
        self.enabled = enabled
        self.run_id: Optional[str] = None
        if enabled:
            from mlflow.tracking import MlflowClient

            self.uri = os.environ.get("MLFLOW_TRACKING_URI") or uri
            relocate_artifacts(self.uri)  # a repository moved with its store: its runs' artifacts stay inside it
            self.client = MlflowClient(tracking_uri=self.uri)

    def start(self, experiment: str, run_name: str, params: dict[str, Any], tags: dict[str, str], run_id: Optional[str] = None) -> Optional[str]:
        if not self.enabled:
            return None
        from mlflow.entities import Param, RunTag

        if run_id:
            if _run_exists(self.client, run_id):
                self.run_id = run_id
                self.client.update_run(run_id, status="RUNNING")
                self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in process_tags().items()])  # resumed here
                return run_id
            log.info("MLflow run %s is not in %s (another tracking store): a new run", run_id, self.uri)
        exp_id = self._experiment_id(experiment)
        run = self.client.create_run(exp_id, run_name=run_name, tags={**tags, **process_tags()})
        self.run_id = run.info.run_id
        try:
            items = [Param(k, str(v)[:6000]) for k, v in sorted(flatten(params).items())]
            for i in range(0, len(items), 100):
                self.client.log_batch(self.run_id, params=items[i : i + 100])
            self.client.log_batch(self.run_id, tags=[RunTag("mlflow.runName", run_name)])
        except BaseException:  # the run exists: not left RUNNING
            self.fail("FAILED")
            raise
        return self.run_id

    def start_in(self, folder: Path, experiment: str, run_name: str, params: dict[str, Any], tags: dict[str, str],
                 run_id: Optional[str] = None) -> Optional[str]:
        """:meth:`start` for a run whose state lives in ``folder`` (a train stage's, a deployment's), which records the
        MLflow run it serves (``mlflow_run.json``). The run it last served, if it is not the one continued now
        (``run_id``), died without ending it (SIGKILL, a lost machine) and nothing will resume it: marked KILLED."""
        from fedsilo.utils.io import read_json, write_json

        sidecar = Path(folder) / RUN_SIDECAR
        earlier = read_json(sidecar).get("run_id") if sidecar.exists() else None
        if earlier and earlier != run_id and self.supersede(earlier):
            log.info("MLflow run %s of an interrupted, not resumed, run marked KILLED", earlier)
        started = self.start(experiment, run_name, params, tags, run_id=run_id)
        if started:
            write_json(sidecar, {"run_id": started})
        return started

    @staticmethod
    def forget(folder: Path) -> None:
        """The run in ``folder`` ended (its outputs are written): nothing is left to supersede or resume."""
        (Path(folder) / RUN_SIDECAR).unlink(missing_ok=True)

    def _experiment_id(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp:
            return exp.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=artifact_location(self.uri, name))
        except Exception:  # noqa: BLE001 - a run started beside this one (a grid worker) created it first
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def log_round(self, entry: dict[str, Any]) -> None:
        if not self.enabled or self.run_id is None:
            return
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = [Metric(k, v, ts, entry["round"]) for k, v in round_metrics(entry).items()]
        for i in range(0, len(ms), 1000):
            self.client.log_batch(self.run_id, metrics=ms[i : i + 1000])

    def tag(self, tags: dict[str, str]) -> None:
        """Set (or overwrite) tags on the run: a resumed deployment's sites and nodes, the rounds sites left or joined."""
        if not self.enabled or self.run_id is None or not tags:
            return
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in sorted(tags.items())])

    def finish(self, summary: dict[str, float], artifacts: list[Path]) -> None:
        if not self.enabled or self.run_id is None:
            return
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(metric_key(f"final.{k}"), float(v), ts, 0) for k, v in summary.items()])
        for a in artifacts:
            self.client.log_artifact(self.run_id, str(a))
        self.client.set_terminated(self.run_id, "FINISHED")

    def fail(self, status: str = "FAILED") -> None:
        """End the run as FAILED (an error) or KILLED (SIGTERM, Ctrl-C); a SIGKILLed run is ended by :meth:`supersede`."""
        if self.enabled and self.run_id is not None:
            try:
                self.client.set_terminated(self.run_id, status)
            except Exception as err:  # noqa: BLE001 - called while another error propagates: that one is the story
                log.warning("could not mark MLflow run %s %s: %s", self.run_id, status, err)

    def supersede(self, run_id: str) -> bool:
        """Mark ``run_id`` KILLED if it is still RUNNING: its process died without a word (SIGKILL, a lost machine)
        and the run will not be resumed (the configuration changed, or it was already finished). True if marked."""
        if not self.enabled:
            return False
        if not _run_exists(self.client, run_id):  # a run of another tracking store: nothing to mark here
            return False
        run = self.client.get_run(run_id)
        if run.info.status != "RUNNING":
            return False
        self.client.set_terminated(run_id, "KILLED")
        return True
