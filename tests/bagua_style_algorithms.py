"""Two algorithms written as Bagua 0.9's authors wrote theirs (``bagua.torch_api``
imports, buckets, the bucket appenders, python ops, Bagua's collectives), which the
equality tests run as gloo processes and on the one-process engine through the sweep's
``--configs 'tests/bagua_style_algorithms.py:ClassName'``, nothing registered for the
engine.

- ``SumThenScaleAlgorithm``: each gradient bucket is summed over the workers
  (``append_centralized_synchronous_op(average=False)``), then a python op divides it
  by the world size: gradient averaging in two ops.
- ``ShiftOneGossipAlgorithm``: the weights, one bucket, are gossiped with one peer
  after each optimizer step (``append_decentralized_synchronous_op``, Bagua's
  ``shift_one``), a python op copies the gossip result back, and a second python op
  pulls every weight a fraction ``pull`` toward the workers' mean
  (``bagua.torch_api.allreduce``).
"""

from bagua.torch_api import ReduceOp, allreduce, get_world_size
from bagua.torch_api.algorithms import Algorithm, AlgorithmImpl
from bagua.torch_api.bucket import BaguaBucket


class SumThenScaleAlgorithmImpl(AlgorithmImpl):
    def init_operations(self, bagua_ddp, bucket: BaguaBucket):
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(hierarchical=False, average=False, group=self.process_group)

        def scale(name):
            flat = bucket.flat_view()
            flat.div_(get_world_size())
            bucket.write_flat(flat)

        bucket.append_python_op(scale, group=self.process_group)


class SumThenScaleAlgorithm(Algorithm):
    def reify(self, process_group):
        return SumThenScaleAlgorithmImpl(process_group)


class ShiftOneGossipAlgorithmImpl(AlgorithmImpl):
    def __init__(self, process_group, pull):
        super().__init__(process_group)
        self.pull = pull

    def init_tensors(self, bagua_ddp):
        parameters = bagua_ddp.bagua_build_params()
        self.tensors = [param.ensure_bagua_tensor(name, bagua_ddp.bagua_module_name)
                        for name, param in reversed(parameters)]
        return self.tensors

    def tensors_to_buckets(self, tensors, do_flatten):
        return [BaguaBucket([t for group in tensors for t in group], flatten=do_flatten, name="weights")]

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        peer_weight = bucket.flattened_tensor().ensure_bagua_tensor("peer_weight")
        op = bucket.append_decentralized_synchronous_op(peer_weight=peer_weight, hierarchical=False,
                                                        peer_selection_mode="shift_one", group=self.process_group)
        bucket.append_python_op(lambda name: op.copy_back_peer_weight(bucket), group=self.process_group)

        def pull_toward_mean(name):
            flat = bucket.flat_view()
            mean = flat.clone()
            allreduce(flat, mean, op=ReduceOp.AVG)
            flat.mul_(1 - self.pull).add_(mean, alpha=self.pull)
            bucket.write_flat(flat)

        bucket.append_python_op(pull_toward_mean, group=self.process_group)

    def init_backward_hook(self, bagua_ddp):
        return lambda name, param: None

    def init_post_backward_hook(self, bagua_ddp):
        return lambda: None

    def init_post_optimizer_step_hook(self, bagua_ddp):
        def hook(optimizer):
            for tensor in self.tensors:
                tensor.bagua_mark_communication_ready()
            bagua_ddp._bagua_backend.wait_pending_comm_ops()

        return hook


class ShiftOneGossipAlgorithm(Algorithm):
    def __init__(self, pull=0.25):
        self.pull = pull

    def reify(self, process_group):
        return ShiftOneGossipAlgorithmImpl(process_group, self.pull)
