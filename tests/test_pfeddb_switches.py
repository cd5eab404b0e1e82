"""pFedDB as its authors ran it (issue 16, item 1): what phi carries (share_bn_affine, share_bn_stats, BatchNorm
found by module type, DenseNet's norm* layers included), the optimizer of each phase (Phase 2's Adam), the
independent initialisation of the two branches for the one-phase ablation, and FedPer's private part in the paper
preset (every fully connected layer and its BatchNorm)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import fedsilo.client.local as local
from fedsilo.client.data import ClientData
from fedsilo.config import ConfigError, NormalizeParams, TrainParams
from fedsilo.fl.engine import Engine
from fedsilo.fl.params import parse_params
from fedsilo.methods.pfeddb import PFedDB, PFedDBParams
from fedsilo.methods.registry import resolve_method
from fedsilo.models import LayeredNet, _DenseUnit, batchnorm_keys, build_model
from tests.conftest import small_params
from tests.test_presets import _load
from tests.tiny import style_shifted_federation


def _tp(**kw) -> TrainParams:
    return TrainParams(**{"rounds": 3, "batch_size": 8, "lr": 0.02, "device": "cpu", "count_flops": False, **kw})


@pytest.fixture(scope="module")
def clients() -> list[ClientData]:
    return style_shifted_federation(n_train=8, n_test=8, per_domain=1)[:2]


def dense_style_net(num_classes: int = 4) -> LayeredNet:
    """A few-hundred-parameter DenseNet: torchvision's own dense layer and transition, so the BatchNorm layers carry
    DenseNet's names (norm0, norm1, norm2, the transition's norm, norm5), in the units the DenseNet-121 backbone uses."""
    from torchvision.models.densenet import _DenseLayer, _Transition

    torch.manual_seed(0)
    stem = nn.Sequential(OrderedDict(conv0=nn.Conv2d(1, 8, 3, padding=1, bias=False), norm0=nn.BatchNorm2d(8), relu0=nn.ReLU()))
    head = nn.Sequential(OrderedDict(norm5=nn.BatchNorm2d(6), relu=nn.ReLU(), pool=nn.AdaptiveAvgPool2d(1),
                                     flatten=nn.Flatten(), classifier=nn.Linear(6, num_classes)))
    return LayeredNet([
        ("stem", stem, 1),
        ("denseblock1.denselayer1", _DenseUnit(_DenseLayer(8, growth_rate=4, bn_size=2, drop_rate=0)), 2),
        ("transition1", _Transition(12, 6), 1),
        ("classifier", head, 1),
    ])


def _uploads(engine: Engine) -> set[str]:
    seen: set[str] = set()
    engine.observer = lambda r, c, d, p: seen.update(p) if d == "up" else None
    engine.run()
    return seen


# --------------------------------------------------------------------------- what phi carries
@pytest.mark.parametrize("net", ["simple_cnn", "dense_style"])
@pytest.mark.parametrize("affine, stats", [(False, False), (True, False), (True, True)])
def test_share_bn_switches_decide_which_batchnorm_tensors_are_uploaded(clients, net, affine, stats):
    model = build_model("simple_cnn", 1, 4, seed=0) if net == "simple_cnn" else dense_style_net()
    depth = 4 if net == "dense_style" else 3
    algo = PFedDB(PFedDBParams(cut_depth=depth, local_rounds=1, share_bn_affine=affine, share_bn_stats=stats), _tp(rounds=2))
    e = Engine(algo, model, clients, algo.train, seed=0)
    bn = {k for k in batchnorm_keys(e.model) if k.startswith("shared.")}
    bn_affine = {k for k in bn if k.endswith((".weight", ".bias"))}
    if net == "dense_style":  # the names the module-type rule must catch: no "bn" in any of them
        assert {"shared.0.norm0.weight", "shared.1.layer.norm1.bias", "shared.1.layer.norm2.weight",
                "shared.2.norm.running_mean"} <= bn
    up = _uploads(e)
    assert up and all(k.startswith("shared.") for k in up)
    assert (up & bn_affine == bn_affine) if affine else not (up & bn_affine)
    assert (up & (bn - bn_affine) == bn - bn_affine) if stats else not (up & (bn - bn_affine))
    # every non-BatchNorm tensor of the shared branch travels
    assert {k for k in e.model.state_dict() if k.startswith("shared.")} - bn <= up
    # and the server holds exactly what was uploaded; the rest stays in the clients' stores
    assert {k for k in e.server if not k.startswith("pfeddb:local_model::")} == up and all(bn - up <= set(s) for s in e.stores)


def test_densenet121_shares_no_batchnorm_by_default_and_its_affine_with_the_switch():
    model = PFedDB(PFedDBParams(cut_depth=88), _tp()).transform_model(build_model("densenet121", 1, 2, seed=0), torch.zeros(2, 1, 32, 32))
    shared_bn = {n: m for n, m in model.shared.named_modules() if isinstance(m, nn.BatchNorm2d)}
    assert len(shared_bn) == 1 + 2 * (6 + 12 + 24) + 3  # norm0, norm1/norm2 of each dense layer, 3 transitions' norm
    affine_keys = {f"shared.{n}.{k}" for n in shared_bn for k in ("weight", "bias")}
    assert "shared.0.1.weight" in affine_keys  # norm0 sits in the stem unit under an index, not a name
    for affine in (False, True):
        shared = set(PFedDB(PFedDBParams(cut_depth=88, share_bn_affine=affine), _tp()).shared_keys(model))
        assert (shared & affine_keys) == (affine_keys if affine else set())
        assert not any(k.endswith(("running_mean", "running_var", "num_batches_tracked")) for k in shared)
        assert "shared.1.layer.conv1.weight" in shared


# --------------------------------------------------------------------------- the optimizer of each phase
def test_an_adam_step_is_not_an_sgd_step(clients):
    """One batch, one step from the same start: Adam's first step moves every parameter with a gradient by lr (its
    normalised update), SGD's by lr times the gradient."""
    c = clients[0]
    one = ClientData(0, "c", c.x_train[:8], c.y_train[:8], c.x_test, c.y_test)
    steps = {}
    for opt in ("sgd", "adam"):
        model = build_model("simple_cnn", 1, 4, seed=0)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        local.train_local(model, one, _tp(optimizer=opt, lr=1e-3), local.make_generator(0))
        steps[opt] = {n: (p.detach() - before[n]).abs() for n, p in model.named_parameters()}
    moved = steps["adam"]["units.0.0.weight"]
    assert moved.max() <= 1e-3 * 1.0001 and moved.median() > 0.99e-3
    assert not torch.allclose(steps["sgd"]["units.0.0.weight"], moved, rtol=0.1)


