"""A character-level language model on an offline corpus, for the one-process engine.

The corpus is the standard library's ``pydoc_data.topics`` (the texts of ``help()``'s
topics, about 465 kB of English prose and code examples): its values joined in the
order of their sorted keys, one blank line between two. Nothing is downloaded.

- :func:`load_text`: the corpus cut into non-overlapping windows of ``context + 1``
  characters; a window's first ``context`` characters are the input, the ``context``
  characters after each position are the targets (next-character prediction at every
  position). The first 90 % of the windows train, the last 10 % validate (a contiguous
  split: no window of the validation text overlaps a training one). Characters are
  numbered in the sorted order of the characters the whole corpus uses.
- :class:`CharTransformer`: a small causal Transformer (token and position embeddings,
  pre-norm blocks of causal self-attention and a GELU MLP, a final norm and a linear
  head to the vocabulary), written with plain tensor operations so that the engine's
  ``torch.func.vmap`` over ``functional_call`` runs it for all workers at once (a GRU
  or ``nn.MultiheadAttention`` takes paths that vmap does not batch).
- :class:`TextWorkers`: the training loop's stacked workers
  (:class:`bagua_algos.experiments.training.StackedWorkers`) with the sequence loss
  (cross-entropy over every position) and an evaluation that also keeps the validation
  loss of every worker's model and of the averaged model (``last_loss``).

The sweep (``benchmarks/heterogeneity_sweep.py``) does not take this task: its
training loop and evaluation are those of a classifier with one label per sample
(``cross_entropy(logits [B, C], labels [B])``, accuracy from ``argmax(-1)``), and its
Dirichlet shares are shares of labels; a language model has a label per position and
no classes to share out. ``bagua-algos reproduce lowcomm-frontier`` trains it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.func import functional_call, vmap

from bagua_algos.experiments.training import StackedWorkers

__all__ = ["TextData", "load_text", "corpus", "CharTransformer", "TextWorkers", "sequence_loss"]

CONTEXT = 64
VALIDATION_SHARE = 0.1
EVAL_CHUNK = 256  # validation windows a vmapped forward takes at once (read when a TextWorkers is built)


def corpus() -> str:
    """The standard library's help topics, joined in the order of their sorted keys."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


@dataclass
class TextData:
    """Windows of the corpus: ``train_x``/``test_x`` ``[N, context]`` character indices,
    ``train_y``/``test_y`` the next character at each position (int64)."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    vocabulary: str
    name: str = "text"

    @property
    def num_classes(self) -> int:
        return len(self.vocabulary)

    @property
    def image_shape(self) -> tuple:
        """One sample's shape (the name the image tasks use): ``(context,)``."""
        return tuple(self.train_x.shape[1:])

    def to(self, device) -> "TextData":
        return replace(self, **{k: getattr(self, k).to(device) for k in ("train_x", "train_y", "test_x", "test_y")})


def load_text(context: int = CONTEXT, validation_share: float = VALIDATION_SHARE) -> TextData:
    """The corpus in windows of ``context + 1`` characters (module notes); the split is
    the same for every seed (the seeds change the model and the order of the batches)."""
    text = corpus()
    vocabulary = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocabulary)}
    codes = torch.tensor([index[c] for c in text], dtype=torch.int64)
    windows = codes[:(len(codes) // (context + 1)) * (context + 1)].view(-1, context + 1)
    cut = len(windows) - max(1, round(validation_share * len(windows)))
    train, test = windows[:cut], windows[cut:]
    return TextData(train[:, :-1].contiguous(), train[:, 1:].contiguous(), test[:, :-1].contiguous(),
                    test[:, 1:].contiguous(), vocabulary)


class _Block(torch.nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, w = h.shape
        q, k, v = self.qkv(self.norm1(h)).split(w, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(w // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=h.device).triu(1)
        attention = scores.masked_fill(causal, float("-inf")).softmax(-1)
        h = h + self.proj((attention @ v).transpose(1, 2).reshape(b, t, w))
        return h + self.down(F.gelu(self.up(self.norm2(h))))


class CharTransformer(torch.nn.Module):
    """A causal Transformer over characters: ``[B, T]`` indices → ``[B, T, V]`` logits of
    the next character at each position, V the vocabulary padded to a multiple of
    ``pad`` (the corpus's 103 characters: 128), as GPT-2's code pads its vocabulary: a
    prime side would cut the embedding and the head into chunks of one row for the
    chunk-wise compressors (DeMo, SparseLoCo), whose messages carry at least a value a
    chunk. The padding's logits learn to stay low; no target names them."""

    def __init__(self, vocabulary: int, context: int = CONTEXT, width: int = 64, layers: int = 2, heads: int = 4,
                 pad: int = 32):
        super().__init__()
        if width % heads:
            raise ValueError(f"width={width} must be a multiple of heads={heads}")
        vocabulary = -(-vocabulary // pad) * pad
        self.token = torch.nn.Embedding(vocabulary, width)
        self.position = torch.nn.Embedding(context, width)
        self.blocks = torch.nn.Sequential(*(_Block(width, heads) for _ in range(layers)))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocabulary)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[-1], device=x.device)
        h = self.token(x) + self.position(positions)
        return self.head(self.norm(self.blocks(h)))


def sequence_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-character cross-entropy, the mean over every position of every sequence."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TextWorkers(StackedWorkers):
    """The engine's n workers on :class:`TextData`: the sequence loss, and an evaluation
    over the validation windows that returns each worker's next-character accuracy and
    the averaged model's, keeping the validation losses in ``last_loss`` (``workers``:
    every worker's, ``averaged``: the averaged model's)."""

    def __init__(self, engine, data, batches, eval_chunk: int | None = None):
        super().__init__(engine, data, batches, batched_average=True)
        self.eval_chunk = EVAL_CHUNK if eval_chunk is None else eval_chunk
        self.last_loss: dict = {}

    def step(self, index):
        return self.engine.step(self.data.train_x[index], self.data.train_y[index], sequence_loss)

    @torch.no_grad()
    def evaluate(self) -> tuple[list[float], float]:
        stacked = self.engine.model
        module = stacked.module
        module.eval()
        params, buffers = stacked._with_average()  # every worker's rows, then the averaged model's

        def one(p, b, xs, ys):
            logits = functional_call(module, ({**p, **stacked.frozen}, b), (xs,))
            flat, targets = logits.reshape(-1, logits.shape[-1]), ys.reshape(-1)
            return F.cross_entropy(flat, targets, reduction="sum"), (flat.argmax(-1) == targets).sum()

        batched = vmap(one, in_dims=(0, 0, None, None))
        views = stacked.param_views(params)
        x, y = self.data.test_x, self.data.test_y
        loss = torch.zeros(params.shape[0], dtype=torch.float64, device=x.device)
        right = torch.zeros(params.shape[0], dtype=torch.float64, device=x.device)
        for s in range(0, len(x), self.eval_chunk):
            chunk_loss, chunk_right = batched(views, buffers, x[s:s + self.eval_chunk], y[s:s + self.eval_chunk])
            loss += chunk_loss.double()
            right += chunk_right.double()
        module.train()
        loss, accuracy = (loss / y.numel()).tolist(), (right / y.numel()).tolist()
        self.last_loss = {"workers": loss[:-1], "averaged": loss[-1]}
        return accuracy[:-1], accuracy[-1]
