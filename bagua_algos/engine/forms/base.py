"""The contract of an algorithm's form on the stacked state.

A form is the second form of one ``Algorithm``: built from the same ``Algorithm``
object a user passes to ``with_bagua`` (its settings), it changes the stacked state at
the three points of a training step where the per-rank ``AlgorithmImpl`` acts:

1. ``before_forward(step)``: where the forward pre-hook runs (D-PSGD takes x^t here);
2. ``after_backward(step)``: every worker's gradient is in ``engine.model.grads``
   (``[n, d]``), where the per-rank backward hooks and post-backward hook have run;
3. ``after_step(step)``: the optimizer has stepped; the parameters
   ``engine.model.params`` (``[n, d]``) are where the post-optimizer-step hook acts.

``step`` is the training step counted from 1 (``bagua_train_step_counter``). A form
must leave every worker's row equal to what that rank's process holds at the same point
(the equality test in tests/test_engine_equality.py holds it to that), and uses the
pure math its algorithm uses (compression/, topologies/, the algorithm's functions),
never a copy of it.

``alignment(algorithm, n)`` is the padding of each bucket that the per-rank form asks
for (the world size for algorithms that cut a bucket into one chunk per worker).
``make_optimizer`` lets a form whose algorithm owns the optimizer (QAdam) build it.
"""

from __future__ import annotations

__all__ = ["StackedForm"]


class StackedForm:
    """Base: a form that changes nothing (each worker trains alone)."""

    def __init__(self, algorithm, engine):
        self.algorithm = algorithm
        self.engine = engine
        self.n = engine.n

    @classmethod
    def alignment(cls, algorithm, n: int) -> int:
        return 1

    @classmethod
    def make_optimizer(cls, algorithm, params, optimizer_factory):
        """The optimizer of the stacked parameter ``params``: by default the user's."""
        return optimizer_factory([params])

    def before_forward(self, step: int) -> None:
        pass

    def after_backward(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass
