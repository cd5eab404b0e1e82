"""A deployed run survives its SuperLink: a loopback deployment as tests/test_deploy_processes.py builds it (TLS,
SuperNode authentication, three sites on their own mirrors, FedBN for 3 rounds), its SuperLink SIGKILLed once the
ServerApp's checkpoint holds round 1, restarted on the same database, then `flwr run` of the same App again. Checks
that the second run resumes (the wire log holds both attempts' registrations and each round's uploads once) and ends
with the in-process engine's numbers, and that the checkpoint is gone. About 5 minutes on 2 cores; not part of the
suite (README, "Checkpoints and resume").

    python scripts/check_deploy_resume.py /tmp/resume-check      # a folder that does not exist yet
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_deploy_processes import CONNECTION, Federation, engine_history  # noqa: E402

from fedsilo.fl.credentials import make_certificates  # noqa: E402
from fedsilo.fl.deploy import peek_checkpoint, resume_key  # noqa: E402

TRAIN = {"model": "simple_cnn", "rounds": 3, "batch_size": 8, "lr": 0.05, "device": "cpu"}
T0 = time.monotonic()


def say(*args: object) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s]", *args, flush=True)


def check(base: Path, fed: Federation) -> bool:
    coordinator = base / "coordinator"
    coordinator.mkdir()
    sites, cards = fed.hospitals()
    certs = make_certificates(coordinator / "certs", ("127.0.0.1", "localhost"))
    link = fed.start_superlink(coordinator, certs, database="superlink.db")  # registrations survive a restart
    node_ids = fed.register(sites)
    fed.start_supernodes(sites, certs)
    fed.wait_online(3)
    say("3 SuperNodes online")

    results = coordinator / "results"
    app = fed.app(coordinator, "three_hospitals", "fedbn", cards, node_ids, TRAIN, results=str(results), state=str(coordinator / "state"))
    dep = json.loads((app / "deployment.json").read_text())
    ckpt, key = coordinator / "state" / "checkpoint.pt", resume_key(dep)

    say("run", fed.flwr("run", str(app), CONNECTION)["run-id"], "started")
    while (peek_checkpoint(ckpt, key) or {}).get("round", 0) < 1:
        time.sleep(0.5)
    link.send_signal(signal.SIGKILL)
    link.wait()
    say("SuperLink SIGKILLed; the checkpoint holds round", peek_checkpoint(ckpt, key)["round"])
    for _ in range(120):  # the ServerApp process of the first run ends (it holds the run's lock)
        if subprocess.run(["pgrep", "-f", "flwr-serverapp"], capture_output=True).returncode != 0:
            break
        time.sleep(1)
    fed.start_superlink(coordinator, certs, name="superlink_restarted", database="superlink.db")
    fed.wait_online(3, limit=180)
    say("SuperLink restarted on its database; 3 SuperNodes back online")
    rid = fed.flwr("run", str(app), CONNECTION)["run-id"]
    say("run", rid, "started")
    run = fed.poll(lambda: next((r for r in fed.flwr("list", "--run-id", str(rid), CONNECTION)["runs"]
                                 if r["status"].startswith("finished")), None), 600, lambda: (results / "metrics.json").exists(),
                   f"run {rid} not finished")
    say("second run:", run["status"])

    history = json.loads((results / "history.json").read_text())
    reference = engine_history(app, sites)
    same = [h.get("eval") for h in history] == [h.get("eval") for h in reference] and \
        [h["bytes_up"] for h in history] == [h["bytes_up"] for h in reference]
    say("rounds", [h["round"] for h in history], "equal to the in-process engine's:", same)
    wire = [json.loads(line) for line in (results / "wire.jsonl").read_text().splitlines()]
    registrations = sum(w["message"] == "query.register" and w["to"] == "server" for w in wire)
    ups = sorted((w["round"], w["site"]) for w in wire if w["message"] == "train" and w["to"] == "server")
    resumed = registrations == 6 and ups == sorted((r, c["site"]) for r in (1, 2, 3) for c in cards.values())
    say("registrations", registrations, "(two attempts: 6); each round's uploads once:", resumed)
    for s, p in sites.items():
        say(s, "keeps", sorted(f.name for f in (p.parent / "state/deploy/three_hospitals").rglob("*.pt")))
    say("checkpoint left:", ckpt.exists())
    return same and resumed and not ckpt.exists() and run["status"] == "finished:completed"


def main() -> int:
    base = Path(sys.argv[1])
    base.mkdir(parents=True, exist_ok=False)
    fed = Federation(base)
    try:
        ok = check(base, fed)
    finally:
        fed.stop()  # and the ClientApp processes its SuperNodes left
    print("OK: the run resumed after its checkpoint with the engine's numbers" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
