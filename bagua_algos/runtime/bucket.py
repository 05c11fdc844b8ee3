"""``BaguaBucket``: Bagua tensors communicated together, and the ops run on them.

As in Bagua 0.9, a bucket holds Bagua tensors (see :mod:`.tensor`); with ``flatten``
their *effective* tensors (gradients for gradient algorithms, parameters for model
averaging) are moved into one contiguous buffer, ``bucket.backend_tensor``, so a
collective runs on the buffer with no pack or unpack copy. ``alignment`` pads the
bucket with a zero tensor so its length divides the alignment (chunking for
scatter-gather and compression).

Ops are appended with Bagua's appenders and run, in the order appended, on the
backend's communication thread once every tensor of the bucket is marked ready
(see :mod:`.backend`):

- ``append_python_op(fn, group)``: ``fn(bucket_name)``;
- ``append_centralized_synchronous_op(hierarchical, average, scattergather,
  compression, group)``: allreduce (sum or mean) of the bucket; with
  ``compression="MinMaxUInt8"`` an 8-bit min-max compressed scatter-gather;
- ``append_decentralized_synchronous_op(peer_weight, hierarchical,
  peer_selection_mode, group)``: gossip the weights into ``peer_weight``; returns the
  op, whose ``copy_back_peer_weight(bucket)`` writes the result back;
- ``append_asynchronous_model_average_op(peer_selection_mode, group)``: one round of
  background model averaging; returns the op (``lock_weight`` / ``unlock_weight``);
- ``append_low_precision_decentralized_synchronous_op(weight, left_peer_weight,
  right_peer_weight, hierarchical, compression, group)``: one step of Bagua's
  low-precision decentralized SGD on a ring (compressed weight differences); returns
  the op.

``bucket.state`` is the home of an algorithm's per-bucket state (error buffers,
warm-start factors, ...): ``module.bagua_state_dict()`` saves it and
``load_bagua_state_dict`` restores it, with no code in the algorithm.
"""

from __future__ import annotations

import os
from typing import Callable, List, Optional

import torch

from ..arguments import check_int
from . import comm, ops
from .tensor import BaguaTensor

__all__ = ["BaguaBucket", "split_into_buckets", "worker_numel", "aligned_buckets", "DEFAULT_BUCKET_SIZE",
           "FIRST_BUCKET_SIZE", "BUCKET_SIZE_ENV", "default_bucket_size"]

DEFAULT_BUCKET_SIZE = 10 * 1024 * 1024  # bytes, as Bagua's default
BUCKET_SIZE_ENV = "BAGUA_DEFAULT_BUCKET_SIZE"  # set by the launchers' --default_bucket_size
FIRST_BUCKET_SIZE = 1024 * 1024  # a small first bucket starts communication early (as DDP)


def default_bucket_size() -> int:
    """The bucket size ``with_bagua`` uses when given none: ``$BAGUA_DEFAULT_BUCKET_SIZE``
    (bytes, as Bagua's launcher set it from ``--default_bucket_size``), else 10 MiB."""
    text = os.environ.get(BUCKET_SIZE_ENV)
    if text is None:
        return DEFAULT_BUCKET_SIZE
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{BUCKET_SIZE_ENV} must be a positive number of bytes, got {text!r}")
    return int(text)