def test_phase_two_trains_with_a_fresh_adam_each_round_and_phase_one_with_sgd(clients, monkeypatch):
    built: list[tuple[int, str, float]] = []
    make = local.make_optimizer

    def spy(params, cfg):
        opt = make(params, cfg)
        built.append((algo.rnd, type(opt).__name__, opt.param_groups[0]["lr"]))
        return opt

    monkeypatch.setattr(local, "make_optimizer", spy)
    algo = PFedDB(PFedDBParams(cut_depth=3, local_rounds=1, phase1_lr=0.03, phase2_optimizer="adam", phase2_lr=1e-3), _tp())
    e = Engine(algo, build_model("simple_cnn", 1, 4, seed=0), clients, algo.train, seed=0)
    e.run()
    assert built == [(1, "SGD", 0.03)] * 2 + [(2, "Adam", 1e-3)] * 2 + [(3, "Adam", 1e-3)] * 2
    assert algo.resolved()["phase2"] == {"optimizer": "adam", "lr": 1e-3}
    # null = train's optimizer and lr in both phases
    plain = PFedDB(PFedDBParams(cut_depth=3, local_rounds=1), _tp(momentum=0.9))
    assert plain.phase_train(1) is plain.train and plain.phase_train(2) is plain.train
    # an Adam phase does not take SGD's momentum; the SGD phase keeps it
    mixed = PFedDB(PFedDBParams(cut_depth=3, local_rounds=1, phase2_optimizer="adam"), _tp(momentum=0.9))
    assert mixed.phase_train(2).optimizer == "adam" and mixed.phase_train(2).momentum == 0.0
    assert mixed.phase_train(1).momentum == 0.9


