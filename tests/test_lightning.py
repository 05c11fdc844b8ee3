"""Lightning: ``strategy="bagua"`` (bagua_algos.lightning) and what lightning-bagua 0.1.0 calls.

One group of two CPU gloo workers, started once for the module, runs every check
(a spawn and Lightning's import cost seconds): inside it the workers look like
processes started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT set), so Lightning does not launch processes; the first fit's
strategy joins the process group itself through the plugin's runtime, later fits
reuse it. Per algorithm (the first row of each name in the algorithm table): a short
``Trainer.fit`` (losses finite, replicas equal or different as the row says);
gradient_allreduce against ``strategy="ddp"`` on the same seed; resuming from an
epoch-end checkpoint against the uninterrupted fit; the async algorithm's background
rounds stopped with the fit. Then Bagua's names that
lightning-bagua 0.1.0 imports and calls, through the compatibility package.
"""

from __future__ import annotations

import math
import os
import sys

import pytest

pytest.importorskip("lightning")

from bagua_algos.experiments.gloo_workers import run_workers  # noqa: E402
from subprocesses import free_port  # noqa: E402

from bagua_algos.algorithms.table import config_by_label, one_per_algorithm  # noqa: E402

LABELS = [config.label for config in one_per_algorithm()]
# Rows whose resume from an epoch-end checkpoint is checked (each costs a fit): the
# baseline and those with state beyond the parameters (D-PSGD's exchange count, relay's
# messages, PowerSGD's factors and error, TernGrad's generator, DiLoCo's outer model and
# momentum).
RESUMED = ("gradient_allreduce", "decentralized", "relay_chain", "powersgd", "terngrad", "diloco")
EPOCHS = 2


def _module_class():
    import lightning as L
    import torch

    class Tiny(L.LightningModule):
        def __init__(self, label: str = "gradient_allreduce"):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
            self.label = label  # the table row: its own optimizer (QAdam's), if it has one
            self.losses = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            return config_by_label(self.label).optimizer_for(
                self.parameters(), lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(64, 8, generator=g)
            y = (x[:, 0] > 0).long()
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True)

    return Tiny


def _fit(strategy, epochs=EPOCHS, label="gradient_allreduce", ckpt_dir=None, ckpt_path=None, module=None):
    import lightning as L
    import torch

    Tiny = _module_class()
    L.seed_everything(1234, verbose=False)
    model = module if module is not None else Tiny(label)
    callbacks = []
    if ckpt_dir is not None:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1,
                                                            every_n_epochs=1))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, num_nodes=1, max_epochs=epochs,
                        logger=False, enable_checkpointing=ckpt_dir is not None, callbacks=callbacks,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=True)
    trainer.fit(model, ckpt_path=ckpt_path)
    params = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    return model, trainer, params


def _lightning_worker(rank, world_size, tmp):
    import torch

    from bagua_algos.runtime import comm

    # Start as torchrun's workers would: no group yet, the strategy joins it.
    comm.destroy_process_group()
    torch.set_num_threads(1)
    import bagua_algos.lightning as bl

    out = {"params": {}, "losses": {}, "resumed": {}}
    for index, label in enumerate(LABELS):
        config = config_by_label(label)
        name, kwargs = config.name, dict(config.kwargs)
        strategy = "bagua" if index == 0 else bl.BaguaStrategy(name, **kwargs)
        resume = label in RESUMED
        ckpt_dir = os.path.join(tmp, label) if resume else None
        model, trainer, params = _fit(strategy, label=label, ckpt_dir=ckpt_dir)
        out["params"][label] = params
        out["losses"][label] = list(model.losses)
        if index == 0:
            out["strategy_type"] = type(trainer.strategy).__name__
            out["plain_module_after_fit"] = trainer.strategy.model is model and not model.bagua_ddp._framework_hooks
        if name == "async":
            impl = model.bagua_ddp.bagua_algorithm
            out["async"] = {"rounds": impl.rounds, "stopped": impl._future is None}
            # A second fit on the same module starts rounds again (a new implementation:
            # the module is wrapped anew) and stops them at its end.
            _fit(bl.BaguaStrategy(name, **kwargs), epochs=1, label=label, module=model)
            impl = model.bagua_ddp.bagua_algorithm
            out["async"].update(second_rounds=impl.rounds, second_stopped=impl._future is None)
        if resume:
            first = os.path.join(ckpt_dir, "epoch=0.ckpt")
            strategy = bl.BaguaStrategy(name, **kwargs)
            resumed_model, _, resumed = _fit(strategy, label=label, ckpt_path=first)
            out["resumed"][label] = (resumed, len(resumed_model.losses))
            if name == "decentralized":
                saved = torch.load(first, map_location="cpu", weights_only=False)["bagua_algos"]
                out["decentralized_ckpt"] = {"world_size": saved["world_size"],
                                     "own_model": ["state_dict" in r for r in saved["ranks"]]}
    _, _, out["ddp"] = _fit("ddp")
    out["compat"] = _lightning_bagua_calls(rank)
    return out


