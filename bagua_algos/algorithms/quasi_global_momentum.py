"""D-PSGD with quasi-global momentum (Lin et al. 2021), the option
``DecentralizedAlgorithm(quasi_global_momentum=True)``.

Local momentum drifts apart on heterogeneous data: each worker's buffer follows its own
gradients. Quasi-global momentum builds the buffer from the model's change across the
gossip instead, which mixes in the neighbours' steps. Lin et al.'s Algorithm 1 (QG-DSGDm),
each step, with step size η and momentum β:

1. m_t = β m̂_{t−1} + g_t                       (m̂_{−1} = 0)
2. x½ = x_t − η m_t
3. x_{t+1} = W x½                               (gossip after the step)
4. d_t = (x_t − x_{t+1}) / η
5. m̂_t = β m̂_{t−1} + (1 − β) d_t

The user's optimizer is torch.optim.SGD with momentum β (> 0, dampening 0): steps 1–2
are its step once its momentum buffer holds m̂_{t−1}, which this algorithm writes into
it after every gossip (step 5), as epfml/relaysgd does. β and η are read from the
parameter's group at each step (a schedule is followed); a step at η = 0 moves nothing
by gradient, and m̂ is left as it was. With Nesterov SGD, step 2 uses g_t + β m_t.
"""

from __future__ import annotations

import torch

from ..runtime.bucket import BaguaBucket
from .adapt_then_combine import AdaptThenCombineImpl

__all__ = ["QuasiGlobalMomentumImpl"]


class QuasiGlobalMomentumImpl(AdaptThenCombineImpl):
    """``bucket.state["quasi_global_momentum"]``: m̂, ``[W, L]`` (zero at the start); the
    optimizer's momentum buffers are overwritten with it after every step."""

    finds_parameters_in_the_optimizer = True  # (each parameter's lr and momentum from its param group)

    WORLD_SIZE_RULE = {
        "step counter and exchange count": "carried over",
        "quasi-global momentum m̂ (this worker's)": "carried over (at a new world size, the first rank's)",
        "topology": "rebuilt for the new world size",
    }
    keeps_previous = True

    def init_state(self, bucket: BaguaBucket, x: torch.Tensor) -> None:
        bucket.state["quasi_global_momentum"] = torch.zeros_like(x)

    def combine(self, bucket: BaguaBucket, x: torch.Tensor, optimizer) -> None:
        groups = _sgd_groups(optimizer, bucket)
        self.mix_(bucket, x)  # x_{t+1} = W x½
        momentum = bucket.state["quasi_global_momentum"]
        views = zip(bucket.tensor_views(momentum), bucket.tensor_views(self.previous[bucket.name]),
                    bucket.tensor_views(x))
        with torch.no_grad():
            for (param, m_hat), (_, before), (_, after) in views:
                group = groups[id(param)]
                lr, beta = group["lr"], group["momentum"]
                if lr != 0:  # m̂ ← β m̂ + (1 − β) (x_t − x_{t+1}) / η
                    m_hat.mul_(beta).add_(before - after, alpha=(1 - beta) / lr)
                buffer = optimizer.state.get(param, {}).get("momentum_buffer")
                if buffer is not None:  # (a parameter without a gradient this step has none yet)
                    buffer.copy_(m_hat.view_as(buffer))


def _sgd_groups(optimizer, bucket: BaguaBucket) -> dict:
    """id(parameter) → its param group, checked: quasi-global momentum replaces an SGD
    momentum buffer, so each group must be torch.optim.SGD's with momentum > 0 and no
    dampening."""
    if not isinstance(optimizer, torch.optim.SGD):
        raise TypeError(
            f"quasi_global_momentum=True replaces torch.optim.SGD's momentum buffer; the optimizer is "
            f"{type(optimizer).__name__}: build torch.optim.SGD(params, lr=..., momentum=0.9)"
        )
    groups = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    for param in bucket.tensors:
        group = groups.get(id(param))
        if group is None:
            raise ValueError("quasi_global_momentum=True: a parameter of the model is not in the optimizer given to "
                             "with_bagua; hand it the optimizer of all the model's parameters")
        if not group["momentum"] > 0 or group["dampening"] != 0:
            raise ValueError(
                f"quasi_global_momentum=True needs SGD momentum > 0 and dampening 0 (β is the quasi-global "
                f"momentum's); got momentum={group['momentum']}, dampening={group['dampening']}"
            )
    return groups
