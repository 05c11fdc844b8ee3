"""Arguments are checked where they are given, by name: boolean flags must be bools (a
"false" string is not True), a seed must be an int, a gossip topology must be
connected (and a topology means gossip between workers), a module without trainable
parameters or with sparse gradients is refused naming the cause. Each check came from
a gap the bad-input probes (tests/bad_input_cases.py) found; here each is checked
without a process group, the probes check them end to end in two gloo workers."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from bagua_algos.algorithms import (
    AsyncModelAverageAlgorithmImpl,
    DecentralizedAlgorithm,
    DecentralizedAlgorithmImpl,
    GradientAllReduceAlgorithm,
    RelayAlgorithm,
)
from bagua_algos.runtime.topology import resolve_topology
from bagua_algos.runtime.algorithm import AlgorithmImpl
from topologies import ChainTopology, Topology, get_topology


@pytest.mark.parametrize("name", ["hierarchical", "average"])
@pytest.mark.parametrize("value", ["false", "True", 0, 1, None])
def test_gradient_allreduce_flags_must_be_bools(name, value):
    with pytest.raises(TypeError, match=f"{name} must be True or False, got {value!r}"):
        GradientAllReduceAlgorithm(**{name: value})


def test_decentralized_hierarchical_must_be_a_bool():
    with pytest.raises(TypeError, match="hierarchical must be True or False, got 'false'"):
        DecentralizedAlgorithm(hierarchical="false")
    with pytest.raises(TypeError, match="hierarchical must be True or False"):
        DecentralizedAlgorithm(hierarchical="true", topology="ring")


def test_bool_flags_are_kept():
    assert GradientAllReduceAlgorithm(hierarchical=True, average=False).average is False
    assert DecentralizedAlgorithm().hierarchical is True  # Bagua's default without a topology
    assert DecentralizedAlgorithm(topology="ring").hierarchical is False
    assert DecentralizedAlgorithm(hierarchical=False).hierarchical is False


@pytest.mark.parametrize("seed", ["x", 1.5, True, None, -1, 2**63])
def test_relay_seed_must_be_an_int(seed):
    with pytest.raises(ValueError, match=re.escape(f"seed must be an int >= 0 and < 2**63, got {seed!r}")):
        RelayAlgorithm(seed=seed)


def test_relay_seed_accepts_integers():
    assert RelayAlgorithm(seed=7).seed == 7
    assert RelayAlgorithm(seed=np.int64(3)).seed == 3


class NoEdges(Topology):
    name = "no_edges"

    def _candidate_neighbors(self, rank):
        return []


class TwoPairs(Topology):
    """0-1 and 2-3: two components."""

    name = "two_pairs"

    def _candidate_neighbors(self, rank):
        return [rank ^ 1]


@pytest.mark.parametrize("topology", [NoEdges(2), TwoPairs(4)])
def test_a_disconnected_topology_is_refused(topology):
    with pytest.raises(ValueError, match="is not connected: ranks in different components"):
        resolve_topology(topology, topology.world_size)


def test_connected_topologies_and_the_tree_message_are_unchanged():
    for name in ("chain", "ring", "double_binary_tree", "exponential", "fully_connected"):
        for n in (1, 2, 5):
            assert resolve_topology(name, n).world_size == n
    assert resolve_topology(ChainTopology(3), 3, require_tree=True).is_tree()
    with pytest.raises(ValueError, match="is not a tree"):
        resolve_topology(NoEdges(2), 2, require_tree=True)
    with pytest.raises(ValueError, match="is not a tree"):
        resolve_topology(get_topology("ring", 4), 4, require_tree=True)


def test_a_module_without_trainable_parameters_is_named_as_the_cause():
    with pytest.raises(ValueError, match="the module has no parameter that requires grad"):
        DecentralizedAlgorithmImpl(None).tensors_to_buckets([], True)
    # AsyncModelAverageAlgorithmImpl's constructor makes a process group: test the method alone.
    impl = object.__new__(AsyncModelAverageAlgorithmImpl)
    impl.step_id, impl.warmup_steps = 0, 0
    with pytest.raises(ValueError, match="the module has no parameter that requires grad"):
        impl.tensors_to_buckets([], True)
    with pytest.raises(ValueError, match="the module has no parameter that requires grad"):
        impl.tensors_to_buckets([[]], True)


def test_a_sparse_gradient_is_refused_by_name_before_it_reaches_a_bucket():
    impl = AlgorithmImpl(None)
    impl._communication_tensor_names = {"embedding.weight"}
    hook = impl.init_backward_hook(None)
    param = torch.nn.Parameter(torch.zeros(10, 3))
    param.grad = torch.sparse_coo_tensor([[1, 2]], torch.ones(2, 3), (10, 3), check_invariants=True)
    with pytest.raises(NotImplementedError, match=r"parameter 'embedding.weight' has a sparse gradient .*sparse=False"):
        hook("embedding.weight", param)
    hook("other", param)  # not communicated by this algorithm: not its business


def test_a_topology_means_gossip_between_workers():
    assert DecentralizedAlgorithm(topology="ring").hierarchical is False
    assert DecentralizedAlgorithm().hierarchical is True  # Bagua's default without a topology
    with pytest.raises(ValueError, match="hierarchical=False with a topology"):
        DecentralizedAlgorithm(topology="ring", hierarchical=True)
