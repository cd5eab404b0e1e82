"""A deployment across hosts of their own: the coordinator and three hospitals each in a Linux network namespace
(its own interfaces, addresses, routes and loopback), joined as a star of point-to-point links (veth pairs), the
coordinator's SuperLink on an address of its own (10.231.0.1, the certificate's only name), each hospital reaching
it through its link and nothing else: the coordinator does not forward, so no hospital can reach another.

The deployment is tests/test_deploy_processes.py's (TLS, SuperNode authentication, `fedsilo site supernode`, FedBN
on three sites' own CheXpert / RSNA / VinBigData mirrors), each process started inside its host's namespace. Checks:
a hospital reaches the SuperLink and not another hospital; the run completes with the in-process engine's numbers;
and it reports, per hospital, the bytes that crossed its link (the interface counters on the coordinator's end,
headers, TLS and Flower's polling included) beside the tensor bytes the run counted for that site, in each direction.

Needs root and iproute2 (`ip netns`). About 3 minutes on 2 cores; not part of the suite (README, "Deploying across
hospitals", **Across hosts**).

    python scripts/check_deploy_hosts.py /tmp/hosts-check      # a folder that does not exist yet
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.deploy_sites import SITE_SOURCES  # noqa: E402
from tests.netns_hosts import COORD_IP as SUPERLINK_IP  # noqa: E402
from tests.netns_hosts import Hosts, sh  # noqa: E402
from tests.test_deploy_processes import BIN, TRAIN, Federation, engine_history  # noqa: E402

from fedsilo.fl.credentials import make_certificates  # noqa: E402

T0 = time.monotonic()


def say(*args: object) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s]", *args, flush=True)


class HostsFederation(Federation):
    """Federation whose processes run in the hosts' namespaces: the SuperLink and the coordinator's CLI in
    ``coord``, each SuperNode in its site's."""

    def __init__(self, base: Path, hosts: Hosts):
        super().__init__(base, host=SUPERLINK_IP)
        self.hosts = hosts

    def _ns(self, name: str) -> str:
        for s, ns in self.hosts.ns.items():
            if name.startswith(f"supernode_{s}"):
                return ns
        return self.hosts.coord

    def start(self, name: str, cmd: list[str], cwd: Path, home: Path) -> subprocess.Popen:
        return super().start(name, ["ip", "netns", "exec", self._ns(name), *cmd], cwd, home)

    def flwr(self, *args: str, timeout: float = 120) -> dict:
        r = subprocess.run(["ip", "netns", "exec", self.hosts.coord, str(BIN / "flwr"), *args, "--format", "json"], cwd=self.base,
                           env={**self.env, "FLWR_HOME": str(self.cli_home)}, capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, f"flwr {' '.join(args)}: {r.stdout}{r.stderr}"
        return json.loads(r.stdout)

    def wait_healthy(self, ca: Path, limit: float = 60) -> None:
        deadline = time.monotonic() + limit
        while sh("ip", "netns", "exec", self.hosts.coord, "curl", "-sf", "--cacert", str(ca), f"https://{self.address}/health",
                 check=False).returncode != 0:
            assert time.monotonic() < deadline, f"the SuperLink at {self.address} not healthy after {limit:.0f} s"
            time.sleep(0.5)


def check(base: Path, fed: HostsFederation, hosts: Hosts) -> bool:
    coordinator = base / "coordinator"
    coordinator.mkdir()
    sites, cards = fed.hospitals()
    hosts.up()
    say("hosts:", {"coordinator": SUPERLINK_IP, **hosts.ip})
    certs = make_certificates(coordinator / "certs", (SUPERLINK_IP,))
    fed.start_superlink(coordinator, certs)
    a, b = SITE_SOURCES[0], SITE_SOURCES[1]
    reach = {"superlink": hosts.connects(hosts.ns[a], SUPERLINK_IP, fed.port)}
    # something listens on hospital b's address (so 'refused' or 'connected' would mean a's host reaches it)
    listener = subprocess.Popen(["ip", "netns", "exec", hosts.ns[b], sys.executable, "-c",
                                 "import socket,time\ns=socket.socket();s.bind(('0.0.0.0',9));s.listen();time.sleep(30)"])
    time.sleep(1.0)
    reach["hospital"] = hosts.connects(hosts.ns[a], hosts.ip[b], 9)
    listener.kill()
    say(f"from {a}'s host: the SuperLink {reach['superlink']}, {b}'s host: {reach['hospital']}")
    node_ids = fed.register(sites)
    fed.start_supernodes(sites, certs)
    fed.wait_online(3)
    say("3 SuperNodes online across their links")

    results = coordinator / "results"
    app = fed.app(coordinator, "three_hosts", "fedbn", cards, node_ids, TRAIN, results=str(results), state=str(coordinator / "state"))
    before = hosts.counters()
    t = time.monotonic()
    run = fed.run(app, ended=lambda: (results / "metrics.json").exists())
    after, seconds = hosts.counters(), time.monotonic() - t
    say("run:", run["status"], f"in {seconds:.0f} s")
    if run["status"] != "finished:completed":
        say(run.get("status-details"))
        return False

    history = json.loads((results / "history.json").read_text())
    reference = engine_history(app, sites)
    same = [h.get("eval") for h in history] == [h.get("eval") for h in reference] and \
        [h["bytes_up"] for h in history] == [h["bytes_up"] for h in reference]
    say("evaluations and upload bytes equal to the in-process engine's:", same)

    say("per hospital: bytes on its link during the run (from `flwr run` to finished) vs tensor bytes the run counted")
    for s in SITE_SOURCES:
        name = cards[s]["site"]
        up = sum(h["bytes_up"].get(name, 0) for h in history)
        down = sum(h["bytes_down"].get(name, 0) + h.get("bytes_eval_down", {}).get(name, 0) for h in history)
        link = {d: after[s][d] - before[s][d] for d in ("up", "down")}
        say(f"  {name:11s} up: link {link['up']:>10,d}  tensors {up:>10,d}  ({link['up'] / max(up, 1):.2f}x)   "
            f"down: link {link['down']:>10,d}  tensors {down:>10,d}  ({link['down'] / max(down, 1):.2f}x)")
    return same and reach == {"superlink": "connected", "hospital": "no route"} and run["status"] == "finished:completed"


def main() -> int:
    if os.geteuid() != 0:
        print("needs root (ip netns)", file=sys.stderr)
        return 2
    base = Path(sys.argv[1])
    base.mkdir(parents=True, exist_ok=False)
    hosts = Hosts(SITE_SOURCES)
    fed = HostsFederation(base, hosts)
    try:
        ok = check(base, fed, hosts)
    finally:
        fed.stop()  # and the ClientApp processes its SuperNodes left
        hosts.down()
    print("OK: three hospitals on hosts of their own trained with the engine's numbers" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
