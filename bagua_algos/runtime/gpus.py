"""Whether a node has a GPU for each of its workers, and the one line that says when not.

A job that puts each worker on its own GPU (NCCL, device ``cuda:LOCAL_RANK``) needs as
many visible GPUs on a node as the node runs workers. :func:`comm.choose_backend
<bagua_algos.runtime.comm.groups.choose_backend>` refuses such a job in each worker;
a parent that knows the worker count (the launcher, a script's ``--spawn``, a sweep's
``--workers``) asks :func:`gpu_shortage` before any worker starts, so the user reads
the reason once, in the words of the flags they gave. Counting the GPUs creates no
CUDA context (torch counts them as ``torch.cuda.is_available`` does), so a parent may
count before it starts its workers.
"""

from __future__ import annotations


def visible_gpus() -> int:
    """The CUDA devices this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_shortage(asked: str, workers: int, fewer: str, on_cpu: str, gpus: int | None = None) -> str | None:
    """``None`` when a node with ``gpus`` visible GPUs (default: :func:`visible_gpus`)
    has one for each of its ``workers`` workers; else the reason, as one line.

    ``asked`` is what put the workers on GPUs (``"backend='nccl'"``, ``"cuda"``),
    ``fewer`` the flag that sets the workers per node (``"--nproc_per_node"``), and
    ``on_cpu`` what runs them on the CPU instead (``"--device cpu"``). With no GPU at all
    only the CPU is offered: fewer workers would not help.
    """
    if gpus is None:
        gpus = visible_gpus()
    if workers <= gpus:
        return None
    head = f"{asked} puts each worker on its own GPU (device cuda:LOCAL_RANK)"
    if gpus == 0:
        return f"{head}, but this node has no visible GPU; run on the CPU instead: {on_cpu}"
    return (f"{head}, but this node runs {workers} workers and has {gpus} visible GPU{'s' if gpus > 1 else ''}; "
            f"start at most {gpus} per node ({fewer} {gpus}), or run on the CPU: {on_cpu}")
