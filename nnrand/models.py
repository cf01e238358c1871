"""The harness's networks: four built-in ResNets, and any torchvision or timm model by name.

Built-in layer vocabulary: ``nn.Conv2d`` (bias=False, groups=1), ``nn.BatchNorm2d``, ``nn.ReLU``,
``nn.MaxPool2d``, ``nn.AdaptiveAvgPool2d(1)``, ``nn.Linear``, the residual add and the flatten before the
classifier: every backward reduction in them is one nnrand routes. External models (``torchvision:NAME``,
``timm:NAME``, extra ``nnrand[vision]``) are routed the same way, at the dispatcher; what they use beyond
that is passed on or refused, as the routing's coverage says.

    resnet18            CIFAR ResNet-18: 3x3 stride-1 stem 3->64, no max-pool, stages [64, 128, 256, 512] x 2
                        BasicBlocks, 1x1 stride-2 projection shortcuts with BN; 11,173,962 params (10 classes)
    resnet18_imagenet   the same body behind the ImageNet stem (7x7 s2 p3 conv, BN, ReLU, 3x3 s2 p1 max-pool),
                        on 32x32 input the body runs at 8x8 -> 1x1
    resnet20            He et al. 2016 CIFAR ResNet-20: 3 stages x 3 BasicBlocks at 16/32/64 channels; option-B
                        shortcuts (1x1 stride-2 conv + BN where the shape changes, identity elsewhere)
    resnet20_maxpool    the same body behind a stem that pools (3x3 conv, BN, ReLU, 3x3 s2 p1 max-pool): stages at
                        16x16 / 8x8 / 4x4 px; the max-pool sibling of resnet20 in the divergence study
    small               CPU-sized ResNet: 3x3 stem 3->16 with BN, ReLU and a 3x3 s2 p1 max-pool (so max-pool
                        backward runs on CPU too), one BasicBlock per stage at 24/48/96 channels and 16/8/4 px;
                        172,746 params (10 classes)

Initialisation: convs kaiming-normal (fan_out, ReLU gain), BN weight 1 and bias 0, Linear PyTorch's default.
Nothing here seeds the RNG: build under the caller's ``torch.manual_seed`` for reproducible weights.
"""
from __future__ import annotations

import torch
from torch import nn

MODELS = ("resnet18", "resnet18_imagenet", "resnet20", "resnet20_maxpool", "small")


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


def _resnet20_stages() -> nn.Sequential:
    return nn.Sequential(stage(16, 16, 3, 1), stage(16, 32, 3, 2), stage(32, 64, 3, 2))


def resnet20(num_classes: int = 10) -> ResNet:
    # 32x32 (16 ch) -> 16x16 (32 ch) -> 8x8 (64 ch); 1 + 3*3*2 convs + 1 linear = 20 weighted layers.
    return ResNet(cifar_stem(16), _resnet20_stages(), 64, num_classes)


def resnet20_maxpool(num_classes: int = 10) -> ResNet:
    # 32x32 stem conv (16 ch) -> max-pool 16x16 -> stages at 16x16 / 8x8 / 4x4: a quarter of the body's work
    stem = nn.Sequential(*cifar_stem(16), nn.MaxPool2d(3, stride=2, padding=1))
    return ResNet(stem, _resnet20_stages(), 64, num_classes)


def small(num_classes: int = 10) -> ResNet:
    # stem 32x32 (16 ch) -> max-pool 16x16 -> 16x16 (24 ch) -> 8x8 (48 ch) -> 4x4 (96 ch). The stem conv
    # still sees full-resolution edges; the blocks start after the pool because the CPU order models'
    # backward cost grows with the positions reduced over: the former layout (a 16-channel block at 32x32,
    # the pool after it) spent ~75% of a CPU step in that block's conv and BatchNorm backward.
    stem = nn.Sequential(*cifar_stem(16), nn.MaxPool2d(3, stride=2, padding=1))
    stages = nn.Sequential(stage(16, 24, 1, 1), stage(24, 48, 1, 2), stage(48, 96, 1, 2))
    return ResNet(stem, stages, 96, num_classes)


_BUILDERS = {"resnet18": resnet18, "resnet18_imagenet": resnet18_imagenet, "resnet20": resnet20,
             "resnet20_maxpool": resnet20_maxpool, "small": small}
assert tuple(_BUILDERS) == MODELS


# Models of other libraries, by name: "torchvision:resnet50", "timm:resnet18". Optional extra: vision.
SOURCES = {"torchvision": "torchvision", "timm": "timm"}


class ModelSourceError(ValueError):
    """An external model whose library is missing or that the library does not know."""


def external_model(name: str, num_classes: int) -> nn.Module:
    """``torchvision:NAME`` or ``timm:NAME``, randomly initialised (no weights are downloaded)."""
    source, _, arch = name.partition(":")
    if source not in SOURCES or not arch:
        raise ValueError(f"unknown model {name!r}; external models are torchvision:NAME or timm:NAME")
    try:
        lib = __import__(SOURCES[source])
    except Exception as e:  # ImportError, or a build that cannot load its extension against this torch
        raise ModelSourceError(f"model {name}: {source} is not importable here ({type(e).__name__}: {e}); "
                               "install the optional extra: pip install 'nnrand[vision]'") from None
    try:
        if source == "torchvision":
            return lib.models.get_model(arch, weights=None, num_classes=num_classes)
        return lib.create_model(arch, pretrained=False, num_classes=num_classes)
    except (ValueError, RuntimeError, KeyError) as e:
        raise ModelSourceError(f"model {name}: {source} cannot build {arch!r}: {e}") from None


def is_known(name: str) -> bool:
    """A built-in model name, or the ``source:NAME`` form of an external one (checked when built)."""
    return name in _BUILDERS or (name.partition(":")[0] in SOURCES and bool(name.partition(":")[2]))


def build_model(name: str, num_classes: int = 10) -> nn.Module:
    """A freshly initialised model; weights come from torch's global RNG, which the caller seeds."""
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if ":" in name:
        return external_model(name, num_classes)
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(MODELS)}, or torchvision:NAME / "
                         "timm:NAME")
    return _BUILDERS[name](num_classes)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
