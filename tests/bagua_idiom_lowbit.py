"""Bagua 0.9.2's low-precision algorithm files, transcribed structure for structure for
the tests: the same classes, appender calls, argument names and defaults, written only
against ``bagua.torch_api`` (they import nothing from bagua_algos). They must run on
the runtime as they are and train exactly like the project's own ``bytegrad``,
``low_precision_decentralized`` and ``qadam``.
"""

from typing import List

import torch

from bagua.torch_api.algorithms import Algorithm, AlgorithmImpl
from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api.tensor import BaguaTensor


class IdiomByteGradImpl(AlgorithmImpl):
    def __init__(self, process_group, hierarchical: bool = True, average: bool = True):
        super(IdiomByteGradImpl, self).__init__(process_group)
        self.hierarchical = hierarchical
        self.average = average

    def tensors_to_buckets(self, tensors: List[List[BaguaTensor]], do_flatten: bool) -> List[BaguaBucket]:
        bagua_buckets = []
        for idx, bucket in enumerate(tensors):
            bagua_buckets.append(BaguaBucket(
                bucket, flatten=do_flatten, name=str(idx),
                alignment=self.process_group.get_global_communicator().nranks(),
            ))
        return bagua_buckets

    def init_operations(self, bagua_ddp, bucket: BaguaBucket):
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(
            hierarchical=self.hierarchical, average=self.average, scattergather=True,
            compression="MinMaxUInt8", group=self.process_group,
        )


class IdiomByteGrad(Algorithm):
    def __init__(self, hierarchical: bool = True, average: bool = True):
        self.hierarchical = hierarchical
        self.average = average

    def reify(self, process_group):
        return IdiomByteGradImpl(process_group, hierarchical=self.hierarchical, average=self.average)


class IdiomLowPrecisionDecentralizedImpl(AlgorithmImpl):
    def __init__(self, process_group, hierarchical: bool = True, communication_interval: int = 1):
        super(IdiomLowPrecisionDecentralizedImpl, self).__init__(process_group)
        self.hierarchical = hierarchical
        self.communication_interval = communication_interval

    def _should_communicate(self, bagua_ddp) -> bool:
        cur_step = bagua_ddp.bagua_train_step_counter - 1
        return cur_step % self.communication_interval == 0

    def init_tensors(self, bagua_ddp):
        parameters = bagua_ddp.bagua_build_params()
        self.tensors = [param.ensure_bagua_tensor(name, bagua_ddp.bagua_module_name)
                        for name, param in parameters.__reversed__()]
        return self.tensors

    def init_backward_hook(self, bagua_ddp):
        def hook(parameter_name, parameter):
            pass

        return hook

    def init_post_backward_hook(self, bagua_ddp):
        def hook():
            pass

        return hook

    def init_post_optimizer_step_hook(self, bagua_ddp):
        def hook(optimizer: torch.optim.Optimizer):
            if self._should_communicate(bagua_ddp):
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        if param.is_bagua_tensor():
                            param.bagua_mark_communication_ready()
                bagua_ddp._bagua_backend.wait_pending_comm_ops()

        return hook

    def _init_states(self, bucket: BaguaBucket):
        bucket._weight = bucket.flattened_tensor().ensure_bagua_tensor("weight")
        bucket._left_peer_weight = bucket.flattened_tensor().ensure_bagua_tensor("left_peer_weight")
        bucket._right_peer_weight = bucket.flattened_tensor().ensure_bagua_tensor("right_peer_weight")

    def init_operations(self, bagua_ddp, bucket: BaguaBucket):
        self._init_states(bucket)
        torch.cuda.synchronize()
        bucket.clear_ops()
        bucket.append_low_precision_decentralized_synchronous_op(
            weight=bucket._weight,
            left_peer_weight=bucket._left_peer_weight,
            right_peer_weight=bucket._right_peer_weight,
            hierarchical=self.hierarchical,
            compression="MinMaxUInt8",
            group=self.process_group,
        )


