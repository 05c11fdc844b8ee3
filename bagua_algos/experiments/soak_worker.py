"""One replica of ``bagua-algos soak`` (started by ``python -m bagua_algos.launch --torchft``,
or started again by the soak after a kill): the sweep's task (scikit-learn's digits, the
sweep's MLP) under one algorithm-table row, trained step after step until the committed
step that ``--stop_file`` names (the same step on every replica, so the survivors end at
one committed state) or ``--until``, a hard wall-clock stop.

It appends to ``--log_dir/<replica id>.jsonl`` (one file per replica, kept across its
restarts): a ``start`` line per start, a ``step`` line per committed step, a
``discarded`` line per discarded one, and a ``final`` line (its committed step count and
test accuracy) at the end; its final parameters, flattened, go to
``<replica id>.final.pt`` for the soak's agreement check.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stop_file", required=True)
    p.add_argument("--until", type=float, required=True, help="a hard stop at this wall-clock time (time.time())")
    p.add_argument("--log_dir", required=True)
    p.add_argument("--label", default="gradient_allreduce", help="an ALGORITHM_TABLE row")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds a collective waits for a silent peer")
    return p.parse_args(argv)


def _stop_step(path: str):
    """The step the soak asked every replica to stop at, or None (not yet, or half written)."""
    try:
        return int(open(path).read())
    except (OSError, ValueError):
        return None


def main(argv=None) -> None:
    a = _parse(argv)
    import bagua_algos as bagua
    from bagua_algos.algorithms.table import config_by_label
    from bagua_algos.experiments.data import build_model, load_data
    from bagua_algos.runtime.comm import fault_tolerance as ft

    bagua.init_process_group(backend="gloo", timeout=a.timeout)
    data = load_data("digits", None, a.seed)
    torch.manual_seed(a.seed)
    model = build_model(data)
    config = config_by_label(a.label)
    optimizer = config.optimizer_for(model.parameters(), lambda ps: torch.optim.SGD(ps, lr=a.lr, momentum=0.9))
    model = model.with_bagua([optimizer], config.build(optimizer))
    ftstep = model.bagua_ddp.fault_tolerance
    if ftstep is None:
        raise SystemExit("soak_worker: needs fault tolerance at the step (run it under the launcher's --torchft)")
    who = os.environ.get(ft.REPLICA_ID_ENV) or f"rank{bagua.get_rank()}"
    log = open(os.path.join(a.log_dir, f"{who}.jsonl"), "a", buffering=1)
    log.write(json.dumps({"start": True, "pid": os.getpid(), "t": time.time()}) + "\n")
    n = len(data.train_y)
    step = ftstep.committed_steps
    while time.time() < a.until:
        model.train()
        ftstep.begin_step()  # the quorum first: a new or returning replica heals to the quorum's step here
        step = ftstep.committed_steps
        stop_at = _stop_step(a.stop_file)
        if stop_at is not None and step >= stop_at:
            ftstep.end_step()  # close the step the quorum opened (an empty step: the model is unchanged)
            break
        # each replica's batch is a function of (seed, step, rank): a step done again draws the same
        g = torch.Generator().manual_seed(1_000_003 * a.seed + 1009 * step + bagua.get_rank())
        idx = torch.randint(0, n, (a.batch,), generator=g)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(data.train_x[idx]), data.train_y[idx])
        loss.backward()
        optimizer.step()
        if ftstep.last_committed:
            log.write(json.dumps({"step": step, "t": time.time(), "world": bagua.get_world_size()}) + "\n")
        else:
            log.write(json.dumps({"discarded": step, "t": time.time(), "error": ft.last_error()}) + "\n")
    else:  # the hard stop: no empty step was opened
        step = ftstep.committed_steps
    model.eval()
    with torch.no_grad():
        accuracy = (model(data.test_x).argmax(dim=1) == data.test_y).float().mean().item()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # the steps trained and committed (the empty step that closed the loop is not one)
    torch.save({"committed": step, "params": flat}, os.path.join(a.log_dir, f"{who}.final.pt"))
    log.write(json.dumps({"final": step, "accuracy": accuracy, "t": time.time()}) + "\n")


if __name__ == "__main__":
    main()
