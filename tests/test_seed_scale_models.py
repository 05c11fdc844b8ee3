"""The seed-scale setup against the papers' code: the models (epfml/relaysgd
tasks/models/vgg.py and resnet20.py, epfml/powersgd paper-code's ResNet-18), their init,
and CIFAR-10's loading, normalisation and crop-and-flip augmentation; and a 16-worker
VGG-11 sweep on a small file in CIFAR-10's own format."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bagua_algos.experiments import data as d
from bagua_algos.experiments.cifar_resnet import CifarResNet18

CIFAR_SHAPE = SimpleNamespace(image_shape=(3, 32, 32), num_classes=10, name="cifar10")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# ---------------------------------------------------------------- a CIFAR-10 file


def write_cifar(root, per_batch: int = 16, test: int = 20, seed: int = 0) -> dict:
    """CIFAR-10's python version in miniature: ``data_batch_1..5``, ``test_batch`` (dicts
    of uint8 ``data`` [N, 3072] in R, G, B planes of 32 rows, ``labels``, ``batch_label``,
    ``filenames``) and ``batches.meta``, pickled as the originals (protocol 2, bytes
    keys); returns the raw arrays written."""
    rng = np.random.default_rng(seed)
    written = {}
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        n = test if name == "test_batch" else per_batch
        pixels = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = [int(v) for v in (np.arange(n) + i) % 10]  # every class in every batch
        batch = {b"batch_label": f"{name} of 6".encode(), b"labels": labels, b"data": pixels,
                 b"filenames": [f"img_{i}_{k}.png".encode() for k in range(n)]}
        with open(root / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)
        written[name] = (pixels, labels)
    meta = {b"num_cases_per_batch": per_batch, b"num_vis": 3072,
            b"label_names": [w.encode() for w in ("airplane automobile bird cat deer dog frog horse ship "
                                                  "truck").split()]}
    with open(root / "batches.meta", "wb") as f:
        pickle.dump(meta, f, protocol=2)
    return written


@pytest.fixture()
def cifar_dir(tmp_path):
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    return tmp_path, write_cifar(root)


def normalised(pixels: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(pixels.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0)
    mean, std = torch.tensor(d.CIFAR_MEAN).view(1, 3, 1, 1), torch.tensor(d.CIFAR_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def test_cifar10_loads_the_python_batches_normalised_as_the_papers(cifar_dir):
    folder, written = cifar_dir
    assert d.check_data_dir(folder) == folder / "cifar-10-batches-py"
    data = d.load_data("cifar10", str(folder), seed=3)
    assert data.train_x.shape == (80, 3, 32, 32) and data.test_x.shape == (20, 3, 32, 32)
    train = np.concatenate([written[f"data_batch_{k}"][0] for k in range(1, 6)])
    torch.testing.assert_close(data.train_x, normalised(train), rtol=0, atol=1e-6)
    # test images: normalised only, nothing else
    torch.testing.assert_close(data.test_x, normalised(written["test_batch"][0]), rtol=0, atol=1e-6)
    assert data.train_y.tolist() == sum((written[f"data_batch_{k}"][1] for k in range(1, 6)), [])
    assert data.test_y.tolist() == written["test_batch"][1]
    # the papers' tasks/cifar.py values
    assert d.CIFAR_MEAN == (0.4914, 0.4822, 0.4465) and d.CIFAR_STD == (0.2023, 0.1994, 0.2010)
    assert isinstance(data.train_augment, d.CifarAugmentation) and data.train_augment.seed == 3
    assert data.to("cpu").train_augment is data.train_augment
    (folder / "cifar-10-batches-py" / "data_batch_4").unlink()
    with pytest.raises(FileNotFoundError, match=r"--data-dir .*missing \['data_batch_4'\]"):
        d.check_data_dir(folder)


def test_digits_and_mnist_have_no_augmentation():
    assert d.load_data("digits", None, seed=0).train_augment is None


# ---------------------------------------------------------------- models


def conv_std(conv: torch.nn.Conv2d) -> float:
    """The papers' rule: N(0, 2 / (k_h k_w c_out))."""
    return math.sqrt(2.0 / (conv.kernel_size[0] * conv.kernel_size[1] * conv.out_channels))


def check_conv_init(model: torch.nn.Module) -> int:
    """Every convolution's weights look like N(0, conv_std²) (sample mean and std within
    5 standard errors) and its bias, if any, is 0; returns the number of convolutions."""
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    for conv in convs:
        w, sigma, n = conv.weight.detach().double(), conv_std(conv), conv.weight.numel()
        assert abs(float(w.mean())) < 5 * sigma / math.sqrt(n), conv
        assert abs(float(w.std()) / sigma - 1) < 5 / math.sqrt(2 * n), (conv, float(w.std()), sigma)
        if conv.bias is not None:
            assert torch.count_nonzero(conv.bias) == 0
    return len(convs)


