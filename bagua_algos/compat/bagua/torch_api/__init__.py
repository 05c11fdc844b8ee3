"""``bagua.torch_api`` on bagua-algos: Bagua 0.9's public names."""

import bagua_algos as _plugin

# Bagua's communication and env names: bagua_algos' list (bagua_algos/__init__.py, where they
# are imported by name) and their values there (get_rank and get_world_size under torchft: the
# replica's slot among the job's)
globals().update((name, getattr(_plugin, name)) for name in _plugin.BAGUA_COMMUNICATION_NAMES)

from bagua_algos.runtime.tensor import BaguaTensor  # noqa: F401
from bagua_algos.runtime.backend import get_backend  # noqa: F401

from . import algorithms, checkpoint, communication, contrib, data_parallel, env  # noqa: F401,E402
from .distributed import BaguaModule  # noqa: F401,E402
from .env import get_node_rank, get_default_bucket_size  # noqa: F401,E402
