"""Task streams over Flower (fl/flower.py, FlowerStream): each site holds its data of every task, and the run gives
the in-process ContinualEngine's numbers, through the ClientApp and its messages (a stand-in Grid in this process;
tests/test_deploy.py runs a stream with the deployment's own apps)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402

from fedsilo.config import ConfigError, TrainParams  # noqa: E402
from fedsilo.fl.continual import ContinualEngine, continual_summary  # noqa: E402
from fedsilo.fl.flower import ClientFailed, FlowerRun, FlowerSpec, FlowerStream, client_app  # noqa: E402
from fedsilo.methods.registry import REGISTRY, stream_methods  # noqa: E402
from tests.test_flower import LoopGrid, identity  # noqa: E402,F401 - the fixture
from tests.tiny import style_stream, tiny_net, without_timing  # noqa: E402

pytestmark = pytest.mark.usefixtures("identity")  # messages take their run and node from Flower's task identity

NAMES = ["S0", "S1", "S2"]
# a third of the clients sit out each round: pFedDIL's task end skips a site that took no part in the task
TRAIN = {"rounds": 2, "local_epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.9, "count_flops": False,
         "device": "cpu", "client_fraction": 0.67}
# each method's distinguishing parameters, at a test's size (FedCIL's generator trains a few steps)
PARAMS = {"fedcil": {"gen_channels": 8, "md_iter": 2, "gen_batch": 8, "lr": 2e-3}}


def _model():
    return tiny_net(1, 4)


def _stream(n_clients: int = 3):
    return style_stream(n_clients=n_clients, n_train=24, n_test=12, domains=len(NAMES))


def _loop(spec: FlowerSpec, sites: list, grid: Callable[..., LoopGrid] = LoopGrid, keep: Optional[Callable] = None,
          run_id: int = 1, **run_kw: Any) -> tuple[FlowerRun, LoopGrid]:
    """The run (``FlowerRun(spec, ..., **run_kw)``) over a stand-in Grid (``grid(app, n)``) in Flower run ``run_id``:
    node k holds ``sites[k]`` (a stream: its client of each task); ``keep``: the sites' folders for their stores."""
    run = FlowerRun(spec, len(sites), **run_kw)
    g = grid(client_app(spec, lambda ctx: sites[int(ctx.node_config["partition-id"])], keep_dir=keep), len(sites))
    for c in g.contexts.values():
        c.run_id = run_id
    run.main(g, Context(run_id=run_id, node_id=0, node_config={}, state=RecordDict(), run_config={}))  # type: ignore[arg-type]
    return run, g


def _method(name: str, train: TrainParams):
    cls = REGISTRY[name]
    return cls(cls.params_cls(**PARAMS.get(name, {})), train, key=name)


@pytest.mark.parametrize("name", stream_methods())
def test_a_stream_over_flower_gives_the_continual_engines_numbers(name):
    """Every stream method: the same sampled sites, evaluations of every task seen, pooled accuracies, bytes (task
    ends included), storage and losses as the engine, and so the same accuracy matrix and forgetting."""
    train = TrainParams(**TRAIN)
    tasks = _stream()
    down: list = []
    reference = ContinualEngine(_method(name, train), _model(), tasks, NAMES, train, 0,
                                observer=lambda r, c, d, p: down.append((r, c, sorted(p))) if d == "down" else None)
    expected = without_timing(reference.run())
    sites = [[tasks[t][k] for t in range(len(NAMES))] for k in range(len(tasks[0]))]
    seen: list = []
    run, grid = _loop(FlowerSpec.of(_method(name, train), _model, 0), sites,
                      observer=lambda r, c, d, p: seen.append((r, c, sorted(p))) if d == "down" else None)
    assert isinstance(run.engine, FlowerStream) and run.engine.round == 3 * train.rounds
    got = [{k: v for k, v in h.items() if k not in ("flower_record_bytes", "bytes_eval_down")} for h in without_timing(run.engine.history)]
    assert got == expected
    assert seen == down  # the same downloads, task ends included, to the same sites
    s = continual_summary(run.engine.history, NAMES, train.rounds)
    assert s["accuracy_matrix"] == continual_summary(expected, NAMES, train.rounds)["accuracy_matrix"]
    if name == "pfeddil":  # a task end reached the sites that took part in the task, as its own message
        ends = [h for h in run.engine.history if h.get("task_end")]
        assert all(h["bytes_task_end"] for h in ends)
        assert any(kind == "query.task_end" for kind, _ in grid.replies)
        assert not any(kind == "query.task_end" and arrays for kind, arrays in grid.replies)


