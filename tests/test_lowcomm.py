"""SparseLoCo, DeMo and SPARTA (bagua_algos/algorithms/sparseloco.py, demo.py, sparta.py)
against oracles written from their rules: n copies of a model in one process, plain
torch. SparseLoCo: H inner steps, e ← β e + Δ, the k largest entries of each chunk
quantized by the reference's statistical quantizer, e ← e − s, θ ← θ_outer − α·mean_r s_r.
DeMo (as demo.py): m ← β m + g, each chunk's DCT, its top-k coefficients sent and taken
out of m, each coefficient the mean of its senders' values, the sign of the inverse DCT
as the gradient of SGD without momentum. SPARTA: after every step the same random places
averaged over the copies; with H, DiLoCo's outer Nesterov step after steps H, 2H, ….

Each runs on the one-process engine and as gloo processes (one spawn for every case: a
module-scoped fixture), on engine_cases' data and model (tanh in place of ReLU, see
_model); the bytes a worker hands to collectives each step are the count of what it
sends (positions, values, tables); a checkpoint resumes bit for bit; bad arguments are
refused by name."""

from __future__ import annotations

import math
import warnings
import zlib

import pytest
import torch

import engine_cases
from bagua_algos.experiments.gloo_workers import run_workers

N, STEPS = 4, 20  # H = 3 below: six synchronisations, and the run ends two steps after the last
SIGN_LR, SIGN_WD = 0.01, 1e-4  # DeMo's SGD: no momentum (the momentum is DeMo's own)

CASES = [
    ("sparseloco", "sparseloco", {"sync_every": 3, "chunk": 8, "topk_density": 0.1, "bits": 2, "ef_decay": 0.9,
                                  "outer_lr": 0.8}),
    ("sparseloco_4bit", "sparseloco", {"sync_every": 3, "chunk": 4, "topk_density": 0.3, "bits": 4,
                                       "ef_decay": 0.95, "outer_lr": 1.0, "range_sigmas": 4.0}),
    ("demo", "demo", {"chunk": 8, "topk": 4, "decay": 0.9}),
    ("demo_defaults", "demo", {}),
    ("sparta", "sparta", {"fraction": 0.05, "seed": 3}),
    ("sparta_diloco", "sparta", {"fraction": 0.02, "sync_every": 3}),
]
LABELS = [case[0] for case in CASES]
# (label, name, kwargs, the bucket whose saved state is returned)
RESUMES = [
    ("sparseloco", "sparseloco", {"sync_every": 3, "chunk": 8, "topk_density": 0.1}, "fragment0"),
    ("demo", "demo", {"chunk": 8, "topk": 4}, "0"),
    ("sparta_diloco", "sparta", {"fraction": 0.05, "sync_every": 3}, "fragment0"),
]


def _model():
    """engine_cases' model with tanh for ReLU: no unit is dead, so no coordinate's update
    is exactly zero (where it is, DeMo's sign is the sign of rounding noise, demo.py's
    too, and two orders of the same sums may disagree on it)."""
    torch.manual_seed(engine_cases.SEED)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4))


def _optimizer(name, params):
    if name == "demo":
        return torch.optim.SGD(params, lr=SIGN_LR, weight_decay=SIGN_WD)
    return engine_cases.optimizer(params)


# ------------------------------------------------------------------ the oracles

def _batches(steps=STEPS):
    """[N, BATCH] indices per step: each worker's share (as the engine draws them)."""
    from samplers import WorkerShares

    _, y = engine_cases.data()
    shares = WorkerShares(y, N, engine_cases.ALPHA, engine_cases.SEED)
    out, epoch = [], 0
    while len(out) < steps:
        out += list(shares.batches(epoch, engine_cases.BATCH))[:steps - len(out)]
        epoch += 1
    return out


def _train(name, before_step=None, after_step=None):
    """[N, d] parameters (registration order) of N copies after STEPS steps, each on its
    own batches; ``before_step(models)`` may rewrite the gradients, ``after_step(step,
    models)`` the parameters."""
    x, y = engine_cases.data()
    models = [_model() for _ in range(N)]
    opts = [_optimizer(name, m.parameters()) for m in models]
    for step, index in enumerate(_batches(), start=1):
        for i, (model, opt) in enumerate(zip(models, opts)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[index[i]]), y[index[i]]).backward()
        if before_step is not None:
            before_step(models)
        for opt in opts:
            opt.step()
        if after_step is not None:
            with torch.no_grad():
                after_step(step, models)
    return torch.stack([torch.nn.utils.parameters_to_vector(m.parameters()).detach() for m in models])


