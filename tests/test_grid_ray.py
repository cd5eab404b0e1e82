"""`fedsilo grid --ray`: a pipeline's stages as Ray tasks on a two-node cluster on loopback (two raylets, two object
stores; the second node declares one GPU), results through a DVC remote: each stage runs once, on a worker, then
`dvc repro` here restores it from the remote's run-cache, runs the report, and leaves `dvc status` clean; a GPU run
lands on the GPU node with CUDA_VISIBLE_DEVICES set by Ray; a failing stage stops the grid naming it; what travels
to the workers is the workspace's code and params, never ignored data or .dvc/config.local."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from fedsilo.grid import GridError  # noqa: E402
from fedsilo.grid_ray import bundle, run_grid_ray, worker_inputs  # noqa: E402
from tests.test_grid import _repo as grid_repo  # noqa: E402

PIPE = """
stages:
  raw:
    cmd: python -c "open('raw.txt','w').write(open('dep.txt').read())"
    deps: [dep.txt]
    outs: [raw.txt]
  prep:
    cmd: python -c "open('prep.txt','w').write(open('raw.txt').read())"
    deps: [raw.txt]
    outs: [prep.txt]
  train_g:
    foreach: [a, b, c]
    do:
      cmd: python -c "import os, time; time.sleep(1); open('{log}', 'a').write('${item}\\\\n'); os.makedirs('out', exist_ok=True); open('out/${item}.txt', 'w').write('${item}' + open('prep.txt').read()); {fail}"
      deps: [prep.txt]
      outs:
        - out/${item}.txt
  report:
    cmd: python -c "import glob; open('report.txt', 'w').write(''.join(sorted(open(f).read() for f in glob.glob('out/*.txt'))))"
    deps: [out]
    outs: [report.txt]
