"""``bagua.torch_api.tensor``: Bagua's methods on torch.Tensor."""

from bagua_algos.runtime.tensor import BaguaTensor  # noqa: F401