def check_default_linear_init(linear: torch.nn.Linear) -> None:
    """PyTorch's default: weights and bias uniform on ±1/sqrt(fan_in) (weights' std bound/sqrt(3))."""
    bound = 1 / math.sqrt(linear.in_features)
    weight, bias = linear.weight.detach(), linear.bias.detach()
    assert float(weight.abs().max()) <= bound and float(bias.abs().max()) <= bound
    assert abs(float(weight.double().std()) / (bound / math.sqrt(3)) - 1) < 5 / math.sqrt(weight.numel())


def count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def conv_params(c_in, c_out, k=3, bias=True):
    return k * k * c_in * c_out + (c_out if bias else 0)


def test_vgg11_is_relaysum_vgg11_with_its_init():
    torch.manual_seed(0)
    model = d.build_model(CIFAR_SHAPE, "vgg11")
    assert isinstance(model, d.VGG11)
    expected, channels = [], 3
    for v in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"):  # configuration "A"
        if v == "M":
            expected.append(("MaxPool2d", 2, 2))
        else:
            expected += [("Conv2d", channels, v, (3, 3), (1, 1), True), ("ReLU",)]
            channels = v
    layers = [("MaxPool2d", m.kernel_size, m.stride) if isinstance(m, torch.nn.MaxPool2d) else
              ("Conv2d", m.in_channels, m.out_channels, m.kernel_size, m.padding, m.bias is not None)
              if isinstance(m, torch.nn.Conv2d) else (type(m).__name__,) for m in model.features]
    assert layers == expected
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    head = [(type(m).__name__, getattr(m, "p", None), getattr(m, "in_features", None), getattr(m, "out_features", None))
            for m in model.classifier]
    assert head == [("Dropout", 0.5, None, None), ("Linear", None, 512, 512), ("ReLU", None, None, None),
                    ("Dropout", 0.5, None, None), ("Linear", None, 512, 512), ("ReLU", None, None, None),
                    ("Linear", None, 512, 10)]
    assert check_conv_init(model) == 8
    for linear in (m for m in model.classifier if isinstance(m, torch.nn.Linear)):
        check_default_linear_init(linear)
    convs = [(3, 64), (64, 128), (128, 256), (256, 256), (256, 512), (512, 512), (512, 512), (512, 512)]
    from_architecture = sum(conv_params(a, b) for a, b in convs) + 2 * (512 * 512 + 512) + 512 * 10 + 10
    print(f"vgg11: {count(model):,} parameters (from the architecture: {from_architecture:,})")
    assert count(model) == from_architecture == 9_750_922
    model.eval()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def basic_block_params(c_in, c_out, stride) -> int:
    """Two 3×3 convolutions without bias and their batch norms, and a 1×1 projection with
    batch norm where the shape changes."""
    p = conv_params(c_in, c_out, bias=False) + conv_params(c_out, c_out, bias=False) + 2 * 2 * c_out
    if stride != 1 or c_in != c_out:
        p += conv_params(c_in, c_out, k=1, bias=False) + 2 * c_out
    return p


def resnet_params(width, stages, blocks, classes=10) -> int:
    total, c_in = conv_params(3, width, bias=False) + 2 * width, width
    for stage in range(stages):
        c_out = width * 2 ** stage
        for b in range(blocks):
            total += basic_block_params(c_in, c_out, 2 if b == 0 and stage > 0 else 1)
            c_in = c_out
    return total + c_in * classes + classes


def block_layout(model, stages):
    """Per block: (c_in, c_out, stride, projection shortcut?)."""
    out = []
    for stage in range(1, stages + 1):
        for block in getattr(model, f"layer{stage}"):
            shortcut = getattr(block, "downsample", None) or getattr(block, "shortcut", None)
            projection = shortcut is not None and len(shortcut) > 0
            if projection:
                assert isinstance(shortcut[0], torch.nn.Conv2d) and shortcut[0].kernel_size == (1, 1)
                assert isinstance(shortcut[1], torch.nn.BatchNorm2d)
            out.append((block.conv1.in_channels, block.conv2.out_channels, block.conv1.stride[0], projection))
    return out


