"""A torchft replica that trains one algorithm-table row after another (a *phase* each,
--phase_steps committed steps), for tests/test_torchft.py and the elastic_faults
measurements. The replica --victim SIGKILLs itself at local step --kill_at of every
phase (after the forward, before its collectives); the test starts it again (the same
replica id, with --start_phase P) and it heals from a live peer. Survivors slow down
(--wait_sleep per step) from local step --kill_at + 3 of a phase while the quorum is
short, so that the returning replica joins within the phase (at most --max_wait s).

One JSON line per event to --log_dir/<replica>.jsonl: each committed step (step, phase,
label, world, rank, digests of the parameters and of bagua_state_dict, and the
parameters of the replicas="equal" rows), each discarded step, each heal received and
each healing state served (torchft's step and the state's digest).
"""

import argparse
import json
import logging
import os
import signal
import sys
import time

import torch

import bagua_algos as bagua
from bagua_algos.algorithms.table import config_by_label
from bagua_algos.runtime import comm
from bagua_algos.runtime.fault_tolerant_step import state_digest

p = argparse.ArgumentParser()
p.add_argument("--labels", required=True, help="comma-separated ALGORITHM_TABLE labels, one phase each")
p.add_argument("--phase_steps", type=int, default=10)
p.add_argument("--kill_at", type=int, default=-1, help="local step of each phase at which --victim dies")
p.add_argument("--victim", default="r2")
p.add_argument("--start_phase", type=int, default=0, help="a returning replica: the phase it rejoins")
p.add_argument("--wait_file", default="", help="start training only once this file exists (a warm standby)")
p.add_argument("--world", type=int, default=3, help="the full quorum's size")
p.add_argument("--wait_sleep", type=float, default=0.3)
p.add_argument("--max_wait", type=float, default=60.0)
p.add_argument("--log_dir", required=True)
p.add_argument("--timeout", type=float, default=10.0)
a = p.parse_args()

labels = a.labels.split(",")
logging.basicConfig(level=logging.WARNING)  # torchft's own errors (a failed configure) to the output
if a.wait_file:
    deadline = time.time() + 300
    while not os.path.exists(a.wait_file):
        if time.time() > deadline:
            sys.exit(3)
        time.sleep(0.05)

bagua.init_process_group(backend="gloo", timeout=a.timeout)
replica = os.environ.get("BAGUA_ALGOS_REPLICA_ID", "r")
log = open(os.path.join(a.log_dir, f"{replica}.jsonl"), "a", buffering=1)


def write(**record):
    log.write(json.dumps(record) + "\n")


def build(phase):
    config = config_by_label(labels[phase])
    torch.manual_seed(phase)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = config.optimizer_for(model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    model = model.with_bagua([optimizer], config.build(optimizer))
    return config, model, optimizer


write(pid=os.getpid(), start_phase=a.start_phase)
if not a.wait_file:  # the first replicas start together: the first quorum holds all of them
    open(os.path.join(a.log_dir, f"ready_{replica}"), "w").close()
    deadline = time.time() + 180
    while not all(os.path.exists(os.path.join(a.log_dir, f"ready_r{i}")) for i in range(a.world)):
        if time.time() > deadline:
            sys.exit(5)
        time.sleep(0.05)
phase = a.start_phase
config, model, optimizer = build(phase)
ftstep = model.bagua_ddp.fault_tolerance
returning = a.start_phase > 0 or a.wait_file
waited, seen_heals, seen_served = 0.0, 0, 0
total = len(labels) * a.phase_steps
while True:
    if not returning:
        step = ftstep.committed_steps
        if step >= total:
            break
        if step // a.phase_steps != phase:
            model.bagua_ddp.detach()
            phase = step // a.phase_steps
            config, model, optimizer = build(phase)
            ftstep = model.bagua_ddp.fault_tolerance
            waited, seen_heals, seen_served = 0.0, 0, 0
    model.train()
    if returning:
        open(os.path.join(a.log_dir, f"requesting{phase}"), "w").close()
    ftstep.begin_step()  # the step's quorum (a heal, a rebuild); the forward's is then a no-op
    step = ftstep.committed_steps
    for s, digest in ftstep.heals[seen_heals:]:
        write(healed=s, digest=digest, phase=phase,
              bagua_keys=sorted(ftstep._snapshot["bagua"]["algorithm_state"]) + sorted(
                  k for b in ftstep._snapshot["bagua"]["bucket_state"].values() for k in b))
    seen_heals = len(ftstep.heals)
    for s, digest in ftstep.served[seen_served:]:
        write(served=s, digest=digest, phase=phase)
    seen_served = len(ftstep.served)
    if returning and not ftstep.heals:
        pass  # the quorum or its group failed (the step is discarded): ask again
    elif returning:
        returning = False
        if step // a.phase_steps != phase or step >= total:
            write(error=f"rejoined at step {step}, outside phase {phase}")
            sys.exit(4)
    local = step - phase * a.phase_steps
    world = comm.get_world_size()
    if world < a.world and a.kill_at >= 0 and local >= a.kill_at + 2:
        # let the returning replica join within this phase: once it asks for a quorum,
        # the survivors' next quorum takes it in
        marker = os.path.join(a.log_dir, f"requesting{phase}")
        while not os.path.exists(marker) and waited < a.max_wait:
            time.sleep(0.05)
            waited += 0.05
        time.sleep(a.wait_sleep)
    gen = torch.Generator().manual_seed(1000 * step + comm.get_rank())
    x = torch.randn(16, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    if (replica == a.victim and local == a.kill_at and world == a.world
            and not (a.wait_file and phase == a.start_phase)):
        write(killed=step, phase=phase)
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward()
    optimizer.step()
    if ftstep.last_committed:
        flat = torch.cat([t.detach().reshape(-1) for t in model.parameters()])
        record = dict(step=step, phase=phase, label=labels[phase], rank=comm.get_rank(), world=world,
                      params_digest=state_digest(flat), bagua_digest=state_digest(model.bagua_ddp.state_dict()),
                      rebuilds=ftstep.rebuilds, t=time.time(), loss=float(loss.detach()))
        topology = getattr(model.bagua_ddp.bagua_algorithm, "topology", None)
        if hasattr(topology, "world_size"):  # gossip's and relay's graphs: rebuilt over each quorum?
            record["topology"] = [type(topology).__name__, topology.world_size, topology.neighbors(comm.get_rank())]
        if config.replicas == "equal":
            record["params"] = flat.tolist()
        write(**record)
    else:
        write(discarded=step, phase=phase, t=time.time())
write(done=ftstep.committed_steps, discarded_total=ftstep.discarded)
sys.exit(0)
