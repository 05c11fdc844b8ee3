"""The CIFAR-10 ResNet-18 of the PowerSGD paper (seed 001, Table 10): a 3×3 first
convolution with 64 channels, no max-pool, four stages of two basic blocks (64, 128,
256, 512 channels), 1×1 convolution shortcuts where the shape changes, a 10-class head.
Parameter names follow the table (``layer4.1.conv2``, ``layer4.0.shortcut.0``, ``linear``).
It is epfml/powersgd ``paper-code/tasks/cifar_architectures/resnet.py``'s ``ResNet18``
layer for layer, with PyTorch's default init as there (that file sets none); the
sweep's ``--model resnet18``."""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, inputs: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet18(nn.Module):
    def __init__(self, num_classes: int = 10, width: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        layers, inputs = [], width
        for index, (planes, stride) in enumerate([(width, 1), (2 * width, 2), (4 * width, 2), (8 * width, 2)]):
            blocks = nn.Sequential(BasicBlock(inputs, planes, stride), BasicBlock(planes, planes, 1))
            setattr(self, f"layer{index + 1}", blocks)
            inputs = planes
        self.linear = nn.Linear(8 * width, num_classes)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        for index in range(1, 5):
            out = getattr(self, f"layer{index}")(out)
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)
