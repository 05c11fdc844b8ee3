"""A training job that survives killed workers: it saves a checkpoint every few steps
and resumes from the newest valid one whenever the elastic agent restarts it::

    python -m bagua_algos.launch --nproc_per_node 2 --max_restarts 3 \\
        examples/fault_tolerance.py --checkpoints /tmp/ft --steps 60

(``python -m torch.distributed.run --standalone --nproc_per_node 2 --max_restarts 3``
works the same.) Kill any worker with SIGKILL while it trains: the agent stops the
others and starts a new round, which resumes from the last checkpoint, and the job
finishes. The same command at another ``--nproc_per_node`` resumes a stopped job at
that world size (each algorithm's rule for its state: docs/elastic.md).

One small model per algorithm (``--algorithms``), all trained in the same steps, each
with its own checkpoints under ``CHECKPOINTS/<algorithm>``. The batch of step t on
rank r is drawn from a generator seeded (r, t), so a resumed run sees the same data as
one that was never stopped, and on CPU computes the same numbers, bit for bit. This
is what tests/test_elastic_restarts.py and benchmarks/elastic_faults.py run; for their
sake each worker also appends "step time" lines to ``progress_rank<r>.txt``, writes
its pid to ``pid_rank<r>.txt`` and, at the end, its final state to
``final_<algorithm>_rank<r>.pt`` and its result (accuracy on a fixed test set) as one
JSON line, printed and written to ``result_rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import bagua_algos as bagua
from bagua_algos.algorithms import (ByteGradAlgorithm, DecentralizedAlgorithm, DiLoCoAlgorithm,
                                    GradientAllReduceAlgorithm, LowPrecisionDecentralizedAlgorithm, PowerSGDAlgorithm,
                                    RelayAlgorithm)

ALGORITHMS = {  # one per family: exact, gossip (two), relay, compressed (two), low-communication (two)
    "gradient_allreduce": lambda: GradientAllReduceAlgorithm(),
    "decentralized": lambda: DecentralizedAlgorithm(hierarchical=False, peer_selection_mode="shift_one"),
    "low_precision_decentralized": lambda: LowPrecisionDecentralizedAlgorithm(hierarchical=False),
    "relay": lambda: RelayAlgorithm(topology="chain"),
    "powersgd": lambda: PowerSGDAlgorithm(rank=1, orthogonalization="gram_schmidt"),
    "bytegrad": lambda: ByteGradAlgorithm(hierarchical=False),
    # outer model and momentum in the checkpoint; streaming: two fragments synchronised two
    # steps apart, each merged one step later (a fragment in flight at some checkpoints)
    "diloco": lambda: DiLoCoAlgorithm(sync_every=3),
    "diloco_streaming": lambda: DiLoCoAlgorithm(sync_every=4, fragments=2, overlap=1),
}
FEATURES, CLASSES = 8, 4


def batch(seed: int, rank: int, step: int, size: int = 16):
    """Step ``step``'s batch on ``rank``: a fixed linear teacher's labels of random inputs."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    x = torch.randn(size, FEATURES, generator=g)
    teacher = torch.Generator().manual_seed(seed)
    w = torch.randn(FEATURES, CLASSES, generator=teacher)
    return x, (x @ w).argmax(dim=1)


def build(name: str, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model.with_bagua([optimizer], ALGORITHMS[name]()), optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoints", required=True, help="directory of the checkpoints (kept across restarts)")
    parser.add_argument("--algorithms", default="gradient_allreduce,decentralized,relay,bytegrad",
                        help=f"comma-separated, of: {', '.join(ALGORITHMS)}")
    parser.add_argument("--steps", type=int, default=60, help="train until this step")
    parser.add_argument("--save_every", type=int, default=5, help="checkpoint every this many steps")
    parser.add_argument("--step_seconds", type=float, default=0.0, help="sleep per step (time to kill a worker)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    names = args.algorithms.split(",")
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown:
        parser.error(f"argument --algorithms: unknown {unknown}; valid: {', '.join(ALGORITHMS)}")

    bagua.init_process_group()
    rank, restart = bagua.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    os.makedirs(args.checkpoints, exist_ok=True)
    with open(os.path.join(args.checkpoints, f"pid_rank{rank}.txt"), "w") as f:
        f.write(str(os.getpid()))
    jobs = {name: build(name, args.seed) for name in names}
    resumed = {name: bagua.resume_from_checkpoint(os.path.join(args.checkpoints, name), model, optimizer)
               for name, (model, optimizer) in jobs.items()}
    start = min(resumed.values())
    print(f"rank {rank} round {restart}: resumed from step {start} ({resumed})", flush=True)
    progress = open(os.path.join(args.checkpoints, f"progress_rank{rank}.txt"), "a")
    for step in range(start + 1, args.steps + 1):
        x, y = batch(args.seed, rank, step)
        for name, (model, optimizer) in jobs.items():
            if step <= resumed[name]:
                continue
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            if step % args.save_every == 0:
                bagua.save_checkpoint(step, os.path.join(args.checkpoints, name), model, optimizer)
        progress.write(f"{step} {time.time():.3f} {restart}\n")
        progress.flush()
        time.sleep(args.step_seconds)
    x, y = batch(args.seed + 1, 0, 0, size=512)  # one test set for every rank
    accuracy = {}
    for name, (model, _) in jobs.items():
        with torch.no_grad():
            accuracy[name] = (model(x).argmax(dim=1) == y).float().mean().item()
        torch.save(model.state_dict(), os.path.join(args.checkpoints, f"final_{name}_rank{rank}.pt"))
    result = json.dumps({"rank": rank, "round": restart, "resumed_from": start, "accuracy": accuracy})
    print(result, flush=True)
    with open(os.path.join(args.checkpoints, f"result_rank{rank}.json"), "w") as f:
        f.write(result)  # whole, unlike stdout, where the workers' lines may interleave


if __name__ == "__main__":
    main()