def _side(n, chunk):
    """The largest divisor of n at most chunk (demo.py's _get_smaller_split)."""
    return max(d for d in range(1, min(n, chunk) + 1) if n % d == 0)


def _chunks(t, chunk):
    """A tensor's chunks [C, L] as the references rearrange it: '(y h) (x w) -> y x (h w)'
    for a matrix, '(c s) -> c s' for a vector; and the inverse."""
    if t.dim() == 2:
        h, w = _side(t.shape[0], chunk), _side(t.shape[1], chunk)
        blocks = t.reshape(t.shape[0] // h, h, t.shape[1] // w, w).permute(0, 2, 1, 3)
        return blocks.reshape(-1, h * w), lambda c: c.reshape(blocks.shape).permute(0, 2, 1, 3).reshape(t.shape)
    s = _side(t.numel(), chunk)
    return t.reshape(-1, s), lambda c: c.reshape(t.shape)


def _sparseloco_oracle(sync_every, chunk, topk_density, bits, ef_decay, outer_lr, range_sigmas=6.0):
    """The paper's rule (SparseLoCo Algorithm 1), with the reference's chunks and quantizer."""
    bins = 2 ** bits
    outer = {name: p.detach().clone().requires_grad_() for name, p in _model().named_parameters()}
    outer_opt = torch.optim.SGD(list(outer.values()), lr=outer_lr)  # no momentum
    errors = [{name: torch.zeros_like(p) for name, p in outer.items()} for _ in range(N)]

    def quantize(v):  # the reference's TopKCompressor._quantize, then _dequantize
        shift = v.mean()
        c = v - shift
        std = c.norm() / math.sqrt(c.numel() - 1) if c.numel() > 1 else torch.tensor(0.0)
        scale = range_sigmas * std / bins
        if scale == 0 or not torch.isfinite(scale):
            scale = torch.tensor(1.0)
        q = (c / scale + bins // 2).round().clamp(0, bins - 1).long()
        sums = torch.zeros(bins).scatter_add_(0, q, c)
        counts = torch.zeros(bins).scatter_add_(0, q, torch.ones_like(c))
        table = torch.where(counts > 0, sums / counts, 0.0)
        return table[q] + shift

    def after_step(step, models):
        if step % sync_every:
            return
        sent = []
        for r, model in enumerate(models):
            mine = {}
            for name, p in model.named_parameters():
                e = errors[r][name]
                e.copy_(ef_decay * e + (outer[name].detach() - p))  # e ← β e + Δ
                c, back = _chunks(e, chunk)
                k = min(c.shape[1], max(1, round(c.shape[1] * topk_density)))
                idx = c.abs().topk(k, dim=-1).indices
                values = quantize(c.gather(-1, idx).reshape(-1)).reshape(idx.shape)
                s = back(torch.zeros_like(c).scatter_(-1, idx, values))
                e.sub_(s)  # e ← e − s
                mine[name] = s
            sent.append(mine)
        for name, p in outer.items():
            total = torch.zeros_like(p)
            for mine in sent:
                total = total + mine[name]
            p.grad = total / N  # θ ← θ_outer − α · mean_r s_r
        outer_opt.step()
        for model in models:
            for name, p in model.named_parameters():
                p.copy_(outer[name])

    return _train("sparseloco", after_step=after_step)


def _dct_rows(n):
    """f[j, b] = DCT-II(e_j)[b], orthonormal (demo.py's _dct(eye(n), norm="ortho"))."""
    j = torch.arange(n, dtype=torch.float64)[:, None]
    b = torch.arange(n, dtype=torch.float64)[None, :]
    f = torch.cos(math.pi * (2 * j + 1) * b / (2 * n)) * math.sqrt(2.0 / n)
    f[:, 0] = math.sqrt(1.0 / n)
    return f.float()


def _demo_encode(t, chunk):
    """demo.py's TransformDCT.encode then CompressDCT's flattening: [chunks, coefficients]."""
    if t.dim() == 2:
        h, w = _side(t.shape[0], chunk), _side(t.shape[1], chunk)
        x = t.reshape(t.shape[0] // h, h, t.shape[1] // w, w)
        c = torch.einsum("yhxw,hb,wd->yxbd", x, _dct_rows(h), _dct_rows(w))
        return c.reshape(c.shape[0], c.shape[1], h * w)
    s = _side(t.numel(), chunk)
    return torch.einsum("cs,sb->cb", t.reshape(-1, s), _dct_rows(s))


def _demo_decode(c, t, chunk):
    """demo.py's TransformDCT.decode (its _idct basis is the transpose)."""
    if t.dim() == 2:
        h, w = _side(t.shape[0], chunk), _side(t.shape[1], chunk)
        x = torch.einsum("yxbd,hb,wd->yhxw", c.reshape(*c.shape[:2], h, w), _dct_rows(h), _dct_rows(w))
        return x.reshape(t.shape)
    s = _side(t.numel(), chunk)
    return torch.einsum("cb,sb->cs", c, _dct_rows(s)).reshape(t.shape)


def _demo_oracle(chunk=64, topk=32, decay=0.999):
    """demo.py's DeMo.step, the momentum without its lr factor (the paper's m ← βm + g)."""
    momenta = [None] * N

    def before_step(models):
        for r, model in enumerate(models):
            if momenta[r] is None:
                momenta[r] = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
        names = [name for name, _ in models[0].named_parameters()]
        for name in names:
            params = [dict(m.named_parameters())[name] for m in models]
            indices, values = [], []
            for r, p in enumerate(params):
                m = momenta[r][name]
                m.copy_(decay * m + p.grad)
                c = _demo_encode(m, chunk)
                k = min(topk, c.shape[-1])
                idx = c.abs().topk(k, dim=-1, largest=True, sorted=False).indices
                val = c.gather(-1, idx)
                m.sub_(_demo_decode(torch.zeros_like(c).scatter_(-1, idx, val), m, chunk))
                indices.append(idx)
                values.append(val)
            grid = torch.zeros_like(c).scatter_reduce_(-1, torch.cat(indices, -1), torch.cat(values, -1), "mean",
                                                       include_self=False)
            direction = _demo_decode(grid, params[0], chunk)
            for p in params:
                p.grad.copy_(direction.sign())

    return _train("demo", before_step=before_step)


def _sparta_places(size, fraction, seed, names, generator):
    """The same places on every copy, from a generator seeded from (seed, the bucket's
    tensor names) (the module's rule): where 8k <= size, the first k distinct values of
    batches of k + k²//size + 8 uniform draws (read one by one here), ascending; else the
    first k of a permutation."""
    if generator[0] is None:
        generator[0] = torch.Generator().manual_seed((seed * 0x9E3779B1 + zlib.crc32(names.encode())) % 2**63)
    k = min(size, max(1, round(fraction * size)))
    if 8 * k > size:
        return torch.randperm(size, generator=generator[0])[:k].sort().values
    picked = []
    while len(picked) < k:
        for value in torch.randint(size, (k + k * k // size + 8,), generator=generator[0]).tolist():
            if value not in picked and len(picked) < k:
                picked.append(value)
    return torch.tensor(sorted(picked))


def _sparta_oracle(fraction, seed=0, sync_every=None):
    """Every step the places' mean over the copies written back (the bucket: the parameters
    in reverse registration order); with H, DiLoCo's outer SGD (0.7, Nesterov 0.9)."""
    model = _model()
    names = [name for name, _ in model.named_parameters()][::-1]
    outer = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
    outer_opt = torch.optim.SGD(list(outer.values()), lr=0.7, momentum=0.9, nesterov=True)
    generator = [None]

    def after_step(step, models):
        flats = torch.stack([torch.cat([dict(m.named_parameters())[n].reshape(-1) for n in names]) for m in models])
        places = _sparta_places(flats.shape[1], fraction, seed, ",".join(names), generator)
        flats[:, places] = flats[:, places].mean(0)
        for m, flat in zip(models, flats):
            offset = 0
            for n in names:
                p = dict(m.named_parameters())[n]
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        if sync_every and step % sync_every == 0:
            for n, p in outer.items():
                p.grad = p.detach() - torch.stack([dict(m.named_parameters())[n] for m in models]).mean(0)
            outer_opt.step()
            for m in models:
                for n, p in m.named_parameters():
                    p.copy_(outer[n])

    return _train("sparta", after_step=after_step)


def _oracle(name, kwargs):
    if name == "sparseloco":
        return _sparseloco_oracle(**kwargs)
    if name == "demo":
        return _demo_oracle(**kwargs)
    return _sparta_oracle(**kwargs)


# ------------------------------------------------------------------ engine and processes

def _engine(name, kwargs):
    """The engine's [N, d] parameters and the bytes a worker handed to collectives each step."""
    from bagua_algos import Algorithm
    from bagua_algos.engine import Engine
    from bagua_algos.runtime import comm

    x, y = engine_cases.data()
    net = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (none expected: DeMo trains with SGD without momentum)
        engine = Engine(net, N, Algorithm.init(name, **kwargs), lambda params: _optimizer(name, params))
    sent = []
    for index in _batches():
        comm.reset_bytes_sent()
        engine.step(x[index], y[index], torch.nn.functional.cross_entropy)
        sent.append(comm.bytes_sent())
    names = [n for n, _ in net.named_parameters()]
    params = torch.stack([torch.cat([engine.model.worker_state(i)[n].reshape(-1) for n in names]) for i in range(N)])
    return params, sent


def _process_run(rank, world, name, kwargs):
    """In a gloo worker: this rank's parameters after STEPS steps, and its bytes each step."""
    from torch.utils.data import DataLoader, TensorDataset

    from bagua_algos import Algorithm
    from bagua_algos.runtime import comm
    from samplers import DistributedHeterogeneousSampler

    x, y = engine_cases.data()
    net = _model()
    opt = _optimizer(name, net.parameters())
    net = net.with_bagua([opt], Algorithm.init(name, **kwargs))
    sampler = DistributedHeterogeneousSampler(TensorDataset(x, y), num_replicas=world, rank=rank,
                                              alpha=engine_cases.ALPHA, seed=engine_cases.SEED, labels=y)
    loader = DataLoader(TensorDataset(x, y), batch_size=engine_cases.BATCH, sampler=sampler)
    sent, epoch = [], 0
    while len(sent) < STEPS:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            if len(sent) == STEPS:
                break
            comm.reset_bytes_sent()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xb), yb).backward()
            opt.step()
            sent.append(comm.bytes_sent())
        epoch += 1
    net.bagua_ddp.detach()
    return torch.nn.utils.parameters_to_vector(net.parameters()).detach().clone(), sent


def _worker(rank, world, cases, resumes):
    out = {"runs": {label: _process_run(rank, world, name, kwargs) for label, name, kwargs in cases}, "resumed": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (checkpoint_resume's SGD has momentum: DeMo warns)
        for label, name, kwargs, bucket in resumes:
            same, saved = engine_cases.checkpoint_resume(rank, world, name, kwargs, bucket)
            out["resumed"][label] = (same, sorted(saved))
    return out


@pytest.fixture(scope="module")
def per_rank():
    return run_workers(_worker, N, CASES, RESUMES, timeout=240)


@pytest.fixture(scope="module")
def engine_runs():
    return {label: _engine(name, kwargs) for label, name, kwargs in CASES}


def _bound(expected):
    return 1e-5 * float(expected.abs().max())


@pytest.mark.parametrize("label,name,kwargs", CASES, ids=LABELS)
def test_the_engine_follows_the_rule(engine_runs, label, name, kwargs):
    expected = _oracle(name, kwargs)
    got, _ = engine_runs[label]
    assert (got - expected).abs().max() <= _bound(expected), f"{label}: {float((got - expected).abs().max()):.3g}"
    start = torch.nn.utils.parameters_to_vector(_model().parameters()).detach()
    assert (got - start).abs().max() > 1e-3  # it trained
    if name == "demo":
        assert (got - got[0]).abs().max() == 0  # every worker applies the same signs
    else:
        assert (got - got[0]).abs().max() > 1e-4  # the copies drift between averages


@pytest.mark.parametrize("label,name,kwargs", CASES, ids=LABELS)
def test_every_engine_worker_equals_its_process(per_rank, engine_runs, label, name, kwargs):
    expected = torch.stack([per_rank[rank]["runs"][label][0] for rank in range(N)])
    got, _ = engine_runs[label]
    assert (got - expected).abs().max() <= _bound(expected), f"{label}: {float((got - expected).abs().max()):.3g}"


def _sparseloco_message(shapes, chunk, topk_density, bits, **_):
    """Positions (int16), levels (bits each, packed), per tensor a shift and a table of
    2^bits levels (float32)."""
    count = 0
    for shape in shapes:
        if len(shape) == 2:
            length = _side(shape[0], chunk) * _side(shape[1], chunk)
        else:
            length = _side(shape[0], chunk)
        chunks = math.prod(shape) // length
        count += chunks * min(length, max(1, round(length * topk_density)))
    return 2 * count + math.ceil(count * bits / 8) + len(shapes) * (1 + 2 ** bits) * 4


def _demo_message(shapes, chunk=64, topk=32, **_):
    """Per chunk min(topk, length) coefficients: float32 values and int16 positions."""
    count = 0
    for shape in shapes:
        length = (_side(shape[0], chunk) * _side(shape[1], chunk)) if len(shape) == 2 else _side(shape[0], chunk)
        count += math.prod(shape) // length * min(topk, length)
    return count * (4 + 2)


def _expected_bytes(name, kwargs):
    """What a worker sends at each of the STEPS steps."""
    shapes = [tuple(p.shape) for p in _model().parameters()]
    d = sum(math.prod(s) for s in shapes)
    if name == "sparseloco":
        settings = {"chunk": 64, "topk_density": 0.02, "bits": 2, **kwargs}
        return [_sparseloco_message(shapes, **settings) if step % kwargs["sync_every"] == 0 else 0
                for step in range(1, STEPS + 1)]
    if name == "demo":
        return [_demo_message(shapes, **kwargs)] * STEPS
    places = min(d, max(1, round(kwargs["fraction"] * d))) * 4
    sync = kwargs.get("sync_every")
    return [places + (4 * d if sync and step % sync == 0 else 0) for step in range(1, STEPS + 1)]


@pytest.mark.parametrize("label,name,kwargs", CASES, ids=LABELS)
def test_the_bytes_a_worker_sends_are_its_message(per_rank, engine_runs, label, name, kwargs):
    expected = _expected_bytes(name, kwargs)
    for rank in range(N):
        assert per_rank[rank]["runs"][label][1] == expected, f"{label}, rank {rank}"
    assert engine_runs[label][1] == expected, label
    d = sum(p.numel() for p in _model().parameters())
    assert sum(expected) < STEPS * 4 * d / 2  # a fraction of what averaging every step would send


@pytest.mark.parametrize("numel,k", [(16, 2), (6, 3)])  # the draws' path (8k <= numel), the permutation's
def test_sparta_places_are_a_uniform_subset(numel, k):
    """Every k-subset of a small bucket about equally often (each expects 100 of the
    draws; 5 sigma either side), k distinct places, ascending."""
    from bagua_algos.algorithms.sparta import sparta_places

    generator = torch.Generator().manual_seed(0)
    subsets = math.comb(numel, k)
    counts = {}
    for _ in range(100 * subsets):
        places = sparta_places(numel, k, generator)
        assert places.dtype == torch.int64 and len(places) == k
        assert (places.diff() > 0).all() and 0 <= places.min() and places.max() < numel
        counts[tuple(places.tolist())] = counts.get(tuple(places.tolist()), 0) + 1
    assert len(counts) == subsets
    assert all(abs(c - 100) < 5 * math.sqrt(100) for c in counts.values()), counts


def test_sparta_places_of_a_large_bucket_are_distinct_and_cover_it():
    """10**7 places, k = 5000 (the default fraction): k distinct, spread over the whole range."""
    from bagua_algos.algorithms.sparta import sparta_places

    places = sparta_places(10**7, 5000, torch.Generator().manual_seed(1))
    assert len(places) == 5000 == len(places.unique())
    assert places.min() < 10**5 and places.max() > 10**7 - 10**5
    # a tenth of the range holds about a tenth of the places (500 expected, sd ~21)
    assert abs(int((places < 10**6).sum()) - 500) < 110


def test_sparseloco_sends_about_a_percent_of_the_pseudo_gradient_at_the_defaults():
    """A 4096 × 4096 matrix in 64 × 64 chunks, 82 of 4096 entries a chunk, and its bias
    in 64 chunks of 64, one entry each: 2 bits a value, int16 positions, two tables."""
    from bagua_algos.algorithms import SparseLoCoAlgorithm
    from bagua_algos.compression.chunked_topk import QuantizedTopKCodec

    defaults = SparseLoCoAlgorithm()
    codec = QuantizedTopKCodec([(4096, 4096), (4096,)], defaults.chunk, defaults.topk_density, defaults.bits,
                               defaults.range_sigmas)
    entries = 4096 * 82 + 64 * 1
    assert codec.message_bytes == entries * 2 + math.ceil(entries * 2 / 8) + 2 * (1 + 4) * 4
    assert 0.010 < codec.message_bytes / (4 * (4096 * 4096 + 4096)) < 0.012


def test_a_sparseloco_message_holds_each_chunks_largest_entries_at_four_levels_a_tensor():
    """Per chunk its k largest entries by magnitude, every tensor's sent values on at most
    2^bits levels; what the message stands for is zero elsewhere."""
    from bagua_algos.compression.chunked_topk import QuantizedTopKCodec

    codec = QuantizedTopKCodec([(24, 12), (10,)], 8, 0.1, 2, 6.0)  # 6 chunks of 8 x 6, k = 5; 2 of 5, k = 1
    rows = torch.randn(3, 298, generator=torch.Generator().manual_seed(0))
    message = codec.encode(rows)
    assert message.shape == (3, codec.message_bytes) and codec.k == 6 * 5 + 2 * 1
    sent = codec.decode(message)
    for row, values in zip(rows, sent):
        matrix, vector = row[:288].view(24, 12), row[288:]
        chosen = values[:288].view(24, 12) != 0
        for y in range(3):
            for x in range(2):
                block, picked = matrix[8 * y:8 * y + 8, 6 * x:6 * x + 6], chosen[8 * y:8 * y + 8, 6 * x:6 * x + 6]
                assert picked.sum() == 5
                assert block.abs()[picked].min() >= block.abs()[~picked].max()
        assert [int(vector[5 * c:5 * c + 5].abs().argmax()) for c in range(2)] == [
            int(values[288 + 5 * c:288 + 5 * c + 5].abs().argmax()) for c in range(2)]
        assert len(set(values[:288][chosen.view(-1)].tolist())) <= 4


@pytest.mark.parametrize("label", [r[0] for r in RESUMES])
def test_a_checkpoint_resumes_bit_for_bit(per_rank, label):
    keys = {"sparseloco": ["diloco_outer", "diloco_outer_steps", "sparseloco_error"],
            "demo": ["error"],
            "sparta_diloco": ["diloco_momentum", "diloco_outer", "diloco_outer_steps", "sparta_rng_state"]}[label]
    for rank in range(N):
        same, saved = per_rank[rank]["resumed"][label]
        assert same, f"{label}, rank {rank}"
        assert saved == keys


@pytest.mark.parametrize("name,kwargs,match", [
    ("sparseloco", {"sync_every": 0}, "sync_every must be the inner steps"),
    ("sparseloco", {"topk_density": 0}, "topk_density must be the share"),
    ("sparseloco", {"topk_density": 1.5}, "topk_density"),
    ("sparseloco", {"chunk": 0}, "chunk must be a chunk side"),
    ("sparseloco", {"bits": 3}, r"bits must be one of \[1, 2, 4, 8\], got 3"),
    ("sparseloco", {"ef_decay": 1.1}, r"ef_decay must be the accumulator's decay β, in \[0, 1\]"),
    ("sparseloco", {"outer_lr": 0}, "outer_lr must be"),
    ("sparseloco", {"range_sigmas": -1.0}, "range_sigmas must be"),
    ("demo", {"chunk": 1.5}, "chunk must be a chunk side"),
    ("demo", {"topk": 0}, "topk must be the coefficients sent per chunk"),
    ("demo", {"decay": 1.0}, r"decay must be a momentum decay in \[0, 1\)"),
    ("sparta", {"fraction": 0}, r"fraction must be the share of the parameters averaged a step, in \(0, 1\]"),
    ("sparta", {"sync_every": 0}, "sync_every must be None or the inner steps"),
    ("sparta", {"seed": -1}, "seed must be an int >= 0"),
    ("sparta", {"outer_lr": 0.5}, "outer_lr=0.5 sets DiLoCo's outer step, which runs only with sync_every"),
    ("sparta", {"sync_every": 3, "outer_momentum": 1.0}, "outer_momentum must be a momentum in"),
])
def test_bad_arguments_are_refused_by_name(name, kwargs, match):
    from bagua_algos import Algorithm

    with pytest.raises(ValueError, match=match):
        Algorithm.init(name, **kwargs)


def test_demo_warns_about_an_optimizer_with_momentum():
    from bagua_algos import Algorithm
    from bagua_algos.engine import Engine

    with pytest.warns(UserWarning, match="DeMoAlgorithm keeps each worker's momentum"):
        Engine(_model(), 2, Algorithm.init("demo"), engine_cases.optimizer)