def test_resnet20_is_relaysum_resnet20_with_its_init():
    torch.manual_seed(0)
    model = d.build_model(CIFAR_SHAPE, "resnet20")
    assert (model.conv1.in_channels, model.conv1.out_channels, model.conv1.kernel_size, model.conv1.stride) == \
        (3, 16, (3, 3), (1, 1))
    assert block_layout(model, 3) == ([(16, 16, 1, False)] * 3 + [(16, 32, 2, True)] + [(32, 32, 1, False)] * 2
                                      + [(32, 64, 2, True)] + [(64, 64, 1, False)] * 2)
    assert (model.fc.in_features, model.fc.out_features) == (64, 10)
    assert check_conv_init(model) == 1 + 18 + 2  # the stem, 9 blocks of 2, 2 projections
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(norms) == 21 and all(bool((m.weight == 1).all()) and bool((m.bias == 0).all()) for m in norms)
    check_default_linear_init(model.fc)
    from_architecture = resnet_params(16, 3, 3)
    print(f"resnet20: {count(model):,} parameters (from the architecture: {from_architecture:,})")
    assert count(model) == from_architecture == 272_474
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_resnet18_is_the_powersgd_papers():
    torch.manual_seed(0)
    model = d.build_model(CIFAR_SHAPE, "resnet18")
    assert isinstance(model, CifarResNet18) and "resnet18" in d.MODELS and "resnet18" in d.IMAGE_MODELS
    assert (model.conv1.kernel_size, model.conv1.stride, model.conv1.out_channels) == ((3, 3), (1, 1), 64)
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in model.modules())
    layout = block_layout(model, 4)
    assert layout == [(64, 64, 1, False)] * 2 + [(64, 128, 2, True), (128, 128, 1, False),
                                                   (128, 256, 2, True), (256, 256, 1, False),
                                                   (256, 512, 2, True), (512, 512, 1, False)]
    names = dict(model.named_parameters())
    assert {"layer4.1.conv2.weight", "layer4.0.shortcut.0.weight", "linear.weight"} <= set(names)
    from_architecture = resnet_params(64, 4, 2)
    print(f"resnet18: {count(model):,} parameters (from the architecture: {from_architecture:,})")
    assert count(model) == from_architecture == 11_173_962
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_describe_setup_names_model_parameters_and_pipeline(cifar_dir):
    folder, _ = cifar_dir
    data = d.load_data("cifar10", str(folder), seed=0)
    setup = d.describe_setup("cifar10", "vgg11", data)
    assert setup["model"] == "vgg11" and setup["model_parameters"] == 9_750_922
    assert "epfml/relaysgd" in setup["model_source"]
    assert setup["data_pipeline"] == ("training: random crop 32, padding 4 (black); horizontal flip p=0.5; "
                                      "normalised by mean (0.4914, 0.4822, 0.4465) std (0.2023, 0.1994, 0.2010); "
                                      "test: normalised only")
    assert d.describe_setup("cifar10", "resnet18") == {**setup, "model": "resnet18",
                                                      "model_parameters": 11_173_962,
                                                      "model_source": d.MODEL_SOURCES["resnet18"]}
    assert "no augmentation" in d.describe_setup("digits", None)["data_pipeline"]
    assert "9,750,922 parameters" in d.setup_line(setup)


def test_catalog_reads_weight_decay_from_the_protocols():
    from bagua_algos.experiments.protocol import PROTOCOLS
    from bagua_algos.experiments.reproduce.catalog import BY_NAME, weight_decay_words

    assert not PROTOCOLS["powersgd"].decay_norm
    text = BY_NAME["seed001-table1"].seed_scale_differs
    assert weight_decay_words(PROTOCOLS["powersgd"]) in text and "0 on normalisation layers" in text
    assert "also on batch-norm" not in text and "no data augmentation" not in text
    assert "protocol relaysum:" in BY_NAME["seed002-fig5.1"].seed_scale_differs
    assert "relaysum_no_momentum" in BY_NAME["relaysum-table2"].seed_scale_differs
    changed = dataclasses.replace(PROTOCOLS["powersgd"], decay_norm=True)
    assert weight_decay_words(changed).endswith("also on normalisation layers")


# ---------------------------------------------------------------- augmentation


