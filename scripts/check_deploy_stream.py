"""Hospitals whose images come as a stream of domains, with real processes: the loopback deployment of
tests/test_deploy_processes.py (TLS, SuperNode authentication, `fedsilo site supernode`), but each of the three sites
split by its own `domain_incremental` (CheXpert -> OpenI mirrors drawn with its own seed, one client under its own
name), the federation training pFedDIL for 2 rounds per task with two sites of three per round.

One site's SuperNode is SIGKILLed as soon as its reply to the first task's end (`query.task_end`) is on the wire,
and started again with the same key once the SuperLink lists it offline: the ServerApp, told by the SuperLink that the
node is unavailable, waits for it (`rejoin-s`) and sends the task's evaluation again, and the site answers it from the
store it kept on disk at the task end, all in the one Flower run. Checks that the run finishes with the continual
engine's samples, evaluations of every task, bytes (task ends included), storage and FLOPs on the same streams; that
a task end carries only the model the site keeps; and that the restarted site answered that evaluation after its
restart. About 5 minutes on 2 cores; not part of the suite (README, "Deploying across hospitals", **Task streams**).

    python scripts/check_deploy_stream.py /tmp/stream-check      # a folder that does not exist yet
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.deploy_sites import make_stream_site  # noqa: E402
from tests.test_deploy_processes import BIN, CONNECTION, REPO_PARAMS, Federation  # noqa: E402

from fedsilo.fl.continual import ContinualEngine  # noqa: E402
from fedsilo.fl.credentials import make_certificates, make_node_key  # noqa: E402
from fedsilo.fl.deploy import deployment_spec  # noqa: E402
from fedsilo.fl.params import load_params  # noqa: E402
from fedsilo.fl.site import load_site  # noqa: E402

TRAIN = {"model": "simple_cnn", "model_width": 0.25, "rounds": 2, "batch_size": 8, "lr": 0.05, "device": "cpu",
         "client_fraction": 0.67}
HOSPITALS = {"hospital_a": "Hospital A", "hospital_b": "Hospital B", "hospital_c": "Hospital C"}
RESTARTED = "hospital_b"
DOMAINS = ["CheXpert", "OpenI"]
T0 = time.monotonic()


def say(*args: object) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s]", *args, flush=True)


def wire_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def check(base: Path, fed: Federation) -> bool:
    coordinator = base / "coordinator"
    coordinator.mkdir()
    sites, cards = {}, {}
    for k, (slug, name) in enumerate(HOSPITALS.items()):
        sites[slug] = make_stream_site(base / slug, name, mirror_seed=k)
        fed.fedsilo("--params", str(sites[slug]), "--root", str(base / slug), "site", "card", "--experiment", "site", cwd=base / slug)
        cards[slug] = json.loads((base / slug / "data/site/site.json").read_text())
        make_node_key(base / slug / "keys", slug)
        say(name, "card:", [(t["domain"], t["n_train"], t["n_test"]) for t in cards[slug]["tasks"]])
    certs = make_certificates(coordinator / "certs", ("127.0.0.1", "localhost"))
    fed.start_superlink(coordinator, certs)
    node_ids = fed.register(sites)
    supernodes = {s: fed.start_supernode(s, p, certs) for s, p in sites.items()}
    fed.wait_online(3)
    say("3 SuperNodes online")

    params = yaml.safe_load(REPO_PARAMS.read_text())
    params["methods"]["pfeddil"] = {"lam": 0.5}
    (coordinator / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    results = coordinator / "results"
    app = fed.app(coordinator, "stream_hospitals", "pfeddil", cards, node_ids, TRAIN, params=coordinator / "params.yaml",
                  results=str(results), state=str(coordinator / "state"))
    rid = fed.flwr("run", str(app), CONNECTION)["run-id"]
    say("run", rid, "started")

    # the restarted site: killed once its reply to the first task end is on the wire, before that task's evaluation
    staging, name = coordinator / "results.wire" / "wire.jsonl", HOSPITALS[RESTARTED]
    deadline = time.monotonic() + 600
    while not any(w["message"] == "query.task_end" and w["to"] == "server" and w["site"] == name for w in wire_lines(staging)):
        assert time.monotonic() < deadline, "no task end from the site after 600 s"
        time.sleep(0.2)
    killed = supernodes[RESTARTED]
    below = psutil.Process(killed.pid).children(recursive=True)  # its SuperExec and the ClientApps that one started
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    for q in below:  # a machine lost: nothing of the site's goes on
        try:
            q.kill()
        except psutil.NoSuchProcess:
            pass
    at_kill = len(wire_lines(staging))
    end_round = next(w["round"] for w in wire_lines(staging) if w["message"] == "query.task_end")
    say(name, "SuperNode SIGKILLed after its task-end reply of round", end_round)
    # the SuperLink lets the key in again only once it counts the dead node offline (2 missed 30 s heartbeats);
    # a restart before that is refused ("Failed to activate SuperNode", exit code 305)
    fed.poll(lambda: any(n["node-id"] == str(node_ids[RESTARTED]) and n["status"] == "offline"
                         for n in fed.flwr("supernode", "list", CONNECTION)["nodes"]), 180, lambda: False, f"{name} not offline")
    say(name, "listed offline by the SuperLink")
    status = json.loads(fed.fedsilo("deploy", "status", "--app", str(app), "--connection", CONNECTION, "--json", cwd=coordinator, cli=True))
    seen = {x["site"]: x["status"] for x in status["sites"]}
    say("fedsilo deploy status:", seen, "; checkpoint round", (status["checkpoint"] or {}).get("round"))
    print(fed.fedsilo("deploy", "status", "--app", str(app), "--connection", CONNECTION, cwd=coordinator, cli=True), flush=True)
    fed.start_supernode(RESTARTED, sites[RESTARTED], certs, log=f"supernode_{RESTARTED}_restarted")
    say(name, "SuperNode started again")

    run = fed.poll(lambda: next((r for r in fed.flwr("list", "--run-id", str(rid), CONNECTION)["runs"]
                                 if r["status"].startswith("finished")), None), 900, lambda: (results / "metrics.json").exists(),
                   f"run {rid} not finished")
    say("run:", run["status"])
    if run["status"] != "finished:completed":
        say(run.get("status-details"))
        return False

    history = json.loads((results / "history.json").read_text())
    metrics = json.loads((results / "metrics.json").read_text())
    spec = deployment_spec(json.loads((app / "deployment.json").read_text()))
    torch.set_num_threads(1)  # as each ClientApp (OMP_NUM_THREADS=1)
    streams = [load_site(load_params(p), "site", p.parent, torch.device("cpu"), index=k) for k, p in enumerate(sites.values())]
    reference = ContinualEngine(spec.method(), spec.make_model(), [[s[t] for s in streams] for t in range(len(DOMAINS))], DOMAINS,
                                spec.train, 0).run()
    keys = ("sampled", "eval", "task_acc", "bytes_up", "bytes_task_end", "storage", "train_flops")
    same = {k: [h.get(k) for h in history] == [h.get(k) for h in reference] for k in keys}
    say("rounds", [(h["round"], h["domain"]) for h in history], "equal to the continual engine's:", same)
    say("accuracy matrix", metrics["accuracy_matrix"], "forgetting", metrics["forgetting"])

    wire = wire_lines(results / "wire.jsonl")
    ends = [w for w in wire if w["message"] == "query.task_end"]
    only_keep = bool(ends) and all(set(w.get("arrays", {})) <= {"keep"} for w in ends)
    say("task ends on the wire:", len(ends), "carrying only the kept model:", only_keep)
    after = [w for w in wire[at_kill:] if w["message"] == "evaluate" and w["to"] == "server" and w["site"] == name
             and w["round"] == end_round]
    say(name, "answered the evaluation of round", end_round, "after its restart:", bool(after))
    server_log = subprocess.run([str(BIN / "flwr"), "log", str(rid), CONNECTION, "--show"], cwd=base, capture_output=True, text=True,
                                env={**fed.env, "FLWR_HOME": str(fed.cli_home)}, timeout=120).stdout
    waited = [ln.strip() for ln in server_log.splitlines() if "gone in round" in ln or "back online" in ln]
    say("the ServerApp's log (flwr log):", waited)
    log = (base / f"supernode_{RESTARTED}_restarted.log").read_text()
    say(name, "restarted SuperNode log mentions its store:", [ln for ln in log.splitlines() if "store" in ln.lower()][:3])
    told = seen == {n: "offline" if n == name else "online" for n in HOSPITALS.values()}
    return all(same.values()) and only_keep and bool(after) and len(waited) == 2 and told


def main() -> int:
    base = Path(sys.argv[1])
    base.mkdir(parents=True, exist_ok=False)
    fed = Federation(base)
    try:
        ok = check(base, fed)
    finally:
        fed.stop()  # and the ClientApp processes its SuperNodes left
    print("OK: the stream hospitals' run, one site restarted after a task end, gave the continual engine's numbers" if ok
          else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
