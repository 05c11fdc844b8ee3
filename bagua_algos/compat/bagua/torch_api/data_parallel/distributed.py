"""``bagua.torch_api.data_parallel.distributed``: Bagua 0.9's torch-DDP-like API.

``DistributedDataParallel(module, ..., optimizers=[], algorithm=GradientAllReduceAlgorithm())``
returns Bagua's wrapper, ``DistributedDataParallel_V1_9_0`` (see
``bagua_algos.runtime.data_parallel`` for what it does and where it goes beyond Bagua).
As in Bagua, arguments that the wrapper cannot honour (``dim != 0``,
``check_reduction=True``, a ``device_ids`` / ``output_device`` other than the module's
own device) give a warning and torch's own ``DistributedDataParallel`` instead.
"""

from __future__ import annotations

import warnings
from typing import List, Optional, Union

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDistributedDataParallel

from bagua_algos.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from bagua_algos.runtime import comm as _comm
from bagua_algos.runtime.data_parallel import DistributedDataParallel_V1_9_0, as_device

__all__ = ["DistributedDataParallel", "DistributedDataParallel_V1_9_0", "DistributedDataParallel_V1_9_0_Interface",
           "to_bagua_process_group"]

# Bagua's abstract base; here the wrapper itself implements the interface.
DistributedDataParallel_V1_9_0_Interface = DistributedDataParallel_V1_9_0


def to_bagua_process_group(process_group=None):
    """The group to train over: ``None`` → the default group; a torch.distributed
    group or a ``BaguaProcessGroup`` is accepted as it is (the runtime takes both)."""
    if process_group is None:
        return _comm._get_default_group()
    if isinstance(process_group, (_comm.BaguaProcessGroup, torch.distributed.ProcessGroup)):
        return process_group
    raise TypeError(f"process_group must be None, a torch.distributed ProcessGroup or a BaguaProcessGroup, "
                    f"got {type(process_group).__name__}")


def _same_device(module, value, single_list: bool) -> bool:
    if value is None:
        return True
    if single_list:
        value = list(value)
        if len(value) != 1:
            return False
        value = value[0]
    params = list(module.parameters())
    return bool(params) and as_device(value) == params[0].device


def DistributedDataParallel(
    module: torch.nn.Module,
    device_ids: Optional[List[Union[int, torch.device]]] = None,
    output_device: Union[int, torch.device] = None,
    dim: int = 0,
    broadcast_buffers: bool = True,
    process_group=None,
    bucket_cap_mb: int = 25,
    find_unused_parameters: bool = False,
    check_reduction: bool = False,
    gradient_as_bucket_view: bool = True,
    optimizers: List[torch.optim.Optimizer] = [],  # noqa: B006 - Bagua's signature
    algorithm=GradientAllReduceAlgorithm(),  # noqa: B008 - Bagua's signature
) -> Union[TorchDistributedDataParallel, DistributedDataParallel_V1_9_0]:
    """Bagua's torch-DDP-compatible entry point (see the module docstring)."""
    supported = (dim == 0 and check_reduction is False and _same_device(module, device_ids, True)
                 and _same_device(module, output_device, False))
    if not supported:
        warnings.warn(
            "DistributedDataParallel: dim != 0, check_reduction=True or device_ids/output_device other than the "
            "module's device are not supported by Bagua's wrapper; falling back to torch's DistributedDataParallel "
            "(as Bagua does)", stacklevel=2)
        return TorchDistributedDataParallel(
            module=module, device_ids=device_ids, output_device=output_device, dim=dim,
            broadcast_buffers=broadcast_buffers, process_group=process_group, bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters, check_reduction=check_reduction,
            gradient_as_bucket_view=gradient_as_bucket_view)
    return DistributedDataParallel_V1_9_0(
        module=module, device_ids=device_ids, output_device=output_device, dim=dim,
        broadcast_buffers=broadcast_buffers, process_group=process_group, bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=find_unused_parameters, check_reduction=check_reduction,
        gradient_as_bucket_view=gradient_as_bucket_view, optimizers=optimizers, algorithm=algorithm)