class BaguaBucket:
    """Bagua tensors communicated together (Bagua 0.9's ``BaguaBucket``)."""

    def __init__(self, tensors: List[BaguaTensor], name: str, flatten: bool, alignment: int = 1) -> None:
        tensors = list(tensors)
        if not tensors:
            raise ValueError(f"bucket {name!r} needs at least one Bagua tensor")
        for index, tensor in enumerate(tensors):
            if not (torch.is_tensor(tensor) and tensor.is_bagua_tensor()):
                raise TypeError(
                    f"bucket {name!r}: tensors[{index}] is not a Bagua tensor; register it with "
                    "tensor.ensure_bagua_tensor(name, module_name) first"
                )
        alignment = check_int(f"bucket {name!r}: alignment", alignment, 1)
        module_names = {t.bagua_module_name for t in tensors}
        if len(module_names) > 1:
            raise ValueError(f"bucket {name!r}: every tensor must belong to one module, got {sorted(map(str, module_names))}")
        # The bucket's flat tensors are [W, numel], a row per worker: W = 1 in a job, the
        # n stacked workers on the one-process engine. How the effective tensors are laid
        # out is the one thing that differs, and only here: a job's are a worker's own,
        # [*shape]; the engine's are stacked, [n, *shape] (one row a worker).
        transport = comm.current_transport()
        lead = transport.row_dims  # the effective tensors' leading dims: () in a job, (n,) on the engine
        self.workers: int = lead[0] if lead else 1
        """W, the number of workers whose rows the bucket's flat tensors hold: 1 in a job,
        n on the one-process engine."""
        self._tensor_lead = lead
        first = _effective_or_proxy(tensors[0])
        for tensor in tensors:
            effective = _effective_or_proxy(tensor)
            if effective.dtype != first.dtype or effective.device != first.device:
                raise ValueError(
                    f"bucket {name!r}: all tensors must share dtype and device; {tensor.bagua_tensor_name!r} is "
                    f"{effective.dtype} on {effective.device}, {tensors[0].bagua_tensor_name!r} is "
                    f"{first.dtype} on {first.device}"
                )
            if lead and (effective.dim() == 0 or effective.shape[0] != self.workers):
                raise ValueError(f"bucket {name!r}: on the one-process engine {tensor.bagua_tensor_name!r} must be "
                                 f"stacked, [{self.workers}, ...] (a row per worker), got {tuple(effective.shape)}")
        self.tensors = tensors
        """The Bagua tensors of the bucket (the padding tensor excluded)."""
        self.name = name
        self.bagua_module_name = tensors[0].bagua_module_name
        self.dtype = first.dtype
        self.device = first.device
        self.padding_tensor = None
        total = sum(self._worker_numel(t) for t in tensors)
        if alignment > 1 and total % alignment:
            padding = alignment - total % alignment
            values = transport.padding_view(self.name, _effective_or_proxy(tensors[-1]), padding)
            if values is None:
                values = torch.zeros(*self._tensor_lead, padding, dtype=self.dtype, device=self.device)
            self.padding_tensor = values.ensure_bagua_tensor(
                "bagua_padding_tensor_bucket_" + name, module_name=self.bagua_module_name
            )
        self._all_tensors = tensors + ([self.padding_tensor] if self.padding_tensor is not None else [])
        self._shapes = [_effective_or_proxy(t).shape[len(self._tensor_lead):] for t in self._all_tensors]
        self._numels = [self._worker_numel(t) for t in self._all_tensors]
        self.numel = sum(self._numels)
        """A worker's number of values (padding included)."""
        self.padding_numel: int = self.numel - sum(self._numels[:len(tensors)])
        """A worker's values of the padding tensor (0 without one)."""
        self.flatten = flatten
        self.backend_tensor: Optional[torch.Tensor] = None
        """With ``flatten``: the buffer holding every effective tensor, in order, ``[W, numel]``
        (what :meth:`flat_view` returns)."""
        self.backend_bucket = self  # Bagua's algorithms hand this to ops; here it is the bucket
        self.state: dict = {}
        self._ops: list = []
        if flatten:
            self._flatten_()
        for tensor in self._all_tensors:
            tensor._bagua_bucket = self

    def _worker_numel(self, tensor) -> int:
        effective = _effective_or_proxy(tensor)
        return int(effective.numel()) // self.workers

    # --- flattening ---------------------------------------------------------------------
    def flattened_tensor(self) -> torch.Tensor:
        """Bagua's ``flattened_tensor()``: a new tensor holding the effective tensors
        (padding included), in order, shaped as Bagua documents it: 1-D, ``[numel]``, in
        a job (on the one-process engine ``[n, numel]``, a row per worker, as the
        effective tensors themselves are stacked there).

        Kept in Bagua's shape because Bagua's own algorithms and user code call it (a
        ``peer_weight``, the low-precision op's weights, a snapshot to compare with) and
        may index or reshape it as 1-D. The plugin's algorithms use :meth:`flat_view` /
        :meth:`flat_zeros`, ``[W, numel]`` everywhere; the ops take either form
        (``t.view(bucket.workers, bucket.numel)``)."""
        out = torch.empty(*self._tensor_lead, self.numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for chunk, tensor in zip(self._chunks(out), self._all_tensors):
                effective = tensor.bagua_getter_closure()
                if effective is None:
                    chunk.zero_()
                else:
                    chunk.copy_(effective)
        return out

    def _flatten_(self) -> None:
        """Move every effective tensor into one buffer (in place: same tensor objects)."""
        if self.check_flatten():
            first = self._all_tensors[0].bagua_getter_closure()
            # a row per worker: the engine's rows lie first.stride(0) apart, a job's one row is all
            row_stride = first.stride(0) if self._tensor_lead else self.numel
            self.backend_tensor = torch.empty(0, dtype=self.dtype, device=self.device).set_(
                first.untyped_storage(), first.storage_offset(), (self.workers, self.numel), (row_stride, 1))
            return
        buffer = self.flattened_tensor()
        self.backend_tensor = buffer.view(self.workers, self.numel)
        for tensor, chunk in zip(self._all_tensors, self._chunks(buffer)):
            if tensor.bagua_getter_closure() is None:
                tensor.bagua_setter_closure(chunk)
            else:
                _set_storage(tensor, chunk)

    def check_flatten(self) -> bool:
        """True if the effective tensors lie one after the other in one storage (on the
        one-process engine: in consecutive columns of the rows of one storage)."""
        expected = None
        storage = None
        row_stride = None
        for tensor, n in zip(self._all_tensors, self._numels):
            effective = tensor.bagua_getter_closure()
            if effective is None:
                return False
            if self._tensor_lead:
                if effective.dim() < 1 or not effective[0].is_contiguous():
                    return False
                # a single row's stride is not a layout (torch gives a size-1 dimension any)
                if effective.shape[0] > 1:
                    if row_stride is None:
                        row_stride = effective.stride(0)
                    elif effective.stride(0) != row_stride:
                        return False
            elif not effective.is_contiguous():
                return False
            if storage is None:
                storage = effective.untyped_storage().data_ptr()
                expected = effective.data_ptr()
            elif effective.untyped_storage().data_ptr() != storage or effective.data_ptr() != expected:
                return False
            expected += n * effective.element_size()
        return True

    @property
    def shapes(self) -> list:
        """A worker's shape of each of the bucket's tensors (the padding excluded)."""
        return [tuple(shape) for shape in self._shapes[:len(self.tensors)]]

    def flat_zeros(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Zeros shaped as the bucket's flat tensor, ``[W, numel]`` (W = 1 in a job, n on
        the one-process engine): the home of per-worker state such as an error buffer, so
        an algorithm written once keeps a row per worker there."""
        return torch.zeros(self.workers, self.numel, dtype=dtype or self.dtype, device=self.device)

    def bytes(self) -> int:
        """Bytes of the bucket's effective tensors (the padding excluded)."""
        item = torch.empty((), dtype=self.dtype).element_size()
        return sum(self._numels[: len(self.tensors)]) * item  # (a worker's, on the engine too)

    # --- execution: what a backend calls (runtime/backend.py, ExecutableBucket) ------------
    def before_ops(self) -> None:
        """Put every effective tensor back into its place in ``backend_tensor``, so that
        the ops find the current values there (a backend calls it on the training thread
        when it hands the bucket over, before :meth:`run_ops`).

        A gradient that ``zero_grad(set_to_none=True)`` removed is zero: its view is
        zeroed and handed to the setter, so autograd accumulates into the buffer next
        time. A gradient that autograd (or the user) replaced is copied into its view.
        """
        if not self.flatten:
            return
        buffer = self._as_tensors_lie(self.backend_tensor)
        with torch.no_grad():
            for tensor, view in zip(self._all_tensors, self._chunks(buffer)):
                effective = tensor.bagua_getter_closure()
                if effective is None or effective.data_ptr() != view.data_ptr():
                    if effective is None:
                        view.zero_()
                    else:
                        view.copy_(effective)
                    if tensor._bagua_setter is not None:
                        tensor.bagua_setter_closure(view)
                    else:
                        effective.set_(view)

    # --- flat access (for ops and for algorithms that work on whole buckets) ----------
    def flat_view(self) -> torch.Tensor:
        """The effective tensors as one ``[W, numel]`` tensor, a row per worker (W = 1 in a
        job, n on the one-process engine): the one shape the algorithms are written for.
        ``backend_tensor`` itself when the bucket is flattened (writing to it writes the
        tensors), else a packed copy."""
        if self.flatten:
            self.before_ops()
            return self.backend_tensor
        return self.flattened_tensor().view(self.workers, self.numel)

    def write_flat(self, flat: torch.Tensor) -> None:
        """Effective tensors ← ``flat`` (``[W, numel]``, or Bagua's
        :meth:`flattened_tensor` form; a no-op when ``flat`` is ``backend_tensor``)."""
        if self.flatten and flat.data_ptr() == self.backend_tensor.data_ptr():
            return
        with torch.no_grad():
            for chunk, tensor in zip(self._chunks(self._as_tensors_lie(flat)), self._all_tensors):
                effective = tensor.bagua_getter_closure()
                if effective is None:
                    tensor.bagua_setter_closure(chunk.clone())
                else:
                    effective.copy_(chunk)

    def tensor_views(self, flat: torch.Tensor):
        """``(tensor, view)`` for each Bagua tensor of the bucket (the padding excluded):
        the tensor's place in ``flat`` (``[..., numel]``, e.g. a state buffer laid out
        as the bucket), shaped ``[..., *shape]``."""
        return zip(self.tensors, self._chunks(flat))

    def _as_tensors_lie(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (``[W, numel]`` or ``[numel]`` in a job) shaped as the effective tensors
        lie, ``[*lead, numel]`` (no lead in a job; ``[n, numel]`` on the engine), a view."""
        return flat.view(*self._tensor_lead, self.numel)

    def _chunks(self, flat: torch.Tensor):
        """Each effective tensor's place in ``flat`` (``[..., numel]``), as a view."""
        offset = 0
        for n, shape in zip(self._numels, self._shapes):
            yield flat[..., offset:offset + n].view(*flat.shape[:-1], *shape)
            offset += n

    # --- ops ----------------------------------------------------------------------------
    def is_local_only(self) -> bool:
        """True when the bucket has ops and each says ``local_only``: with this group it
        does nothing but count on the host (e.g. a reduction over one worker), so a
        backend may run them on the marking thread, without a CUDA event."""
        return bool(self._ops) and all(getattr(op, "local_only", False) for op in self._ops)

    def run_ops(self) -> None:
        """Run the bucket's ops once, in the order they were appended, on this thread
        (a backend calls it on its communication thread, after :meth:`before_ops`)."""
        for op in list(self._ops):
            op(self)

    @property
    def ops(self) -> tuple:
        return tuple(self._ops)

    def clear_ops(self) -> "BaguaBucket":
        """Remove the ops appended so far."""
        self._ops.clear()
        return self

    def append_python_op(self, python_function: Callable[[str], None], group=None) -> "BaguaBucket":
        """Run ``python_function(bucket_name)`` (on the communication thread)."""
        if not callable(python_function):
            raise TypeError(f"append_python_op: python_function must be callable, got {type(python_function).__name__}")
        self._ops.append(ops.PythonOp(python_function))
        return self

    def append_centralized_synchronous_op(
        self,
        hierarchical: bool = False,
        average: bool = True,
        scattergather: bool = False,
        compression: Optional[str] = None,
        group=None,
    ) -> "BaguaBucket":
        """Sum or average the bucket over every worker of ``group`` (all by default).

        ``hierarchical``: within each node first, then across nodes. ``scattergather``:
        a reduce-scatter then an all-gather instead of one allreduce. ``compression``:
        ``None`` or ``"MinMaxUInt8"``: Bagua's 8-bit min-max quantized scatter-gather
        (chunks compressed, all-to-all, each worker reduces its chunk, compresses it,
        all-gather; see :func:`.ops.compressed_scatter_gather`), which is used whatever
        ``scattergather`` says, as in Bagua.
        """
        self._ops.append(ops.CentralizedSynchronousOp(hierarchical, average, scattergather, compression, group))
        return self

    def append_decentralized_synchronous_op(
        self,
        peer_weight: BaguaTensor,
        hierarchical: bool = True,
        peer_selection_mode: str = "all",
        group=None,
        topology=None,
    ) -> "ops.DecentralizedSynchronousOp":
        """Gossip the bucket's weights with peers, result in ``peer_weight``.

        The weights are averaged into ``peer_weight`` (copied there first, or, between
        workers with shift_one or a topology, sent from the bucket with the result built
        there) ("all": with every worker; "shift_one": with one peer, changing at each
        execution; ``topology=`` (an extension of Bagua's API): with the topology's neighbours,
        Metropolis–Hastings weights). ``op.copy_back_peer_weight(bucket)`` writes the
        result into the bucket.
        """
        op = ops.DecentralizedSynchronousOp(self, peer_weight, hierarchical, peer_selection_mode, group, topology)
        self._ops.append(op)
        return op

    def append_low_precision_decentralized_synchronous_op(
        self, weight: BaguaTensor, left_peer_weight: BaguaTensor, right_peer_weight: BaguaTensor,
        hierarchical: bool = True, compression: str = "MinMaxUInt8", group=None,
    ) -> "ops.LowPrecisionDecentralizedSynchronousOp":
        """Average the bucket's weights with the ring neighbours by exchanging 8-bit
        compressed weight differences (Bagua's low-precision decentralized SGD; see
        :class:`.ops.LowPrecisionDecentralizedSynchronousOp`). ``weight``,
        ``left_peer_weight`` and ``right_peer_weight`` hold this worker's and its two
        neighbours' shared copies (each ``bucket.flattened_tensor()`` at set-up).
        Returns the op."""
        op = ops.LowPrecisionDecentralizedSynchronousOp(
            self, weight, left_peer_weight, right_peer_weight, hierarchical, compression, group)
        self._ops.append(op)
        return op

    def append_asynchronous_model_average_op(self, peer_selection_mode: str = "all", group=None) -> "ops.AsyncModelAverageOp":
        """One round of model averaging with the other workers of ``group``, meant to run
        on a background thread while training goes on: x ← x + (mean(s) − s), with s
        the weights copied when the round began. Returns the op."""
        op = ops.AsyncModelAverageOp(self, peer_selection_mode, group)
        self._ops.append(op)
        return op

    def __repr__(self) -> str:
        return f"BaguaBucket({self.name!r}, tensors={len(self.tensors)}, numel={self.numel}, flatten={self.flatten})"


def _set_storage(tensor, view: torch.Tensor) -> None:
    """The effective tensor of ``tensor`` ← ``view``'s place (its storage, offset and
    strides), in place without a setter, else through it."""
    effective = tensor.bagua_getter_closure()
    with torch.no_grad():
        if tensor._bagua_setter is None:
            effective.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
        else:
            tensor.bagua_setter_closure(view)


def _effective_or_proxy(tensor) -> torch.Tensor:
    effective = tensor.bagua_getter_closure()
    return tensor if effective is None else effective


def bucket_groups(sizes: List[int], kinds: list, bucket_size: int = DEFAULT_BUCKET_SIZE,
                  first_bucket_size: int = FIRST_BUCKET_SIZE) -> List[List[int]]:
    """Bagua's bucketing rule on plain numbers: the indices of tensors of ``sizes`` bytes
    and ``kinds`` (e.g. (dtype, device)), cut into consecutive runs; a run closes once it
    holds ``bucket_size`` bytes (the first at ``first_bucket_size``, so communication
    starts early in backward, as in torch DDP); a change of kind starts a new one. The one
    home of the rule: :func:`split_into_buckets` and the one-process engine's layout."""
    bucket_size = check_int("bucket_size", bucket_size, 1, what="a positive number of bytes")
    groups: List[List[int]] = []
    size = 0
    closed = True
    kind = None
    for index, (nbytes, t_kind) in enumerate(zip(sizes, kinds)):
        if closed or t_kind != kind:
            groups.append([index])
            size = 0
            kind = t_kind
        else:
            groups[-1].append(index)
        size += nbytes
        cap = min(first_bucket_size, bucket_size) if len(groups) == 1 else bucket_size
        closed = size >= cap
    return groups


def worker_numel(tensor) -> int:
    """A worker's number of values of a Bagua tensor's effective tensor (on the
    one-process engine, one row of its stacked ``[n, *shape]``)."""
    lead = comm.current_transport().row_dims
    return int(_effective_or_proxy(tensor).numel()) // (lead[0] if lead else 1)


def split_into_buckets(
    tensors: List[BaguaTensor],
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    first_bucket_size: int = FIRST_BUCKET_SIZE,
) -> List[List[BaguaTensor]]:
    """Bagua's bucketing suggestion (:func:`bucket_groups`) for Bagua tensors, by the
    bytes, dtype and device of what each one communicates."""
    effective = [_effective_or_proxy(t) for t in tensors]
    groups = bucket_groups([worker_numel(t) * e.element_size() for t, e in zip(tensors, effective)],
                           [(e.dtype, e.device) for e in effective], bucket_size, first_bucket_size)
    return [[tensors[i] for i in group] for group in groups]


def aligned_buckets(tensors: List[List[BaguaTensor]], do_flatten: bool, alignment: int) -> List[BaguaBucket]:
    """One bucket per group of ``tensors``, named by its index, each padded to a multiple
    of ``alignment`` (the world size, for algorithms that cut a bucket into one chunk per
    worker: scatter-gather and compression)."""
    return [BaguaBucket(group, flatten=do_flatten, name=str(index), alignment=alignment)
            for index, group in enumerate(tensors)]
