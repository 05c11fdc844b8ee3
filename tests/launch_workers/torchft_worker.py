"""A torchft replica for tests/test_torchft.py: a small linear model trained until the
quorum has committed --steps steps; each committed step is logged as one JSON line
(step, replica rank, world size, a checksum of the parameters) to --log_dir/<replica>.jsonl.

--die_at S: this replica SIGKILLs itself at the start of committed step S (after the
forward, before its collectives). --hang_at S: it SIGSTOPs itself there instead.
"""

import argparse
import json
import os
import signal
import sys
import time

import torch

import bagua_algos as bagua
from bagua_algos.runtime import comm
from bagua_algos.runtime.algorithm import Algorithm

p = argparse.ArgumentParser()
p.add_argument("--algorithm", default="gradient_allreduce")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--log_dir", required=True)
p.add_argument("--die_at", type=int, default=-1)
p.add_argument("--hang_at", type=int, default=-1)
p.add_argument("--victim", default="node0_replica2", help="the replica that --die_at/--hang_at apply to")
p.add_argument("--step_sleep", type=float, default=0.0)
p.add_argument("--timeout", type=float, default=20.0)
a = p.parse_args()

bagua.init_process_group(backend="gloo", timeout=a.timeout)
replica = os.environ.get("BAGUA_ALGOS_REPLICA_ID", "r")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
kwargs = {"average": True} if a.algorithm == "gradient_allreduce" else {}
if a.algorithm == "allreduce_average":
    kwargs = {"communication_interval": 2}
if a.algorithm == "diloco":
    kwargs = {"sync_every": 3}
model = model.with_bagua([optimizer], Algorithm.init(a.algorithm, **kwargs))
ftstep = model.bagua_ddp.fault_tolerance
log = open(os.path.join(a.log_dir, f"{replica}.jsonl"), "a", buffering=1)
log.write(json.dumps({"pid": os.getpid()}) + "\n")
if replica != a.victim:
    a.die_at = a.hang_at = -1
while ftstep.committed_steps < a.steps:
    step = ftstep.committed_steps
    gen = torch.Generator().manual_seed(1000 * step + comm.get_rank())
    x = torch.randn(32, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    if step == a.die_at:
        os.kill(os.getpid(), signal.SIGKILL)
    if step == a.hang_at:
        os.kill(os.getpid(), signal.SIGSTOP)
    loss.backward()
    optimizer.step()
    if ftstep.last_committed:
        flat = torch.cat([t.detach().reshape(-1) for t in model.parameters()])
        log.write(json.dumps({"step": step, "rank": comm.get_rank(), "world": comm.get_world_size(),
                              "sum": float(flat.double().sum()), "params": flat.tolist(), "t": time.time()}) + "\n")
    else:
        log.write(json.dumps({"discarded": step, "t": time.time()}) + "\n")
    if a.step_sleep:
        time.sleep(a.step_sleep)
log.write(json.dumps({"done": ftstep.committed_steps, "discarded_total": ftstep.discarded}) + "\n")
sys.exit(0)