def test_phase_optimizers_given_per_backbone_resolve_for_the_runs_backbone():
    """The paper preset serves Digits (Simple-CNN), Office-Caltech-10 and DomainNet (AlexNet-BN) and Chest-X-Ray-4
    (DenseNet-121) with one methods block: the Digits script's Adam in Phase 2 there, the paper's SGD on the other two."""
    p = PFedDBParams(cut_depth=3, local_rounds=1, phase2_optimizer={"simple_cnn": "adam", "alexnet_bn": "sgd"},
                     phase2_lr={"simple_cnn": 0.01, "alexnet_bn": None})
    digits = PFedDB(p, _tp(model="simple_cnn"))
    office = PFedDB(p, _tp(model="alexnet_bn"))
    assert (digits.phase_train(2).optimizer, digits.phase_train(2).lr) == ("adam", 0.01)
    assert (office.phase_train(2).optimizer, office.phase_train(2).lr) == ("sgd", 0.02)  # null: train.lr
    with pytest.raises(ConfigError, match=r"methods\.pfeddb\.phase2_optimizer: no entry for the backbone densenet121"):
        PFedDB(p, _tp(model="densenet121"))  # when the method is built from params, before any stage trains
    # a one-phase run has no Phase 1: its phase1_* values are not looked at, nor recorded
    one = PFedDB(PFedDBParams(cut_depth=3, two_phase=False, phase1_lr={"alexnet_bn": 0.1}, phase2_optimizer="sgd"),
                 _tp(model="densenet121"))
    assert one.phase_optimizers() == {"phase2": {"optimizer": "sgd", "lr": 0.02}}
    raw = small_params()
    for bad, msg in (({"phase2_optimizer": {"alexnet_bn": "rmsprop"}}, r"methods\.pfeddb\.phase2_optimizer\.alexnet_bn: Input should be 'sgd' or 'adam'"),
                     ({"phase1_lr": {"alexnet": 0.1}}, r"methods\.pfeddb\.phase1_lr\.alexnet: unknown backbone"),
                     ({"phase2_lr": -1.0}, r"methods\.pfeddb\.phase2_lr: Input should be greater than 0")):
        raw["methods"]["pfeddb"] = bad
        with pytest.raises(ConfigError, match=msg):
            parse_params(raw)


def test_an_unknown_optimizer_is_refused_naming_its_key():
    raw = small_params()
    raw["methods"]["pfeddb"] = {"phase2_optimizer": "rmsprop"}
    with pytest.raises(ConfigError, match=r"methods\.pfeddb\.phase2_optimizer: Input should be 'sgd' or 'adam'"):
        parse_params(raw)
    raw = small_params(optimizer="rmsprop")
    with pytest.raises(ConfigError, match=r"experiments\.quick\.train\.optimizer: Input should be 'sgd' or 'adam'"):
        parse_params(raw)
    raw = small_params(optimizer="adam", momentum=0.9)
    with pytest.raises(ConfigError, match=r"experiments\.quick\.train: momentum: SGD's momentum"):
        parse_params(raw)
    with pytest.raises(ConfigError, match=r"train\.optimizer: 'rmsprop' is not one of sgd, adam"):
        local.make_optimizer([nn.Parameter(torch.zeros(1))], _tp().model_copy(update={"optimizer": "rmsprop"}))


# --------------------------------------------------------------------------- branch initialisation (Table 4)
def test_one_phase_branches_start_independent_unless_same(clients):
    def round0(**kw):
        algo = PFedDB(PFedDBParams(cut_depth=3, two_phase=False, **kw), _tp(rounds=2))
        e = Engine(algo, build_model("simple_cnn", 1, 4, seed=0), clients, algo.train, seed=0)
        sd = e.model.state_dict()
        return [(sd[k], sd["private." + k[len("shared."):]]) for k in ("shared.0.0.weight", "shared.2.0.weight", "shared.0.0.bias")]

    state = torch.random.get_rng_state()
    independent = round0()
    assert all(not torch.equal(s, p) for s, p in independent)
    torch.random.set_rng_state(state)
    again = round0(branch_init="independent")
    assert all(torch.equal(a[0], b[0]) for a, b in zip(independent, again)), "the draw is a function of the seed"
    same = round0(branch_init="same")
    assert all(torch.equal(s, p) for s, p in same)
    # the private branch is the run's seeded backbone either way
    assert all(torch.equal(a[1], b[1]) for a, b in zip(independent, same))


