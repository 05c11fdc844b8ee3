"""A Bagua script under --torchft whose samplers are built right after init: torch's
DistributedSampler given bagua's rank and world size, torch's DistributedSampler by
torch.distributed's default group, and DistributedHeterogeneousSampler by its defaults.
Writes DIR/<replica id>.json with each sampler's indices, the rank and world size before
and after two training steps, and the quorum's size."""

import json
import os
import sys

import torch

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import gradient_allreduce
from samplers import DistributedHeterogeneousSampler

out = sys.argv[1]
bagua.init_process_group()
rank, world = bagua.get_rank(), bagua.get_world_size()
labels = torch.arange(40) % 4
dataset = torch.utils.data.TensorDataset(torch.randn(40, 3), labels)
plain = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=world, rank=rank, seed=1)
torch_default = torch.utils.data.distributed.DistributedSampler(dataset, shuffle=False)
hetero = DistributedHeterogeneousSampler(dataset, alpha=1.0, labels=labels)
model = torch.nn.Linear(3, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model = model.with_bagua([optimizer], gradient_allreduce.GradientAllReduceAlgorithm())
for x, y in torch.utils.data.DataLoader(dataset, batch_size=7, sampler=plain):
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
from bagua_algos.runtime import comm  # noqa: E402

record = dict(rank=rank, world=world, plain=list(plain), torch_default=list(torch_default), hetero=list(hetero),
              after=[bagua.get_rank(), bagua.get_world_size()], quorum=comm.get_world_size())
with open(os.path.join(out, os.environ["BAGUA_ALGOS_REPLICA_ID"] + ".json"), "w") as f:
    json.dump(record, f)
