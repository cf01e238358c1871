"""The harness's networks, built only from layers the kernel routing can intercept.

Layer vocabulary (nothing else holds parameters or does arithmetic on activations, except the residual
add and the flatten before the classifier): ``nn.Conv2d`` (bias=False, groups=1), ``nn.BatchNorm2d``,
``nn.ReLU``, ``nn.MaxPool2d``, ``nn.AdaptiveAvgPool2d``, ``nn.Linear``.

    resnet18            CIFAR ResNet-18: 3x3 stride-1 stem 3->64, no max-pool, stages [64, 128, 256, 512] x 2
                        BasicBlocks, 1x1 stride-2 projection shortcuts with BN; 11,173,962 params (10 classes)
    resnet18_imagenet   the same body behind the ImageNet stem (7x7 s2 p3 conv, BN, ReLU, 3x3 s2 p1 max-pool),
                        on 32x32 input the body runs at 8x8 -> 1x1
    resnet20            He et al. 2016 CIFAR ResNet-20: 3 stages x 3 BasicBlocks at 16/32/64 channels; option-B
                        shortcuts (1x1 stride-2 conv + BN where the shape changes, identity elsewhere)
    small               CPU-sized ResNet: 3x3 stem 3->16, one BasicBlock per stage at 16/32/64 channels, a
                        3x3 s2 p1 max-pool after the first stage (so max-pool backward runs on CPU too); 78,042 params

Initialisation: convs kaiming-normal (fan_out, ReLU gain), BN weight 1 and bias 0, Linear PyTorch's default.
Nothing here seeds the RNG: build under the caller's ``torch.manual_seed`` for reproducible weights.
"""
from __future__ import annotations

import torch
from torch import nn

MODELS = ("resnet18", "resnet18_imagenet", "resnet20", "small")


# --------------------------------------------------------------------------------------------------
# Building blocks


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, padding=0, bias=False)


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN, plus the shortcut, then ReLU. The shortcut is the identity when the
    shape is kept and a 1x1 strided conv + BN (projection) when channels or resolution change."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = conv3x3(cin, cout, stride)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU()
        self.conv2 = conv3x3(cout, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu2 = nn.ReLU()
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


def stage(cin: int, cout: int, blocks: int, stride: int) -> nn.Sequential:
    layers = [BasicBlock(cin, cout, stride)]
    layers += [BasicBlock(cout, cout) for _ in range(blocks - 1)]
    return nn.Sequential(*layers)


class ResNet(nn.Module):
    """stem -> stages -> global average pool -> flatten -> linear."""

    def __init__(self, stem: nn.Sequential, stages: nn.Sequential, width: int, num_classes: int):
        super().__init__()
        self.stem = stem
        self.stages = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.stages(self.stem(x)))
        return self.fc(torch.flatten(x, 1))


def init_weights(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


# --------------------------------------------------------------------------------------------------
# Stems


def cifar_stem(width: int) -> nn.Sequential:
    return nn.Sequential(conv3x3(3, width), nn.BatchNorm2d(width), nn.ReLU())


def imagenet_stem(width: int) -> nn.Sequential:
    # 32x32 -> 16x16 (conv) -> 8x8 (pool)
    return nn.Sequential(nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width),
                         nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))


# --------------------------------------------------------------------------------------------------
# The models


def _resnet18_stages() -> nn.Sequential:
    return nn.Sequential(stage(64, 64, 2, 1), stage(64, 128, 2, 2), stage(128, 256, 2, 2),
                         stage(256, 512, 2, 2))


def resnet18(num_classes: int = 10) -> ResNet:
    return ResNet(cifar_stem(64), _resnet18_stages(), 512, num_classes)


def resnet18_imagenet(num_classes: int = 10) -> ResNet:
    return ResNet(imagenet_stem(64), _resnet18_stages(), 512, num_classes)


def resnet20(num_classes: int = 10) -> ResNet:
    # 32x32 (16 ch) -> 16x16 (32 ch) -> 8x8 (64 ch); 1 + 3*3*2 convs + 1 linear = 20 weighted layers.
    stages = nn.Sequential(stage(16, 16, 3, 1), stage(16, 32, 3, 2), stage(32, 64, 3, 2))
    return ResNet(cifar_stem(16), stages, 64, num_classes)


def small(num_classes: int = 10) -> ResNet:
    # 32x32 (16 ch) -> max-pool 16x16 -> 8x8 (32 ch) -> 4x4 (64 ch). The pool sits after the first
    # block rather than in the stem so the network still sees full-resolution edges once.
    stages = nn.Sequential(stage(16, 16, 1, 1), nn.MaxPool2d(3, stride=2, padding=1),
                           stage(16, 32, 1, 2), stage(32, 64, 1, 2))
    return ResNet(cifar_stem(16), stages, 64, num_classes)


_BUILDERS = {"resnet18": resnet18, "resnet18_imagenet": resnet18_imagenet, "resnet20": resnet20,
             "small": small}
assert tuple(_BUILDERS) == MODELS


def build_model(name: str, num_classes: int = 10) -> nn.Module:
    """A freshly initialised model; weights come from torch's global RNG, which the caller seeds."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(MODELS)}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    return _BUILDERS[name](num_classes)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
