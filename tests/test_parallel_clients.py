"""Clients trained at once (``train.parallel_clients``): every method's numbers equal a one-at-a-time run with as many
threads per client; the clients of a wave really train at the same time, on their own copies of the model; methods
that keep per-call state on themselves train one at a time; FLOPs, threads and failures are handled."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import logging
import re
import threading
from pathlib import Path

import pytest
import torch

from fedsilo.config import TrainParams
from fedsilo.fl.continual import ContinualEngine
from fedsilo.fl.engine import Engine
from fedsilo.methods import REGISTRY, method_class
from fedsilo.methods.base import Method
from fedsilo.methods.fedavg import FedAvg
from fedsilo.models import build_model
from tests.tiny import style_shifted_federation, style_stream, tiny_net, without_timing

RESNET = {"f2dc", "fedrcl", "fdse"}  # methods built on a ResNet's blocks
# pFedDB's federated phase from round 1 (what repeats every round), its shared branch a copy of the tiny backbone
PARAMS = {"pfeddb": {"two_phase": False, "branch_init": "same"}}
STATIC = sorted(m for m, cls in REGISTRY.items() if not cls.stream_only)
# the stream methods that train clients at once (those that do not are the same run either way)
STREAM = sorted(m for m, cls in REGISTRY.items() if cls.task_stream and cls.client_parallel)


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _clients():
    return style_shifted_federation(n_train=12, n_test=6, per_domain=1)[:3]


def _engine(name, k, cls=None, rounds=2, **train):
    cls = cls or method_class(name)
    resnet = name in RESNET
    tp = TrainParams(model="resnet10" if resnet else "simple_cnn", rounds=rounds, batch_size=6, lr=0.05, momentum=0.5,
                     device="cpu", parallel_clients=k, eval_every=rounds, **{"count_flops": False, **train})
    model = build_model("resnet10", 1, 4, seed=0, image_size=16) if resnet else tiny_net(1, 4)
    return Engine(cls(cls.params_cls(**PARAMS.get(name, {})), tp), model, _clients(), tp, seed=0)


def _same_state(a, b):
    """Equal tensor by tensor, bit for bit (NaN where the other has NaN: pFedDIL's intensities not yet measured)."""
    def same(x, y):
        return x.shape == y.shape and (torch.equal(x, y) or (x.is_floating_point() and torch.equal(x.isnan(), y.isnan())
                                                              and torch.equal(x.nan_to_num(), y.nan_to_num())))
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


def _of_another_site(engine) -> list[tuple[str, str, str]]:
    """The keys of what the server sends each site, to train (``download``) and to be evaluated (``eval_download``),
    that name another site (by name, or by index as ``<prefix>:<index>::``): the server's bookkeeping of a site, or
    its own part, goes to that site only."""
    out = []
    for c in engine.clients:
        sent = {"download": engine.method.download(engine.server, c, engine.round + 1),
                "eval": engine.method.eval_download(engine.server, c)}
        for part, payload in sent.items():
            out += [(c.name, part, k) for k in payload for o in engine.clients
                    if o is not c and (o.name in k or re.search(rf"(^|:){o.index}::", k))]
    return out


@pytest.mark.parametrize("name", STATIC)
def test_every_method_gives_the_numbers_of_one_client_at_a_time(name, one_thread):
    """Also: nothing the server sends a site, after those rounds, names another site (:func:`_of_another_site`)."""
    one, two = _engine(name, 1), _engine(name, 2)
    h1, h2 = one.run(), two.run()
    assert two.parallel == (2 if REGISTRY[name].client_parallel else 1)
    assert without_timing(h1) == without_timing(h2)
    assert _same_state(one.server, two.server)
    assert all(_same_state(s1, s2) for s1, s2 in zip(one.stores, two.stores))
    assert not _of_another_site(two), _of_another_site(two)[:4]


@pytest.mark.parametrize("case", ["host_augment", "decouple_finetune", "moon_own_init"])
def test_options_that_draw_per_client_give_the_numbers_of_one_client_at_a_time(case, one_thread):
    """An albumentations policy (re-seeded per batch: one per thread), FT-FedAvg with F²DC's modules (the
    fine-tuning's mask noise seeded per client, not left from whichever client trained last), and MOON's own-init
    previous models (drawn per client, not from a generator two threads reseed at once)."""
    def run(k):
        train = {"augment": {"host": [{"name": "Affine", "rotate": [-20, 20], "p": 1.0}]}} if case == "host_augment" else {}
        params = {"decouple_finetune": {"decouple": {}, "finetune_epochs": 1}, "moon_own_init": {"first_previous": "own_init"}}.get(case, {})
        cls = method_class("moon" if case == "moon_own_init" else "fedavg")
        tp = TrainParams(rounds=2, batch_size=6, lr=0.05, momentum=0.5, device="cpu", parallel_clients=k, count_flops=False, **train)
        e = Engine(cls(cls.params_cls(**params), tp), tiny_net(1, 4), _clients(), tp, seed=0)
        return e, e.run()

    (one, h1), (two, h2) = run(1), run(2)
    assert two.parallel == 2 and without_timing(h1) == without_timing(h2)
    assert _same_state(one.server, two.server)


@pytest.mark.parametrize("name", STREAM)
def test_every_stream_method_gives_the_numbers_of_one_client_at_a_time(name, one_thread):
    """A stream of two domain tasks, a round each: what a task's start creates (a head, a model) is in the copies."""
    def run(k):
        tp = TrainParams(rounds=1, batch_size=8, lr=0.05, momentum=0.5, device="cpu", parallel_clients=k, count_flops=False)
        cls = REGISTRY[name]
        e = ContinualEngine(cls(cls.params_cls(), tp), tiny_net(1, 4), style_stream(n_train=12, n_test=6, domains=2),
                            ["S0", "S1"], tp, 0)
        return e, e.run()

    (one, h1), (two, h2) = run(1), run(2)
    assert two.parallel == (2 if REGISTRY[name].client_parallel else 1)
    assert without_timing(h1) == without_timing(h2)
    assert _same_state(one.server, two.server)
    assert all(_same_state(s1, s2) for s1, s2 in zip(one.stores, two.stores))


class _Meeting(FedAvg):
    """FedAvg whose clients wait for each other inside the local update: it finishes only when two train at once."""

    name = "meeting"

    def setup(self, model):
        super().setup(model)
        self.barrier = threading.Barrier(2, timeout=20)
        self.seen: list[tuple[str, int]] = []
        self.engine_model = model

    def local_update(self, model, store, payload, client, rnd, seed):
        self.barrier.wait()
        self.seen.append((threading.current_thread().name, id(model)))
        return super().local_update(model, store, payload, client, rnd, seed)


def test_the_clients_of_a_wave_train_at_the_same_time_on_their_own_models(one_thread):
    clients = style_shifted_federation(n_train=12, n_test=6, per_domain=1)  # four clients: two waves of two
    tp = TrainParams(rounds=1, batch_size=6, device="cpu", parallel_clients=2, count_flops=False)
    algo = _Meeting(_Meeting.params_cls(), tp)
    e = Engine(algo, tiny_net(1, 4), clients, tp, seed=0)
    e.run()  # one at a time, the first client would wait at the barrier until it breaks
    threads = {t for t, _ in algo.seen}
    models = {m for _, m in algo.seen}
    assert len(algo.seen) == 4 and len(threads) == 2 and all(t.startswith("fedsilo-client") for t in threads)
    assert id(e.model) not in models and len(models) == 2  # a copy of the model per worker, made for the round
    assert set(e.history[0]["train_loss"]) == {c.name for c in clients}  # each client's own loss, from its thread
    assert all(v is not None for v in e.history[0]["train_loss"].values())


def test_a_method_that_keeps_per_call_state_trains_one_client_at_a_time(caplog):
    for name in ("cd2pfed", "fedlgf"):
        assert not REGISTRY[name].client_parallel
        with caplog.at_level(logging.WARNING, logger="fedsilo.fl.engine"):
            e = _engine(name, 3, rounds=1)
        assert e.parallel == 1 and e.execution() == {"parallel_clients": 1, "threads": torch.get_num_threads()}
        assert f"{REGISTRY[name].name} trains its clients one at a time" in caplog.text


def test_the_run_threads_are_shared_among_a_wave_and_given_back():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        inside: list[int] = []

        class Counting(FedAvg):
            name = "counting"

            def local_update(self, model, store, payload, client, rnd, seed):
                inside.append(torch.get_num_threads())
                return super().local_update(model, store, payload, client, rnd, seed)

        e = _engine("counting", 2, cls=Counting, rounds=1)
        assert e.client_threads() == 1 and e.execution() == {"parallel_clients": 2, "threads": 2, "threads_per_client": 1}
        e.run()
        assert inside == [1, 1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_flops_are_counted_in_the_worker_threads(one_thread):
    one = _engine("fedavg", 1, rounds=1, count_flops=True).run()[-1]["train_flops"]
    two = _engine("fedavg", 2, rounds=1, count_flops=True).run()[-1]["train_flops"]
    assert one > 0 and two == one


def test_a_client_that_fails_in_a_wave_stops_the_run_after_the_others_finish(one_thread):
    done: list[str] = []

    class Failing(FedAvg):
        name = "failing"

        def local_update(self, model, store, payload, client, rnd, seed):
            if client.index == 0:
                raise RuntimeError(f"client {client.name} lost its disk")
            up = super().local_update(model, store, payload, client, rnd, seed)
            done.append(client.name)
            return up

    e = _engine("failing", 2, cls=Failing, rounds=1)
    with pytest.raises(RuntimeError, match="lost its disk"):
        e.run()
    assert done == [e.clients[1].name] and e.round == 0 and torch.get_num_threads() == 1


def test_compiled_models_are_not_trained_from_several_threads():
    with pytest.raises(ValueError, match="parallel_clients: torch.compile"):
        TrainParams(compile=True, parallel_clients=2)
    with pytest.raises(ValueError):
        TrainParams(parallel_clients=0)


# hooks the engine calls from its own thread only (server side, set-up, evaluation)
MAIN_THREAD = {"__init__", "setup", "join", "set_tasks", "transform_model", "init_server", "init_client", "on_round_start",
               "on_task_start", "download", "hear", "aggregate", "agg_begin", "agg_add", "agg_end", "shared_keys",
               "load_eval_model", "eval_state", "global_state", "predict_task", "resolved"}


def test_methods_trained_in_parallel_keep_nothing_on_themselves_during_a_local_update():
    """A method class that allows client-parallel training assigns no attribute of itself outside the engine's own
    thread's hooks (but last_loss, kept per thread): the next method to keep, say, a hook's capture on ``self`` must
    set ``client_parallel = False`` or keep it per model (``Spares``)."""
    offenders = []
    for cls in {c for c in REGISTRY.values() if c.client_parallel}:
        for klass in cls.__mro__:
            if klass in (Method, object) or not issubclass(klass, Method):
                continue
            src = Path(inspect.getsourcefile(klass)).read_text()
            node = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef) and n.name == klass.__name__)
            for f in node.body:
                if not isinstance(f, ast.FunctionDef) or f.name in MAIN_THREAD:
                    continue
                for n in ast.walk(f):
                    targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
                    for t in targets:
                        base = t.value if isinstance(t, ast.Subscript) else t
                        if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id == "self" and base.attr != "last_loss":
                            offenders.append(f"{klass.__name__}.{f.name}: self.{base.attr}")
    assert not offenders, offenders


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_each_client_of_a_wave_has_its_own_stream_and_the_numbers_do_not_change():
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    streams: list[int] = []

    class OnStreams(FedAvg):
        name = "on_streams"

        def local_update(self, model, store, payload, client, rnd, seed):
            streams.append(torch.cuda.current_stream().cuda_stream)
            return super().local_update(model, store, payload, client, rnd, seed)

    def run(k):
        clients = [dataclasses.replace(c, x_train=c.x_train.cuda(), y_train=c.y_train.cuda(), x_test=c.x_test.cuda(), y_test=c.y_test.cuda())
                   for c in style_shifted_federation(n_train=24, n_test=6, per_domain=2)]
        tp = TrainParams(rounds=2, batch_size=8, lr=0.05, momentum=0.5, device="cuda", amp="off", parallel_clients=k, count_flops=False)
        e = Engine(OnStreams(OnStreams.params_cls(), tp), tiny_net(1, 4).cuda(), clients, tp, seed=0)
        return e, e.run()

    (one, h1), (four, h4) = run(1), run(4)
    default = torch.cuda.default_stream().cuda_stream
    assert set(streams[:16]) == {default} and len(set(streams[16:])) == 4 and default not in streams[16:]
    assert without_timing(h1) == without_timing(h4) and _same_state(one.server, four.server)


