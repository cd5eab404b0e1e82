"""FedCIL (methods/fedcil.py) on the task stream: ACGAN generative replay of earlier tasks from the second task on,
the server's model consolidation from synthetic data only, consistency enforcement, what travels and its bytes."""

from __future__ import annotations

import torch

from fedsilo.client.data import ClientData
from fedsilo.config import TrainParams
from fedsilo.fl.continual import ContinualEngine
from fedsilo.methods.base import RunningMean, payload_bytes
from fedsilo.methods.continual import take
from fedsilo.methods.fedcil import PREV, ACGANGenerator, FedCIL, feature_tap, last_linear, running_stats_frozen
from fedsilo.methods.registry import REGISTRY
from tests.tiny import finite_stream_summary, resume_mid_run, style_stream, tiny_net, without_timing

NAMES = ["S0", "S1", "S2"]
SMALL = {"gen_channels": 8, "md_iter": 2, "gen_batch": 8, "lr": 2e-3}


def _train(**kw) -> TrainParams:
    base = {"rounds": 2, "local_epochs": 1, "batch_size": 16, "lr": 0.05, "count_flops": False, "device": "cpu"}
    return TrainParams(**{**base, **kw})


def _engine(train: TrainParams | None = None, checkpoint=None, observer=None, **params) -> ContinualEngine:
    train = train or _train()
    method = FedCIL(FedCIL.params_cls(**{**SMALL, **params}), train)
    return ContinualEngine(method, tiny_net(1, 4), style_stream(domains=3), list(NAMES), train, 0,
                           checkpoint=checkpoint, config_hash="h", observer=observer)


def _weights(server) -> dict[str, torch.Tensor]:
    return {k: v for k, v in server.items() if not k.startswith(("labels", "prev"))}


def test_fedcil_is_a_registered_stream_method_with_the_authors_defaults():
    assert REGISTRY["fedcil"] is FedCIL and FedCIL.task_stream
    p = FedCIL.params_cls()
    assert (p.lr, p.beta1, p.beta2, p.weight_decay) == (1e-4, 0.5, 0.99, 1e-5)  # main.py's Adam defaults
    assert (p.md_iter, p.gen_batch, p.importance, p.noise_dim, p.gen_channels) == (100, 32, 0.5, 100, 64)


def test_the_generator_is_the_authors_and_draws_at_the_data_size():
    # the authors' Generator(z_size=110, image_size=32, image_channel_size=1, channel_size=64), counted by hand:
    # fc 110*8192+8192, deconvs 512*256*16+256, 256*128*16+128, 128*64*16+64, 64*1*9+1, BN 2*(512+256+128+64)
    g = ACGANGenerator(10, 100, 1, (32, 32))
    assert sum(p.numel() for p in g.parameters()) == 3_664_769
    for side, drawn in ((16, 16), (28, 32), (32, 32), (64, 32)):
        g = ACGANGenerator(4, 100, 3, (side, side), c=8)
        with torch.no_grad():
            x = g(torch.randn(5, 104))
        assert g.draw == (drawn, drawn) and x.shape == (5, 3, side, side)
        assert float(x.abs().max()) <= 1.0  # tanh: the images' [-1, 1] range


def test_replay_draws_the_previous_global_generator_from_the_second_task_on():
    downs: list[tuple[int, str, bool]] = []

    def observer(rnd, name, way, payload):
        if way == "down":
            downs.append((rnd, name, any(k.startswith(PREV) for k in payload)))

    e = _engine(observer=observer)
    logs, gens, prevs, stores = {}, {}, {}, {}
    while e.round < e.total_rounds:
        e.step()
        logs[e.round] = dict(e.method.batch_log)
        # the server's consolidation: md_iter batches of gen_batch stand-ins, and as many replayed images from task 1 on
        assert e.method.server_log == {"synthetic": 2 * 8, "replay": 0 if e.round <= 2 else 2 * 8}
        gens[e.round] = {k: v.clone() for k, v in take(e.server, "gen.").items()}
        prevs[e.round] = {k: v.clone() for k, v in take(e.server, PREV).items()}
        stores[e.round] = [{k: v.clone() for k, v in take(s, PREV).items()} for s in e.stores]
    for rnd, log in logs.items():
        for c in log.values():
            # task 0 (rounds 1-2): the real batches only; then one replayed image per real one, every batch
            assert c["real"] == 40 and c["replay"] == (0 if rnd <= 2 else 40)
    same = lambda a, b: a.keys() == b.keys() and all(torch.equal(v, b[k]) for k, v in a.items())  # noqa: E731
    # G^{t-1} is the global generator at the end of the previous task, frozen through the task; every client holds
    # it, received once per task at its first round of the task
    assert not prevs[2] and not any(stores[2])
    for rnd, end in ((3, 2), (4, 2), (5, 4), (6, 4)):
        assert same(prevs[rnd], gens[end]) and all(same(s, gens[end]) for s in stores[rnd])
    assert not same(gens[3], gens[2])
    assert [(r, sent) for r, _, sent in downs] == [(r, r in (3, 5)) for r in range(1, 7) for _ in range(3)]