@pytest.mark.parametrize("device", DEVICES)
def test_crop_flip_shifts_with_fill_and_mirrors_exactly(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 3, 32, 32, generator=g).to(device)  # [W, B, C, H, W]
    p = 4
    full = lambda v: torch.full((2, 3), v, dtype=torch.long)  # noqa: E731
    no = torch.zeros(2, 3, dtype=torch.bool)
    assert torch.equal(d.crop_flip(x, full(p), full(p), no), x)  # the centre crop: the image itself
    assert torch.equal(d.crop_flip(x, full(p), full(p), ~no), x.flip(-1))  # an exact mirror image
    dy, dx = 1, 7  # the window 3 rows up and 3 columns right of the centre
    out = d.crop_flip(x, full(dy), full(dx), no, p, fill=0.0)
    expected = torch.zeros_like(x)
    expected[..., p - dy:, :32 - (dx - p)] = x[..., :32 - (p - dy), dx - p:]
    assert torch.equal(out, expected)
    # flipped: the mirror image of the same window; a per-channel fill
    fill = (-1.0, -2.0, -3.0)
    out = d.crop_flip(x, full(dy), full(dx), ~no, p, fill=fill)
    expected = torch.empty_like(x)
    expected[:] = torch.tensor(fill, device=device).view(3, 1, 1)
    expected[..., p - dy:, :32 - (dx - p)] = x[..., :32 - (p - dy), dx - p:]
    assert torch.equal(out, expected.flip(-1))


def all_crops(image: torch.Tensor, fill, p: int = 4) -> list:
    """Every image the papers' transform can make of ``image`` [C, H, W]."""
    candidates = []
    for flip in (False, True):
        for dy in range(2 * p + 1):
            for dx in range(2 * p + 1):
                candidates.append(d.crop_flip(image, torch.tensor(dy), torch.tensor(dx), torch.tensor(flip), p, fill))
    return candidates


@pytest.mark.parametrize("device", DEVICES)
def test_cifar_augmentation_is_seeded_per_worker_and_step(device):
    aug = d.CifarAugmentation(seed=5)
    x = torch.randn(4, 8, 3, 32, 32, generator=torch.Generator().manual_seed(1)).to(device)
    out = aug(x, 2, 7, range(4))
    assert out.shape == x.shape and out.device == x.device
    assert torch.equal(out, aug(x, 2, 7, range(4)))  # the same draws for the same (seed, epoch, step)
    for w in range(4):  # the engine's stacked call and one worker's own call (--engine processes) agree
        assert torch.equal(out[w], aug(x[w], 2, 7, w))
    assert not torch.equal(out, aug(x, 2, 8, range(4)))
    assert not torch.equal(out, d.CifarAugmentation(seed=6)(x, 2, 7, range(4)))
    assert torch.equal(aug.with_seed(6)(x, 2, 7, range(4)), d.CifarAugmentation(seed=6)(x, 2, 7, range(4)))
    # every output image is one of the 162 crops and flips of its input, padded with normalised black
    fill = tuple(-m / s for m, s in zip(d.CIFAR_MEAN, d.CIFAR_STD))
    for w, b in [(0, 0), (1, 3), (3, 7)]:
        assert sum(torch.equal(c, out[w, b]) for c in all_crops(x[w, b], fill)) == 1
    dy, dx, flip = d.draw_crop_flip((4000,), torch.Generator().manual_seed(0))
    assert (int(dy.min()), int(dy.max()), int(dx.min()), int(dx.max())) == (0, 8, 0, 8)
    assert abs(float(flip.float().mean()) - 0.5) < 0.05  # flipped with probability 1/2
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        d.CifarAugmentation(seed=-1)
    with pytest.raises(ValueError, match="3 workers for a batch of shape"):
        aug(x, 0, 0, range(3))


class _RecordingEngine:
    """The engine's surface StackedWorkers uses, recording what it is given."""

    def __init__(self, n):
        self.n, self.steps, self.predicted = n, [], []
        self.model = SimpleNamespace(predict=self.predict)

    def step(self, x, y, loss_fn):
        self.steps.append(x.clone())
        return torch.zeros(self.n)

    def predict(self, x, with_average=False):
        self.predicted.append(x)
        return torch.zeros(self.n + 1, len(x), dtype=torch.long)


def test_training_augments_train_batches_only(cifar_dir):
    from bagua_algos.experiments.training import StackedWorkers, train_epochs

    folder, _ = cifar_dir
    data = d.load_data("cifar10", str(folder), seed=0)
    engine = _RecordingEngine(2)
    index = torch.arange(16).view(2, 8)
    workers = StackedWorkers(engine, data, lambda epoch: iter([index, index + 16]))
    train_epochs(workers, epochs=2)
    assert len(engine.steps) == 4
    for k, x in enumerate(engine.steps):
        epoch, step = divmod(k, 2)
        raw = data.train_x[index + 16 * step]
        assert torch.equal(x, data.train_augment(raw, epoch, step, range(2))) and not torch.equal(x, raw)
    assert all(p is data.test_x for p in engine.predicted)  # test images: as loaded, normalised only