"""


def _dvc(*args: str, cwd: Path) -> str:
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _repo(tmp: Path, fail: str = "None", sub: bool = False, items: str = "[a, b, c]") -> Path:
    """test_grid's repository with this file's pipeline (its log in ``tmp``; ``items``: the train stages) and a local
    default remote, plus what must never reach a worker."""
    pipe = PIPE.replace("{log}", str(tmp / "runs.log")).replace("[a, b, c]", items)
    repo = grid_repo(tmp, fail, sub, pipe=pipe, remote=tmp / "remote")
    # never sent to a worker: credentials of this machine, data git ignores
    (repo / ".dvc" / "config.local").write_text("['remote \"vault\"']\n    url = https://dvc.example.invalid/store\n"
                                                "    password = not-for-workers\n")
    (repo / "ignored-data.bin").write_bytes(b"\0" * 64)
    (repo / ".gitignore").write_text("/ignored-data.bin\n")
    return repo


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1, num_gpus=1, resources={"second_node": 1})  # a GPU Ray schedules; the stages never touch it
    c.wait_for_nodes()
    yield c
    c.shutdown()


def test_the_workspace_sent_to_workers_has_code_params_and_locks_but_no_credentials_or_data(tmp_path):
    repo = _repo(tmp_path)
    _dvc("repro", "prep", cwd=repo)
    names = tarfile.open(fileobj=io.BytesIO(bundle(repo)), mode="r:gz").getnames()
    assert {"dvc.yaml", "dep.txt", "dvc.lock", ".dvc/config", ".gitignore"} <= set(names)
    assert not {".dvc/config.local", "ignored-data.bin", "prep.txt", "raw.txt"} & set(names)
    assert not any(n.startswith(".dvc/cache") or n.startswith(".git/") for n in names)
    # the workers pull what the stage needs, never the DAG's roots (the fetched sources)
    assert worker_inputs("dvc.yaml", repo, ["train_g@a"]) == ["prep"]  # not "raw", the root
    # a root stage a run reads directly (the root pipeline's code_fingerprint) is pulled, a root upstream of others is not
    dag = ({"d:raw", "d:prep", "d:code", "d:train@a"}, {"d:prep": {"d:raw"}, "d:train@a": {"d:prep", "d:code"}})
    assert worker_inputs("dvc.yaml", repo, ["train@a"], dag) == ["d:code", "d:prep"]


def test_ray_grid_runs_each_stage_once_on_two_nodes_and_leaves_the_pipeline_up_to_date(tmp_path, cluster):
    repo = _repo(tmp_path, sub=True, items="[a, b]")  # where a paper's pipeline lives: pipelines/<paper>/dvc.yaml, run at the root
    pipe = "pipelines/demo/dvc.yaml"
    r = run_grid_ray(pipe, repo, cluster.address, worker_cache=str(tmp_path / "node-cache"), quiet=True)
    assert sorted(r["queued"]) == ["train_g@a", "train_g@b"]
    assert sorted((tmp_path / "runs.log").read_text().split()) == ["a", "b"]  # each once, by a worker
    assert len({x["node"] for x in r["runs"]}) == 2  # one CPU a node, one a run, both at once: both nodes worked
    assert all(x["omp_num_threads"] == "1" for x in r["runs"])  # a run's threads = the CPUs it reserved
    assert all(x["cuda_visible_devices"] == "" for x in r["runs"])  # a CPU run sees no GPU, even on the GPU node
    assert not any("train_g" in s for s in r["ran_after"]) and f"{pipe}:report" in r["ran_after"]
    assert (repo / "report.txt").read_text() == "a1b1"
    assert "up to date" in _dvc("status", pipe, cwd=repo)
    assert run_grid_ray(pipe, repo, cluster.address, quiet=True)["queued"] == []  # nothing stale, nothing run
    assert len((tmp_path / "runs.log").read_text().split()) == 2


def test_a_run_this_machines_run_cache_holds_is_restored_here_not_trained_on_a_node(tmp_path, cluster):
    """Runs finished here for inputs since changed and changed back: the nodes see the remote's run-cache only and
    trained them again; now they are restored here (DVC runs no command under the shell `false`) and only the others
    go to the cluster."""
    repo = _repo(tmp_path, items="[a, b]")
    log = tmp_path / "runs.log"
    assert sorted(run_grid_ray("dvc.yaml", repo, cluster.address, worker_cache=None, quiet=True)["queued"]) == ["train_g@a", "train_g@b"]
    # inputs never seen: nothing to restore, nothing run, and the previous results back in place (DVC removed them)
    from fedsilo.grid import restore_cached, tracking_env

    (repo / "dep.txt").write_text("3")
    _dvc("repro", "prep", cwd=repo)
    assert restore_cached("dvc.yaml", repo, ["train_g@a", "train_g@b"], tracking_env(None, repo)) == []
    assert (repo / "out" / "a.txt").read_text() == "a1" and len(log.read_text().split()) == 2
    (repo / "dep.txt").write_text("2")
    assert run_grid_ray("dvc.yaml", repo, cluster.address, worker_cache=str(tmp_path / "node-cache"), quiet=True)["restored_here"] == []
    assert len(log.read_text().split()) == 4
    (repo / "dep.txt").write_text("1")  # back: both runs of the first grid are in this machine's run-cache
    said: list[str] = []
    r = run_grid_ray("dvc.yaml", repo, cluster.address, worker_cache=None, quiet=True, log=said.append)
    assert r["queued"] == [] and sorted(r["restored_here"]) == ["train_g@a", "train_g@b"] and r["runs"] == []
    assert len(log.read_text().split()) == 4  # nothing trained again, here or on a node
    assert (repo / "report.txt").read_text() == "a1b1" and "up to date" in _dvc("status", cwd=repo)
    assert "grid: 2 stage(s) restored from this machine's run-cache, not sent to the cluster" in said
    # this machine's run-cache gone (another checkout), the nodes' worker cache holds the runs for dep 2: they are
    # restored there, not trained again, and the grid says so
    import shutil

    shutil.rmtree(repo / ".dvc" / "cache" / "runs")
    (repo / "dep.txt").write_text("2")
    said.clear()
    r = run_grid_ray("dvc.yaml", repo, cluster.address, worker_cache=str(tmp_path / "node-cache"), quiet=True, log=said.append)
    assert sorted(r["queued"]) == ["train_g@a", "train_g@b"] and all(x["restored_from_run_cache"] for x in r["runs"])
    assert len(log.read_text().split()) == 4
    assert "grid: 2 stage(s) restored from a node's run-cache, not trained again: train_g@a, train_g@b" in said


def test_a_node_whose_worker_cache_ran_a_stage_before_restores_it_and_says_so(tmp_path):
    """run_stage as a node runs it (no cluster needed): the second run of the same stage and inputs through the same
    worker cache is DVC's "is cached", reported as restored_from_run_cache, and its command does not run again."""
    from fedsilo.grid_ray import run_stage

    repo = _repo(tmp_path, items="[a]")
    _dvc("repro", "prep", cwd=repo)
    _dvc("push", "prep", cwd=repo)
    workspace, cache = bundle(repo), str(tmp_path / "node-cache")
    first = run_stage(workspace, "dvc.yaml", "train_g@a", ["prep"], {}, cache)
    second = run_stage(workspace, "dvc.yaml", "train_g@a", ["prep"], {}, cache)
    assert (first["restored_from_run_cache"], second["restored_from_run_cache"]) == (False, True)
    assert (tmp_path / "runs.log").read_text().split() == ["a"]  # trained once
    # a fresh worker cache has no run-cache: the stage trains
    assert run_stage(workspace, "dvc.yaml", "train_g@a", ["prep"], {}, str(tmp_path / "other-cache"))["restored_from_run_cache"] is False
    assert (tmp_path / "runs.log").read_text().split() == ["a", "a"]


