"""fedsilo reaches only the addresses a user names: the libraries it drives are told not to phone home (MLflow's
telemetry, albumentations' version check, DVC's analytics and update check, Flower's telemetry). A hospital's site
and an offline GPU machine make no call of their own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# MLflow keeps its telemetry off where any of these is set (CI, pytest): a user's shell has none of them
MLFLOW_CI_MARKERS = ("PYTEST_CURRENT_TEST", "GITHUB_ACTIONS", "CI", "CIRCLECI", "GITLAB_CI", "JENKINS_URL", "TRAVIS", "TF_BUILD",
                     "BITBUCKET_BUILD_NUMBER", "CODEBUILD_BUILD_ARN", "BUILDKITE", "TEAMCITY_VERSION", "CLOUD_RUN_EXECUTION")


def _lookups(tmp_path: Path, first_imports: tuple[str, ...]) -> list[set[str]]:
    """Per entry of ``first_imports``, the host names a fresh interpreter looks up while it logs an MLflow run (local
    SQLite) and builds an albumentations policy after that import; its name lookups and connections are recorded and
    refused. The interpreters run at once (each mostly imports and makes its store)."""
    env = {k: v for k, v in os.environ.items() if k not in MLFLOW_CI_MARKERS and k not in ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK",
                                                                                        "NO_ALBUMENTATIONS_UPDATE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    started = []
    for k, first_import in enumerate(first_imports):
        record = tmp_path / f"lookups-{k}.txt"
        code = (
            "import socket, time\n"
            "def refuse(*a, **k):\n"
            f"    open({str(record)!r}, 'a').write(str(a[0][0] if isinstance(a[0], tuple) else a[0]) + '\\n')\n"
            "    raise OSError('offline')\n"
            "socket.getaddrinfo = socket.create_connection = refuse\n"
            f"{first_import}\n"
            "import albumentations, mlflow\n"
            f"mlflow.set_tracking_uri('sqlite:///{tmp_path / f'store-{k}.db'}')\n"
            "with mlflow.start_run():\n"
            "    mlflow.log_metric('acc', 0.5)\n"
            "time.sleep(0.5)\n"
        )
        started.append((record, subprocess.Popen([sys.executable, "-c", code], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                                                 stderr=subprocess.PIPE, text=True)))
    out = []
    try:
        for record, proc in started:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-2000:]
            out.append(set(record.read_text().split()) if record.exists() else set())
    finally:
        for _, proc in started:  # one that failed or hung ends with the test
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


def test_training_libraries_make_no_network_call_once_fedsilo_is_imported(tmp_path):
    # the control: without fedsilo, the same work looks up MLflow's telemetry host and PyPI (the recorder works)
    control, with_fedsilo = _lookups(tmp_path, ("pass", "import fedsilo"))
    # each library's own host, by name (MLflow's lookup runs in a thread of its own: named, it cannot pass unseen)
    assert control >= {"config.mlflow-telemetry.io", "pypi.org"}, f"the control looked up {control}: nothing left to catch?"
    assert with_fedsilo == set()


def test_the_repository_dvc_config_turns_off_dvc_analytics_and_its_update_check(monkeypatch):
    from dvc import analytics
    from dvc.updater import Updater

    for name in ("DVC_TEST", "DVC_NO_ANALYTICS"):  # the committed .dvc/config alone
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(ROOT)
    assert analytics.is_enabled() is False
    assert Updater(str(ROOT / ".dvc" / "tmp")).is_enabled() is False