def test_independent_draw_leaves_the_global_random_state_alone_and_needs_train_model():
    algo = PFedDB(PFedDBParams(cut_depth=3, two_phase=False), _tp())
    state = torch.random.get_rng_state()
    algo.transform_model(build_model("simple_cnn", 1, 4, seed=0), torch.zeros(2, 1, 16, 16))
    assert torch.equal(torch.random.get_rng_state(), state)
    with pytest.raises(ConfigError, match=r"methods\.pfeddb\.branch_init: independent"):
        algo.transform_model(dense_style_net(), torch.zeros(2, 1, 16, 16))


def test_authors_weight_init_draws_each_branch_as_their_dual_branch_classes_do():
    """weight_init: authors: convolutions Kaiming normal (ReLU gain, fan_out), linear layers N(0, 0.01), biases 0,
    BatchNorm 1 / 0; the two branches independent draws of a seeded generator; the backbone's own draw otherwise."""
    example = torch.zeros(2, 3, 28, 28)

    def dual(**kw):
        algo = PFedDB(PFedDBParams(cut_depth=3, two_phase=False, **kw), _tp(model="simple_cnn", model_width=0.5))
        algo.run_seed = 5
        return algo.transform_model(build_model("simple_cnn", 3, 10, seed=0, image_size=28, width=0.5), example)

    net, again, plain = dual(weight_init="authors"), dual(weight_init="authors"), dual()
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    convs = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
    big = max(linears, key=lambda m: m.weight.numel())
    assert abs(big.weight.std().item() - 0.01) < 0.001 and all(not m.bias.any() for m in linears + convs)
    for m in convs:
        fan_out = m.weight.shape[0] * m.weight[0, 0].numel()
        assert abs(m.weight.std().item() / (2.0 / fan_out) ** 0.5 - 1) < 0.25
    bns = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert bns and all(bool((m.weight == 1).all()) and not m.bias.any() for m in bns)
    s, p = net.shared.state_dict(), net.private.state_dict()
    assert not torch.equal(s["0.0.weight"], p["0.0.weight"])  # independent draws
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), again.state_dict().values()))  # seeded
    # torch's default linear init is uniform within 1/sqrt(fan_in) (here about as wide as N(0, 0.01), never as far
    # out), with biases drawn too
    plain_big = max((m for m in plain.modules() if isinstance(m, nn.Linear)), key=lambda m: m.weight.numel())
    bound = plain_big.weight.shape[1] ** -0.5
    assert plain_big.weight.abs().max() <= bound < big.weight.abs().max() and plain_big.bias.any()
    same = dual(weight_init="authors", branch_init="same")
    assert all(torch.equal(same.shared.state_dict()[k], v) for k, v in same.private.state_dict().items())
    raw = small_params()
    raw["methods"]["pfeddb"] = {"weight_init": "authors"}  # two_phase: true by default
    with pytest.raises(ConfigError, match=r"methods\.pfeddb\.weight_init: authors applies to two_phase: false"):
        parse_params(raw)


# --------------------------------------------------------------------------- the paper preset
def _simple_and_alexnet(p):
    for exp, model in (("pfeddb_digits5", "simple_cnn"), ("pfeddb_office", "alexnet_bn")):
        train = p.experiments[exp].train
        assert train.model == model
        yield train, build_model(model, 3, 10, seed=0)


def test_paper_preset_fedper_keeps_exactly_the_fully_connected_layers_and_their_batchnorm():
    p = _load("paper")
    for train, model in _simple_and_alexnet(p):
        algo = resolve_method(p, "fedper", train)
        algo.setup(model)
        fc = {f"{n}.{k}" for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.BatchNorm1d))
              for k in m.state_dict()}
        assert set(algo.private) == fc, train.model
        assert not any(isinstance(m, nn.BatchNorm2d) and f"{n}.weight" in algo.private for n, m in model.named_modules())


