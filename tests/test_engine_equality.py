"""The contract of the one-process engine (docs/engine.md): for every algorithm of the
table, each of its topologies and modes, every worker of the engine holds after 20 steps
the parameters its rank holds as a gloo process, within 1e-5 relative, for 4 and 8
workers. A vectorised sum (the mean over workers, the gossip's multiply-adds) rounds in
another order than gloo's ring or a process's term-by-term sum; those differences are a
few float32 ulps per step, far inside the bound."""

from __future__ import annotations

import pytest
import torch

import engine_cases
from gloo_workers import run_workers

RTOL = 1e-5

CASES = [
    ("gradient_allreduce", "gradient_allreduce", {}),
    ("gradient_allreduce_sum", "gradient_allreduce", {"average": False}),
    ("allreduce_average", "allreduce_average", {}),
    ("allreduce_average_k3", "allreduce_average", {"communication_interval": 3}),
    ("decentralized_all", "decentralized", {}),
    ("decentralized_shift_one", "decentralized", {"peer_selection_mode": "shift_one", "hierarchical": False}),
    ("decentralized_ring", "decentralized", {"topology": "ring"}),
    ("decentralized_exponential_k2", "decentralized", {"topology": "exponential", "communication_interval": 2}),
    ("relay_chain", "relay", {"topology": "chain"}),
    ("relay_binary_tree", "relay", {"topology": "binary_tree"}),
    ("relay_double_binary_tree", "relay", {"topology": "double_binary_tree"}),
    ("relay_chain_world_size", "relay", {"topology": "chain", "mode": "world_size"}),
    ("relay_dbt_drops", "relay", {"topology": "double_binary_tree", "drop_rate": 0.3, "seed": 5}),
]


@pytest.fixture(scope="module", params=[4, 8])
def per_rank(request):
    world = request.param
    results = run_workers(engine_cases.per_rank, world, CASES, timeout=240)
    return world, results


@pytest.mark.parametrize("label,name,kwargs", CASES, ids=[c[0] for c in CASES])
def test_every_worker_equals_its_process(per_rank, label, name, kwargs):
    world, results = per_rank
    expected = torch.stack([results[rank][label] for rank in range(world)])
    got = engine_cases.stacked(world, name, kwargs)
    scale = expected.abs().max()
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=RTOL * float(scale))
    if name not in ("gradient_allreduce", "allreduce_average"):
        assert not torch.allclose(got[0], got[1]), "the workers' models should differ here: the check would be empty"
