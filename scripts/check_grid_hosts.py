"""`fedsilo grid --ray` on a cluster whose nodes are hosts of their own: the head (no CPU to schedule: it only
coordinates) and the driver on the coordinator's host, two worker nodes each on a host of its own (Linux network
namespaces joined as a star of links, tests/netns_hosts.py), every Ray process bound to its host's address.

The pipeline is tests/test_grid_ray.py's (three train stages after a prep stage, then a report) with a DVC remote in
a folder every host reads (one machine's disk here; a bucket or an ssh:// host across machines). Checks: each stage
ran once, on a worker host (never the head), and the runs used both; `dvc status` is clean after the grid; the report
holds every run. Prints the bytes each worker's link carried (the workspace through Ray's object store, Ray's own
traffic).

Needs root, iproute2 and Ray (`pip install 'fedsilo[ray]'`); ends every Ray process of this machine at the end (`ray
stop`): run it when nothing else uses Ray here. About 1 minute; not part of the suite (README, "Many machines, a Ray
cluster").

    python scripts/check_grid_hosts.py /tmp/grid-hosts-check      # a folder that does not exist yet
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.netns_hosts import COORD_IP, Hosts  # noqa: E402
from tests.test_grid_ray import _dvc, _repo  # noqa: E402

PORT = 6391
WORKERS = ("worker_a", "worker_b")
BIN = Path(sys.executable).parent
T0 = time.monotonic()


def say(*args: object) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s]", *args, flush=True)


def ray_start(ns: str, *args: str) -> None:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    head = ["--include-dashboard=false"] if "--head" in args else []
    r = subprocess.run(["ip", "netns", "exec", ns, str(BIN / "ray"), "start", "--disable-usage-stats", *head, *args],
                       capture_output=True, text=True, env=env, timeout=180)
    if r.returncode != 0:
        raise RuntimeError(f"ray start {' '.join(args)} in {ns}: {r.stdout[-2000:]}{r.stderr[-2000:]}")


def check(base: Path, hosts: Hosts) -> bool:
    repo = _repo(base)
    hosts.up()
    say("hosts:", {"head": COORD_IP, **hosts.ip})
    ray_start(hosts.coord, "--head", "--node-ip-address", COORD_IP, "--port", str(PORT), "--num-cpus", "0")
    for w in WORKERS:
        ray_start(hosts.ns[w], "--address", f"{COORD_IP}:{PORT}", "--node-ip-address", hosts.ip[w], "--num-cpus", "1")
    say("Ray: a head and two worker nodes on their hosts")
    before = hosts.counters()
    driver = ("import json, sys\nfrom pathlib import Path\nfrom fedsilo.grid_ray import run_grid_ray\n"
              "r = run_grid_ray('dvc.yaml', Path(sys.argv[1]), sys.argv[2], worker_cache=sys.argv[3], quiet=True)\n"
              "print(json.dumps({k: r[k] for k in ('queued', 'runs', 'nodes', 'ran_after')}, default=str))")
    r = subprocess.run(["ip", "netns", "exec", hosts.coord, sys.executable, "-c", driver, str(repo), f"{COORD_IP}:{PORT}",
                        str(base / "node-cache")], capture_output=True, text=True, timeout=900, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    after = hosts.counters()
    if r.returncode != 0:
        say("the grid failed:", r.stderr[-4000:])
        return False
    out = json.loads(r.stdout.strip().splitlines()[-1])
    where = {n["node"]: n["address"] for n in out["nodes"]}
    placed = {x["stage"]: where.get(x["node"], x["node"]) for x in out["runs"]}
    say("nodes:", sorted(where.values()), "; runs placed:", placed)
    ran = sorted((base / "runs.log").read_text().split())
    status = _dvc("status", cwd=repo)
    report = (repo / "report.txt").read_text() if (repo / "report.txt").exists() else None
    say("each stage ran once:", ran == ["a", "b", "c"], "; dvc status:", status.strip().splitlines()[-1:], "; report:", report)
    for w in WORKERS:
        link = {d: after[w][d] - before[w][d] for d in ("up", "down")}
        say(f"  {w} ({hosts.ip[w]}): link up {link['up']:,d} B, down {link['down']:,d} B during the grid")
    on_workers = set(placed.values()) <= {hosts.ip[w] for w in WORKERS}
    return ran == ["a", "b", "c"] and on_workers and len(set(placed.values())) == 2 and "up to date" in status and report == "a1b1c1"


def main() -> int:
    if os.geteuid() != 0:
        print("needs root (ip netns)", file=sys.stderr)
        return 2
    base = Path(sys.argv[1])
    base.mkdir(parents=True, exist_ok=False)
    hosts = Hosts(WORKERS)
    try:
        ok = check(base, hosts)
    finally:
        subprocess.run([str(BIN / "ray"), "stop", "--force"], capture_output=True, timeout=120)
        hosts.down()
    print("OK: the Ray grid ran each stage once on worker hosts of their own" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