def test_paper_preset_pfeddb_runs_the_authors_protocol():
    p = _load("paper")
    train = p.experiments["pfeddb_digits5"].train
    for key in ("pfeddb", "pfeddb_cut_a", "pfeddb_cut_b", "pfeddb_cut_c", "pfeddb_cut_d", "pfeddb_one_phase"):
        algo = resolve_method(p, key, train)
        phases = {"phase1": {"optimizer": "sgd", "lr": 0.01}, "phase2": {"optimizer": "adam", "lr": 0.01}}  # Digits
        assert algo.phase_optimizers() == (phases if algo.params.two_phase else {"phase2": phases["phase2"]}), key
        assert not algo.params.share_bn_affine and not algo.params.share_bn_stats, key
    one_phase = resolve_method(p, "pfeddb_one_phase", train).params
    assert one_phase.branch_init == "independent" and one_phase.weight_init == "authors"


# --------------------------------------------------------------------------- a newcomer's onboarding (Fig. 6)
def test_onboarding_freeze_global_keeps_all_of_phi_its_batchnorm_statistics_too(clients):
    """freeze_global keeps every tensor of phi as downloaded, its BatchNorm statistics too where phi carries them
    (share_bn_stats); finetune_all moves them."""
    from fedsilo.client.data import to_float
    from fedsilo.methods.pfeddb.onboarding import onboard_newcomer
    from tests.tiny import tiny_net

    client = clients[0]
    method = PFedDB(PFedDBParams(cut_depth=2, local_rounds=1, share_bn_stats=True, share_bn_affine=True), _tp())
    trained = method.transform_model(tiny_net(1, 4, seed=5), to_float(client.x_train[:2], NormalizeParams()))
    method.setup(trained)
    with torch.no_grad():  # a phi that is no fresh draw, its statistics included
        for t in trained.state_dict().values():
            if t.is_floating_point():
                t.add_(0.1)
    phi = {k: v.clone() for k, v in trained.state_dict().items() if k in method.shared}
    res = onboard_newcomer(method, lambda s: tiny_net(1, 4, seed=s), client, phi, 1, 2, seed=3,
                           strategies=["freeze_global", "finetune_all"])
    kept, tuned = res["models"]["freeze_global"], res["models"]["finetune_all"]
    assert any("running_mean" in k for k in phi) and all(torch.equal(kept[k], phi[k]) for k in phi)
    assert any(not torch.equal(tuned[k], phi[k]) for k in phi if "running_mean" in k)


def test_onboarding_is_refused_by_key_without_a_newcomer_split_or_a_pfeddb_entry(tmp_path):
    """The onboard stage needs a holdout_domain split whose held-out domain is a newcomer, and pFedDB's entry; each
    refused before any file is read."""
    from fedsilo.fl.onboard import run_onboarding

    raw = small_params()
    with pytest.raises(ConfigError, match="experiments.quick.split: onboarding needs protocol holdout_domain with role newcomer"):
        run_onboarding(parse_params(raw), "quick", 0, tmp_path)
    raw["experiments"]["quick"]["split"] = {"protocol": "holdout_domain", "holdout": "OpenI", "role": "external_test", "n_train": 24, "n_test": 16}
    with pytest.raises(ConfigError, match="onboarding needs protocol holdout_domain with role newcomer"):
        run_onboarding(parse_params(raw), "quick", 0, tmp_path)
    raw["experiments"]["quick"]["split"]["role"] = "newcomer"
    with pytest.raises(ConfigError, match="methods.fedavg: onboarding needs a pfeddb entry, not fedavg"):
        run_onboarding(parse_params(raw), "quick", 0, tmp_path, method="fedavg")
    with pytest.raises(FileNotFoundError):  # past the checks: the split is not made yet
        run_onboarding(parse_params({**raw, "methods": {**raw["methods"], "pfeddb": {}}}), "quick", 0, tmp_path)
