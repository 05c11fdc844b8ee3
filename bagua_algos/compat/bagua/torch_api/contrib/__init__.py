"""``bagua.torch_api.contrib``: the fused optimizer (a documented pass-through here)."""

from .fuse.optimizer import fuse_optimizer, is_fused_optimizer  # noqa: F401
