"""train.normalize: the model's input scale, (v / 255 - mean) / std per channel as torchvision's ToTensor + Normalize
make it in the papers' code (F²DC's: ImageNet statistics on every dataset); [-1, 1] by default."""

from __future__ import annotations

import pytest
import torch
from torchvision.transforms import v2

from fedsilo.client.data import ClientData, augment, to_float
from fedsilo.client.local import predict, train_local
from fedsilo.config import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    AugmentParams,
    ConfigError,
    NormalizeParams,
    TrainParams,
    parse_params,
)
from fedsilo.fl.engine import Engine
from fedsilo.methods import method_class
from tests.conftest import small_params
from tests.tiny import tiny_net

IMAGENET = NormalizeParams.model_validate("imagenet")


def _rgb_client(n: int = 12, size: int = 8, seed: int = 0) -> ClientData:
    """Colour images each holding a black (0) and a white (255) pixel in every channel, so that a batch's extremes
    show the scale the model saw."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
    x[:, :, 0, 0], x[:, :, -1, -1] = 0, 255
    y = torch.arange(n) % 2
    return ClientData(0, "A", x, y, x.clone(), y.clone(), domain="A")


def test_the_default_is_minus_one_to_one_bit_for_bit():
    x = torch.randint(0, 256, (4, 3, 5, 5), dtype=torch.uint8)
    assert torch.equal(to_float(x, NormalizeParams()), x.float().div(127.5).sub(1.0))
    assert NormalizeParams().minus_one_one and not IMAGENET.minus_one_one


def test_imagenet_statistics_match_torchvision_totensor_then_normalize():
    x = torch.randint(0, 256, (4, 3, 6, 6), dtype=torch.uint8)
    want = v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)(v2.ToDtype(torch.float32, scale=True)(x))
    assert torch.allclose(to_float(x, IMAGENET), want, atol=1e-6)
    # one value for every channel, e.g. ToTensor alone: [0, 1]
    assert torch.allclose(to_float(x, NormalizeParams(mean=[0.0], std=[1.0])), x.float() / 255)


def test_the_crop_pads_black_on_the_normalized_scale():
    """The same draws on both scales give the same crop: the padding is uint8 0 normalized, as RandomCrop(padding)
    pads the PIL image before ToTensor / Normalize (not 0 after normalizing, which is ImageNet's mean colour)."""
    x = torch.full((16, 3, 8, 8), 255, dtype=torch.uint8)
    p = AugmentParams(crop_pad=4, hflip=True)
    pm1 = augment(to_float(x, NormalizeParams()), p, torch.Generator().manual_seed(3), NormalizeParams())
    imnet = augment(to_float(x, IMAGENET), p, torch.Generator().manual_seed(3), IMAGENET)
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    assert torch.allclose(imnet, ((pm1 + 1) / 2 - mean) / std, atol=1e-6)
    black = -mean / std
    assert bool(torch.isclose(imnet, black.expand_as(imnet)).any())  # the padding is there, black per channel


def test_training_and_evaluation_feed_the_model_the_normalized_images():
    client = _rgb_client()
    seen: list[torch.Tensor] = []
    model = tiny_net(3, 2)
    model.register_forward_pre_hook(lambda _m, inp: seen.append(inp[0].detach().clone()))
    lo, hi = [(-m / s) for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)], [((1 - m) / s) for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)]
    for cfg_norm, want_lo, want_hi in ((IMAGENET, lo, hi), (NormalizeParams(), [-1.0] * 3, [1.0] * 3)):
        cfg = TrainParams(batch_size=4, local_epochs=1, device="cpu", normalize=cfg_norm)
        for run in (lambda cfg=cfg: train_local(model, client, cfg, torch.Generator().manual_seed(0)),
                    lambda cfg=cfg: predict(model, client.x_test, cfg=cfg)):
            seen.clear()
            run()
            x = torch.cat(seen)
            assert torch.allclose(x.amin((0, 2, 3)), torch.tensor(want_lo), atol=1e-5)
            assert torch.allclose(x.amax((0, 2, 3)), torch.tensor(want_hi), atol=1e-5)


