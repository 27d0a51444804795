"""``rlaunch.lightning.FabricStrategy``: Lightning Fabric's DDP on the rlaunch runtime.

``Fabric(strategy=rlaunch.lightning.FabricStrategy())`` trains as Fabric's DDP does, under
``rlaunch`` or plain ``torchrun``. Fabric leaves the loop to the script (:mod:`rlaunch.userloop`):
written on ``rt.steps()`` it moves live, written over the loader's epochs it trains as under Fabric
and takes the restart path. The strategy:

- takes its ranks and process group from the runtime and builds DDP on ``rt.group``;
- tracks what ``fabric.setup()`` returns (modules, optimizers, a scheduler passed to it) and the
  precision plugin's ``GradScaler``; other state (an LR scheduler stepped by hand) the script tracks
  itself with ``strategy.rt.track(...)`` (the first vote names an untracked scheduler);
- makes each loader ``fabric.setup_dataloaders()`` returns resumable: ``loader.batch()`` gives the
  step's batch through ``rt.epochs`` (made at the first ``batch()``, each loader under its own
  name); a loader iterated as it is (an evaluation loader) is read as Fabric reads it;
- votes in the optimizer's ``step()`` (a discarded step is not applied; ``rt.steps()`` yields it
  again and ``loader.batch()`` gives its batches again).

A standby that joins takes the rank it was given for rank-zero-only code (``fabric.is_global_zero``)
and for the samplers of the loaders it iterates as they are, when its state lands.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from rlaunch.errors import UsageError
from rlaunch.lightning import packages
from rlaunch.lightning.data import resumable, unmovable
from rlaunch.lightning.environment import RuntimeEnvironment
from rlaunch.runtime.runtime import Runtime, report_errors_as_sentences
from rlaunch.userloop import LoopData, UserLoop

MixedPrecision = packages.fabric("plugins.precision.amp").MixedPrecision
DDPStrategy = packages.fabric("strategies").DDPStrategy
move_data_to_device = packages.fabric("utilities.apply_func").move_data_to_device
_set_sampler_epoch = packages.fabric("utilities.data")._set_sampler_epoch


class _Ranks:
    """A tracked object with no state of its own: loading one means this rank's place changed (a joiner
    takes its rank when its state lands), so rank-zero-only code follows the runtime's rank."""

    def __init__(self, strategy: FabricStrategy) -> None:
        self._strategy = strategy

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._strategy._set_world_ranks()
        self._strategy._user_loop().joined()


class _Epochs:
    """The loader's epochs as Fabric iterates them (``set_epoch`` before each), for a loop over epochs."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self._n = 0

    def __iter__(self) -> Any:
        _set_sampler_epoch(self._loader, self._n)
        self._n += 1
        return iter(self._loader)


class _CountedSync:
    """Fabric's ``no_backward_sync`` (a gradient-accumulation micro-step), told to the loop."""

    def __init__(self, control: Any, loop: Any) -> None:
        self._control = control
        self._loop = loop

    def no_backward_sync(self, module: Any, enabled: bool) -> Any:
        if enabled:
            self._loop().micro_step()
        return self._control.no_backward_sync(module, enabled)


class FabricStrategy(DDPStrategy):  # type: ignore[misc,valid-type]
    """Fabric's DDP on the rlaunch runtime (see the module docstring); ``rt`` and ``timeout_s`` as for
    :class:`rlaunch.lightning.Strategy`, other keyword arguments go to ``DistributedDataParallel``."""

    def __init__(self, *, rt: Runtime | None = None, timeout_s: float = 300.0, **ddp_kwargs: Any) -> None:
        report_errors_as_sentences()
        packages.check("rlaunch.lightning.FabricStrategy")
        super().__init__(cluster_environment=RuntimeEnvironment(self._runtime), **ddp_kwargs)
        self._rt = rt
        self._timeout_s = timeout_s
        self._loop: UserLoop | None = None
        control: Any = getattr(self, "_backward_sync_control")  # noqa: B009 - set by Fabric's DDPStrategy
        self._backward_sync_control: Any = _CountedSync(control, self._user_loop)

    @property
    def rt(self) -> Runtime:
        """The runtime (started by the strategy unless the script passed one): ``strategy.rt.steps(...)``."""
        return self._runtime()

    def _runtime(self) -> Runtime:
        if self._rt is None:
            import rlaunch

            self._rt = rlaunch.init(self._timeout_s)
        return self._rt

    def _user_loop(self) -> UserLoop:
        if self._loop is None:
            self._loop = UserLoop.of(self._runtime(), "rlaunch.lightning.FabricStrategy")
            self._loop.track("ranks", _Ranks(self))
            scaler = self.precision.scaler if isinstance(self.precision, MixedPrecision) else None
            if scaler is not None:
                self._loop.track("scaler", scaler)
        return self._loop

    def _track(self, kind: str, obj: Any) -> None:
        self._user_loop().track(kind, obj)

    def _setup_distributed(self) -> None:
        rt = self._runtime()
        self._set_world_ranks()
        self._process_group_backend = rt.group.backend.value
        expected = self.num_nodes * self.num_processes
        if expected != rt.world_size:
            raise UsageError(
                f"Fabric(devices={self.num_processes}, num_nodes={self.num_nodes}) asks for {expected} processes, "
                f"but the job has {rt.world_size}; give devices= the processes per node and num_nodes= the nodes."
            )

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        rt = self._runtime()
        return {"num_replicas": rt.world_size, "rank": max(rt.rank, 0)}  # a sandbox's rank is -1

    def setup_module(self, module: torch.nn.Module) -> DistributedDataParallel:
        ddp = DistributedDataParallel(
            module=module, device_ids=self._determine_ddp_device_ids(), process_group=self._runtime().group,
            **self._ddp_kwargs,
        )  # fmt: skip
        self._track("model", ddp)
        return ddp

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self._track("optimizer", optimizer)
        return optimizer

    def setup_module_and_optimizers(self, module: Any, optimizers: list[Any], scheduler: Any = None) -> Any:
        module, optimizers, scheduler = super().setup_module_and_optimizers(module, optimizers, scheduler)
        if scheduler is not None:
            self._track("scheduler", scheduler)
        return module, optimizers, scheduler

    def process_dataloader(self, dataloader: Any) -> LoopData:
        """Each loader of ``fabric.setup_dataloaders(...)``: read with ``batch()`` through ``rt.epochs``
        (made at the first ``batch()``), or iterated as Fabric iterates it."""
        loop = self._user_loop()
        why = unmovable(dataloader)

        def epochs(name: str, together: bool) -> Any:
            _, data, _ = resumable(self._runtime(), dataloader, name, track=False)  # the loop tracks its stand-in
            return data

        sampler = getattr(getattr(dataloader, "batch_sampler", None), "sampler", None)
        return loop.data(
            None if why else epochs, _Epochs(dataloader), lambda b: move_data_to_device(b, self.root_device),
            len(dataloader), why, sampler,
        )  # fmt: skip

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if kwargs:  # a closure: the optimizer evaluates it inside its step, which a vote cannot split
            self._user_loop().refuse(
                f"The optimizer's step was given {sorted(kwargs)}: it evaluates a closure inside its step, which the "
                "per-step vote cannot split; call optimizer.step() after backward, without arguments."
            )
            return super().optimizer_step(optimizer, **kwargs)
        scaler = self.precision.scaler if isinstance(self.precision, MixedPrecision) else None
        return self._user_loop().vote(optimizer, scaler, lambda: super(FabricStrategy, self).optimizer_step(optimizer))