def test_clients_replay_images_drawn_by_the_previous_tasks_generator_not_their_own(monkeypatch):
    """In task 2 a client's replayed batch (x~, y~) is drawn by G^{t-1}, the global generator of task 1's end, not by
    the generator it trains: in the task's second round (the downloaded generator has moved on from G^{t-1}) every
    replayed image is the output of a generator holding G^{t-1}'s weights."""
    e = _engine()
    for _ in range(3):
        e.step()
    prev = take(e.server, PREV)["fc.weight"].clone()
    assert not torch.equal(prev, e.server["gen.fc.weight"])
    drawn, seen = [], []
    forward, d_loss = ACGANGenerator.forward, FedCIL._d_loss

    def spy_forward(g, z):
        out = forward(g, z)
        drawn.append((torch.equal(g.fc.weight.detach(), prev), out.detach()))
        return out

    def spy_d_loss(self, d, g, x, *args):
        seen.append(x.detach())
        return d_loss(self, d, g, x, *args)

    monkeypatch.setattr(ACGANGenerator, "forward", spy_forward)
    monkeypatch.setattr(FedCIL, "_d_loss", spy_d_loss)
    e.step()
    replayed = seen[1::2]  # per batch: the current (or stand-in) batch, then the replayed one
    assert len(replayed) >= 3 * 3  # three clients, three batches each (and the server's consolidation)
    for x in replayed:
        by_prev = [p for p, out in drawn if out.shape == x.shape and torch.equal(out, x)]
        assert by_prev and all(by_prev)


def test_without_replay_the_first_task_is_the_same_and_the_second_differs():
    on, off = _engine(), _engine(replay=False)
    for _ in range(2):
        on.step()
        off.step()
    assert all(torch.equal(v, off.server[k]) for k, v in _weights(on.server).items())
    on.step()
    off.step()
    assert all(c["replay"] == 0 for c in off.method.batch_log.values()) and not any(take(s, PREV) for s in off.stores)
    key = "units.2.2.weight"  # the auxiliary classifier D_c
    assert not torch.equal(on.server[key], off.server[key])


def test_consistency_from_a_tasks_second_round_and_it_changes_training():
    on, off = _engine(), _engine(consistency_weight=0.0)
    for rnd in range(1, 4):
        on.step()
        off.step()
        assert all(c["consistency"] == (120 if rnd == 2 else 0) for c in on.method.batch_log.values())
        assert all(c["consistency"] == 0 for c in off.method.batch_log.values())
        same = all(torch.equal(v, off.server[k]) for k, v in _weights(on.server).items())
        assert same == (rnd == 1)  # round 1 has no consistency term, round 2 has


def test_consolidation_changes_the_global_model_from_synthetic_data_only():
    ups: dict[str, dict[str, torch.Tensor]] = {}

    def observer(rnd, name, way, payload):
        if way == "up":
            ups[name] = payload

    e = _engine(observer=observer, md_iter=3)
    before = {k: v.clone() for k, v in e.server.items()}
    e.step()
    clients = e.tasks[0]
    uploads = [(c, ups[c.name]) for c in clients]
    # what reached the server: weights and a presence vector of classes per client, no image
    for _, up in uploads:
        assert up["labels"].dtype == torch.uint8 and up["labels"].shape == (4,) and set(up["labels"].tolist()) <= {0, 1}
        assert all(k == "labels" or k.startswith(("units.", "gen.", "rf.")) for k in up)
    mean = RunningMean()
    for c, up in uploads:
        mean.add(c.n_train, {k: v for k, v in up.items() if k != "labels"})
    mean = mean.result()
    # the consolidation moved the FedAvg mean (weights of trunk, classifier, real/fake head and generator) ...
    assert not torch.equal(e.server["units.2.2.weight"], mean["units.2.2.weight"])
    assert not torch.equal(e.server["gen.fc.weight"], mean["gen.fc.weight"])
    # ... but not the BatchNorm statistics, which stay the clients' mean (it has no data)
    assert torch.equal(e.server["units.0.1.running_mean"], mean["units.0.1.running_mean"])
    assert torch.equal(e.server["labels_now"], uploads[0][1]["labels"] | uploads[1][1]["labels"] | uploads[2][1]["labels"])
    # the server's result is a function of the uploads: clients with other images give the very same global model
    blank = [(ClientData(c.index, c.name, torch.zeros_like(c.x_train), c.y_train, c.x_test, c.y_test, c.domain), up) for c, up in uploads]
    noise = [(ClientData(c.index, c.name, torch.randint_like(c.x_train, 256), c.y_train, c.x_test, c.y_test, c.domain), up) for c, up in uploads]
    for fake in (blank, noise):
        again = e.method.aggregate(before, fake, 1)
        assert all(torch.equal(v, again[k]) for k, v in e.server.items())
    # and without consolidation the server's model is the plain FedAvg mean
    e.method.params = e.method.params.model_copy(update={"md_iter": 0})
    plain = e.method.aggregate(before, uploads, 1)
    assert all(torch.equal(v, plain[k]) for k, v in mean.items())


