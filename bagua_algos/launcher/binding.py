"""Where a job on one machine listens: loopback only.

torch's TCPStore server listens on every interface whatever host it is given (its
``host_name`` is only what clients connect to): torchrun's static rendezvous
(``torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py``, ``TCPStore(
self.master_addr, self.master_port, self.world_size, is_master, self.timeout,
multi_tenant=True)``) and its c10d backend (``c10d_rendezvous_backend.py``, ``TCPStore(host,
port, is_master=is_server, multi_tenant=True, ...)``) have no argument, flag or variable
that changes that. Both ask for a *multi-tenant* store, and torch shares one server among
the multi-tenant stores of a process on the same port. So, when the rendezvous address
is a loopback one, the launcher starts that server itself first, on a socket already
bound to the loopback address (TCPStore's ``master_listen_fd``), and keeps it for the
job: the agent's store is then a tenant of it. ``--standalone`` (torch picks
``localhost:0``, a port known only after the fact) becomes the same c10d rendezvous on a
loopback port chosen here. The workers' gloo pairs are put on the loopback interface
(``GLOO_SOCKET_IFNAME``, unless set). Under c10d the workers' own store is started by
worker 0 at ``MASTER_ADDR`` (the launcher opts out of torch's shared store), which
``init_process_group`` binds to that address when it is a loopback one.
"""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from typing import Optional, Tuple

from bagua_algos.launcher.flags import DEFAULT_C10D_PORT, rendezvous_backend, split_endpoint
from bagua_algos.runtime.comm.fault_tolerance import is_loopback

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"


def loopback_interface() -> Optional[str]:
    """The name of this machine's loopback interface ("lo" on Linux, "lo0" on BSD and
    macOS), or None."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


def rendezvous_address(args: argparse.Namespace) -> Optional[Tuple[str, int]]:
    """(host, port) of the rendezvous store when it is on loopback, else None;
    ``--standalone`` is (127.0.0.1, 0): the port is chosen when the store starts."""
    if args.standalone:
        return "127.0.0.1", 0
    if rendezvous_backend(args) == "static":
        if args.rdzv_endpoint:
            host, port = split_endpoint(args.rdzv_endpoint)
        else:
            host, port = args.master_addr, args.master_port
    elif args.rdzv_endpoint:
        host, port = split_endpoint(args.rdzv_endpoint)
        port = DEFAULT_C10D_PORT if port is None else port
    else:
        return None
    host = "127.0.0.1" if host.lower() == "localhost" else host
    return (host.strip("[]"), int(port)) if is_loopback(host) else None


def single_host(args: argparse.Namespace) -> bool:
    """Whether every node of the job runs on this machine (its rendezvous is on loopback)."""
    return rendezvous_address(args) is not None


def bind_rendezvous(args: argparse.Namespace, targs: argparse.Namespace):
    """Start the rendezvous store's server on its loopback address, before torchrun's
    agent asks for it (see the module). Returns the store to keep for the job's length,
    or None (not a loopback rendezvous, or the port is held already: another node of the
    job on this machine hosts the store, or the agent reports the port's owner itself)."""
    import torch.distributed as dist

    address = rendezvous_address(args)
    if address is None:
        return None
    host, port = address
    if rendezvous_backend(args) == "c10d" and not targs.local_addr:
        # the workers' master address (torch publishes the node's address, its FQDN by
        # default): their store is started by worker 0, and init_process_group binds it to
        # a loopback MASTER_ADDR (runtime/comm/lifecycle.py)
        targs.local_addr = host
    if rendezvous_backend(args) == "static" and args.node_rank != 0:
        return None  # the static rendezvous's store is node 0's
    if str(args.rdzv_conf.get("is_host", "true")).lower() in ("0", "false", "f", "no", "n"):
        return None  # c10d told not to host the store here (torch's is_host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own store server
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        return None
    port = sock.getsockname()[1]
    if args.standalone:  # the same rendezvous as torchrun's --standalone, on this port
        targs.standalone = False
        targs.rdzv_backend, targs.rdzv_endpoint, targs.rdzv_id = "c10d", f"{host}:{port}", str(uuid.uuid4())
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                         master_listen_fd=sock.detach())


def loopback_environment(args: argparse.Namespace) -> None:
    """The workers of a job on one machine talk over loopback: gloo's pairs bind the
    loopback interface (``GLOO_SOCKET_IFNAME``, unless set)."""
    if not single_host(args):
        return
    if args.torchft and args.lighthouse and not is_loopback(split_endpoint(args.lighthouse.split("://", 1)[-1]
                                                                          .rstrip("/"))[0]):
        return  # replicas of other machines join through that lighthouse
    name = loopback_interface()
    if name is not None:
        os.environ.setdefault(GLOO_IFNAME_ENV, name)
