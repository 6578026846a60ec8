"""ResNet (He et al., 2015), written here because there is no CPU build of torchvision.

Bottleneck blocks for ResNet-50/101/152 and basic blocks for ResNet-18/34, with the
"ResNet v1.5" stride on the 3x3 convolution as torchvision and NVIDIA's recipes have it,
and the last BatchNorm of each residual branch starting at zero (Goyal et al., 2017).
``width`` scales every layer's channels (64 is the paper's): tests train a width-8
ResNet-50, which has the real depth and structure at 1/64 of the parameters.
"""

from __future__ import annotations

from torch import Tensor, nn

DEPTHS: dict[str, tuple[str, tuple[int, int, int, int]]] = {
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet34": ("basic", (3, 4, 6, 3)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
    "resnet101": ("bottleneck", (3, 4, 23, 3)),
    "resnet152": ("bottleneck", (3, 8, 36, 3)),
}


def _conv_bn(inputs: int, outputs: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(inputs, outputs, kernel, stride=stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(outputs)]


class Basic(nn.Module):
    expansion = 1

    def __init__(self, inputs: int, width: int, stride: int) -> None:
        super().__init__()
        self.branch = nn.Sequential(*_conv_bn(inputs, width, 3, stride), nn.ReLU(inplace=True), *_conv_bn(width, width, 3))
        self.shortcut = nn.Sequential(*_conv_bn(inputs, width, 1, stride)) if stride != 1 or inputs != width else nn.Identity()
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.relu(self.branch(x) + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inputs: int, width: int, stride: int) -> None:
        super().__init__()
        outputs = width * self.expansion
        self.branch = nn.Sequential(
            *_conv_bn(inputs, width, 1), nn.ReLU(inplace=True),
            *_conv_bn(width, width, 3, stride), nn.ReLU(inplace=True),
            *_conv_bn(width, outputs, 1),
        )
        self.shortcut = nn.Sequential(*_conv_bn(inputs, outputs, 1, stride)) if stride != 1 or inputs != outputs else nn.Identity()
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.relu(self.branch(x) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, arch: str = "resnet50", classes: int = 1000, width: int = 64) -> None:
        super().__init__()
        if arch not in DEPTHS:
            raise ValueError(f"unknown arch {arch!r}; one of {', '.join(DEPTHS)}")
        kind, counts = DEPTHS[arch]
        block: type[Basic] | type[Bottleneck] = Basic if kind == "basic" else Bottleneck
        self.stem = nn.Sequential(*_conv_bn(3, width, 7, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1))
        stages: list[nn.Module] = []
        channels = width
        for stage, count in enumerate(counts):
            stage_width = width * 2**stage
            for index in range(count):
                stages.append(block(channels, stage_width, 2 if index == 0 and stage > 0 else 1))
                channels = stage_width * block.expansion
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        for module in self.modules():
            if isinstance(module, (Basic, Bottleneck)):
                last_norm = [m for m in module.branch if isinstance(m, nn.BatchNorm2d)][-1]
                nn.init.zeros_(last_norm.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.pool(self.stages(self.stem(x))).flatten(1))
