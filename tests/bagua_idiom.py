"""Algorithms written only against Bagua 0.9's API (``bagua.torch_api``), in Bagua's
idiom, for the tests: they import nothing from bagua_algos.

- ``SumThenScaleAlgorithm``: gradient averaging built from Bagua's pieces: each
  gradient registered through getter/setter closures, buckets padded to a multiple of
  the world size (``alignment``), a centralized *sum* followed by a Python op that
  divides by the world size. It must train exactly like gradient_allreduce.
- ``GossipAllAlgorithm``: Bagua's decentralized pattern: the weights marked ready in the
  forward pre-hook, gossiped into a ``peer_weight`` copy while forward and backward run,
  copied back after backward; it calls torch.cuda events and synchronize as Bagua's own
  file does (no-ops without a GPU).
- ``FailingAlgorithm``: a Python op that raises, to see the error reach the trainer.
"""

import torch

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import Algorithm, AlgorithmImpl
from bagua.torch_api.bucket import BaguaBucket


class SumThenScaleImpl(AlgorithmImpl):
    def init_tensors(self, bagua_ddp):
        parameters = bagua_ddp.bagua_build_params()
        tensors = []
        for name, param in parameters.__reversed__():
            param = param.bagua_ensure_grad().ensure_bagua_tensor(
                name,
                bagua_ddp.bagua_module_name,
                getter_closure=lambda param: param.grad,
                setter_closure=lambda param, t: setattr(param, "grad", t),
            )
            tensors.append(param)
        self._names = set(name for name, _ in parameters)
        return tensors

    def tensors_to_buckets(self, tensors, do_flatten):
        size = bagua.get_world_size()
        return [BaguaBucket(b, flatten=do_flatten, name=str(i), alignment=size) for i, b in enumerate(tensors)]

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(hierarchical=False, average=False, group=self.process_group)

        def scale(name):
            for tensor in bucket.tensors:
                tensor.bagua_getter_closure().div_(bagua.get_world_size())

        bucket.append_python_op(scale, group=self.process_group)

    def init_backward_hook(self, bagua_ddp):
        def hook(parameter_name, parameter):
            if parameter_name in self._names:
                parameter.bagua_mark_communication_ready()

        return hook

    def init_post_backward_hook(self, bagua_ddp):
        def hook():
            bagua_ddp._bagua_backend.wait_pending_comm_ops()

        return hook


class SumThenScaleAlgorithm(Algorithm):
    def reify(self, process_group):
        return SumThenScaleImpl(process_group)


class GossipAllImpl(AlgorithmImpl):
    def __init__(self, process_group):
        super().__init__(process_group)
        self.cuda_event = torch.cuda.Event()

    def init_tensors(self, bagua_ddp):
        parameters = bagua_ddp.bagua_build_params()
        self.tensors = [
            param.ensure_bagua_tensor(name, bagua_ddp.bagua_module_name) for name, param in parameters.__reversed__()
        ]
        return self.tensors

    def tensors_to_buckets(self, tensors, do_flatten):
        all_tensors = [t for bucket in tensors for t in bucket]
        return [BaguaBucket(all_tensors, flatten=do_flatten, name=str(0))]

    def init_forward_pre_hook(self, bagua_ddp):
        def hook(input):
            for tensor in self.tensors:
                tensor.bagua_mark_communication_ready()

        return hook

    def init_backward_hook(self, bagua_ddp):
        def hook(parameter_name, parameter):
            return

        return hook

    def init_post_backward_hook(self, bagua_ddp):
        def hook():
            bagua_ddp._bagua_backend.wait_pending_comm_ops()
            torch.cuda.current_stream().record_event(self.cuda_event)
            self.cuda_event.synchronize()
            for bucket in bagua_ddp.bagua_buckets:
                bucket._decentralized_op.copy_back_peer_weight(bucket.backend_bucket)

        return hook

    def init_operations(self, bagua_ddp, bucket):
        bucket._peer_weight = bucket.flattened_tensor().ensure_bagua_tensor("peer_weight")
        torch.cuda.synchronize()
        bucket.clear_ops()
        bucket._decentralized_op = bucket.append_decentralized_synchronous_op(
            peer_weight=bucket._peer_weight,
            hierarchical=False,
            peer_selection_mode="all",
            group=self.process_group,
        )


class GossipAllAlgorithm(Algorithm):
    def reify(self, process_group):
        return GossipAllImpl(process_group)


class FailingImpl(AlgorithmImpl):
    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()

        def explode(name):
            raise ValueError(f"boom in bucket {name}")

        bucket.append_python_op(explode)


class FailingAlgorithm(Algorithm):
    def reify(self, process_group):
        return FailingImpl(process_group)


class ScatterGatherImpl(AlgorithmImpl):
    """Gradient averaging by a reduce-scatter and an all-gather (``scattergather=True``)."""

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(hierarchical=False, average=True, scattergather=True,
                                                 group=self.process_group)


class ScatterGatherAlgorithm(Algorithm):
    def reify(self, process_group):
        return ScatterGatherImpl(process_group)
