"""Issue 16.2 (augmentation): albumentations policies declared in params (train.augment.host) run on the host per
image before the batch reaches the device; bad policies name the key; bench reports what a policy costs."""

from __future__ import annotations

import copy

import pytest
import torch

from fedsilo.bench import run_bench
from fedsilo.client.hostaug import apply_host, host_policy
from fedsilo.config import AugmentParams, ConfigError, NormalizeParams, TrainParams, parse_params
from fedsilo.fl.engine import Engine
from fedsilo.methods import method_class
from tests.conftest import small_params
from tests.tiny import style_shifted_federation, tiny_net

CXR_POLICY = [{"name": "CLAHE", "p": 1.0, "clip_limit": 2.0}, {"name": "Affine", "rotate": [-15, 15], "p": 1.0},
              {"name": "RandomBrightnessContrast", "p": 0.5}]


def _train(clients, host=()):
    tp = TrainParams(rounds=2, batch_size=8, lr=0.05, local_epochs=1, device="cpu", count_flops=False, augment=AugmentParams(host=tuple(host)))
    cls = method_class("fedavg")
    e = Engine(cls(cls.params_cls(), tp), tiny_net(1, 4), clients, tp, seed=0)
    e.run()
    return e.server


@pytest.mark.parametrize("policy, message", [
    ([{"name": "NoSuchTransform"}], r"train\.augment\.host\[0\]\.name: 'NoSuchTransform' is not an albumentations transform"),
    ([{"name": "CLAHE", "p": 1.0}, {"name": "Affine", "rotatee": 10}], r"train\.augment\.host\[1\] \(Affine\): .*rotatee"),
    ([{"name": "CLAHE", "p": 3.0}], r"train\.augment\.host\[0\] \(CLAHE\)"),
])
def test_a_bad_policy_names_the_key(policy, message):
    with pytest.raises(ConfigError, match=message):
        host_policy(AugmentParams(host=policy).host)


def test_a_transform_that_changes_the_image_size_is_refused():
    p = host_policy(AugmentParams(host=[{"name": "RandomCrop", "height": 8, "width": 8}]).host)
    with pytest.raises(ConfigError, match=r"train\.augment\.host: the policy turned a \(16, 16, 1\) image into \(8, 8, 1\)"):
        apply_host(p, torch.zeros(2, 1, 16, 16, dtype=torch.uint8), torch.Generator().manual_seed(0))


def test_the_policy_is_seeded_from_the_run_and_changes_grey_and_colour_batches():
    p = host_policy(AugmentParams(host=CXR_POLICY).host)
    for c in (1, 3):
        x = torch.randint(0, 256, (4, c, 24, 24), dtype=torch.uint8)
        a = apply_host(p, x, torch.Generator().manual_seed(7))
        b = apply_host(p, x, torch.Generator().manual_seed(7))
        d = apply_host(p, x, torch.Generator().manual_seed(8))
        assert a.shape == x.shape and a.dtype == torch.uint8
        assert torch.equal(a, b) and not torch.equal(a, x) and not torch.equal(a, d)


def test_no_policy_is_none_and_each_thread_gets_a_policy_of_its_own():
    """A run without a policy builds nothing (and so draws no seed); clients trained at once in threads each re-seed
    their own copy, never one another's; one thread reuses its copy."""
    import threading

    assert host_policy(AugmentParams().host) is None
    host = AugmentParams(host=CXR_POLICY).host
    mine = host_policy(host)
    assert host_policy(host) is mine
    theirs = []
    worker = threading.Thread(target=lambda: theirs.append(host_policy(host)))
    worker.start()
    worker.join()
    assert theirs[0] is not None and theirs[0] is not mine


