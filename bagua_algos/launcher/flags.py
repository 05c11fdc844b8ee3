"""The launcher's flags as data: each flag's names, value type, default, help, and
where it goes on the ``torch.distributed.run`` (torchrun) command line (``FLAGS``).

:mod:`bagua_algos.launcher.launch` builds its parser from ``FLAGS`` and translates
the parsed flags into torchrun's argument list in one function
(:func:`bagua_algos.launcher.launch.torchrun_argv`), by each flag's ``torchrun``
entry. The value parsers here are argparse ``type=`` functions: an
``ArgumentTypeError`` becomes "argument --flag: <message>", naming the flag as it
was typed.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Union

from bagua_algos.runtime.bucket import BUCKET_SIZE_ENV

PROG = "bagua_algos.launch"
RUN_PROG = "bagua.distributed.run"

# The defaults that differ between the entry points: each keeps its Bagua namesake's
# (bagua.distributed.launch: one worker, no restarts; Bagua 0.9's run.py: auto workers,
# 3 restarts, a look at the workers every 5 s). None: torchrun's own default.
ENTRY_DEFAULTS = {
    PROG: dict(nnodes=(1, 1), nproc_per_node=1, max_restarts=0, monitor_interval=None),
    "bagua.distributed.launch": dict(nnodes=(1, 1), nproc_per_node=1, max_restarts=0, monitor_interval=None),
    RUN_PROG: dict(nnodes=(1, 1), nproc_per_node="auto", max_restarts=3, monitor_interval=5.0),
}

RDZV_BACKENDS = ("static", "c10d")
NPROC_WORDS = ("auto", "cpu", "gpu")
DEFAULT_C10D_PORT = 29400  # torch's c10d rendezvous port when --rdzv_endpoint names none
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
LATE_JOIN_ISSUE = "pytorch/pytorch#147064"

# torchrun substitutes this macro with each worker's local rank
# (torch.distributed.elastic.utils.macros.local_rank).
_LOCAL_RANK_MACRO = "${local_rank}"

# torch's Std.from_str: one value for every local rank, or LOCAL_RANK:VALUE pairs
_STD_VALUE = re.compile(r"^[0123]$")
_STD_MAPPING = re.compile(r"^(\d:[0123],)*(\d:[0123])$")
_STD_VALID = ("0 (none), 1 (stdout), 2 (stderr), 3 (both), or LOCAL_RANK:VALUE pairs "
              "such as 0:3,1:2")


# ------------------------------------------------------------------ value parsers

def _nnodes(text: str) -> Tuple[int, int]:
    """``N`` or ``MIN:MAX`` -> (min, max) with 1 <= min <= max."""
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
        if len(parts) > 2:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a number of nodes nor a range MIN:MAX (such as 2 or 1:4)") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the number of nodes must be >= 1, and a range MIN:MAX needs 1 <= MIN <= MAX")
    return low, high


def _nproc(text: str):
    """A number of workers >= 1, or one of torchrun's words auto/cpu/gpu."""
    if text in NPROC_WORDS:
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}: give a number >= 1 or one of {', '.join(NPROC_WORDS)}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (or one of {', '.join(NPROC_WORDS)}), got {value}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _std_spec(text: str) -> str:
    if _STD_VALUE.match(text) or _STD_MAPPING.match(text):
        return text
    raise argparse.ArgumentTypeError(f"invalid value {text!r}: give {_STD_VALID}")


def split_endpoint(text: str) -> Tuple[str, Optional[int]]:
    """``host``, ``host:port``, ``[v6]:port`` -> (host, port or None); ValueError says why."""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError("an IPv6 host is written in brackets, as [::1]:29400")
        port_text = rest[1:] if rest else None
    elif text.count(":") > 1:
        raise ValueError("an IPv6 host is written in brackets, as [::1]:29400")
    else:
        host, _, port_text = text.partition(":")
        port_text = port_text if ":" in text else None
    if not host:
        raise ValueError("the host is missing")
    if port_text is None:
        return host, None
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"the port must be a number in [1, 65535], got {port_text!r}")
    return host, int(port_text)


