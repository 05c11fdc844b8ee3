"""comm's calls are answered by a transport (runtime/comm/transport.py): the interface
names every call, each public call reaches the transport it is on with its own
arguments, and the engine's transport implements the whole interface."""

from __future__ import annotations

import inspect

import pytest
import torch

from bagua_algos.engine.transport import StackedGroup
from bagua_algos.runtime import comm
from bagua_algos.runtime.comm import api
from bagua_algos.runtime.comm.transport import Transport


def test_the_interface_names_every_call_of_comm():
    assert set(Transport.__abstractmethods__) == set(api.CALLS) | {"default_group"}
    for name in api.CALLS:
        assert getattr(comm, name) is getattr(api, name), f"comm.{name} is not the transport's call"


class _Recorder(Transport):
    """A transport that answers every call with (its name, the arguments it got)."""


for _name in Transport.__abstractmethods__:
    setattr(_Recorder, _name, (lambda name: lambda self, *args, **kwargs: (name, args, kwargs))(_name))
_Recorder.__abstractmethods__ = frozenset()


def _arguments(function, transport) -> list:
    """A distinct stand-in for each required positional argument of ``function`` (a
    required group: the transport itself, the engine's way of naming its group)."""
    return [transport if p.name == "group" else object() for p in inspect.signature(function).parameters.values()
            if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


@pytest.mark.parametrize("name", api.CALLS)
def test_each_call_reaches_the_current_transport_with_its_arguments(name):
    recorder = _Recorder()
    args = _arguments(getattr(api, name), recorder)
    with comm.using_transport(recorder):
        called, got, _ = getattr(comm, name)(*args)
    assert called == name
    assert all(any(a is g for g in got) for a in args)  # every argument handed on, itself


@pytest.mark.parametrize("name", ["allreduce_inplace", "broadcast", "barrier", "all_gather_object"])
def test_a_transport_named_as_comm_answers_outside_any_block(name):
    recorder = _Recorder()
    args = _arguments(getattr(api, name), recorder)
    assert getattr(comm, name)(*args, comm=recorder)[0] == name
    assert getattr(comm, name)(*args, group=recorder)[0] == name


def test_a_process_group_named_on_the_engine_is_refused():
    world = StackedGroup(2)
    with comm.using_transport(world):
        with pytest.raises(TypeError, match="communicate through their own group"):
            comm.allreduce_inplace(torch.zeros(2, 3), group="a process group")
    with pytest.raises(TypeError, match="transport must be a comm.Transport"):
        with comm.using_transport(object()):
            pass


def test_the_engines_transport_is_a_whole_transport_and_the_process_one_is_the_default():
    world = StackedGroup(3)  # (an abstract method left unimplemented would refuse this)
    assert world.row_dims == (3,) and world.runs_in_caller
    assert comm.current_transport() is comm.PROCESS_TRANSPORT
    assert comm.PROCESS_TRANSPORT.row_dims == () and not comm.PROCESS_TRANSPORT.runs_in_caller
    with comm.using_transport(world):
        assert comm.current_transport() is world
        assert comm.get_world_size() == 3 and torch.equal(comm.get_rank(), torch.arange(3))
        assert comm.worker_ranks() == [0, 1, 2]
    assert comm.current_transport() is comm.PROCESS_TRANSPORT


def test_the_engine_refuses_a_call_it_has_no_form_of():
    with comm.using_transport(StackedGroup(2)):
        with pytest.raises(NotImplementedError, match=r"comm.gather has no stacked form.*--engine processes"):
            comm.gather(torch.zeros(2, 1), torch.zeros(2, 2), 0)
