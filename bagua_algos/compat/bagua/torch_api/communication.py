"""``bagua.torch_api.communication`` on bagua-algos (torch.distributed underneath)."""

from bagua_algos.runtime.comm import *  # noqa: F401,F403
from bagua_algos.runtime.comm import _get_default_group  # noqa: F401
from bagua_algos.runtime.backend import get_backend  # noqa: F401
from bagua_algos.runtime import comm as _comm


class _GroupRanks:
    """Bagua's ``_pg_group_ranks``: group → {global rank: rank in the group}."""

    def __getitem__(self, group):
        return {g: r for r, g in enumerate(_comm.group_ranks(group))}

    def __contains__(self, group) -> bool:
        return True


_pg_group_ranks = _GroupRanks()


def _rank_not_in_group(group) -> bool:
    return group is not None and _comm.group_rank(group) < 0