class IdiomLowPrecisionDecentralized(Algorithm):
    def __init__(self, hierarchical: bool = True, communication_interval: int = 1):
        self.hierarchical = hierarchical
        self.communication_interval = communication_interval

    def reify(self, process_group):
        return IdiomLowPrecisionDecentralizedImpl(
            process_group, hierarchical=self.hierarchical, communication_interval=self.communication_interval)


class IdiomQAdamImpl(AlgorithmImpl):
    """Bagua 0.9.2's QAdamAlgorithmImpl structure, driving the project's QAdamOptimizer
    (imported through Bagua's module path)."""

    def __init__(self, process_group, q_adam_optimizer, hierarchical: bool = True):
        super(IdiomQAdamImpl, self).__init__(process_group)
        self.hierarchical = hierarchical
        self.optimizer = q_adam_optimizer
        self.warmup_steps = self.optimizer.warmup_steps

    @property
    def optimizer_step_id(self):
        param = self.optimizer.param_groups[0]["params"][0]
        return self.optimizer.state[param].get("step", 0)

    def need_reset(self):
        return self.optimizer_step_id == self.warmup_steps

    def init_tensors(self, bagua_ddp):
        parameters = bagua_ddp.bagua_build_params()
        for idx, (name, param) in enumerate(parameters.__reversed__()):
            param._q_adam_name = name
            param._q_adam_idx = idx
        tensor_groups = []
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if self.optimizer_step_id < self.warmup_steps:
                    registered_tensor = param.bagua_ensure_grad().ensure_bagua_tensor(
                        param._q_adam_name, bagua_ddp.bagua_module_name,
                        getter_closure=lambda param: param.grad,
                        setter_closure=lambda param, t: setattr(param, "grad", t),
                    )
                else:
                    def set_momentum_fn(param, t):
                        self.optimizer.state[param]["exp_avg"] = t

                    registered_tensor = param.bagua_ensure_grad().ensure_bagua_tensor(
                        param._q_adam_name, bagua_ddp.bagua_module_name,
                        getter_closure=lambda param: self.optimizer.state[param]["exp_avg"],
                        setter_closure=set_momentum_fn,
                    )
                tensor_groups.append(registered_tensor)
        tensor_groups.sort(key=lambda x: x._q_adam_idx)
        return tensor_groups

    def tensors_to_buckets(self, tensors, do_flatten):
        return [BaguaBucket(bucket, flatten=do_flatten, name=str(idx),
                            alignment=self.process_group.get_global_communicator().nranks())
                for idx, bucket in enumerate(tensors)]

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        if self.optimizer_step_id < self.warmup_steps:
            bucket.append_centralized_synchronous_op(hierarchical=False, average=True, group=self.process_group)
        else:
            def calculate_momentum(*args):
                beta1, beta2 = self.optimizer.param_groups[0]["betas"]
                for tensor in bucket.tensors:
                    tensor.bagua_getter_closure().mul_(beta1).add_(tensor.grad, alpha=1 - beta1)

            bucket.append_python_op(calculate_momentum, group=self.process_group)
            bucket.append_centralized_synchronous_op(
                hierarchical=self.hierarchical, average=True, scattergather=True,
                compression="MinMaxUInt8", group=self.process_group,
            )

    def init_backward_hook(self, bagua_ddp):
        def hook_momentum(parameter_name, parameter):
            assert parameter.bagua_backend_tensor().data_ptr() == self.optimizer.state[parameter]["exp_avg"].data_ptr()
            parameter.bagua_mark_communication_ready()

        def hook_grad(parameter_name, parameter):
            assert parameter.bagua_backend_tensor().data_ptr() == parameter.grad.data_ptr()
            parameter.bagua_mark_communication_ready()

        return hook_grad if self.optimizer_step_id < self.warmup_steps else hook_momentum


class IdiomQAdam(Algorithm):
    def __init__(self, q_adam_optimizer, hierarchical: bool = True):
        self.hierarchical = hierarchical
        self.optimizer = q_adam_optimizer

    def reify(self, process_group):
        return IdiomQAdamImpl(process_group, q_adam_optimizer=self.optimizer, hierarchical=self.hierarchical)