def test_training_sees_the_transformed_images():
    """An inverting policy trains exactly like plain training on inverted images (one local epoch: the policy's
    per-batch seed draw comes after the epoch's batch order, so the two runs draw the same batches)."""
    clients = style_shifted_federation(n_train=24, n_test=12, per_domain=1)
    inverted = copy.deepcopy(clients)
    for c in inverted:
        c.x_train = 255 - c.x_train
    with_policy = _train(clients, [{"name": "InvertImg", "p": 1.0}])
    by_hand = _train(inverted)
    plain = _train(clients)
    # the same numbers up to float summation order (the host path hands the device a tensor built from numpy, whose
    # alignment can steer the CPU convolution to another kernel: 2e-7 seen)
    assert all(torch.allclose(with_policy[k].float(), by_hand[k].float(), atol=1e-5, rtol=0) for k in with_policy)
    assert max((with_policy[k].float() - plain[k].float()).abs().max() for k in with_policy) > 1e-2


def test_params_take_a_policy_and_it_enters_the_run_hash():
    raw = small_params()
    base = parse_params(copy.deepcopy(raw)).experiments["quick"].train
    raw["experiments"]["quick"]["train"]["augment"] = {"hflip": True, "host": CXR_POLICY}
    tp = parse_params(raw).experiments["quick"].train
    assert tp.augment.host[0].name == "CLAHE" and tp.augment.host[0].model_dump()["clip_limit"] == 2.0
    assert tp.model_dump(mode="json")["augment"]["host"] != base.model_dump(mode="json")["augment"]["host"]


def test_bench_reports_what_a_policy_costs_per_round():
    r = run_bench(clients=2, samples=32, test_samples=8, image_size=16, channels=1, rounds=1, warmup=0, methods=("fedavg",),
                  device="cpu", memory_clients=0, harmonize_images=0, checkpoint=False, host_augment=tuple(CXR_POLICY))
    h = r["host_augment"]
    assert [p["name"] for p in h["policy"]] == ["CLAHE", "Affine", "RandomBrightnessContrast"]
    assert "fedavg+host_augment" in r["throughput"] and 0 < h["throughput_with_over_without"]
    assert h["seconds_per_round_added"] == pytest.approx(
        r["throughput"]["fedavg+host_augment"]["sec_per_round"] - r["throughput"]["fedavg"]["sec_per_round"])


def test_device_crop_pads_black_as_torchvision_randomcrop():
    # a white image shifted by the crop shows the padding: black (-1 on the [-1, 1] scale), as RandomCrop(padding=p)
    # pads the image before ToTensor / Normalize; zero would be mid-grey
    from fedsilo.client.data import augment

    x = torch.ones(16, 3, 8, 8)
    out = augment(x, AugmentParams(crop_pad=4), torch.Generator().manual_seed(0), NormalizeParams())
    values = set(out.unique().tolist())
    assert values <= {-1.0, 1.0} and -1.0 in values


def test_check_params_and_a_runs_start_refuse_a_bad_policy_by_its_whole_key(tmp_path, capsys):
    """A policy naming no transform fails `fedsilo check-params` (it printed ok, and the run failed inside its first
    batch) and a train run before its first round, each naming experiments.<e>.train.augment.host[i]."""
    import yaml

    from fedsilo.cli import main
    from fedsilo.fl.params import load_params
    from fedsilo.fl.run import run_training

    raw = small_params()
    raw["experiments"]["quick"]["train"]["augment"] = {"host": [{"name": "CLAHE", "p": 1.0}, {"name": "NoSuchTransform"}]}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    assert main(["--root", str(tmp_path), "--params", str(tmp_path / "params.yaml"), "check-params"]) == 2
    assert "experiments.quick.train.augment.host[1].name: 'NoSuchTransform' is not an albumentations transform" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"^experiments\.quick\.train\.augment\.host\[1\]\.name: 'NoSuchTransform'"):
        run_training(load_params(tmp_path / "params.yaml"), "quick", "fedavg", 0, root=tmp_path, quiet=True)
    assert not (tmp_path / "results").exists()
