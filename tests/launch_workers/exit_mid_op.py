"""Leave the interpreter while the communication thread is inside a bucket op.

Usage: exit_mid_op.py MODE   (MODE: "exit" — sys.exit(0); "raise" — an uncaught error)

One gloo process (world size 1, a FileStore): a model wrapped with gradient_allreduce
whose bucket also runs a slow Python op (a loop of matrix products: torch releases the
GIL inside each one). The script hands every bucket to the communication thread and
leaves at once, as a script does that ends, or dies of an exception, while
communication is in flight. A daemon thread still inside a GIL-releasing torch call at
interpreter finalization is killed by CPython with pthread_exit, whose unwinding
through torch's C++ frames ends in std::terminate ("terminate called without an
active exception", SIGABRT). The runtime must let the op finish first: the exit code
is then 0 for "exit" and 1 for "raise".
"""

import os
import sys
import tempfile
from datetime import timedelta

import torch

import bagua_algos  # noqa: F401 - patches torch.nn.Module.with_bagua
from bagua_algos.algorithms import GradientAllReduceAlgorithm
from bagua_algos.runtime import comm

OP_SECONDS = 0.5


def slow_op(bucket_name: str) -> None:
    import time

    a = torch.randn(384, 384)
    stop = time.monotonic() + OP_SECONDS
    while time.monotonic() < stop:
        a = torch.tanh(a @ a)
    print(f"op of bucket {bucket_name} done", flush=True)


def main() -> None:
    mode = sys.argv[1]
    torch.set_num_threads(1)
    store = torch.distributed.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    comm.init_process_group(store, 0, 1, backend="gloo", timeout=timedelta(seconds=30))
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.with_bagua([optimizer], GradientAllReduceAlgorithm())
    for bucket in model.bagua_buckets:
        bucket.append_python_op(slow_op)
    for bucket in model.bagua_buckets:
        for tensor in bucket.tensors:
            tensor.bagua_mark_communication_ready()
    print("buckets handed over", flush=True)
    if mode == "raise":
        raise RuntimeError("the training script failed while communication was in flight")
    sys.exit(0)


if __name__ == "__main__":
    main()
