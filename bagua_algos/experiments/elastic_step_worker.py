"""One worker of ``elastic_faults --step_faults`` (the throughput runs): the sweep's task
(scikit-learn's digits, the sweep's MLP), one algorithm-table row, trained until the
step the orchestrator writes into --stop_file (or --until, a hard stop); one JSON line per step to --log_dir/<who>.jsonl.

Two modes, one loop:

- ``torchft`` (a torchft replica: $BAGUA_ALGOS_FAULT_TOLERANCE=torchft): the step is the
  quorum's committed step; each step logs committed or discarded;
- ``restart`` (under torchrun's elastic agent): resumes from the newest checkpoint
  (``resume_from_checkpoint``), saves one every --save_every steps, logs each step.

At the end each worker logs its test accuracy and its last step.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main(argv=None) -> None:
    t_main = time.time()  # torch imported, bagua_algos not yet
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("torchft", "restart"), required=True)
    p.add_argument("--stop_file", required=True,
                   help="train until the step this file names, once it exists (the same step on every worker)")
    p.add_argument("--until", type=float, required=True, help="a hard stop at this wall-clock time (time.time())")
    p.add_argument("--log_dir", required=True)
    p.add_argument("--label", default="gradient_allreduce", help="an ALGORITHM_TABLE row")
    p.add_argument("--checkpoints", default="")
    p.add_argument("--save_every", type=int, default=50)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=10.0)
    a = p.parse_args(argv)

    import bagua_algos as bagua
    from bagua_algos.algorithms.table import config_by_label
    from bagua_algos.experiments.data import build_model, load_data

    bagua.init_process_group(backend="gloo", timeout=a.timeout)
    data = load_data("digits", None, a.seed)
    torch.manual_seed(a.seed)
    model = build_model(data)
    config = config_by_label(a.label)
    optimizer = config.optimizer_for(model.parameters(),
                                     lambda ps: torch.optim.SGD(ps, lr=a.lr, momentum=0.9))
    model = model.with_bagua([optimizer], config.build(optimizer))
    ftstep = model.bagua_ddp.fault_tolerance
    who = os.environ.get("BAGUA_ALGOS_REPLICA_ID") or f"rank{bagua.get_rank()}"
    log = open(os.path.join(a.log_dir, f"{who}.jsonl"), "a", buffering=1)
    start = 0
    if a.mode == "restart":
        start = bagua.resume_from_checkpoint(a.checkpoints, model, optimizer)
    log.write(json.dumps({"start": start, "pid": os.getpid(), "t": time.time(), "t_main": t_main,
                          "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}) + "\n")
    step = start
    n = len(data.train_y)
    stop_at = None
    while time.time() < a.until:
        if ftstep is not None:
            model.train()
            ftstep.begin_step()  # the quorum first (a returning replica heals to the quorum's step)
            step = ftstep.committed_steps
        if stop_at is None and os.path.exists(a.stop_file):
            try:
                stop_at = int(open(a.stop_file).read())
            except ValueError:  # being written
                pass
        if stop_at is not None and step >= stop_at:
            if ftstep is not None:  # close the step the quorum opened: nothing done, nothing changed
                ftstep.end_step()
            break
        rank = bagua.get_rank()
        g = torch.Generator().manual_seed(1_000_003 * a.seed + 1009 * step + rank)
        idx = torch.randint(0, n, (a.batch,), generator=g)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(data.train_x[idx]), data.train_y[idx])
        loss.backward()
        optimizer.step()
        now = time.time()
        if ftstep is not None:
            slow = {k: round(v, 4) for k, v in ftstep.last_begin.items() if v > 0.05}
            if slow:  # where a quorum change's time goes (docs/elastic.md)
                log.write(json.dumps({"slow_begin": step, "t": now, "world": bagua.get_world_size(), **slow}) + "\n")
            if ftstep.last_committed:
                log.write(json.dumps({"step": step, "t": now, "world": bagua.get_world_size()}) + "\n")
            else:
                from bagua_algos.runtime.comm import fault_tolerance as ft

                log.write(json.dumps({"discarded": step, "t": now, "error": ft.last_error()}) + "\n")
            continue
        step += 1
        log.write(json.dumps({"step": step, "t": now, "world": bagua.get_world_size()}) + "\n")
        if step % a.save_every == 0:
            bagua.save_checkpoint(step, a.checkpoints, model, optimizer)
    model.eval()
    with torch.no_grad():
        accuracy = (model(data.test_x).argmax(dim=1) == data.test_y).float().mean().item()
    last = ftstep.committed_steps if ftstep is not None else step
    log.write(json.dumps({"final": last, "accuracy": accuracy, "t": time.time()}) + "\n")


if __name__ == "__main__":
    main()
