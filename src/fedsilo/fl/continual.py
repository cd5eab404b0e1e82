"""The task stream of federated domain-incremental learning (pFedDIL's protocol).

Every client learns the same sequence of domain tasks (a ``domain_incremental`` split: one task = one domain, that
domain's images spread over the clients with Dirichlet(alpha) label skew). Task t runs for ``train.rounds`` rounds
(pFedDIL's T per task), rounds ``t*T+1 .. (t+1)*T`` of the run; each round a fraction ``train.client_fraction`` of the
clients takes part (pFedDIL's active ratio k) and trains on the current task's data only: earlier tasks' images are
out of reach. The server calls the method's ``on_task_start`` at each task's first round, and after a task's last aggregation
sends each client what the method says it keeps of the task (``task_end_download``: pFedDIL's family model).

Evaluation (every ``train.eval_every`` rounds and always at the end of each task) scores every client on the test
sets of every task seen so far, with the prediction the method gives for that task (``Method.predict_task``: the
global model for FedAvg, the task's own model for Disjoint, pFedDIL's weighted ensemble). A task's accuracy is the
mean over the clients that hold test images of it (a Dirichlet share may leave a client none); its pooled accuracy
(correct over images, all clients' test images together, as FedCIL's code scores) is recorded beside it. Reported,
from the evaluations at the end of each task:

- the accuracy matrix ``A[t][j]``: after learning task t, the accuracy on task j (j <= t), and the same pooled;
- the accuracy after each task, the mean of its row, and their mean ("Avg"): our reading of the numbers pFedDIL's
  Tables 1-3 print under each domain (the paper does not define them; see ``acc_on_task``), and the same pooled;
- the accuracy on each task right after learning it (the matrix's diagonal, ``acc_on_task``) and its mean: the
  other reading of those columns. The paper's Office-31 Source-only row (46.53 on amazon, then 20.61 with the model
  frozen) cannot be a mean over the tasks seen (it would be at least 46.53 / 2), which this reading allows; neither
  reading makes every published row plausible, so the report prints both;
- forgetting: for every task but the last, the best accuracy it had at the end of a task minus its accuracy at the
  end of the stream, averaged (Chaudhry et al. 2018; a task no client scored left out);
- where sites left the stream (a deployment's ``left``), the same matrix and forgetting over the sites in at the
  end, from each evaluation's per-site accuracies (``task_acc_by_client``);
- rounds to the best accuracy within each task and their sum (pFedDIL's Table 5), at the resolution of
  ``eval_every``;
- per-round curves in ``history.json`` (``seen_acc``, ``task_acc`` per domain).

The run checkpoints like a static one (train.checkpoint_every); the task of a round follows from its number, so a run killed
mid-task resumes inside that task and ends with the numbers of an uninterrupted run.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from fedsilo.client.data import ClientData
from fedsilo.client.local import score
from fedsilo.fl.engine import Engine, payload_bytes, read_only, transfer
from fedsilo.methods.registry import check_stream_fit


class TaskStream:
    """The task bookkeeping of a stream, shared by the in-process :class:`ContinualEngine` and the Flower server of a
    stream (``fl/flower.py``): which task a round belongs to, the method's ``on_task_start`` at a task's first round,
    evaluation at every task's end, and the round entry's task, domain, task end and storage. Mixed in before the
    engine class whose ``run_round`` trains the round's clients; ``self.tasks[t]`` are task t's clients (or, on
    Flower, the sites' cards of task t)."""

    stream = True
    tasks: list
    task_names: list[str]
    per_task: int

    def _stream(self, method, tasks: list, task_names: list[str], rounds: int) -> None:
        check_stream_fit(type(method), True, method.key, "the clients hold one (a domain_incremental split)")
        if len(tasks) != len(task_names) or not tasks:
            raise ValueError("one list of clients per task is needed")
        self.tasks, self.task_names, self.per_task = tasks, list(task_names), rounds

    def task_of(self, rnd: int) -> int:
        return (rnd - 1) // self.per_task

    def _enter(self, task: int) -> None:
        self.clients = self.tasks[task]
        self.method.task = task

    def eval_due(self, rnd: int) -> bool:
        return rnd % self.train.eval_every == 0 or rnd % self.per_task == 0

    def task_storage(self, rnd: int) -> dict[str, dict[str, int]]:
        """At a task's end (round ``rnd``), after its evaluation: what each client still in the federation keeps
        (pFedDIL's Table 6), by client name."""
        raise NotImplementedError

    def run_round(self) -> dict[str, Any]:
        rnd = self.round + 1
        task = self.task_of(rnd)
        self._enter(task)
        if (rnd - 1) % self.per_task == 0:
            self.server = self.method.on_task_start(self.server, self.model, task)
        entry = super().run_round()  # type: ignore[misc]
        entry["task"] = task
        entry["domain"] = self.task_names[task]
        if rnd % self.per_task == 0:
            entry["task_end"] = True
            entry["storage"] = self.task_storage(rnd)
        return entry


def stream_eval(names: list[str], task_names: list[str], scores: list[list[tuple[str, Optional[float], int]]]) -> dict[str, Any]:
    """An evaluation of a stream from ``scores[j][k]``: client k's (name, accuracy, test images) on task j, in client
    order, for every task j seen so far (accuracy None where the client holds no test image of task j); ``names``:
    the clients of the current task in order. The per-client accuracy is the mean over the tasks it was scored on; a
    task's accuracy the mean over its scored clients, its pooled accuracy correct over images."""
    by_client: dict[str, list[float]] = {n: [] for n in names}
    task_acc: dict[str, float] = {}
    task_acc_pooled: dict[str, float] = {}
    by_site: dict[str, dict[str, float]] = {}  # task -> client -> accuracy: a matrix over other sites can be formed
    for j, row in enumerate(scores):
        accs, correct, seen_images = [], 0.0, 0
        for name, acc, n_test in row:
            if acc is None:
                continue
            accs.append(acc)
            correct += acc * n_test
            seen_images += n_test
            by_client[name].append(acc)
            by_site.setdefault(task_names[j], {})[name] = acc
        task_acc[task_names[j]] = float(np.mean(accs)) if accs else float("nan")
        task_acc_pooled[task_names[j]] = correct / seen_images if seen_images else float("nan")
    per = {name: {"acc": float(np.mean(v)) if v else float("nan")} for name, v in by_client.items()}
    client_means = np.array([v["acc"] for v in per.values() if not np.isnan(v["acc"])])
    seen = float(np.nanmean(list(task_acc.values())))
    return {
        "eval": per,
        "mean_acc": seen,
        "std_acc": float(client_means.std()) if len(client_means) else float("nan"),
        "task_acc": task_acc,
        "task_acc_pooled": task_acc_pooled,
        "task_acc_by_client": by_site,
        "seen_acc": seen,
    }


class ContinualEngine(TaskStream, Engine):
    def __init__(self, method, model, tasks: list[list[ClientData]], task_names: list[str], train, seed: int, **kw: Any):
        self._stream(method, tasks, task_names, train.rounds)
        method.set_tasks(self.task_names)
        Engine.__init__(self, method, model, tasks[0], train, seed, **kw)
        self.total_rounds = self.per_task * len(tasks)
        self._enter(self.task_of(max(self.round, 1)))

    def task_storage(self, rnd: int) -> dict[str, dict[str, int]]:
        here = set(self.active(rnd))  # a site that has left keeps what it kept, outside the federation's count
        return {c.name: self.method.storage(self.server, s) for k, (c, s) in enumerate(zip(self.clients, self.stores)) if k in here}

    def after_aggregation(self, entry: dict[str, Any], rnd: int) -> None:
        """At a task's last round, after the aggregation: the server sends each client what it keeps of the task
        (``Method.task_end_download`` / ``task_end_keep``; pFedDIL: the federation's final model of the family the
        client learned the task with), counted in ``bytes_task_end`` and in the round's download total."""
        if rnd % self.per_task:
            return
        here = set(self.active(rnd))  # a site that has left is sent nothing more
        for k, (c, store) in enumerate(zip(self.clients, self.stores)):
            if k not in here:
                continue
            down = read_only(self.method.task_end_download(self.server, c))
            if not down:  # nothing for this client (pFedDIL: it took no part in the task)
                continue
            entry.setdefault("bytes_task_end", {})[c.name] = payload_bytes(down)
            if self.observer:
                self.observer(rnd, c.name, "down", transfer(down))
            self.method.task_end_keep(store, c, transfer(down))
            self.stores[k] = self._place(store)  # where stores live (the host, with train.store_device: host)

    def evaluate(self, rnd: Optional[int] = None) -> dict[str, Any]:
        rnd = self.round if rnd is None else rnd
        here = self.active(rnd)  # a site that has left is not evaluated: the rows from then on are the others'
        scores = []
        for j in range(self.task_of(rnd) + 1):
            row: list[tuple[str, Optional[float], int]] = []
            for k in here:
                store, c = self.stores[k], self.tasks[j][k]
                if len(c.y_test) == 0:
                    row.append((c.name, None, 0))
                    continue
                probs = self.method.predict_task(self.model, self.server, store, c, j, rnd)
                row.append((c.name, score(probs, c.y_test, probabilities=True)["acc"], len(c.y_test)))
            scores.append(row)
        return stream_eval([self.clients[k].name for k in here], self.task_names, scores)


def _forgetting(matrix: list[list[float]], n_tasks: int) -> float | None:
    """Mean over every task but the last of its best accuracy at a task's end before the last minus its final one;
    a task no client scored (NaN: none holds its test images) left out. None before the stream's end."""
    n = len(matrix)
    if n != n_tasks or n < 2:
        return None
    drops = []
    for j in range(n - 1):
        before = [matrix[t][j] for t in range(j, n - 1) if not np.isnan(matrix[t][j])]
        if before and not np.isnan(matrix[n - 1][j]):
            drops.append(max(before) - matrix[n - 1][j])
    return float(np.mean(drops)) if drops else None


def continual_summary(history: list[dict[str, Any]], task_names: list[str], per_task: int) -> dict[str, Any]:
    """The stream's metrics from a run's history (see the module docstring)."""
    ends = {h["task"]: h for h in history if h.get("task_end")}
    matrix = [[ends[t]["task_acc"][task_names[j]] for j in range(t + 1)] for t in sorted(ends)]
    after = [float(np.nanmean(row)) for row in matrix]
    on_task = [row[-1] for row in matrix]  # the diagonal: each task right after it was learned
    forgetting = _forgetting(matrix, len(task_names))
    best_rounds = []
    for t in sorted(ends):
        evals = [h for h in history if h.get("task") == t and "seen_acc" in h]
        best = max(evals, key=lambda h: (h["seen_acc"], -h["round"]))
        best_rounds.append(int(best["round"] - t * per_task))
    out: dict[str, Any] = {
        "tasks": list(task_names),
        "rounds_per_task": per_task,
        "accuracy_matrix": matrix,
        "acc_after_task": dict(zip(task_names, after)),
        "avg_acc": float(np.mean(after)) if after else float("nan"),
        "acc_on_task": dict(zip(task_names, on_task)),
        "avg_on_task": float(np.nanmean(on_task)) if on_task else float("nan"),
        "final_acc": after[-1] if after else float("nan"),
        "forgetting": forgetting,
        "rounds_to_best": best_rounds,
        "rounds_to_best_total": int(sum(best_rounds)),
    }
    if ends and all("task_acc_pooled" in ends[t] for t in ends):  # runs before it was recorded have none
        pooled = [[ends[t]["task_acc_pooled"][task_names[j]] for j in range(t + 1)] for t in sorted(ends)]
        after_pooled = [float(np.nanmean(row)) for row in pooled]
        out.update({"accuracy_matrix_pooled": pooled, "acc_after_task_pooled": dict(zip(task_names, after_pooled)),
                    "avg_acc_pooled": float(np.mean(after_pooled))})
    left = sorted({name for h in history for name in h.get("left", ())})
    if left and ends and all("task_acc_by_client" in ends[t] for t in ends):
        # sites left during the stream: the rows above average different sites; the same matrix and forgetting over
        # the sites still in at the end (every row scored on them)
        stay = set().union(*ends[max(ends)]["task_acc_by_client"].values())  # scored at the last task's end
        kept = [[float(np.mean(v)) if (v := [a for c, a in ends[t]["task_acc_by_client"].get(task_names[j], {}).items() if c in stay])
                 else float("nan") for j in range(t + 1)] for t in sorted(ends)]
        out.update({"sites_at_end": sorted(stay), "accuracy_matrix_sites_at_end": kept,  # (a deployment: sites_left)
                    "forgetting_sites_at_end": _forgetting(kept, len(task_names))})
    last = ends.get(max(ends)) if ends else None
    if last is not None and "storage" in last:
        out["storage"] = last["storage"]
        out["models_per_client"] = float(np.mean([v["models"] for v in last["storage"].values()]))
        out["bytes_kept_per_client"] = float(np.mean([v["bytes"] for v in last["storage"].values()]))
    return out