def test_uploads_hold_only_shared_keys_and_bytes_are_the_tensors_moved():
    moved: dict[str, int] = {}
    seen_keys: set[str] = set()

    def observer(rnd, name, way, payload):
        if way == "up":
            seen_keys.update(payload)
        moved[way] = moved.get(way, 0) + payload_bytes(payload)

    e = _engine(observer=observer)
    shared = set(e.model.state_dict()) | {"rf." + k for k in e.method.rf.state_dict()} | {"gen." + k for k in e.method.gen.state_dict()}
    hist = e.run()
    assert seen_keys == shared | {"labels"}
    assert not seen_keys & e.method.private_keys(e.model)
    assert moved["up"] == sum(h["bytes_up_total"] for h in hist)
    assert moved["down"] == sum(h["bytes_down_total"] for h in hist)
    acgan = payload_bytes({k: v for k, v in e.server.items() if k in shared})
    assert all(v == acgan + 4 for h in hist for v in h["bytes_up"].values())  # the ACGAN and 4 one-byte labels
    prev = payload_bytes(take(e.server, PREV))
    for h in hist:  # the ACGAN, two label sets, and G^{t-1} at a client's first round of tasks 1 and 2
        assert all(v == acgan + 8 + (prev if h["round"] in (3, 5) else 0) for v in h["bytes_down"].values())


def test_bn_running_statistics_move_with_data_batches_only():
    net = tiny_net(1, 4)
    net.train()
    bn = net.units[0][1]
    start = bn.running_mean.clone()
    with running_stats_frozen(net):
        out = net(torch.randn(8, 1, 16, 16))
    assert torch.equal(bn.running_mean, start) and bn.track_running_stats and torch.isfinite(out).all()
    net(torch.randn(8, 1, 16, 16))
    assert not torch.equal(bn.running_mean, start)


def test_a_three_task_stream_runs_end_to_end_with_finite_metrics():
    e = _engine(train=_train(client_fraction=0.67))
    hist = e.run()
    finite_stream_summary(hist, NAMES, 2)
    assert e.method.resolved()["generator_draw_side"] == [16, 16]


def test_a_run_killed_mid_task_resumes_to_the_same_numbers(tmp_path):
    resumed, full = resume_mid_run(lambda ck: _engine(checkpoint=ck), tmp_path)  # task 1's first round done, the second not
    assert without_timing(resumed.run()) == without_timing(full)


