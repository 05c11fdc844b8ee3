"""``bagua.torch_api.checkpoint``: save_checkpoint / load_checkpoint."""

from bagua_algos.runtime.checkpoint import load_checkpoint, save_checkpoint  # noqa: F401