class _Recorder(torch.nn.Module):
    """A model that keeps every input it is given."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(3 * 32 * 32, 10))
        self.inputs = []

    def forward(self, x):
        self.inputs.append(x.detach().clone())
        return x.flatten(1) @ self.weight


def test_both_engines_crop_and_flip_each_workers_batch_alike(cifar_dir, monkeypatch):
    """The engine's stacked batches (WorkerShares) and each rank's own loader over its
    DistributedHeterogeneousSampler (--engine processes) get the same augmented images."""
    from torch.utils.data import DataLoader, TensorDataset

    from bagua_algos.experiments.training import ProcessWorker, StackedWorkers
    from bagua_algos.runtime import comm
    from samplers import DistributedHeterogeneousSampler, WorkerShares

    folder, _ = cifar_dir
    data = d.load_data("cifar10", str(folder), seed=4)
    n, alpha, batch = 4, 0.5, 8
    shares = WorkerShares(data.train_y, n, alpha, seed=4)
    engine = _RecordingEngine(n)
    stacked = StackedWorkers(engine, data, lambda epoch: shares.batches(epoch, batch))
    for epoch in range(2):
        for index in stacked.batches(epoch):
            stacked.step(index)
    for rank in range(n):
        monkeypatch.setattr(comm, "get_rank", lambda: rank)
        dataset = TensorDataset(data.train_x, data.train_y)
        sampler = DistributedHeterogeneousSampler(dataset, num_replicas=n, rank=rank, alpha=alpha, seed=4,
                                                  labels=data.train_y)
        model = _Recorder()
        worker = ProcessWorker(model, torch.optim.SGD(model.parameters(), lr=0.0), DataLoader(
            dataset, batch_size=batch, sampler=sampler), sampler, None, data.train_augment)
        for epoch in range(2):
            for one in worker.batches(epoch):
                worker.step(one)
        assert len(model.inputs) == len(engine.steps) > 2
        for mine, everyone in zip(model.inputs, engine.steps):
            assert torch.equal(mine, everyone[rank])


# ---------------------------------------------------------------- the sweep


def test_sixteen_worker_vgg11_sweep_on_the_engine(cifar_dir, tmp_path, capsys):
    from bagua_algos.experiments.sweep.cli import main

    folder, _ = cifar_dir
    out = tmp_path / "sweep"
    started = time.perf_counter()
    main(["--dataset", "cifar10", "--data-dir", str(folder), "--model", "vgg11", "--workers", "16",
          "--epochs", "1", "--max-steps-per-epoch", "1", "--configs", "allreduce_average", "--alphas", "1",
          "--engine", "sim", "--jobs", "1", "--lr", "0.05", "--out-dir", str(out), "--no-progress"])
    seconds = time.perf_counter() - started
    captured = capsys.readouterr()
    with capsys.disabled():
        print(f"\n16-worker VGG-11 sweep (1 step of 5 images a worker): {seconds:.1f} s")
    assert "model vgg11 (9,750,922 parameters" in captured.err
    assert "random crop 32, padding 4" in captured.err
    report = json.loads((out / "results.json").read_text())
    assert report["setup"]["model_parameters"] == 9_750_922
    assert report["setup"]["data_pipeline"].startswith("training: random crop 32, padding 4")
    (run,) = report["all_runs"]
    assert len(run["worker_accuracies"]) == 16 and math.isfinite(run["curve_train_loss"][0])
    assert seconds < 240


class _Payload:
    """What a hostile batch file would hold: unpickling it would create ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_cifar_batch_is_data_a_pickled_payload_in_it_never_runs(cifar_dir, capsys):
    folder, _ = cifar_dir
    marker = folder / "ran"
    with open(folder / "cifar-10-batches-py" / "data_batch_2", "wb") as f:
        pickle.dump({b"data": _Payload(marker), b"labels": [0]}, f, protocol=2)
    with pytest.raises(ValueError, match=r"--data-dir: .*data_batch_2 is not a CIFAR-10 python batch \(posix\.system"):
        d.load_data("cifar10", str(folder), seed=0)
    assert not marker.exists()
    # through the sweep's command line: one line, exit 2, nothing run
    from bagua_algos.experiments.sweep import cli

    with pytest.raises(SystemExit) as stop:
        cli.main(["--dataset", "cifar10", "--data-dir", str(folder), "--model", "vgg11", "--epochs", "1",
                  "--configs", "allreduce_average", "--alphas", "1", "--no-progress", "--out-dir",
                  str(folder / "out")])
    assert stop.value.code == 2
    assert "not a CIFAR-10 python batch" in capsys.readouterr().err
    assert not marker.exists()
