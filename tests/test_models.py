import pytest
import torch

from fedsilo.config import TrainParams
from fedsilo.models import MODELS, batchnorm_keys, build_model


@pytest.mark.parametrize("name, layers", [("simple_cnn", 6), ("alexnet_bn", 8), ("densenet121", 121), ("resnet10", 10), ("resnet18", 18), ("resnet34", 34)])
def test_layer_counts_and_interface(name, layers):
    m = build_model(name, 1, 2, seed=0).eval()
    assert m.num_layers == layers
    x = torch.randn(2, 1, 64, 64)
    with torch.no_grad():
        assert m(x).shape == (2, 2)
        assert torch.allclose(m.head()(m.feature_extractor()(x)), m(x))
    assert len(m.layers()) == len(m.units)


def test_model_width_scales_simple_cnn_only_and_keeps_its_layers():
    """train.model_width: the same units, layers, state keys and BatchNorm sets with every conv's channels and hidden
    unit scaled; FedBN's model at 1.0; a model of fixed width refuses another, naming the key."""
    from fedsilo.config import ConfigError, parse_params
    from tests.conftest import small_params

    full, quarter = build_model("simple_cnn", 3, 10, seed=0), build_model("simple_cnn", 3, 10, seed=0, width=0.25)
    assert list(full.state_dict()) == list(quarter.state_dict()) and full.unit_names == quarter.unit_names
    assert batchnorm_keys(full) == batchnorm_keys(quarter) and full.num_layers == quarter.num_layers == 6
    shapes = {k: tuple(v.shape) for k, v in quarter.state_dict().items()}
    assert shapes["units.0.0.weight"] == (16, 3, 5, 5) and shapes["units.3.0.weight"] == (512, 32 * 7 * 7)
    assert sum(p.numel() for p in full.parameters()) == 14_219_210 and sum(p.numel() for p in quarter.parameters()) == 892_154
    with torch.no_grad():
        assert quarter.eval()(torch.zeros(2, 3, 28, 28)).shape == (2, 10)
    with pytest.raises(ConfigError, match=r"train.model_width: 0.5, but resnet18"):
        build_model("resnet18", 3, 10, width=0.5)
    raw = small_params(model="resnet18")
    assert "model_width" not in raw["experiments"]["quick"]["train"]
    raw["experiments"]["quick"]["train"]["model_width"] = 0.5
    with pytest.raises(ConfigError, match=r"experiments.quick.train.*model_width: 0.5, but resnet18 is built at its paper's width"):
        parse_params(raw)


def _share(m, depth):
    f, _ = m.cut(depth)
    return sum(p.numel() for p in f.parameters()) / sum(p.numel() for p in m.parameters())


def test_paper_cut_depth_ratios():
    # pFedDB Table 3: DenseNet-121 l_c = 14/39/88/120 -> 0.05/0.20/0.68/0.99; AlexNet l_c = 5/6/7 -> 0.04/0.71/0.99
    d = build_model("densenet121", 3, 2)
    assert [round(_share(d, lc), 2) for lc in (14, 39, 88, 120)] == [0.05, 0.21, 0.69, 1.0]
    a = build_model("alexnet_bn", 3, 10)
    assert [round(_share(a, lc), 2) for lc in (5, 6, 7)] == [0.04, 0.71, 1.0]
    f, _ = a.cut(6)
    assert round(sum(p.numel() for p in f.parameters()) * 4 / 2**20, 1) == 153.5  # MB uploaded per round


def test_cut_inside_a_unit_is_refused():
    with pytest.raises(ValueError, match="falls inside unit 'denseblock1.denselayer1'"):
        build_model("densenet121", 3, 2).cut(2)


def test_unrolled_densenet_equals_torchvision():
    from torchvision.models import densenet121

    torch.manual_seed(0)
    ref = densenet121(weights=None, num_classes=2).eval()
    ours = build_model("densenet121", 3, 2).eval()
    ours.load_state_dict(dict(zip(ours.state_dict().keys(), ref.state_dict().values())))
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(ours(x), ref(x), atol=1e-5)


def test_batchnorm_keys_cover_bn_state():
    m = build_model("simple_cnn", 1, 2)
    keys = batchnorm_keys(m)
    assert {k.rsplit(".", 1)[1] for k in keys} == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
    assert len(keys) == 5 * 5  # 3 conv BN + 2 FC BN
    from typing import get_args

    # every backbone can be named in params.yaml and every name there builds
    assert set(MODELS) == set(get_args(TrainParams.model_fields["model"].annotation))


def test_small_vit_counts_blocks_and_cuts_at_the_papers_depths():
    """pFedDB's ViT cut depths l_c in {3, 6, 9, 12} are transformer blocks: each shares a quarter more of the model."""
    from fedsilo.methods.pfeddb import PFedDB, PFedDBParams

    m = build_model("vit_tiny", 3, 10, seed=0, image_size=32)
    assert m.num_layers == 13 and m.depths[0] == 0 and m.depths[1:] == [1] * 13
    total = sum(p.numel() for p in m.parameters())
    shares = [sum(p.numel() for u in m.units[: m.cut_index(lc)] for p in u.parameters()) / total for lc in (3, 6, 9, 12)]
    assert [round(s, 2) for s in shares] == [0.25, 0.5, 0.75, 1.0]
    for size in (28, 32, 40, 224):  # the position embedding follows the patch grid of the input
        mm = build_model("vit_tiny", 1, 2, seed=0, image_size=size)
        assert mm(torch.randn(2, 1, size, size)).shape == (2, 2)
    assert m(torch.randn(2, 3, 40, 40)).shape == (2, 10)
    with pytest.raises(ValueError, match="image size"):
        build_model("vit_tiny", 3, 10)
    for fusion in ("add", "concat", "attention", "weighted"):  # fusion works on tokens (B, T, D)
        algo = PFedDB(PFedDBParams(cut_depth=6, fusion=fusion), TrainParams(model="vit_tiny"))
        dual = algo.transform_model(build_model("vit_tiny", 3, 10, seed=0, image_size=32), torch.zeros(2, 3, 32, 32))
        assert dual(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_label_skew_papers_cnns_have_their_published_shapes():
    """FedeCouple's CNN: 106,400 extractor parameters at 32 px (415.6 KB, its Table VII) and 129 * C in the classifier;
    its grey variant 115,776 at 28 px; LeNet-5's 62,006 parameters at 32 px with 10 classes; each at other sizes too."""
    def n(ps):
        return sum(p.numel() for p in ps)

    cnn = build_model("fedecouple_cnn", 3, 10, seed=0, image_size=32)
    assert n(cnn.feature_extractor().parameters()) == 106_400 and n(cnn.head().parameters()) == 129 * 10
    assert cnn.num_layers == 5 and cnn.head()[0].in_features == 128
    gray = build_model("fedecouple_cnn_gray", 1, 62, seed=0, image_size=28)
    assert n(gray.feature_extractor().parameters()) == 115_776 and n(gray.head().parameters()) == 129 * 62
    lenet = build_model("lenet5", 3, 10, seed=0, image_size=32)
    assert n(lenet.parameters()) == 62_006 and lenet.num_layers == 5
    for name, c, size in (("fedecouple_cnn", 3, 32), ("fedecouple_cnn_gray", 1, 28), ("lenet5", 3, 32), ("lenet5", 1, 28)):
        m = build_model(name, c, 7, seed=0, image_size=size).eval()
        with torch.no_grad():
            assert m(torch.randn(2, c, size, size)).shape == (2, 7)


def test_resnet10_cifar_starts_from_pytorch_default_init_as_the_f2dc_code():
    # F²DC's backbones have no init code: every conv keeps PyTorch's Kaiming-uniform (a = sqrt 5), weight std
    # 1 / sqrt(3 fan_in) -- 0.024 for a 64 -> 64 3x3 conv; torchvision's ResNet re-inits them Kaiming-normal (fan_out,
    # std sqrt(2 / fan_out) = 0.059), which is what resnet10 (the ImageNet-style ResNet) keeps
    convs = [m for m in build_model("resnet10_cifar", 3, 7, seed=0).modules() if isinstance(m, torch.nn.Conv2d)]
    for conv in convs:
        fan_in = conv.weight[0].numel()
        assert abs(conv.weight.std().item() / (1 / (3 * fan_in) ** 0.5) - 1) < 0.15, conv
    layer1_conv = [m for m in build_model("resnet10", 3, 7, seed=0).modules() if isinstance(m, torch.nn.Conv2d)][1]
    assert layer1_conv.weight.std().item() > 2 * (1 / (3 * 576)) ** 0.5