def test_a_train_stage_with_clients_at_once_records_it_and_gives_the_same_numbers(mirror_root, tmp_path, one_thread, monkeypatch):
    """Through ``run_training`` (what ``dvc repro`` runs): metrics.json's engine block says what ran, and the history
    equals the one-at-a-time run's; K is a parameter, so the two runs have their own hash. The K = 2 run also asks for
    deterministic kernels (``train.deterministic``), which the stage turns on (on the CPU: the same numbers)."""
    import shutil

    import yaml

    from fedsilo.cli import main
    from fedsilo.config import parse_params
    from fedsilo.fl import run as run_module
    from fedsilo.fl.run import run_training

    turned_on: list[bool] = []
    monkeypatch.setattr(run_module, "deterministic_kernels", lambda: turned_on.append(True))  # process-wide: not in a test worker
    from fedsilo.utils.io import read_json
    from tests.conftest import small_params

    out = {}
    for k in (1, 2):
        root = tmp_path / f"k{k}"
        shutil.copytree(mirror_root / "data", root / "data")
        raw = small_params(rounds=2, parallel_clients=k, deterministic=k == 2)
        (root / "p.yaml").write_text(yaml.safe_dump(raw))
        assert main(["--root", str(root), "--params", str(root / "p.yaml"), "split", "--experiment", "quick"]) == 0
        run_training(parse_params(raw), "quick", "fedbn", 0, root, quiet=True)
        run = root / "results" / "quick" / "fedbn" / "seed0"
        out[k] = (read_json(run / "metrics.json"), json.loads((run / "history.json").read_text()))
    threads = torch.get_num_threads()  # the run's, on the CPU: a CPU's float sums follow it
    assert out[1][0]["engine"] == {"parallel_clients": 1, "threads": threads}
    assert out[2][0]["engine"] == {"parallel_clients": 2, "threads": threads, "threads_per_client": max(1, threads // 2)}
    assert out[1][0]["params_hash"] != out[2][0]["params_hash"]
    assert turned_on == [True]
    assert without_timing(out[1][1]) == without_timing(out[2][1]) and out[1][0]["mean_acc"] == out[2][0]["mean_acc"]
