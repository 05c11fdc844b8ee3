"""A torchft replica for tests/test_torchft_open_points.py: checkpoints inside a torchft job.

It resumes from --ckpt (resume_from_checkpoint, after with_bagua, before the first step),
then trains until the quorum has committed --steps steps, saving a checkpoint (every
replica calls save_checkpoint, the iteration the committed steps) when --save_at steps are
committed, and SIGKILLs itself once --die_after steps are committed (every replica does:
the job loses all of them). One JSON line per event to --log_dir/<replica>.jsonl: the
resume (iteration, committed steps, parameters), each committed step, the save.
"""

import argparse
import json
import os
import signal
import sys

import torch

import bagua_algos as bagua
from bagua_algos.runtime import comm
from bagua_algos.runtime.algorithm import Algorithm
from bagua_algos.runtime.checkpoint import resume_from_checkpoint, save_checkpoint

p = argparse.ArgumentParser()
p.add_argument("--log_dir", required=True)
p.add_argument("--ckpt", required=True)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--save_at", type=int, default=-1)
p.add_argument("--die_after", type=int, default=-1)
p.add_argument("--algorithm", default="gradient_allreduce")
a = p.parse_args()

bagua.init_process_group(backend="gloo", timeout=20.0)
replica = os.environ.get("BAGUA_ALGOS_REPLICA_ID", "r")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
model = model.with_bagua([optimizer], Algorithm.init(a.algorithm), lr_schedulers=[scheduler])
ftstep = model.bagua_ddp.fault_tolerance
log = open(os.path.join(a.log_dir, f"{replica}.jsonl"), "a", buffering=1)


def params():
    return torch.cat([t.detach().reshape(-1) for t in model.parameters()]).tolist()


iteration = resume_from_checkpoint(a.ckpt, model, optimizer, scheduler)
log.write(json.dumps({"resumed": iteration, "committed": ftstep.committed_steps, "params": params(),
                      "last_epoch": scheduler.last_epoch}) + "\n")
while ftstep.committed_steps < a.steps:
    step = ftstep.committed_steps
    gen = torch.Generator().manual_seed(1000 * step + bagua.get_rank())
    x = torch.randn(32, 8, generator=gen)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin()).backward()
    optimizer.step()
    scheduler.step()
    if ftstep.last_committed:
        log.write(json.dumps({"step": step, "world": comm.get_world_size(), "heals": len(ftstep.heals),
                              "lr": optimizer.param_groups[0]["lr"], "params": params()}) + "\n")
    if ftstep.last_committed and ftstep.committed_steps == a.save_at:
        save_checkpoint(ftstep.committed_steps, a.ckpt, model, optimizer, scheduler)
        log.write(json.dumps({"saved": ftstep.committed_steps, "rank": comm.get_rank(), "params": params(),
                              "last_epoch": scheduler.last_epoch}) + "\n")
    if ftstep.committed_steps == a.die_after:
        os.kill(os.getpid(), signal.SIGKILL)
log.write(json.dumps({"done": ftstep.committed_steps}) + "\n")
sys.exit(0)
