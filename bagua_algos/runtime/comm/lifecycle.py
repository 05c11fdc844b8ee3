"""Joining and leaving the job: the backend rule (:func:`choose_backend`),
:func:`init_process_group`, :func:`destroy_process_group`, the exit hook, and the
clean-up of process groups held in torch.distributed's default arguments."""

from __future__ import annotations

import atexit
import os
import sys
import types
from datetime import timedelta

import torch
import torch.distributed as dist

from ...arguments import check_int
from ..gpus import gpu_shortage
from .env import _env_int, is_initialized
from .agent_watch import watch_agent
from .groups import DEFAULT_TIMEOUT, _as_timedelta, _joined, job_timeout
from .helper_thread import _stop_helper
from .rounds import agent_store_shared, round_store

_owner = {"joined": False, "atexit": False}  # this module called dist.init_process_group; its exit hook is set


BACKEND_ENV = "BAGUA_ALGOS_BACKEND"
INIT_TIMEOUT_ENV = "BAGUA_ALGOS_INIT_TIMEOUT"
# Under torchrun's elastic agent a round of workers that cannot form its group is
# better given up soon: the agent then starts the next round (a restart), instead of
# every worker waiting out the job's timeout (10 minutes by default).
AGENT_INIT_TIMEOUT = timedelta(minutes=2)
BACKENDS = ("auto", "gloo", "nccl")
# NCCL carries CUDA tensors, gloo CPU tensors: one group serves both (torch's per-device
# backends), so a script's CPU flags and counters work in a GPU job, as under Bagua.
_MIXED = "cpu:gloo,cuda:nccl"


def choose_backend(backend: str | None = None, local_world_size: int | None = None) -> str:
    """The torch backend string for ``backend`` (``None``: $BAGUA_ALGOS_BACKEND, else
    ``"auto"``) on a node running ``local_world_size`` workers (default: LOCAL_WORLD_SIZE).

    - ``"gloo"``: gloo for every tensor; CUDA tensors are staged through host memory.
    - ``"nccl"``: NCCL for CUDA tensors and gloo for CPU tensors, each worker on GPU
      ``LOCAL_RANK``; needs a GPU per worker of the node.
    - ``"auto"``: ``"nccl"`` when CUDA is available, else ``"gloo"``.

    A node with more workers than GPUs is refused here, before any CUDA call, naming
    both counts and the ways out (one process per GPU could never share one NCCL
    device, and ``cuda:LOCAL_RANK`` would not exist)."""
    where = "backend"
    if backend is None:
        backend = os.environ.get(BACKEND_ENV) or "auto"
        where = f"${BACKEND_ENV}" if os.environ.get(BACKEND_ENV) else "backend"
    if backend == _MIXED:
        backend = "nccl"
    if backend not in BACKENDS:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, BACKENDS))} (or {_MIXED!r}), got {backend!r}")
    if backend == "gloo" or (backend == "auto" and not torch.cuda.is_available()):
        return "gloo"
    workers = local_world_size if local_world_size and local_world_size > 0 else _env_int("LOCAL_WORLD_SIZE", 1)
    shortage = gpu_shortage(f"{where}={backend!r}", workers, "--nproc_per_node",
                            f"init_process_group(backend='gloo'), {BACKEND_ENV}=gloo, or the launcher's --backend gloo")
    if shortage:
        raise RuntimeError(shortage)
    return _MIXED


