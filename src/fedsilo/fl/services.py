"""The commands and systemd units that run a deployment's parties: the SuperLink, a site's SuperNode, and the
services that restart them (README "Deploying across hospitals")."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from fedsilo.config import ConfigError


def superlink_command(certs: Path, database: Optional[Path], host: str = "0.0.0.0", port: int = 9093) -> list[str]:
    """The coordinator's ``flower-superlink`` command: TLS with ``fedsilo deploy certs``' files in ``certs``, SuperNode
    authentication (only registered keys get in), its state in ``database`` (registrations and runs survive a restart;
    None: in memory), the Fleet and Control APIs on ``host``:``port``, and no package installed at run time (every
    party runs the fedsilo it has). Refuses a missing certificate file by name."""
    certs = Path(certs).resolve()
    missing = [n for n in ("ca.crt", "server.pem", "server.key") if not (certs / n).is_file()]
    if missing:
        raise ConfigError(f"--certs: {certs} lacks {', '.join(missing)} (make them with `fedsilo deploy certs`)")
    return ["flower-superlink", "--ssl-ca-certfile", str(certs / "ca.crt"), "--ssl-certfile", str(certs / "server.pem"),
            "--ssl-keyfile", str(certs / "server.key"), "--enable-supernode-auth",
            *(["--database", str(Path(database).resolve())] if database is not None else []),
            "--host", host, "--port", str(port), "--disable-runtime-dependency-installation"]


def restart_after_s() -> int:
    """How long a service manager waits before it starts a SuperNode again: the SuperLink lets the same key in only
    once it counts the old node offline, after Flower's heartbeat patience times its interval (2 x 30 s); 10 s more."""
    from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE

    return int(HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL) + 10


def _unit_word(arg: str, command: bool = True) -> str:
    """One word of a systemd command line (``command``) or of an Environment= assignment: bare when plain, else
    double-quoted; ``%`` (a specifier) doubled, and in a command line ``$`` (a variable) too, as systemd reads them."""
    import re

    if "\n" in arg or "\r" in arg:
        raise ConfigError(f"{arg!r}: a line break cannot be written into a systemd unit")
    arg = arg.replace("%", "%%")
    if command:
        arg = arg.replace("$", "$$")
    if re.fullmatch(r"[A-Za-z0-9_@%+=:,./-]+", arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_unit(description: str, command: list[str], workdir: Path, restart_s: int, env: dict[str, str],
                 note: str = "") -> str:
    """A systemd service that runs ``command`` (a fedsilo command line with absolute paths: a service has no shell,
    PATH or virtual environment) in ``workdir`` as the account owning it, restarted ``restart_s`` s after a failure,
    at most 5 times in 15 minutes, never after fedsilo refused its input (exit status 2: data, files or credentials
    that no longer match or have expired, which a restart does not mend; Flower's own failures all exit 1)."""
    workdir = Path(workdir).resolve()
    lines = [*([f"# {note}"] if note else []),
             "# written by fedsilo; install: copy it to /etc/systemd/system/, `systemctl daemon-reload`, `systemctl enable --now <its name>`",
             "[Unit]", f"Description={description.replace('%', '%%')}", "Wants=network-online.target", "After=network-online.target",
             "StartLimitIntervalSec=900", "StartLimitBurst=5", "",
             "[Service]", "Type=exec", f"User={workdir.owner()}", f"WorkingDirectory={str(workdir).replace('%', '%%')}",
             "Environment=" + " ".join(_unit_word(f"{k}={v}", command=False) for k, v in env.items()),
             "ExecStart=" + " ".join(_unit_word(a) for a in command),
             "Restart=on-failure", f"RestartSec={int(restart_s)}", "RestartPreventExitStatus=2", "KillSignal=SIGTERM",
             "TimeoutStopSec=30", "NoNewPrivileges=yes", "PrivateTmp=yes", "",
             "[Install]", "WantedBy=multi-user.target"]
    return "\n".join(lines) + "\n"


def fedsilo_command(*args: str) -> list[str]:
    """fedsilo's command line with this Python (the virtual environment fedsilo is installed in)."""
    return [sys.executable, "-m", "fedsilo.cli", *args]


def write_unit(path: Path, text: str) -> Path:
    """Write a unit file whole or not at all."""
    from fedsilo.utils.io import atomic_file

    path = Path(path)
    if not path.parent.is_dir():
        raise ConfigError(f"--systemd-unit: {path.parent} is not a folder")
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return path


def supernode_command(params_file: Path, experiment: str, root: Path, superlink: str, root_certificates: Path,
                      auth_key: Path, port: int = 9094, host: str = "127.0.0.1") -> list[str]:
    """The ``flower-supernode`` command of a site: TLS against the federation's CA, its authentication key, the
    node config that tells the ClientApp where the site's params and data are, and its own Runtime API port."""
    node_config = f'params="{Path(params_file).resolve()}" experiment="{experiment}" root="{Path(root).resolve()}"'
    return ["flower-supernode", "--superlink", superlink, "--root-certificates", str(Path(root_certificates).resolve()),
            "--auth-supernode-private-key", str(Path(auth_key).resolve()), "--node-config", node_config,
            "--host", host, "--port", str(port)]