def test_a_stream_site_keeps_its_models_home_and_the_server_holds_cards():
    """pFedDIL over Flower: the personalized models, auxiliary classifiers, routes and intensities live in each
    site's node state only; every upload is the one model a site trained, and its announcement."""
    train = TrainParams(**TRAIN)
    tasks = _stream()
    sites = [[tasks[t][k] for t in range(len(NAMES))] for k in range(len(tasks[0]))]
    run, grid = _loop(FlowerSpec.of(_method("pfeddil", train), _model, 0), sites)
    keys = set(_model().state_dict())
    ups = [arrays for kind, arrays in grid.replies if kind == "train"]
    assert ups and all(set(a) == {"up"} and a["up"] == keys for a in ups)
    said = [arrays for kind, arrays in grid.replies if kind == "query.announce"]
    assert said and all(a == {"said": {"family"}} for a in said)
    for ctx in grid.contexts.values():
        store = ctx.state.array_records["fedsilo.store"]
        assert {"route", "rho"} <= set(store.keys()) and any(k.startswith("slot") for k in store.keys())
    assert all(x.numel() == 0 for task in run.engine.tasks for c in task for x in (c.x_train, c.x_test))  # cards: no image


def test_sites_with_different_streams_or_static_data_are_refused(caplog):
    """Refused once the sites registered, before any round, and every site is told why."""
    train = TrainParams(**TRAIN)
    tasks = _stream()
    sites = [[tasks[t][k] for t in range(len(NAMES))] for k in range(len(tasks[0]))]
    spec = FlowerSpec.of(_method("fedavg", train), _model, 0)
    reordered = [sites[0], sites[1], [sites[2][1], sites[2][0], sites[2][2]]]
    with caplog.at_level("ERROR", logger="fedsilo.flower"), \
            pytest.raises(ConfigError, match=r"the sites' task streams differ: C0: S0 -> S1 -> S2; C1: S0 -> S1 -> S2; C2: S1 -> S0 -> S2"):
        _loop(spec, reordered)
    told = [r.getMessage() for r in caplog.records if "the federation refused this site" in r.getMessage()]
    assert len(told) == 3 and all("the sites' task streams differ" in t for t in told)
    with pytest.raises(ConfigError, match=r"C2: static data"):
        _loop(spec, [sites[0], sites[1], sites[2][0]])
    static = FlowerSpec.of(_method("pfeddil", train), _model, 0)
    with pytest.raises(ConfigError, match=r"methods.pfeddil: pfeddil learns a stream of domain tasks only; these sites hold static data"):
        _loop(static, [s[0] for s in sites])
    fedbn = REGISTRY["fedbn"]
    with pytest.raises(ConfigError, match=r"methods.fedbn: fedbn does not learn a stream of domain tasks; the sites hold task streams"):
        _loop(FlowerSpec.of(fedbn(fedbn.params_cls(), train, key="fedbn"), _model, 0), sites)


def test_a_stream_site_refuses_a_task_its_stream_does_not_hold():
    train = TrainParams(**TRAIN)
    tasks = _stream()
    sites = [[tasks[t][k] for t in range(2)] for k in range(len(tasks[0]))]  # two tasks each
    spec = FlowerSpec.of(_method("fedavg", train), _model, 0)

    class ThirdTask(LoopGrid):  # a server that asks for a task beyond the sites' streams
        def send_and_receive(self, messages, timeout=None):
            for m in messages:
                if m.metadata.message_type == "train":
                    m.content.config_records["fedsilo"]["task"] = 2
            return super().send_and_receive(messages, timeout)

    with pytest.raises(ClientFailed, match=r"client C0: asked for task 2; its stream holds 2 tasks"):
        _loop(spec, sites, grid=ThirdTask)
    assert torch.is_tensor(sites[0][0].x_train)


def test_a_stream_resumed_after_a_task_end_on_restarted_sites_ends_with_the_uninterrupted_numbers(tmp_path, caplog):
    """pFedDIL, checkpointed, each site keeping its stores on its disk: the run goes down in task 1's first round,
    after task 0's end, and runs again on sites whose node state is gone (restarted SuperNodes). A site that sat out
    task 0's last round still kept the task's end in that round: it resumes from that store (its training store of
    round 1 lacks the family model), so the resumed run has the uninterrupted run's numbers."""
    train = TrainParams(**TRAIN)
    tasks = _stream()
    sites = [[tasks[t][k] for t in range(len(NAMES))] for k in range(len(tasks[0]))]
    spec = FlowerSpec.of(_method("pfeddil", train), _model, 0)

    def attempt(folder: str, run_id: int, down_at: int = 0) -> FlowerRun:
        def on_round(entry):
            if entry["round"] == down_at:
                raise ConnectionError("the SuperLink went down")

        return _loop(spec, sites, keep=lambda ctx: tmp_path / folder / "sites" / str(ctx.node_id), run_id=run_id,
                     checkpoint=tmp_path / folder / "checkpoint.pt", config_hash="h", on_round=on_round)[0]

    whole = attempt("whole", 1).engine.history
    # the same run where the site that sat out task 0's last round restarts between that round's task end and its
    # evaluation: its node state is gone, and it scores with the store it kept of the task end (the server names
    # round 2 for it), not its training store of round 1
    sat_out = set(whole[0]["sampled"]) - set(whole[1]["sampled"])
    node = 100 + int(sorted(sat_out)[0][1:])

    class RestartsBeforeEvaluate(LoopGrid):
        restarted = False

        def send_and_receive(self, messages, timeout=None):
            if not self.restarted and any(m.metadata.message_type == "evaluate" and m.metadata.group_id == "2" for m in messages):
                self.contexts[node].state = RecordDict()
                self.restarted = True
            return super().send_and_receive(messages, timeout)

    with caplog.at_level("WARNING", logger="fedsilo.flower"):
        run, grid = _loop(spec, sites, grid=RestartsBeforeEvaluate, keep=lambda ctx: tmp_path / "restart" / "sites" / str(ctx.node_id),
                          checkpoint=tmp_path / "restart" / "checkpoint.pt", config_hash="h")
    assert grid.restarted and [h["eval"] for h in run.engine.history] == [h["eval"] for h in whole]
    # (pFedDIL scores a task's end with the federation's model of the family either way: the store it loaded tells)
    loaded = [r.getMessage() for r in caplog.records if "resumed from its store" in r.getMessage()]
    assert loaded and loaded[0].startswith(f"client {sorted(sat_out)[0]}: resumed from its store of round 2 ")
    with pytest.raises(ConnectionError, match="went down"):
        attempt("resumed", 2, down_at=3)
    resumed = attempt("resumed", 3)
    assert resumed.engine.history[0]["round"] == 1 and len(resumed.engine.history) == len(whole)
    assert sat_out and sat_out <= set(whole[1]["bytes_task_end"])  # the case this test is for
    for key in ("sampled", "eval", "task_acc", "task_acc_pooled", "bytes_up", "bytes_down", "bytes_task_end", "storage", "train_loss"):
        assert [h.get(key) for h in resumed.engine.history] == [h.get(key) for h in whole], key