def init_process_group(
    store: dist.Store | None = None,
    rank: int = -1,
    world_size: int = -1,
    local_world_size: int = -1,
    *,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
    init_timeout: timedelta | float | None = None,
    fault_tolerance: str | None = None,
) -> None:
    """Join the job's process group, like Bagua 0.9's
    ``init_process_group(store=None, rank=-1, world_size=-1, local_world_size=-1)``.

    Without ``store`` it rendezvous through ``env://``: RANK, WORLD_SIZE, MASTER_ADDR
    and MASTER_PORT. With ``store``, ``rank`` and ``world_size`` come from the
    arguments (or RANK / WORLD_SIZE). ``local_world_size`` (or LOCAL_WORLD_SIZE)
    sets how many consecutive ranks share a node; when neither is given all
    processes are taken to be on one node. ``backend`` (``"auto"``, ``"gloo"`` or
    ``"nccl"``; default $BAGUA_ALGOS_BACKEND, else ``"auto"``) is chosen by
    :func:`choose_backend`: with NCCL, CUDA tensors travel over NCCL, CPU tensors over
    gloo, and the current CUDA device becomes ``cuda:LOCAL_RANK``; with gloo, CUDA
    tensors are staged through host memory. ``timeout`` (a timedelta or seconds,
    default 10 minutes) bounds every wait on a peer, in this group and in every group
    created from it, so a dead or silent peer becomes an error instead of a hang.

    ``init_timeout`` (a timedelta or seconds; default $BAGUA_ALGOS_INIT_TIMEOUT, else
    2 minutes under torchrun's elastic agent and ``timeout`` otherwise, never more
    than ``timeout``) bounds the join itself: a worker that cannot form the group by
    then raises, and the agent starts a new round instead of waiting ``timeout``.
    Under the agent's shared store (torchrun's default: TORCHELASTIC_USE_AGENT_STORE)
    the group is formed in a namespace of the store that belongs to this round alone
    (bagua_algos/runtime/comm/rounds.py: the store outlives restarts, and a restarted
    round would otherwise read the keys of the round before; pytorch/pytorch#135712).

    ``fault_tolerance="torchft"`` (default ``$BAGUA_ALGOS_FAULT_TOLERANCE``, which the
    launcher's ``--torchft`` sets) makes this process a torchft replica instead: no
    rendezvous here; the group is formed over each step's quorum (comm/fault_tolerance.py,
    docs/elastic.md). Only the gloo backend is supported then.
    """
    from . import fault_tolerance as _fault_tolerance

    if _fault_tolerance.requested(fault_tolerance) == "torchft":
        if isinstance(store, str):
            backend, store = store, None
        if is_initialized():
            raise RuntimeError("init_process_group() was called twice in this process")
        if choose_backend(backend, 1) != "gloo":
            raise ValueError("fault_tolerance='torchft' runs over gloo here: pass backend='gloo' "
                             f"(or {BACKEND_ENV}=gloo, the launcher's --backend gloo)")
        timeout = DEFAULT_TIMEOUT if timeout is None else _as_timedelta(timeout)
        _fault_tolerance.init(timeout)
        _owner["joined"] = True
        if not _owner["atexit"]:
            atexit.register(_destroy_at_exit)
            _owner["atexit"] = True
        return
    if isinstance(store, str):  # the old positional order began with the backend
        backend, store = store, None
    if is_initialized():
        raise RuntimeError("init_process_group() was called twice in this process")
    timeout = DEFAULT_TIMEOUT if timeout is None else _as_timedelta(timeout)
    init_timeout = _init_timeout(init_timeout, timeout)
    rank, world_size, local_world_size, local_rank = _job_layout(store, rank, world_size, local_world_size)
    torch_backend = choose_backend(backend, local_world_size)
    if torch_backend != "gloo":
        torch.cuda.set_device(local_rank)
    if not hasattr(dist, "set_timeout"):  # an older torch cannot lengthen a group's timeout after the join
        init_timeout = timeout
    kwargs = {"backend": torch_backend, "timeout": init_timeout, "rank": rank, "world_size": world_size}
    agent_client = None
    if store is not None:
        kwargs["store"] = store
    elif agent_store_shared(os.environ):
        kwargs["store"], agent_client = round_store(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT"),
                                                    rank, world_size, init_timeout)
    else:
        kwargs["init_method"] = "env://"
        _owner["loopback_store"] = _loopback_master(rank, world_size, init_timeout)
    dist.init_process_group(**kwargs)
    if init_timeout != timeout:  # joined: from now on every wait gets the job's timeout
        dist.set_timeout(timeout)
        default_store = agent_client or dist.distributed_c10d._get_default_store()
        default_store.set_timeout(timeout)
    _joined(timeout)
    watch_agent()  # under torchrun's agent: stop if the agent dies (agent_watch.py)
    _owner["joined"] = True
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    os.environ["LOCAL_RANK"] = str(local_rank)
    if not _owner["atexit"]:
        atexit.register(_destroy_at_exit)
        _owner["atexit"] = True


def _loopback_master(rank: int, world_size: int, timeout: timedelta):
    """Worker 0's store server on a loopback ``MASTER_ADDR``, bound to that address: torch's
    env:// store (``rendezvous.py``, ``TCPStore(..., is_master=start_daemon,
    multi_tenant=True)``) listens on every interface whatever its host; started here
    first on a bound socket (``master_listen_fd``), it is that store's server (a
    multi-tenant store shares the server of its port). None otherwise."""
    import socket

    from .fault_tolerance import is_loopback

    host = os.environ.get("MASTER_ADDR", "")
    if rank != 0 or not is_loopback(host):
        return None
    host = "127.0.0.1" if host.lower() == "localhost" else host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own store server
    try:
        sock.bind((host, _env_int("MASTER_PORT")))
        sock.listen(128)
    except OSError:  # the port is taken: torch's own store says so, as before
        sock.close()
        return None
    return dist.TCPStore(host, sock.getsockname()[1], world_size, is_master=True, timeout=timeout,
                         wait_for_workers=False, multi_tenant=True, master_listen_fd=sock.detach())


def _init_timeout(init_timeout, timeout: timedelta) -> timedelta:
    """The bound on joining (see :func:`init_process_group`), at most ``timeout``."""
    if init_timeout is None:
        from_env = os.environ.get(INIT_TIMEOUT_ENV)
        if from_env:
            try:
                init_timeout = float(from_env)
            except ValueError:
                init_timeout = from_env  # refused below, naming the variable
            init_timeout = _as_timedelta(init_timeout, f"${INIT_TIMEOUT_ENV}")
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            init_timeout = AGENT_INIT_TIMEOUT
        else:
            init_timeout = timeout
    else:
        init_timeout = _as_timedelta(init_timeout, "init_timeout")
    return min(init_timeout, timeout)