def test_the_discriminator_loss_weighs_current_and_replayed_data_by_the_importance(monkeypatch):
    # L_D = r * l(current batch) + (1 - r) * l(replayed batch): every l the clients' discriminators computed in task 1's
    # first round, recorded in order (current, replayed, current, ...), gives back each client's mean loss of the round
    r = 0.3
    calls: dict[str, list[tuple[int, float]]] = {}
    means: dict[str, float] = {}
    d_loss, local_update = FedCIL._d_loss, FedCIL.local_update
    who: list[str] = []

    def spy_d_loss(self, d, g, x, y, pool, rng):
        loss, c = d_loss(self, d, g, x, y, pool, rng)
        if who:
            calls.setdefault(who[-1], []).append((len(x), float(loss.detach())))
        return loss, c

    def spy_update(self, model, store, payload, client, rnd, seed):
        who.append(client.name)
        try:
            return local_update(self, model, store, payload, client, rnd, seed)
        finally:
            who.pop()
            means[client.name] = self.last_loss

    monkeypatch.setattr(FedCIL, "_d_loss", spy_d_loss)
    monkeypatch.setattr(FedCIL, "local_update", spy_update)
    e = _engine(importance=r, consistency_weight=0.0)
    close = lambda a, b: abs(a - b) < 1e-5 * max(1.0, abs(b))  # noqa: E731  (the round's mean sums in float32)
    for _ in range(2):  # task 0: no replayed batch, one l per batch
        calls.clear()
        e.step()
        assert all(close(means[n], sum(b * v for b, v in calls[n]) / sum(b for b, _ in calls[n])) for n in calls)
    calls.clear()
    e.step()  # task 1's first round: a replayed batch beside every current one
    assert len(calls) == 3
    for name, seen in calls.items():
        assert len(seen) % 2 == 0
        pairs = list(zip(seen[0::2], seen[1::2]))
        assert all(b == b_r for (b, _), (b_r, _) in pairs)
        expect = sum(b * (r * cur + (1 - r) * rep) for (b, cur), (_, rep) in pairs) / sum(b for (b, _), _ in pairs)
        assert close(means[name], expect)
        unweighted = sum(b * (cur + rep) for (b, cur), (_, rep) in pairs) / sum(b for (b, _), _ in pairs)
        assert abs(means[name] - unweighted) > 1e-3


def test_the_consistency_terms_are_the_two_divergences_and_the_global_generators_cross_entropy():
    # with D_c's weights zero its logits are its bias b on any image: KD_g1 = KL(softmax b || softmax b) = 0,
    # KD_g2 = CE(b, y'') = -log softmax(b)[0] at labels drawn from {0} only, and KD_d = KL(softmax b || softmax o)
    # against the client's logits o on its real batch (the direction the docstring states)
    e = _engine()
    e.step()
    m, model = e.method, e.model
    head = last_linear(model)
    b = torch.tensor([2.0, -1.0, 0.5, 0.0])
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(b)
    m.glob.load_state_dict(m.gen.state_dict())
    m.glob.eval()
    o = torch.tensor([[0.0, 1.0, -2.0, 0.5]]).repeat(6, 1)
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    rng = torch.Generator().manual_seed(0)
    model.train()
    with feature_tap(model) as seen:
        got = m._consistency(m._disc(model, m.rf, seen), o, y, torch.tensor([0]), rng)
    pb, po = b.softmax(0), o[0].softmax(0)
    expect = float((pb * (pb.log() - po.log())).sum()) + 0.0 + float(-pb[0].log())
    assert abs(float(got.detach()) - expect) < 1e-5


def test_server_consolidation_weighs_current_and_replayed_data_by_the_importance(monkeypatch):
    """Model consolidation on the server: each discriminator step minimizes r * l(synthetic current) + (1 - r) *
    l(replayed) with r = importance (0.3 here, so swapping r and 1 - r shows)."""
    r = 0.3
    inside: list[bool] = []
    d_losses: list[float] = []
    backwards: list[float] = []
    consolidate, d_loss, backward = FedCIL.consolidate, FedCIL._d_loss, torch.Tensor.backward

    def spy_consolidate(self, server, uploads, rnd):
        inside.append(True)
        try:
            return consolidate(self, server, uploads, rnd)
        finally:
            inside.pop()

    def spy_d_loss(self, *args):
        loss, c = d_loss(self, *args)
        if inside:
            d_losses.append(float(loss.detach()))
        return loss, c

    def spy_backward(self, *args, **kw):
        if inside:
            backwards.append(float(self.detach()))
        return backward(self, *args, **kw)

    monkeypatch.setattr(FedCIL, "consolidate", spy_consolidate)
    monkeypatch.setattr(FedCIL, "_d_loss", spy_d_loss)
    monkeypatch.setattr(torch.Tensor, "backward", spy_backward)
    e = _engine(importance=r, consistency_weight=0.0)
    e.step()
    e.step()
    d_losses.clear()
    backwards.clear()
    e.step()  # task 1's first round: the server replays G^0 beside the participants' generators
    steps = SMALL["md_iter"]
    assert len(d_losses) == 2 * steps and len(backwards) == 2 * steps  # (current, replayed); (D step, G step)
    for i in range(steps):
        cur, rep = d_losses[2 * i], d_losses[2 * i + 1]
        assert abs(cur - rep) > 1e-3
        assert abs(backwards[2 * i] - (r * cur + (1 - r) * rep)) < 1e-5 * max(1.0, abs(backwards[2 * i]))
