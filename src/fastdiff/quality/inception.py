"""The InceptionV3 of the standard FID (pytorch-fid's variant of TF's 2015-12-05 Inception), 2048-d features.

Written here without torchvision; module names follow torchvision's Inception3 so the state dict of
``pt_inception-2015-12-05-6726825d.pth`` loads as it is (its unused 1008-class ``fc`` head is dropped).
The FID variant differs from torchvision's Inception in its pooling branches: average pools leave the zero
padding out of the mean (TensorFlow's behaviour) and the last block (Mixed_7c) max-pools instead.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fastdiff.errors import FastdiffError

log = logging.getLogger(__name__)

INCEPTION_WEIGHTS_NAME = "pt_inception-2015-12-05-6726825d.pth"
FEATURE_DIM = 2048
INPUT_SIZE = 299
UNUSED_KEYS = ("fc.weight", "fc.bias")
"""The 1008-class logits layer in the weights file; FID uses the pooled features before it."""


class BasicConv2d(nn.Module):
    """Conv (no bias), BatchNorm (eps 1e-3), ReLU."""

    def __init__(self, in_channels: int, out_channels: int, **conv_kwargs: object) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, bias=False, **conv_kwargs)
        self.bn = nn.BatchNorm2d(out_channels, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


def tf_avg_pool(x: torch.Tensor) -> torch.Tensor:
    """3×3 stride-1 average pool that leaves the zero padding out of the mean, as TensorFlow does."""
    return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, count_include_pad=False)


class InceptionA(nn.Module):
    """35×35 block (Mixed_5b/c/d)."""

    def __init__(self, in_channels: int, pool_features: int) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(in_channels, 64, kernel_size=1)
        self.branch5x5_1 = BasicConv2d(in_channels, 48, kernel_size=1)
        self.branch5x5_2 = BasicConv2d(48, 64, kernel_size=5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, padding=1)
        self.branch_pool = BasicConv2d(in_channels, pool_features, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch5x5 = self.branch5x5_2(self.branch5x5_1(x))
        branch3x3dbl = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        branch_pool = self.branch_pool(tf_avg_pool(x))
        return torch.cat([self.branch1x1(x), branch5x5, branch3x3dbl, branch_pool], 1)


class InceptionB(nn.Module):
    """35×35 → 17×17 reduction (Mixed_6a)."""

    def __init__(self, in_channels: int) -> None:
        super().__init__()
        self.branch3x3 = BasicConv2d(in_channels, 384, kernel_size=3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch3x3dbl = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        branch_pool = F.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([self.branch3x3(x), branch3x3dbl, branch_pool], 1)


class InceptionC(nn.Module):
    """17×17 block with factorised 7×7 convolutions (Mixed_6b/c/d/e)."""

    def __init__(self, in_channels: int, channels_7x7: int) -> None:
        super().__init__()
        c7 = channels_7x7
        self.branch1x1 = BasicConv2d(in_channels, 192, kernel_size=1)
        self.branch7x7_1 = BasicConv2d(in_channels, c7, kernel_size=1)
        self.branch7x7_2 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(in_channels, c7, kernel_size=1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(in_channels, 192, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch7x7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        branch7x7dbl = self.branch7x7dbl_1(x)
        for conv in (self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4, self.branch7x7dbl_5):
            branch7x7dbl = conv(branch7x7dbl)
        branch_pool = self.branch_pool(tf_avg_pool(x))
        return torch.cat([self.branch1x1(x), branch7x7, branch7x7dbl, branch_pool], 1)


class InceptionD(nn.Module):
    """17×17 → 8×8 reduction (Mixed_7a)."""

    def __init__(self, in_channels: int) -> None:
        super().__init__()
        self.branch3x3_1 = BasicConv2d(in_channels, 192, kernel_size=1)
        self.branch3x3_2 = BasicConv2d(192, 320, kernel_size=3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(in_channels, 192, kernel_size=1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, kernel_size=3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch3x3 = self.branch3x3_2(self.branch3x3_1(x))
        branch7x7x3 = self.branch7x7x3_1(x)
        for conv in (self.branch7x7x3_2, self.branch7x7x3_3, self.branch7x7x3_4):
            branch7x7x3 = conv(branch7x7x3)
        branch_pool = F.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([branch3x3, branch7x7x3, branch_pool], 1)


class InceptionE(nn.Module):
    """8×8 block with split 1×3 / 3×1 convolutions; ``max_pool`` selects the pooling branch of Mixed_7c."""

    def __init__(self, in_channels: int, max_pool: bool) -> None:
        super().__init__()
        self.max_pool = max_pool
        self.branch1x1 = BasicConv2d(in_channels, 320, kernel_size=1)
        self.branch3x3_1 = BasicConv2d(in_channels, 384, kernel_size=1)
        self.branch3x3_2a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 448, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, kernel_size=3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(in_channels, 192, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch3x3 = self.branch3x3_1(x)
        branch3x3 = torch.cat([self.branch3x3_2a(branch3x3), self.branch3x3_2b(branch3x3)], 1)
        branch3x3dbl = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        branch3x3dbl = torch.cat([self.branch3x3dbl_3a(branch3x3dbl), self.branch3x3dbl_3b(branch3x3dbl)], 1)
        pooled = F.max_pool2d(x, kernel_size=3, stride=1, padding=1) if self.max_pool else tf_avg_pool(x)
        return torch.cat([self.branch1x1(x), branch3x3, branch3x3dbl, self.branch_pool(pooled)], 1)


class FIDInceptionV3(nn.Module):
    """Images [N, 1 or 3, H, W] in [-1, 1] → pooled features [N, 2048] (gray images are repeated to RGB,
    every image is resized to 299×299 bilinearly, as pytorch-fid does)."""

    def __init__(self) -> None:
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, kernel_size=3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, kernel_size=3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, kernel_size=1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, kernel_size=3)
        self.Mixed_5b = InceptionA(192, pool_features=32)
        self.Mixed_5c = InceptionA(256, pool_features=64)
        self.Mixed_5d = InceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, channels_7x7=128)
        self.Mixed_6c = InceptionC(768, channels_7x7=160)
        self.Mixed_6d = InceptionC(768, channels_7x7=160)
        self.Mixed_6e = InceptionC(768, channels_7x7=192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280, max_pool=False)
        self.Mixed_7c = InceptionE(2048, max_pool=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] not in (1, 3):
            raise FastdiffError(f"Inception needs images [N, 1 or 3, H, W], got {tuple(x.shape)}")
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        x = F.interpolate(x, size=(INPUT_SIZE, INPUT_SIZE), mode="bilinear", align_corners=False)
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        for block in (self.Mixed_5b, self.Mixed_5c, self.Mixed_5d, self.Mixed_6a, self.Mixed_6b):
            x = block(x)
        for block in (
            self.Mixed_6c,
            self.Mixed_6d,
            self.Mixed_6e,
            self.Mixed_7a,
            self.Mixed_7b,
            self.Mixed_7c,
        ):
            x = block(x)
        return F.adaptive_avg_pool2d(x, 1).flatten(1)


def inception_from_state_dict(state: dict[str, torch.Tensor], source: str) -> FIDInceptionV3:
    """An eval-mode FIDInceptionV3 holding ``state`` (pytorch-fid key names; fc.* and missing BatchNorm
    ``num_batches_tracked`` counters are allowed)."""
    from fastdiff.models.weights import load_state_dict_checked

    model = FIDInceptionV3()
    state = {k: v for k, v in state.items() if k not in UNUSED_KEYS}
    for key, value in model.state_dict().items():
        if key.endswith("num_batches_tracked") and key not in state:
            state[key] = value
    load_state_dict_checked(model, state, source)
    return model.eval()


def load_inception(path: Path | None, device: str | torch.device = "cpu") -> FIDInceptionV3:
    """FIDInceptionV3 with the weights of ``pt_inception-2015-12-05-6726825d.pth`` at ``path``."""
    from fastdiff.models.weights import read_state_dict

    hint = f"FID needs the InceptionV3 weights {INCEPTION_WEIGHTS_NAME}; pass --inception PATH"
    if path is None:
        raise FastdiffError(hint)
    path = Path(path)
    if not path.is_file():
        raise FastdiffError(f"{hint} ({path} not found)")
    state = read_state_dict(path)
    if not isinstance(state, dict):
        raise FastdiffError(f"{path} holds a {type(state).__name__}, expected an InceptionV3 state dict")
    return inception_from_state_dict(state, str(path)).to(device)


@torch.no_grad()
def inception_features(model: FIDInceptionV3, images: torch.Tensor, batch_size: int = 50) -> torch.Tensor:
    """Pool features float32 [N, 2048] on the CPU of images [N, 1 or 3, H, W] in [-1, 1]."""
    device = next(model.parameters()).device
    model.eval()
    out = [
        model(images[i : i + batch_size].to(device, torch.float32)).float().cpu()
        for i in range(0, images.shape[0], batch_size)
    ]
    log.debug("inception features of %d images on %s", images.shape[0], device)
    return torch.cat(out)
