"""``bagua.torch_api.contrib.fuse.optimizer``: ``fuse_optimizer`` as a pass-through.

Bagua's fused optimizer flattens parameters that share a group so that one kernel
updates many of them (``optimizer.fuse_step()``). Here ``fuse_optimizer`` returns the
same optimizer with ``fuse_step()`` doing exactly ``step()``: results are identical,
only the kernel fusion is missing (torch's own ``foreach`` implementations, on by
default on CUDA, already batch the updates).
"""

import torch


def fuse_optimizer(optimizer: torch.optim.Optimizer, do_flatten: bool = True, check_flatten: bool = True):
    """Return ``optimizer`` with ``fuse_step()`` (= ``step()``)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fuse_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    optimizer._bagua_fused = True
    optimizer.fuse_step = optimizer.step
    return optimizer


def is_fused_optimizer(optimizer) -> bool:
    return bool(getattr(optimizer, "_bagua_fused", False))