def test_a_gpu_run_lands_on_the_gpu_node_with_the_device_ray_granted(tmp_path, cluster):
    repo = _repo(tmp_path, items="[a, b]")  # two runs, one after the other on the one GPU
    r = run_grid_ray("dvc.yaml", repo, cluster.address, gpus_per_run=1, worker_cache=None, quiet=True)
    gpu_node = next(n["node"] for n in r["nodes"] if n["resources"].get("GPU"))
    assert len(r["runs"]) == 2 and {x["node"] for x in r["runs"]} == {gpu_node}  # never the CPU-only head node
    assert {x["cuda_visible_devices"] for x in r["runs"]} == {"0"}
    assert "up to date" in _dvc("status", cwd=repo)
    with pytest.raises(GridError, match="--gpus-per-run 2 but no node of the cluster has"):
        (repo / "dep.txt").write_text("2")  # stale again
        run_grid_ray("dvc.yaml", repo, cluster.address, gpus_per_run=2, quiet=True)


def test_a_failing_ray_run_stops_the_grid_naming_it_and_leaves_the_lock_alone(tmp_path, cluster):
    repo = _repo(tmp_path, fail="exit(3) if '${item}' == 'b' else None", items="[a, b]")
    with pytest.raises(GridError, match=r"1 of 2 Ray runs failed: train_g@b") as e:
        run_grid_ray("dvc.yaml", repo, cluster.address, worker_cache=None, quiet=True)
    assert "dvc repro of train_g@b failed" in str(e.value)
    assert "train_g" not in (repo / "dvc.lock").read_text() and not (repo / "report.txt").exists()


def test_after_its_runs_the_ray_grid_ends_the_mlflow_runs_whose_process_died_on_each_node(tmp_path, cluster, monkeypatch):
    """A run SIGKILLed on a node stays RUNNING (its workspace copy, and so its checkpoint, are gone): after the grid's
    runs, each live node marks KILLED the runs its own host started whose process is gone; a live one is left."""
    import socket

    from mlflow.entities import RunTag

    from tests.conftest import killed_and_live_runs

    t, uri, killed, live = killed_and_live_runs(tmp_path, monkeypatch, "train_g@z-seed0")
    said: list[str] = []
    repo = _repo(tmp_path, items="[a]")
    run_grid_ray("dvc.yaml", repo, cluster.address, tracking_uri=uri, worker_cache=None, quiet=True, log=said.append)
    assert t.client.get_run(killed).info.status == "KILLED" and t.client.get_run(live).info.status == "RUNNING"
    assert any("1 MLflow run(s) whose process died marked KILLED: train_g@z-seed0 on " in x for x in said), said
    # a store the nodes reach (an MLflow server's; here the loopback cluster's one disk): each live node asked at once
    from fedsilo.grid_ray import end_stale_on_nodes

    again = t.start("demo", "train_g@y-seed0", {}, {})
    t.client.log_batch(again, tags=[RunTag("fedsilo.pid", t.client.get_run(killed).data.tags["fedsilo.pid"])])  # a dead pid
    ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")
    try:
        assert end_stale_on_nodes(ray, uri, said.append, nodes=True) == [f"train_g@y-seed0 on {socket.gethostname()}"]
    finally:
        ray.shutdown()
    assert t.client.get_run(again).info.status == "KILLED" and t.client.get_run(live).info.status == "RUNNING"


def test_without_a_default_remote_the_ray_grid_says_how_to_add_one(tmp_path):
    repo = _repo(tmp_path)
    _dvc("remote", "default", "--unset", cwd=repo)
    with pytest.raises(GridError, match="no default DVC remote.*dvc remote add -d"):
        run_grid_ray("dvc.yaml", repo, "127.0.0.1:1", quiet=True)


def test_an_address_nothing_answers_at_is_refused_at_once_naming_it(tmp_path):
    """A wrong port left Ray retrying its GCS connection for minutes with no word of fedsilo's."""
    import socket

    from fedsilo.grid_ray import check_address

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(GridError, match=rf"grid --ray 127.0.0.1:{port}: nothing answers at 127.0.0.1:{port}; start the head node"):
        check_address(f"127.0.0.1:{port}")
    check_address("auto")  # Ray's to resolve