def test_a_stream_on_flowers_simulation_runtime_gives_the_engines_numbers():
    """`simulate` with each client given as its stream: pFedDIL on Flower's simulation runtime (Ray, one process per
    site) has the continual engine's history, bit for bit (both on one thread per client)."""
    from fedsilo.fl.flower import simulate

    train = TrainParams(**{**TRAIN, "rounds": 1})
    tasks = style_stream(n_clients=2, n_train=24, n_test=12, domains=2)  # two sites: a Ray worker each on two cores
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = without_timing(ContinualEngine(_method("pfeddil", train), _model(), tasks, NAMES[:2], train, 0).run())
    finally:
        torch.set_num_threads(threads)
    history = simulate(_method("pfeddil", train), _model, [[tasks[t][k] for t in range(2)] for k in range(2)], seed=0)
    got = [{k: v for k, v in h.items() if k not in ("flower_record_bytes", "bytes_eval_down")} for h in without_timing(history)]
    assert got == expected and [h["domain"] for h in history] == ["S0", "S1"] and history[-1]["storage"]


def test_a_stream_site_takes_the_task_from_the_round_and_refuses_a_task_end_out_of_place(tmp_path):
    """A server cannot make a site train a round on another task's images, send a task end in a round that ends no
    task, or replay an old task end over the stores a site kept since."""
    train = TrainParams(**TRAIN)
    tasks = _stream()
    sites = [[tasks[t][k] for t in range(len(NAMES))] for k in range(len(tasks[0]))]
    spec = FlowerSpec.of(_method("pfeddil", train), _model, 0)

    class Tampering(LoopGrid):
        def __init__(self, app, n, tamper):
            super().__init__(app, n)
            self.tamper = tamper

        def send_and_receive(self, messages, timeout=None):
            for m in messages:
                self.tamper(m)
            return super().send_and_receive(messages, timeout)

    def run(tamper, keep=None):
        _loop(spec, sites, grid=lambda app, n: Tampering(app, n, tamper), keep=keep)

    def earlier_task(m):  # task 1's first round (3) announced and trained as task 0
        cfg = m.content.config_records.get("fedsilo")
        if cfg is not None and m.metadata.group_id == "3" and m.metadata.message_type in ("query.announce", "train"):
            cfg["task"] = 0

    with pytest.raises(ClientFailed, match=r"round 3 belongs to task 1 \(2 rounds per task\), not task 0; refused"):
        run(earlier_task)

    def early_end(m):  # a task end after round 1 of a two-round task
        if m.metadata.message_type == "train" and m.metadata.group_id == "1":
            m.metadata.message_type = "query.task_end"

    with pytest.raises(ClientFailed, match=r"a task end in round 1, which ends no task \(2 rounds per task\); refused"):
        run(early_end)

    seen: dict = {}

    def replay(m):  # round 2's task end kept aside, sent again in round 4's place
        if m.metadata.message_type == "query.task_end" and m.metadata.group_id == "2":
            seen.setdefault(m.metadata.dst_node_id, m.content)
        if m.metadata.message_type == "query.task_end" and m.metadata.group_id == "4" and m.metadata.dst_node_id in seen:
            m.content = seen[m.metadata.dst_node_id]
            m.metadata.group_id = "2"

    with pytest.raises(ClientFailed, match=r"a task end of round 2, but it kept its store of round [34] already; refused"):
        run(replay, keep=lambda ctx: tmp_path / str(ctx.node_id))