def _from_env_or(name: str, value, variable: str) -> int:
    """A rank or size argument: an int >= 0, or -1 / None for "from $``variable``"."""
    if value is None:
        return -1
    return check_int(name, value, -1, what=f"an int >= 0 (or -1: from ${variable})")


def _job_layout(store, rank, world_size, local_world_size) -> tuple[int, int, int, int]:
    """(rank, world_size, local_world_size, local_rank) from the arguments, else the
    launcher's environment variables, each checked."""
    rank = _from_env_or("rank", rank, "RANK")
    world_size = _from_env_or("world_size", world_size, "WORLD_SIZE")
    local_world_size = _from_env_or("local_world_size", local_world_size, "LOCAL_WORLD_SIZE")
    if store is None:
        rank = _env_int("RANK") if rank < 0 else rank
        world_size = _env_int("WORLD_SIZE") if world_size < 0 else world_size
        _env_int("MASTER_PORT")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    else:
        if rank < 0 and "RANK" in os.environ:
            rank = _env_int("RANK")
        if world_size < 0 and "WORLD_SIZE" in os.environ:
            world_size = _env_int("WORLD_SIZE")
        if rank < 0 or world_size < 0:
            raise ValueError("init_process_group(store=...) also needs rank= and world_size= (or RANK and WORLD_SIZE)")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}) for world_size={world_size}, got {rank}")
    if local_world_size >= 0 and not 1 <= local_world_size <= world_size:
        raise ValueError(f"local_world_size must be in [1, {world_size}], got {local_world_size}")
    if local_world_size < 0:
        local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
        if not 1 <= local_world_size <= world_size:
            raise ValueError(f"LOCAL_WORLD_SIZE must be in [1, {world_size}], got {local_world_size}")
        return rank, world_size, local_world_size, _env_int("LOCAL_RANK", rank % local_world_size)
    return rank, world_size, local_world_size, rank % local_world_size


def destroy_process_group() -> None:
    """Leave the job: stop the helper thread, destroy every group (collective-free)."""
    _stop_helper(job_timeout().total_seconds() + 5)
    from .fault_tolerance import shutdown as _shutdown_fault_tolerance

    _shutdown_fault_tolerance()
    _joined(None)
    _owner["joined"] = False
    _owner.pop("loopback_store", None)  # worker 0's store server (_loopback_master)
    if is_initialized():
        dist.destroy_process_group()
        _drop_groups_held_as_defaults()


def _drop_groups_held_as_defaults() -> None:
    """Point every torch.distributed function whose default argument is a process
    group back at ``None`` (the default group), so that destroyed groups are freed.

    Why: torch.distributed.nn.functional declares ``group=group.WORLD``, evaluated once,
    when the module is first imported; building the first optimizer imports it (torch.optim
    → torch._dynamo → FSDP). A script that builds its optimizer after init_process_group
    thus leaves the job's group in ten default tuples, and dist.destroy_process_group()
    cannot free it: its gloo threads (or NCCL watchdog) run on into interpreter
    finalization. A gloo thread that drops a finished op there needs the GIL for the op's
    tensors, CPython ends it with pthread_exit, and the process aborts ("terminate called
    without an active exception", SIGABRT, after a successful run: a core's backtrace is
    in docs/exit_abort.md). ``None`` is what ``group.WORLD`` was before init and what
    torch reads as the default group.
    """
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None) if name.startswith("torch.distributed") else None
        if not isinstance(namespace, dict):  # another package, or a placeholder in sys.modules
            continue
        for fn in list(namespace.values()):
            if type(fn) is not types.FunctionType:  # type(): no attribute access on the module's objects
                continue
            if fn.__defaults__ and any(isinstance(d, dist.ProcessGroup) for d in fn.__defaults__):
                fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in fn.__defaults__)
            if fn.__kwdefaults__ and any(isinstance(d, dist.ProcessGroup) for d in fn.__kwdefaults__.values()):
                fn.__kwdefaults__ = {k: None if isinstance(d, dist.ProcessGroup) else d
                                     for k, d in fn.__kwdefaults__.items()}


def _destroy_at_exit() -> None:
    # A process group still alive at interpreter exit is torn down while its backend
    # threads run, which can abort the process; destroy it first (only if ours). A
    # script that called torch's dist.destroy_process_group() itself may still have
    # left the group in torch's default arguments: free it now, not at finalization.
    if not _owner["joined"]:
        return
    try:
        if is_initialized():
            destroy_process_group()
        else:
            _drop_groups_held_as_defaults()
    except Exception:  # noqa: BLE001 - nothing useful to do at exit
        pass
