"""``bagua.torch_api.bucket``."""

from bagua_algos.runtime.bucket import BaguaBucket  # noqa: F401
