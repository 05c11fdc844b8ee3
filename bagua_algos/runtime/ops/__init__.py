"""The ops a bucket runs once it is ready (built by ``BaguaBucket.append_*``).

Each op is a callable ``op(bucket)`` run on the backend's communication thread; it may
block on collectives, which only that thread waits for. Ops reach torch.distributed
through :mod:`..comm` only. One module per op:

- :mod:`.python_op`       ``PythonOp``: a function of the bucket's name;
- :mod:`.centralized`     ``CentralizedSynchronousOp``: sum or mean over the group, exact
                          or MinMaxUInt8-compressed;
- :mod:`.decentralized`   ``DecentralizedSynchronousOp``: gossip averaging, and Bagua's
                          ``shift_one`` pairing;
- :mod:`.low_precision`   ``LowPrecisionDecentralizedSynchronousOp``: the 8-bit ring step;
- :mod:`.async_average`   ``AsyncModelAverageOp`` and its weight lock;

and what they share: :mod:`.scatter_gather` (``compressed_scatter_gather``, the min-max
codec's reduction over a group; its stages are
:mod:`bagua_algos.compression.scatter_gather`'s) and :mod:`.common` (``within_nodes``,
Bagua's hierarchical pattern). This package's names are all importable from it.
"""

from ...compression.scatter_gather import reduce_chunks  # (the scatter-gather's reduction step, compression's)
from .async_average import AsyncModelAverageOp
from .centralized import COMPRESSIONS, CentralizedSynchronousOp
from .common import MINMAX_UINT8_BITS, within_nodes
from .decentralized import PEER_SELECTION_MODES, DecentralizedSynchronousOp, shift_one_peer
from .low_precision import LowPrecisionDecentralizedSynchronousOp, low_precision_difference, ring_peers
from .python_op import PythonOp
from .scatter_gather import compressed_scatter_gather

__all__ = [
    "PythonOp",
    "CentralizedSynchronousOp",
    "DecentralizedSynchronousOp",
    "LowPrecisionDecentralizedSynchronousOp",
    "compressed_scatter_gather",
    "low_precision_difference",
    "reduce_chunks",
    "ring_peers",
    "AsyncModelAverageOp",
    "PEER_SELECTION_MODES",
    "COMPRESSIONS",
    "shift_one_peer",
]
