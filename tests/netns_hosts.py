"""Hosts of their own on one machine, for the checks that run a federation or a cluster across a network
(scripts/check_deploy_hosts.py, scripts/check_grid_hosts.py): a coordinator and one host per member, each a Linux
network namespace (its own interfaces, addresses, routes and loopback), joined as a star of point-to-point links
(veth pairs). The coordinator has an address of its own (``COORD_IP``, on its loopback) that every member reaches
through its link; the coordinator does not forward, so no member reaches another. Needs root and iproute2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

COORD_IP = "10.231.0.1"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r


class Hosts:
    """The namespaces and links: ``coord`` and one namespace per member, member k on 10.231.<k+1>.0/24."""

    def __init__(self, members: tuple[str, ...]):
        tag = os.getpid() % 100000
        self.coord = f"fs{tag}-coord"
        self.ns = {s: f"fs{tag}-{s}" for s in members}
        self.link = {s: f"fs{tag}c{k}" for k, s in enumerate(members)}  # the coordinator's end of member s's link
        self.ip = {s: f"10.231.{k + 1}.2" for k, s in enumerate(members)}

    def up(self) -> None:
        sh("ip", "netns", "add", self.coord)
        sh("ip", "-n", self.coord, "link", "set", "lo", "up")
        sh("ip", "-n", self.coord, "addr", "add", f"{COORD_IP}/32", "dev", "lo")  # the coordinator's own address (a SuperLink, a Ray head)
        sh("ip", "netns", "exec", self.coord, "sysctl", "-qw", "net.ipv4.ip_forward=0")
        for k, (s, ns) in enumerate(self.ns.items()):
            far = f"{self.link[s]}h"
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "link", "add", self.link[s], "netns", self.coord, "type", "veth", "peer", "name", far, "netns", ns)
            sh("ip", "-n", self.coord, "addr", "add", f"10.231.{k + 1}.1/24", "dev", self.link[s])
            sh("ip", "-n", ns, "addr", "add", f"{self.ip[s]}/24", "dev", far)
            sh("ip", "-n", self.coord, "link", "set", self.link[s], "up")
            sh("ip", "-n", ns, "link", "set", far, "up")
            sh("ip", "-n", ns, "route", "add", "default", "via", f"10.231.{k + 1}.1")

    def down(self) -> None:
        for ns in (*self.ns.values(), self.coord):
            sh("ip", "netns", "del", ns, check=False)

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes on each member's link, seen from the coordinator's end: rx = from the member (up), tx = to it (down)."""
        out = {}
        for s, dev in self.link.items():
            stats = json.loads(sh("ip", "-n", self.coord, "-s", "-j", "link", "show", "dev", dev).stdout)[0]["stats64"]
            out[s] = {"up": int(stats["rx"]["bytes"]), "down": int(stats["tx"]["bytes"])}
        return out

    def connects(self, ns: str, ip: str, port: int) -> str:
        """What a TCP connection from namespace ``ns`` to ip:port gets: 'connected', 'refused' or 'no route'."""
        code = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3); print('connected')\n"
                "except ConnectionRefusedError: print('refused')\nexcept OSError: print('no route')")
        return sh("ip", "netns", "exec", ns, sys.executable, "-c", code, ip, str(port)).stdout.strip()