def _endpoint(text: str) -> str:
    try:
        split_endpoint(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST[:PORT]: {error}") from None
    return text


# --rdzv_conf: the keys each rendezvous reads, each with its check (a function from the
# text to an error message, or None). torch ignores a key it does not read: a typo
# there ("join_timout") would leave the 600 s default in force without a word.
def _positive_int_text(text: str) -> Optional[str]:
    return None if text.isdigit() and int(text) >= 1 else "a whole number >= 1"


def _nonnegative_int_text(text: str) -> Optional[str]:
    return None if text.isdigit() else "a whole number >= 0"


_BOOL_WORDS = ("1", "0", "true", "false", "t", "f", "yes", "no", "y", "n")  # torch's get_as_bool


def _bool_text(text: str) -> Optional[str]:
    return None if text.lower() in _BOOL_WORDS else "true or false"


def _store_type_text(text: str) -> Optional[str]:
    return None if text.strip().lower() in ("tcp", "file") else "tcp or file"


RDZV_CONF_KEYS = {
    "c10d": {
        "join_timeout": _positive_int_text,        # seconds for the rendezvous to complete (600)
        "last_call_timeout": _nonnegative_int_text,  # extra wait once MIN nodes are in (30)
        "close_timeout": _positive_int_text,       # (30)
        "heartbeat_timeout": _positive_int_text,
        "read_timeout": _positive_int_text,        # a store operation, connecting included (60)
        "keep_alive_interval": _positive_int_text,  # a node's heartbeat period (5)
        "keep_alive_max_attempt": _positive_int_text,  # missed beats before it counts as dead (3)
        "is_host": _bool_text,                     # whether this agent hosts the store
        "store_type": _store_type_text,
    },
    "static": {
        "timeout": _positive_int_text,  # seconds to wait for the other nodes (900)
    },
}
# torch's defaults, for messages
C10D_DEFAULTS = {"join_timeout": 600, "last_call_timeout": 30, "read_timeout": 60}
STATIC_DEFAULT_TIMEOUT = 900
# --rdzv_timeout's key in each backend's configuration
RDZV_TIMEOUT_KEY = {"c10d": "join_timeout", "static": "timeout"}


def parse_rdzv_conf(text: str) -> Dict[str, str]:
    """``k1=v1,k2=v2`` -> {k1: v1, k2: v2} (torch's format); ValueError says why not."""
    conf: Dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise ValueError(f"{item!r} is not KEY=VALUE")
        if key in conf:
            raise ValueError(f"{key!r} is given twice")
        conf[key] = value
    return conf


def _rdzv_conf(text: str) -> Dict[str, str]:
    try:
        return parse_rdzv_conf(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"{error}; give KEY=VALUE pairs separated by commas, such as join_timeout=60,read_timeout=10"
        ) from None


# Flags of Bagua's launchers that configure Bagua's own services (autotune server,
# Bagua-Net, metrics, baguarun's host list). They have no meaning here: accepted, and
# named in one warning. name -> argparse keyword arguments; the default (None, or False
# for a switch) tells whether the flag was given. Bagua 0.9's run.py spelled Bagua-Net's
# switch --bagua-net_switch_on; launch.py --enable_bagua_net.
BAGUA_ONLY_FLAGS = {
    "--bagua_service_port": dict(type=int),
    "--autotune_level": dict(type=int),
    "--autotune_log_file": dict(type=str),
    "--is_output_autotune_log": dict(action="store_true"),
    "--report_metrics": dict(action="store_true"),
    "--autotune_max_samples": dict(type=int),
    "--autotune_sampling_confidence_time": dict(type=float),
    "--autotune_warmup_time": dict(type=float),
    "--enable_bagua_net": dict(action="store_true"),
    "--bagua-net_switch_on": dict(action="store_true"),
    "--host_list": dict(type=str),
    "--ssh_port": dict(type=int),
}


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def torchrun_spelling(flag: str) -> str:
    """``--nproc_per_node`` -> ``--nproc-per-node``: torchrun's spelling of a flag."""
    return "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag



def nnodes_text(nnodes: Tuple[int, int]) -> str:
    """(2, 2) -> '2'; (1, 4) -> '1:4' (torchrun's form)."""
    low, high = nnodes
    return str(low) if low == high else f"{low}:{high}"


# ------------------------------------------------------------------ the table

# Where a flag goes on torchrun's command line (``Flag.torchrun``); torchrun_argv
# reads these and nothing else.
SAME = "same"              # torchrun's flag of the same name, in its spelling, with the value as
                           # text (a switch: the flag alone); left out when the value is None
RENDEZVOUS = "rendezvous"  # as SAME, unless --standalone, which makes its own rendezvous
STATIC = "static"          # as SAME, with the static rendezvous only (c10d numbers the nodes
                           # and publishes the workers' master itself)
CONF = "rdzv-conf"         # into --rdzv-conf: --rdzv_conf's pairs, and --rdzv_timeout under its
                           # backend's key (rdzv_conf)
LOGS = "logs"              # --log-dir and --redirects; --logdir D is --log-dir D --redirects 3
SCRIPT = "script"          # an argument of the training script, before the script's own
ENV = "environment"        # not on torchrun's line: the workers' environment
                           # (launch.set_worker_environment)
IGNORED = None             # accepted and without effect

PER_ENTRY = object()  # a default that differs between the entry points (ENTRY_DEFAULTS)

RENDEZVOUS_GROUP = "rendezvous (how the nodes find each other)"
TORCHFT_GROUP = "fault tolerance at the step (torchft)"
BAGUA_GROUP = "Bagua's service flags (accepted for compatibility and ignored, with one warning)"


@dataclass(frozen=True)
class Flag:
    """One launcher flag. ``names``: Bagua's spellings (a short form first, if any);
    each long name with underscores also gets a hidden twin in torchrun's spelling.
    ``help``: the text, or a function of the entry point's defaults for a flag whose
    default depends on it. ``torchrun``: where the value goes (SAME, STATIC, ...).
    ``text``: the value as torchrun reads it."""

    names: Tuple[str, ...]
    torchrun: Optional[str]
    help: Union[str, Callable[[Dict[str, Any]], str]]
    default: Any = None
    type: Optional[Callable[[str], Any]] = None
    choices: Optional[Tuple[str, ...]] = None
    switch: bool = False
    group: Optional[str] = None
    text: Callable[[Any], str] = str

    @property
    def name(self) -> str:
        """The long name: what --help shows last and errors name."""
        return self.names[-1]

    @property
    def dest(self) -> str:
        return _dest(self.name)

    def argparse_kwargs(self, entry_defaults: Dict[str, Any]) -> Dict[str, Any]:
        default = entry_defaults[self.dest] if self.default is PER_ENTRY else self.default
        kwargs: Dict[str, Any] = dict(help=self.help(entry_defaults) if callable(self.help) else self.help)
        if self.switch:
            kwargs.update(action="store_true", default=bool(default))
            return kwargs
        kwargs["default"] = default
        if self.type is not None:
            kwargs["type"] = self.type
        if self.choices is not None:
            kwargs["choices"] = self.choices
        return kwargs


def _default_nnodes(defaults: Dict[str, Any]) -> str:
    low, high = defaults["nnodes"]
    return str(low) if low == high else f"{low}:{high}"


def _default_monitor(defaults: Dict[str, Any]) -> str:
    seconds = defaults["monitor_interval"]
    return f"{seconds:g})" if seconds else "torchrun's, 0.1)"


# Every flag, in the order --help lists them.
FLAGS: Tuple[Flag, ...] = (
    Flag(("--nnodes",), SAME, type=_nnodes, default=PER_ENTRY, text=nnodes_text,
         help=lambda d: "number of nodes N, or a range MIN:MAX (elastic; needs --rdzv_backend c10d) "
         f"(default {_default_nnodes(d)})"),
    Flag(("--nproc_per_node",), SAME, type=_nproc, default=PER_ENTRY,
         help=lambda d: "worker processes on this node: a number, or auto (a GPU each, else a CPU core "
         f"each), cpu or gpu (default {d['nproc_per_node']})"),
    # the rendezvous
    Flag(("--rdzv_backend",), RENDEZVOUS, choices=RDZV_BACKENDS, default="static", group=RENDEZVOUS_GROUP,
         help="static: fixed nodes, node 0 at --master_addr:--master_port, each given --node_rank; "
         "c10d: nodes join a store hosted by the agent at --rdzv_endpoint, may come and go "
         "within --nnodes MIN:MAX (default static)"),
    Flag(("--rdzv_endpoint",), RENDEZVOUS, type=_endpoint, group=RENDEZVOUS_GROUP,
         help=f"HOST[:PORT] of the rendezvous (c10d: the agent on HOST hosts its store; port "
         f"{DEFAULT_C10D_PORT} if none is given)"),
    Flag(("--rdzv_id",), RENDEZVOUS, type=str, default="none", group=RENDEZVOUS_GROUP,
         help="job id, the same on every node (default none)"),
    Flag(("--rdzv_conf",), CONF, type=_rdzv_conf, default={}, group=RENDEZVOUS_GROUP,
         help="KEY=VALUE,... for the rendezvous; c10d: " + ", ".join(RDZV_CONF_KEYS["c10d"])
         + "; static: " + ", ".join(RDZV_CONF_KEYS["static"])),
    Flag(("--rdzv_timeout",), CONF, type=int, group=RENDEZVOUS_GROUP,
         help="seconds an agent waits for the other nodes to join (join_timeout with c10d, "
         "timeout with static; torch's defaults: 600 and 900)"),
    Flag(("--standalone",), SAME, switch=True, group=RENDEZVOUS_GROUP,
         help="one node: a c10d rendezvous on a free local port with a fresh id "
         "(--rdzv_backend/--rdzv_endpoint/--rdzv_id are then not used)"),
    Flag(("--local_addr",), SAME, type=str, group=RENDEZVOUS_GROUP,
         help="c10d: this node's address as the other nodes reach it, published as the workers' "
         "MASTER_ADDR when this node holds rank 0 (default: this host's fully qualified name; "
         "an extension: torchrun's --local-addr)"),
    Flag(("--node_rank",), STATIC, type=int, default=0, group=RENDEZVOUS_GROUP,
         help="static: rank of this node, in [0, nnodes) (default 0)"),
    Flag(("--master_addr",), STATIC, type=str, default="127.0.0.1", group=RENDEZVOUS_GROUP,
         help="static: address of node 0 (default 127.0.0.1)"),
    Flag(("--master_port",), STATIC, type=int, default=29500, group=RENDEZVOUS_GROUP,
         help="static: free port on node 0 (default 29500)"),
    # the agent and its workers
    Flag(("--max_restarts",), SAME, type=int, default=PER_ENTRY,
         help=lambda d: f"restarts of the worker group before failing (default {d['max_restarts']})"),
    Flag(("--monitor_interval",), SAME, type=_positive_seconds, default=PER_ENTRY,
         help=lambda d: "seconds between the agent's looks at its workers (default " + _default_monitor(d)),
    Flag(("--start_method",), SAME, choices=("spawn", "fork", "forkserver"), default="spawn",
         help="how the agent starts workers of a function entry point (default spawn)"),
    Flag(("--role",), SAME, type=str, default="default", help="the workers' role (default 'default')"),
    Flag(("-m", "--module"), SAME, switch=True, help="run the training script as a module, like 'python -m'"),
    Flag(("--no_python",), SAME, switch=True, help="execute the training script directly, without 'python'"),
    Flag(("--run_path",), SAME, switch=True,
         help="run the training script with runpy.run_path in the worker's interpreter"),
    Flag(("--log_dir",), LOGS, type=str, help="directory for the workers' log files (see --redirects and --tee)"),
    Flag(("-r", "--redirects"), LOGS, type=_std_spec, default="0",
         help="send workers' streams to files under --log_dir: " + _STD_VALID + " (default 0)"),
    Flag(("-t", "--tee"), SAME, type=_std_spec, default="0",
         help="like --redirects, but also to the console (default 0)"),
    Flag(("--logdir",), LOGS, type=str,
         help="bagua.distributed.launch's flag: --log_dir with both streams of every worker "
         "redirected to files"),
    Flag(("--set_additional_flag",), SCRIPT, switch=True,
         help="pass --local_rank=<local rank> to the training script"),
    Flag(("--use_env",), IGNORED, switch=True, default=True,
         help="accepted for Bagua's run: LOCAL_RANK is always in the workers' environment"),
    # the workers' environment
    Flag(("--backend",), ENV, choices=("auto", "gloo", "nccl"),
         help="backend of the workers' init_process_group() when the script names none "
         "(sets BAGUA_ALGOS_BACKEND): nccl puts each worker on GPU LOCAL_RANK (CUDA tensors "
         "over NCCL, CPU tensors over gloo) and needs a GPU per worker; gloo runs on CPU "
         "(CUDA tensors staged through host memory); auto (the default) is nccl when CUDA "
         "is available, else gloo"),
    Flag(("--torchft",), ENV, switch=True, group=TORCHFT_GROUP,
         help="fault tolerance at the step on torchft (pip install 'bagua-algos[torchft]'): each worker is a "
              "replica; a worker that dies or hangs is dropped from the quorum and the others go on; its "
              "step is discarded everywhere (docs/elastic.md). Starts a lighthouse unless --lighthouse"),
    Flag(("--lighthouse",), ENV, type=str, group=TORCHFT_GROUP,
         help="with --torchft: join the torchft lighthouse at this address (http://HOST:PORT) instead of "
              "starting one; needed on more than one node (keep it on a private network: docs/elastic.md)"),
    Flag(("--min_replicas",), ENV, type=int, default=1, group=TORCHFT_GROUP,
         help="with --torchft: the fewest replicas a step may commit with, and the lighthouse's quorum "
              "minimum, from 1 to nnodes x nproc_per_node (default 1)"),
    Flag(("--join_timeout",), ENV, type=_positive_seconds, default=10.0, group=TORCHFT_GROUP,
         help="with --torchft: seconds the lighthouse it starts waits for more replicas before a quorum "
              "without them (default 10)"),
    Flag(("--heartbeat_timeout",), ENV, type=_positive_seconds, default=2.0, group=TORCHFT_GROUP,
         help="with --torchft: seconds without a heartbeat (a replica sends one every 0.1 s) after which "
              "the lighthouse it starts counts a replica dead; until then a quorum waits for a dead "
              "replica as for a live straggler (default 2; torchft's own default is longer)"),
    Flag(("--no_bagua_compat",), ENV, switch=True,
         help="do not put the compatibility package 'bagua' on the "
         "workers' PYTHONPATH (by default it is put there when no real "
         "Bagua is installed, so that 'import bagua.torch_api' works)"),
    Flag(("--default_bucket_size",), ENV, type=int,
         help=f"bytes per bucket for with_bagua() when the script names none (sets {BUCKET_SIZE_ENV} "
         "for the workers; default 10 MiB)"),
    # Bagua's services: accepted, named in one warning (ignored_flags_warning)
    *(Flag((flag,), IGNORED, help="ignored", group=BAGUA_GROUP, switch=kwargs.get("action") == "store_true",
           type=kwargs.get("type")) for flag, kwargs in BAGUA_ONLY_FLAGS.items()),
)


def rendezvous_backend(args: argparse.Namespace) -> str:
    return "c10d" if args.standalone else args.rdzv_backend


def rdzv_conf(args: argparse.Namespace) -> Dict[str, str]:
    """--rdzv_conf with --rdzv_timeout added under its backend's key."""
    conf = dict(args.rdzv_conf)
    if args.rdzv_timeout is not None:
        conf[RDZV_TIMEOUT_KEY[rendezvous_backend(args)]] = str(args.rdzv_timeout)
    return conf
