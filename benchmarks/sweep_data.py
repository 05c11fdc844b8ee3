"""Data sets and models of the heterogeneity sweep; nothing is downloaded.

- ``digits`` (default): scikit-learn's embedded 8×8 handwritten digits (1797 images,
  10 classes), a fixed stratified 80/20 split, and a two-layer MLP.
- ``cifar10``: the CIFAR-10 python batches in a directory the user gives
  (``data_batch_1..5``, ``test_batch``), and VGG-11 without batch norm (torchvision)
  with a 512 → 10 classifier, as in the RelaySum paper.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

DATASETS = ("digits", "cifar10")
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


@dataclass
class SplitData:
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    name: str

    def to(self, device) -> "SplitData":
        """The same split with its tensors on ``device``."""
        return replace(self, **{k: getattr(self, k).to(device) for k in ("train_x", "train_y", "test_x", "test_y")})


def load_digits(seed: int = 0) -> SplitData:
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    bunch = sklearn_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int64)
    train_x, test_x, train_y, test_y = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return SplitData(
        torch.from_numpy(train_x), torch.from_numpy(train_y),
        torch.from_numpy(test_x), torch.from_numpy(test_y), 10, "digits",
    )


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    images = batch[b"data"].reshape(-1, 3, 32, 32).astype(np.float32) / 255.0
    return images, np.asarray(batch[b"labels"], dtype=np.int64)


def load_cifar10(data_dir: str | Path) -> SplitData:
    root = Path(data_dir)
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    missing = [n for n in names if not (root / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"--data-dir {data_dir!s} must hold the CIFAR-10 python batches "
            f"(data_batch_1..5 and test_batch, or a cifar-10-batches-py folder); missing {missing}"
        )
    parts = [_read_cifar_batch(root / n) for n in names[:5]]
    train_x = np.concatenate([p[0] for p in parts])
    train_y = np.concatenate([p[1] for p in parts])
    test_x, test_y = _read_cifar_batch(root / "test_batch")
    mean = np.asarray(CIFAR_MEAN, dtype=np.float32).reshape(1, 3, 1, 1)
    std = np.asarray(CIFAR_STD, dtype=np.float32).reshape(1, 3, 1, 1)
    return SplitData(
        torch.from_numpy((train_x - mean) / std), torch.from_numpy(train_y),
        torch.from_numpy((test_x - mean) / std), torch.from_numpy(test_y), 10, "cifar10",
    )


def load_data(name: str, data_dir: str | None, seed: int) -> SplitData:
    if name == "digits":
        return load_digits(seed)
    if name == "cifar10":
        if data_dir is None:
            raise ValueError("--dataset cifar10 needs --data-dir, the folder with the CIFAR-10 python batches")
        return load_cifar10(data_dir)
    raise ValueError(f"unknown dataset {name!r}; valid: {list(DATASETS)}")


def build_model(data: SplitData, hidden: int = 128) -> torch.nn.Module:
    """A fresh model for ``data`` (the caller seeds torch first)."""
    if data.name == "digits":
        features = data.train_x.shape[1]
        return torch.nn.Sequential(
            torch.nn.Linear(features, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, data.num_classes),
        )
    from torchvision.models import vgg11

    model = vgg11(num_classes=data.num_classes)  # torchvision's vgg11 has no batch norm
    # 32×32 inputs leave 512×1×1 features: classify them directly, as the RelaySum code does.
    model.avgpool = torch.nn.Flatten()
    model.classifier = torch.nn.Linear(512, data.num_classes)
    return model
