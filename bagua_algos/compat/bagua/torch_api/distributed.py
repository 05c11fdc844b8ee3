"""``bagua.torch_api.distributed``: every torch.nn.Module has ``with_bagua``.

bagua-algos patches ``torch.nn.Module`` when it is imported (``with_bagua``,
``bagua_algorithm``, ``bagua_module_name``, ``bagua_buckets``, ``bagua_optimizers``,
``bagua_train_step_counter``); ``BaguaModule`` is the name Bagua's annotations use.
"""

import torch

from bagua_algos.runtime.ddp import with_bagua  # noqa: F401

BaguaModule = torch.nn.Module