def _lightning_bagua_calls(rank):
    """What lightning-bagua 0.1.0's BaguaStrategy imports and calls, with Bagua's
    signatures (the package itself needs Lightning 2.0.x, which cannot be installed here)."""
    import torch

    from bagua_algos.compat import compat_path

    if str(compat_path()) not in sys.path:
        sys.path.insert(0, str(compat_path()))
    import bagua.torch_api as bagua  # noqa: F401
    from bagua.torch_api.algorithms import Algorithm
    from bagua.torch_api.algorithms.q_adam import QAdamOptimizer
    from bagua.torch_api.communication import ReduceOp as BaguaReduceOp
    from bagua.torch_api.communication import allreduce_inplace, barrier, broadcast_object, is_initialized
    from bagua.torch_api.data_parallel.distributed import DistributedDataParallel_V1_9_0 as BaguaDDP

    result = {"initialized": is_initialized()}
    barrier()
    result["broadcast"] = broadcast_object({"from": rank}, 0)
    ops = {}
    for op in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"):
        t = torch.tensor([rank + 2], dtype=torch.float32 if op in ("AVG",) else torch.int64)
        allreduce_inplace(t, op=getattr(BaguaReduceOp, op))
        ops[op] = t.item()
    result["ops"] = ops
    from bagua.torch_api.communication import allreduce_coalesced_inplace, broadcast_coalesced

    pair = [torch.full((2, 2), float(rank + 1)), torch.full((3,), float(10 * (rank + 1)))]
    allreduce_coalesced_inplace(pair, BaguaReduceOp.SUM)
    result["coalesced_sum"] = [t.clone() for t in pair]
    pair = [torch.full((2,), float(rank)), torch.full((1, 3), float(rank + 5))]
    broadcast_coalesced(pair, src=1)
    result["coalesced_broadcast"] = [t.clone() for t in pair]
    from bagua.torch_api.data_parallel.functional import all_reduce

    x = torch.tensor([float(rank + 1), 2.0], requires_grad=True)
    y = all_reduce(x)  # sum over ranks: [3, 4]; d(sum(y * w))/dx = allreduce of w
    (y * torch.tensor([1.0, float(rank)])).sum().backward()
    result["functional"] = (y.detach().clone(), x.grad.clone())
    runs = {}
    for name, kwargs in (("gradient_allreduce", {}), ("decentralized", {}), ("low_precision_decentralized", {}),
                         ("bytegrad", {}), ("async", {"sync_interval_ms": 5}), ("qadam", None)):
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        module._bagua_module_name = f"Emulated{name}"  # as lightning-bagua's LightningBaguaModule sets it
        if kwargs is None:
            optimizer = QAdamOptimizer(module.parameters(), lr=0.01, warmup_steps=2)
            kwargs = {"q_adam_optimizer": optimizer}
        else:
            optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        model = BaguaDDP(module=module, optimizers=[optimizer], algorithm=Algorithm.init(name, **kwargs),
                         gradient_as_bucket_view=True)
        if name == "async":
            model.bagua_algorithm.resume(model)
        losses = []
        for step in range(4):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        model.inner.require_backward_grad_sync = False  # lightning-bagua's manual-optimization switch
        model.inner.require_backward_grad_sync = True
        if name == "async":
            model.bagua_algorithm.abort(model)
        runs[name] = {"losses": losses, "keys": sorted(model.state_dict()),
                      "params": torch.cat([p.detach().reshape(-1) for p in module.parameters()])}
    result["runs"] = runs
    return result


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("lightning"))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "BAGUA_ALGOS_BACKEND": "gloo",
           "PYTHONWARNINGS": "ignore"}
    return run_workers(_lightning_worker, 2, tmp, timeout=240, pg_timeout=60, env=env)


def test_strategy_name_registered(lightning_runs):
    from lightning.pytorch.strategies import StrategyRegistry

    import bagua_algos.lightning as bl

    assert "bagua" in StrategyRegistry
    assert StrategyRegistry["bagua"]["strategy"] is bl.BaguaStrategy
    assert all(r["strategy_type"] == "BaguaStrategy" for r in lightning_runs)
    assert all(r["plain_module_after_fit"] for r in lightning_runs)


def test_the_resumed_rows_are_among_the_fitted_ones():
    assert set(RESUMED) <= set(LABELS), sorted(set(RESUMED) - set(LABELS))