def test_a_run_on_another_scale_trains_other_numbers():
    """The engine's local training and evaluation take train.normalize: the same seed ends elsewhere."""
    finals = []
    for norm in (NormalizeParams(), IMAGENET):
        tp = TrainParams(rounds=2, batch_size=4, lr=0.05, device="cpu", count_flops=False, normalize=norm)
        cls = method_class("fedavg")
        clients = [_rgb_client(seed=0), _rgb_client(seed=1)]
        clients[1].index, clients[1].name, clients[1].domain = 1, "B", "B"
        e = Engine(cls(cls.params_cls(), tp), tiny_net(3, 2), clients, tp, seed=0)
        e.run()
        finals.append(torch.cat([v.flatten() for v in e.server.values() if v.is_floating_point()]))
    assert not torch.allclose(finals[0], finals[1])


@pytest.mark.parametrize("value, message", [
    ("imagenett", r"'imagenett': expected imagenet or \{mean: \[\.\.\.\], std: \[\.\.\.\]\}"),
    ({"mean": [123.675, 116.28, 103.53], "std": [58.395, 57.12, 57.375]}, r"mean.*less than or equal to 1"),
    ({"mean": [0.1, 0.2, 0.3], "std": [0.2, 0.2]}, r"mean has 3 values and std 2"),
    ({"mean": [0.5], "std": [0.0]}, r"std"),
])
def test_bad_statistics_name_the_key(value, message):
    p = small_params()
    p["experiments"]["quick"]["train"]["normalize"] = value
    with pytest.raises(ConfigError, match=r"experiments\.quick\.train\.normalize") as err:
        parse_params(p)
    assert err.match(message)


def test_statistics_for_other_channels_are_refused():
    grey = torch.zeros(2, 1, 4, 4, dtype=torch.uint8)
    assert IMAGENET.channel_mismatch(1) == "mean has 3 values for images of 1 channel(s): give one, or 1"
    with pytest.raises(ConfigError, match=r"train\.normalize: mean has 3 values for images of 1 channel"):
        to_float(grey, IMAGENET)
    assert IMAGENET.channel_mismatch(3) is None and NormalizeParams().channel_mismatch(1) is None


def test_fedcil_keeps_its_generator_scale():
    cls = method_class("fedcil")
    with pytest.raises(ConfigError, match=r"train\.normalize: fedcil \(FedCIL\) draws its generator's images on \[-1, 1\]"):
        cls(cls.params_cls(), TrainParams(normalize=IMAGENET))
    cls(cls.params_cls(), TrainParams())


def test_fedecouples_augmentation_works_on_the_runs_scale():
    """FedeCouple's one random operation (crop, flip, rotation, brightness, inversion) on ImageNet-scaled images is
    the operation on [-1, 1] mapped to that scale: inversion turns white into black, brightness clips at white, not
    values beyond black and white."""
    from fedsilo.client.data import from_minus_one_one, one_random_op

    x = torch.randint(0, 256, (300, 3, 12, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    x[:100] = 255  # white images: their inversions and brightenings show the scale
    got = one_random_op(to_float(x, IMAGENET), torch.Generator().manual_seed(5), IMAGENET)
    want = from_minus_one_one(one_random_op(to_float(x, NormalizeParams()), torch.Generator().manual_seed(5), NormalizeParams()), IMAGENET)
    assert torch.allclose(got, want, atol=1e-5)
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    black, white = -mean / std, (1 - mean) / std
    assert bool((got >= black - 1e-5).all()) and bool((got <= white + 1e-5).all())
    assert bool(torch.isclose(got[:100], black.expand(100, 3, 12, 12), atol=1e-5).all((1, 2, 3)).any())  # an inverted white


def test_the_same_statistics_per_channel_are_the_default_scale():
    same = NormalizeParams(mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])
    assert same.minus_one_one
    x = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    assert torch.equal(to_float(x, same), to_float(x, NormalizeParams()))
