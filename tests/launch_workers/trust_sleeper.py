"""A worker that starts, says so (``DIR/ready.PID``; under torchft also the lighthouse's
address, ``DIR/lighthouse.PID``) and waits for ``DIR/go`` (60 s at most); then, with
``--train``, trains a small model for 40 steps, else meets its peers once (barrier) when
it is not a torchft replica. tests/test_trust_network.py reads the job's sockets meanwhile."""

import os
import sys
import time

import torch

import bagua_algos

out = sys.argv[1]
bagua_algos.init_process_group()
if os.environ.get("TORCHFT_LIGHTHOUSE"):
    with open(os.path.join(out, f"lighthouse.{os.getpid()}"), "w") as f:
        f.write(os.environ["TORCHFT_LIGHTHOUSE"])
open(os.path.join(out, f"ready.{os.getpid()}"), "w").close()
start = time.time()
while not os.path.exists(os.path.join(out, "go")) and time.time() - start < 60:
    time.sleep(0.2)
if "--train" in sys.argv:
    from bagua_algos.algorithms import GradientAllReduceAlgorithm

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = model.with_bagua([optimizer], GradientAllReduceAlgorithm())
    for step in range(40):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        time.sleep(0.25)
elif not os.environ.get("BAGUA_ALGOS_FAULT_TOLERANCE"):
    bagua_algos.barrier()