@pytest.mark.parametrize("label", LABELS)
def test_fit(lightning_runs, label):
    import torch

    config = config_by_label(label)
    for r in lightning_runs:
        losses = r["losses"][label]
        assert len(losses) == EPOCHS * 4, losses
        assert all(math.isfinite(v) for v in losses), losses
        assert torch.isfinite(r["params"][label]).all()
    p0, p1 = (r["params"][label] for r in lightning_runs)
    if config.replicas == "equal" or config.background_rounds:  # (async: the fit's end averages once)
        torch.testing.assert_close(p0, p1, rtol=0, atol=1e-6)
    elif config.replicas == "differ":
        assert not torch.equal(p0, p1)  # D-PSGD: the replicas differ, as they should


def test_gradient_allreduce_equals_ddp(lightning_runs):
    import torch

    for r in lightning_runs:
        torch.testing.assert_close(r["params"]["gradient_allreduce"], r["ddp"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("label", RESUMED)
def test_resume_equals_uninterrupted(lightning_runs, label):
    import torch

    for r in lightning_runs:
        params, steps = r["resumed"][label]
        assert steps == (EPOCHS - 1) * 4  # it did start from the checkpoint
        torch.testing.assert_close(params, r["params"][label], rtol=0, atol=0)


def test_checkpoint_holds_every_ranks_state(lightning_runs):
    saved = lightning_runs[0]["decentralized_ckpt"]
    assert saved["world_size"] == 2
    assert saved["own_model"] == [False, True]  # rank 1's D-PSGD model differs from rank 0's


def test_async_rounds_follow_the_fit(lightning_runs):
    for r in lightning_runs:
        a = r["async"]
        assert a["rounds"] > 0 and a["stopped"]
        assert a["second_rounds"] > 0 and a["second_stopped"]


def test_lightning_bagua_calls(lightning_runs):
    import torch

    c0, c1 = (r["compat"] for r in lightning_runs)
    assert c0["initialized"] and c1["initialized"]
    assert c0["broadcast"] == c1["broadcast"] == {"from": 0}
    # rank values 2 and 3
    assert c0["ops"] == c1["ops"] == {"SUM": 5, "PRODUCT": 6, "MIN": 2, "MAX": 3, "BAND": 2, "BOR": 3, "BXOR": 1,
                                      "AVG": 2.5}
    for c in (c0, c1):  # Bagua's coalesced forms: several tensors, one collective, results in place
        assert torch.equal(c["coalesced_sum"][0], torch.full((2, 2), 3.0))
        assert torch.equal(c["coalesced_sum"][1], torch.full((3,), 30.0))
        assert torch.equal(c["coalesced_broadcast"][0], torch.full((2,), 1.0))
        assert torch.equal(c["coalesced_broadcast"][1], torch.full((1, 3), 6.0))
        y, grad = c["functional"]  # data_parallel.functional.all_reduce and its gradient
        assert torch.equal(y, torch.tensor([3.0, 4.0])) and torch.equal(grad, torch.tensor([2.0, 1.0]))
    for name, run in c0["runs"].items():
        assert all(math.isfinite(v) for v in run["losses"]), name
        assert all(k.startswith("module.") for k in run["keys"]), run["keys"]
    for name in ("gradient_allreduce", "bytegrad", "qadam", "async"):
        torch.testing.assert_close(c0["runs"][name]["params"], c1["runs"][name]["params"], rtol=0, atol=1e-6)


# ------------------------------------------------------- benchmarks/lightning_benchmark.py


def test_lightning_benchmark_times_exactly_steps_after_warmup():
    from bagua_algos.experiments.lightning_benchmark import StepTimer, batches_to_run

    timer = StepTimer(warmup=2)
    for batch in range(batches_to_run(steps=5, warmup=2)):
        timer.on_train_batch_start(None, None, None, batch)
    assert len(timer.times) == 5 and all(t >= 0 for t in timer.times)


def test_lightning_benchmark_run_reports_the_steps_it_was_given():
    from subprocesses import REPO, run_python

    script = REPO / "benchmarks" / "lightning_benchmark.py"
    code, out, err = run_python([script, "--devices", 1, "--steps", 3, "--warmup", 2, "--width", 8, "--depth", 1,
                                 "--batch-size", 4], timeout=180)
    assert code == 0, err[-3000:]
    assert "batch 4 per process, 3 timed steps after 2" in out, out
    assert "ratio bagua/ddp step time: " in out
    code, out, err = run_python([script, "--help"], timeout=60)
    assert code == 0
    help_text = " ".join(out.split())
    assert "--steps STEPS timed steps per strategy (default 40)" in help_text
    assert "--warmup WARMUP untimed steps before the timed ones, per strategy (default 5)" in help_text
    code, out, err = run_python([script, "--steps", 0], timeout=60)
    assert code == 2 and "argument --steps: must be >= 1, got 0" in err
