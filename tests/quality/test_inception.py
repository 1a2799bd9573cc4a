"""FID InceptionV3: pytorch-fid state-dict layout, loading rules, one random-weight forward (a big net)."""

import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.quality.inception import (
    FIDInceptionV3,
    inception_features,
    inception_from_state_dict,
    load_inception,
)

# (key, shape) pairs of pt_inception-2015-12-05-6726825d.pth, as torchvision's Inception3 names them
KNOWN_KEYS = {
    "Conv2d_1a_3x3.conv.weight": (32, 3, 3, 3),
    "Conv2d_1a_3x3.bn.running_var": (32,),
    "Conv2d_4a_3x3.conv.weight": (192, 80, 3, 3),
    "Mixed_5b.branch_pool.conv.weight": (32, 192, 1, 1),
    "Mixed_5d.branch5x5_2.conv.weight": (64, 48, 5, 5),
    "Mixed_6a.branch3x3.conv.weight": (384, 288, 3, 3),
    "Mixed_6b.branch7x7_2.conv.weight": (128, 128, 1, 7),
    "Mixed_6e.branch7x7dbl_5.conv.weight": (192, 192, 1, 7),
    "Mixed_7a.branch3x3_2.conv.weight": (320, 192, 3, 3),
    "Mixed_7c.branch3x3dbl_3b.conv.weight": (384, 384, 3, 1),
    "Mixed_7c.branch_pool.conv.weight": (192, 2048, 1, 1),
    "Mixed_7c.branch_pool.bn.bias": (192,),
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return FIDInceptionV3().eval()


def test_state_dict_layout(model):
    state = model.state_dict()
    for key, shape in KNOWN_KEYS.items():
        assert tuple(state[key].shape) == shape, key
    # torchvision's inception_v3 has 27,161,264 parameters; minus AuxLogits (2,827,696) and the fc (2,049,000)
    assert sum(p.numel() for p in model.parameters()) == 21_785_568
    assert not any(k.startswith(("fc.", "AuxLogits")) for k in state)


def test_loading_pytorch_fid_style_state(model):
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
    state["fc.weight"] = torch.zeros(1008, 2048)
    state["fc.bias"] = torch.zeros(1008)
    loaded = inception_from_state_dict(state, "fake.pth")
    assert torch.equal(loaded.Mixed_6b.branch7x7_2.conv.weight, model.Mixed_6b.branch7x7_2.conv.weight)
    state["Mixed_6b.branch7x7_2.conv.weight"] = torch.zeros(128, 128, 7, 1)
    with pytest.raises(FastdiffError, match="Mixed_6b.branch7x7_2.conv.weight"):
        inception_from_state_dict(state, "fake.pth")
    del state["Mixed_6b.branch7x7_2.conv.weight"]
    with pytest.raises(FastdiffError, match="missing"):
        inception_from_state_dict(state, "fake.pth")


def test_missing_weights_file_message(tmp_path):
    with pytest.raises(FastdiffError, match=r"pt_inception-2015-12-05-6726825d\.pth; pass --inception PATH"):
        load_inception(None)
    with pytest.raises(FastdiffError, match="not found"):
        load_inception(tmp_path / "nope.pth")


def test_random_weight_forward_gives_2048_features(model):
    x = torch.rand(2, 1, 32, 32) * 2 - 1
    features = inception_features(model, x)
    assert features.shape == (2, 2048) and torch.isfinite(features).all()
    with pytest.raises(FastdiffError, match="1 or 3"):
        model(torch.zeros(1, 2, 8, 8))