class _FakeRay:
    """What end_stale_on_nodes and _check_cluster ask of Ray: its nodes, and remote calls on them that answer at once,
    fail, or never answer."""

    def __init__(self, nodes, answers=None):
        self._nodes, self.answers, self.asked = nodes, answers or {}, []

    def nodes(self):
        return self._nodes

    def remote(self, fn):
        ray_ = self

        class Task:
            def options(self, scheduling_strategy=None, **_):
                node = scheduling_strategy.node_id

                class Bound:
                    def remote(self, uri):
                        ray_.asked.append((node, uri))
                        return node
                return Bound()
        return Task()

    def wait(self, refs, num_returns, timeout):
        return [r for r in refs if self.answers.get(r) != "late"], [r for r in refs if self.answers.get(r) == "late"]

    def get(self, ref):
        if isinstance(self.answers.get(ref), Exception):
            raise self.answers[ref]
        return self.answers.get(ref, [])


def _nid(i: int) -> str:
    return f"{i:056x}"  # a node id as Ray writes it (28 bytes in hex)


def _node(i, alive=True, cpus=2.0, gpus=0.0, host=None):
    return {"NodeID": _nid(i), "NodeManagerAddress": host or f"10.0.0.{i}", "Alive": alive, "Resources": {"CPU": cpus, "GPU": gpus}}


def test_stale_runs_are_ended_here_for_a_file_store_and_on_every_live_node_for_a_server(monkeypatch):
    import fedsilo.grid_ray as gr

    monkeypatch.setattr(gr, "end_stale_here", lambda uri: [f"here {uri}"])
    fake = _FakeRay([_node(1), _node(2), _node(3, alive=False)])
    for uri in ("sqlite:///mlflow.db", "file:///tmp/mlruns", "mlruns"):  # a store this machine alone holds
        assert gr.end_stale_on_nodes(fake, uri, print) == [f"here {uri}"] and not fake.asked
    said: list[str] = []
    fake = _FakeRay([_node(1), _node(2), _node(3, alive=False), _node(4), _node(5, host="10.0.0.9")],
                    {_nid(1): ["r on h1"], _nid(2): ["r on h1", "s on h2"], _nid(4): RuntimeError("gone"), _nid(5): "late"})
    ended = gr.end_stale_on_nodes(fake, "http://mlflow:5000", said.append)
    assert sorted(n for n, _ in fake.asked) == [_nid(i) for i in (1, 2, 4, 5)]  # every live node, the dead one not
    assert ended == ["r on h1", "s on h2"]  # two nodes of one machine find its runs once
    assert any("could not look for MLflow runs left RUNNING on 10.0.0.4 (RuntimeError: gone)" in x for x in said), said
    assert any("10.0.0.9 did not say within 120 s" in x for x in said), said


def test_the_cluster_check_refuses_too_few_resources_and_warns_of_a_file_store_across_hosts():
    from fedsilo.grid_ray import _check_cluster

    said: list[str] = []
    two_hosts = _FakeRay([_node(1, cpus=2, gpus=1), _node(2, cpus=4), _node(3, alive=False, cpus=64, gpus=8)])
    assert [n["NodeID"] for n in _check_cluster(two_hosts, 4, 1, "sqlite:///m.db", said.append)] == [_nid(1), _nid(2)]
    assert len(said) == 1 and "a file on this machine, but the cluster spans 2 hosts (10.0.0.1, 10.0.0.2)" in said[0]
    with pytest.raises(GridError, match="--gpus-per-run 2 but no node of the cluster has that many GPUs \\(the most: 1"):
        _check_cluster(two_hosts, 1, 2, None, said.append)  # the dead node's 8 do not count
    with pytest.raises(GridError, match="--cpus-per-run 5 but the largest node has 4 CPUs"):
        _check_cluster(two_hosts, 5, 0, None, said.append)
    said.clear()
    one_host = _FakeRay([_node(1, host="h"), _node(2, host="h")])  # two raylets of one machine reach its file
    _check_cluster(one_host, 1, 0, "sqlite:///m.db", said.append)
    _check_cluster(two_hosts, 1, 0, "http://mlflow:5000", said.append)
    assert said == []


def test_nonpositive_cpus_or_negative_gpus_per_run_are_refused_and_an_oversized_workspace_is_named(tmp_path, monkeypatch):
    import fedsilo.grid_ray as gr

    for kw in ({"cpus_per_run": 0}, {"cpus_per_run": -1}, {"gpus_per_run": -0.5}):
        with pytest.raises(GridError, match="--cpus-per-run must be > 0 and --gpus-per-run >= 0"):
            run_grid_ray("dvc.yaml", tmp_path, "127.0.0.1:1", quiet=True, **kw)
    repo = _repo(tmp_path)
    (repo / "big.txt").write_bytes(b"x" * 4096)  # tracked or not, git does not ignore it
    monkeypatch.setattr(gr, "BUNDLE_LIMIT", 2048)
    with pytest.raises(GridError, match="the workspace to send to the workers passed 0 MiB at big.txt"):
        bundle(repo)
