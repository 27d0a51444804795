"""``rlaunch.lightning.Strategy``: live drains and replacements for a PyTorch Lightning ``Trainer``.

A user adds one argument, ``Trainer(strategy=rlaunch.lightning.Strategy())``, and launches the
script with ``rlaunch`` (or ``torchrun``: the strategy then trains as Lightning's DDP does). It
is Lightning's ``DDPStrategy`` with these hook points (the loop stays Lightning's):

- the process group and ranks are the runtime's (``rlaunch.init()``, ``rt.group``), and DDP is
  built on ``rt.group``, so a move swaps its communicator in place;
- ``setup`` tracks the model, the optimizers, the LR schedulers, a ``GradScaler``, the fit loop's
  position (:mod:`rlaunch.lightning.position`) and the callbacks' states;
- ``process_dataloader`` wraps the train loader (:mod:`rlaunch.lightning.data`): each step begins
  (``rt.drive()``) right before its first batch is read, where a leaver hands its state over and
  a standby joins and takes the loop position it received;
- ``optimizer_step`` runs Lightning's closure itself (forward and backward), then the per-step
  vote; a step the vote discards is redone inside that call: the earlier micro-batches of a
  gradient-accumulation window are run again from their own batches and random states, then the
  closure, so Lightning's loop never sees the redo. What the discarded attempt logged
  (``self.log``) and did to the callbacks is put back first;
- with manual optimization the vote is in the ``training_step``'s ``optimizer.step()`` and a
  discarded step reruns the whole ``training_step``;
- what runs after a step's vote and before the next step (the rest of the batch: its
  ``on_train_batch_end`` hooks, a step-interval plateau scheduler; validation; the epoch's end:
  early stopping's and the checkpoint's decisions across ranks) is never redone: a fault seen
  after validation or an epoch's end, or after a collective of the rest of the batch gave this
  rank its own values, refuses the live move, and the job restarts from the user's checkpoint
  (:mod:`rlaunch.lightning.aftervote`).

What it cannot carry is named at ``fit`` time (:mod:`rlaunch.lightning.checks`): the job then
trains as under Lightning's DDP and takes the restart path on a fault or drain.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from rlaunch.errors import RlaunchError, UsageError
from rlaunch.lightning import checks, packages
from rlaunch.lightning.aftervote import Reading, Stretch, refusal
from rlaunch.lightning.data import TrainData, WorkerSeeds, train_data
from rlaunch.lightning.environment import RuntimeEnvironment
from rlaunch.lightning.position import LoopPosition, Monitored
from rlaunch.runtime import rng, workerstreams
from rlaunch.runtime.driven import DrivenSteps
from rlaunch.runtime.runtime import Runtime, report_errors_as_sentences
from rlaunch.runtime.vote import RefusedError

pl = packages.trainer()
_optimizer_handles_unscaling = packages.fabric("plugins.precision.amp")._optimizer_handles_unscaling
reset_seed = packages.fabric("utilities.seed").reset_seed
ModelCheckpoint = packages.trainer("callbacks").ModelCheckpoint
LightningOptimizer = packages.trainer("core.optimizer").LightningOptimizer
_block_parallel_sync_behavior = packages.trainer("loops.utilities")._block_parallel_sync_behavior
MixedPrecision = packages.trainer("plugins.precision").MixedPrecision
DDPStrategy = packages.trainer("strategies").DDPStrategy
TrainerFn = packages.trainer("trainer.states").TrainerFn


@dataclass
class _MicroBatch:
    """One ``training_step`` call of the current step: what is needed to run it again."""

    args: tuple[Any, ...]
    rng: rng.RngState  # the generators as the call found them
    batch_idx: int


#: What a ``ModelCheckpoint`` decides from besides its ``state_dict()``, carried beside it under
#: :data:`KEPT`: the global step it last saved at (a save at the same step is skipped, with the save's
#: collectives: a joiner whose sandbox saved there would leave its peers waiting in them) and the
#: path of that save. ``current_score`` is in its ``state_dict()`` but its ``load_state_dict()`` leaves it.
CHECKPOINT_KEPT = ("_last_global_step_saved", "_last_checkpoint_saved")
#: What a ``WeightAveraging`` decides from besides its ``state_dict()`` (which holds the step of its last
#: update): the epoch of its last update at an epoch's end (a joiner whose sandbox ran an epoch's end
#: would skip an update its peers make)
AVERAGING_KEPT = ("_latest_update_epoch",)
KEPT = "rlaunch_kept"


def _kept_beside(callback: Any) -> tuple[str, ...]:
    """The attributes of ``callback`` carried beside its ``state_dict()``."""
    if isinstance(callback, ModelCheckpoint):
        return CHECKPOINT_KEPT
    if isinstance(callback, checks.WeightAveraging):
        return AVERAGING_KEPT
    return ()


class CallbackStates:
    """The ``state_dict()`` of every callback that has one (a tracked object: a checkpoint callback's
    best scores, early stopping's patience), by the callback's ``state_key``; a ``ModelCheckpoint``'s
    and a ``WeightAveraging``'s with what their own load leaves as it was (:data:`CHECKPOINT_KEPT`,
    ``current_score``, :data:`AVERAGING_KEPT`), so that a joiner's holds what the sender's did, not what
    its sandbox's validation or epoch's end left."""

    def __init__(self, callbacks: list[Any]) -> None:
        self._callbacks = callbacks

    def state_dict(self) -> dict[str, Any]:
        out = {}
        for callback in self._callbacks:
            state = callback.state_dict()
            kept = _kept_beside(callback)
            if kept:
                state = {**state, KEPT: {name: getattr(callback, name) for name in kept}}
            out[callback.state_key] = state
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for callback in self._callbacks:
            held = copy.deepcopy(state[callback.state_key])
            kept = held.pop(KEPT, {})
            if isinstance(callback, ModelCheckpoint):
                callback.dirpath = held.get("dirpath", callback.dirpath)  # its load keeps scores only in the same dir
            callback.load_state_dict(held)
            if isinstance(callback, ModelCheckpoint):
                callback.current_score = held.get("current_score", callback.current_score)
            for name in _kept_beside(callback):
                if name in kept:
                    setattr(callback, name, kept[name])


class Strategy(DDPStrategy):  # type: ignore[misc,valid-type]
    """Lightning's DDP on the rlaunch runtime, with live drains and replacements (see the module docstring).

    ``rt``: a runtime the script started itself (``rlaunch.init()``); by default the strategy starts
    one where Lightning would call ``init_process_group``, with ``timeout_s`` for group set-up and
    collectives. Other keyword arguments go to ``DistributedDataParallel`` (``find_unused_parameters``...).
    """

    strategy_name = "rlaunch"

    def __init__(self, *, rt: Runtime | None = None, timeout_s: float = 300.0, **ddp_kwargs: Any) -> None:
        report_errors_as_sentences()
        packages.check("rlaunch.lightning.Strategy")
        super().__init__(cluster_environment=RuntimeEnvironment(self._runtime), **ddp_kwargs)
        self._rt = rt
        self._timeout_s = timeout_s
        self._trainer: Any = None
        self._driver: DrivenSteps | None = None  # while a fit drives the runtime's steps
        self._fitted = False  # a fit has driven the runtime's steps in this process (once per process)
        self._position: LoopPosition | None = None
        self._callbacks: CallbackStates | None = None
        self._data: TrainData | None = None
        self._stepping = ""  # why the optimizer step is left to Lightning (no vote)
        self._window: list[_MicroBatch] = []  # the training_step calls of the current step
        self._reads = 0  # batches the current step read
        self._kept: tuple[Any, Any] | None = None  # logged results and callback states at the last call's start
        self._averages: dict[str, torch.nn.Module] = {}  # the WeightAveraging models tracked at the fit's setup
        #: the runtime's count of issued collectives where the step began or its last training_step or backward
        #: pass ended, past Lightning's SIGTERM broadcasts since (what is issued beyond it, a batch hook issued)
        self._issued_mark = 0
        self._redoing = False  # a discarded step is being run again: record nothing
        self._stepped = 0  # manual optimization: optimizer steps in this training_step
        self._discarded = False  # manual optimization: the vote discarded this training_step's step
        self._windows: tuple[Any, Any] | None = None  # (accumulation, validation interval) last checked
        self._monitors: dict[str, str] = {}  # logged keys that callbacks and plateau schedulers decide from
        self._logged_seen: set[str] = set()  # keys logged in training that were checked
        self._metrics: list[Any] = []  # the model's torchmetrics Metric modules
        self._metric_counts: dict[int, int] = {}  # their update counts at the step's start
        self._stretch = Stretch.BEFORE_STEPS  # where the fit stands against the steps' votes
        self._at_vote: Reading | None = None  # read where the last vote applied its step
        self._validations = 0  # validation runs begun
        self._as_lightning = False  # live moves were refused at setup: the train data is read as Lightning would
        self._read_at = -1  # Lightning's count of batches when the last one was read

    # -- the runtime, ranks and the process group --------------------------------------------

    def _runtime(self) -> Runtime:
        if self._rt is None:
            import rlaunch

            self._rt = rlaunch.init(self._timeout_s)
        return self._rt

    def setup_distributed(self) -> None:
        """Instead of ``init_process_group``: the runtime's group (under plain torchrun, torch's)."""
        reset_seed()
        rt = self._runtime()
        self.set_world_ranks()
        self._process_group_backend = rt.group.backend.value
        expected = self.num_nodes * self.num_processes
        if expected != rt.world_size:
            raise UsageError(
                f"Trainer(devices={self.num_processes}, num_nodes={self.num_nodes}) asks for {expected} processes, "
                f"but the job has {rt.world_size}; give devices= the processes per node and num_nodes= the nodes."
            )

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # A standby's sandbox has rank -1, which DistributedSampler refuses: it reads rank 0's part
        # until it joins, when rt.epochs gives the sampler the rank it took.
        rt = self._runtime()
        return {"num_replicas": rt.world_size, "rank": max(rt.rank, 0)}

    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        return DistributedDataParallel(
            module=model, device_ids=self.determine_ddp_device_ids(), process_group=self._runtime().group,
            **self._ddp_kwargs,
        )  # fmt: skip

    # -- what is tracked, and the train data ---------------------------------------------------

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self._trainer = trainer
        if self._fitted:
            self._refuse(
                "A second trainer.fit() ran in this process, and the runtime's steps are driven by one fit only; "
                "run one fit per process."
            )
            return
        self._fitted = True
        rt = self._runtime()
        self._stepping = checks.stepping(trainer, self.precision_plugin, self.optimizers)
        refused = ([self._stepping] if self._stepping else []) + checks.refusals(trainer, self)
        self._monitors = checks.monitors(trainer)
        self._metrics = _metric_modules(trainer.lightning_module)
        for why in refused:
            self._refuse(why)
        self._as_lightning = bool(refused)  # nothing will move: read the data exactly as Lightning would
        tracked: dict[str, Any] = {"model": self.model}
        for i, opt in enumerate(self.optimizers):
            tracked[f"optimizer{i}" if len(self.optimizers) > 1 else "optimizer"] = opt
        plateau: dict[str, Any] = {}
        for i, config in enumerate(trainer.lr_scheduler_configs):
            # a plateau scheduler follows a metric, which differs by rank unless it is synced
            (plateau if config.reduce_on_plateau else tracked)[f"scheduler{i}"] = config.scheduler
        scaler = self._scaler()
        if scaler is not None:
            tracked["scaler"] = scaler
        self._averages = checks.averaged_models(trainer)
        tracked.update(self._averages)
        self._position = LoopPosition(trainer)
        tracked["lightning"] = self._position
        epoch_loop = trainer.fit_loop.epoch_loop
        epoch_loop._broadcast_sigterm_tensor = self._sigterm_alike(epoch_loop._broadcast_sigterm_tensor)
        rt.track(**tracked)
        carried = checks.carried_callbacks(trainer)
        if carried:
            self._callbacks = CallbackStates(carried)
            plateau["callbacks"] = self._callbacks
        if self._monitors:
            plateau["monitored"] = Monitored(trainer, list(self._monitors))
        if plateau:
            rt.track_if_same(**plateau)
        self._driver = rt.drive()
        if self._data is not None:  # the train loader Lightning set up for its estimate: wrapped now
            self._settle(self._data)

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or not trainer.training:
            return dataloader  # validation, testing, prediction: read as Lightning prepared them
        if self._driver is None:
            if self._fitted:
                return dataloader  # a second fit: it steps as Lightning does (see setup)
            # Before the strategy's setup ended: Trainer.estimated_stepping_batches, read in configure_optimizers
            # (or the module's setup), sets up the train loader once, before anything is tracked. It is
            # wrapped now and settled at the setup's end (Lightning does not set it up again).
            self._data = TrainData(dataloader, self._before_read)
            return self._data
        if self._data is not None:
            self._refuse(
                "The fit has more than one train loader (or makes it again), whose positions are not carried; use "
                "one train loader (combine datasets in its dataset), made once."
            )
            self._data = TrainData(dataloader, self._before_read)  # read as it is; its reads still begin steps
            self._data.settle(dataloader, None)
            return self._data
        self._data = TrainData(dataloader, self._before_read)
        self._settle(self._data)
        return self._data

    def _settle(self, train: TrainData) -> None:
        why = train_data(self._runtime(), train, as_is=self._as_lightning)
        if why:
            self._refuse(why)

    def _sigterm_alike(self, broadcast: Callable[[], None]) -> Callable[[], None]:
        """Lightning's broadcast of its SIGTERM flag, issued before each batch is read, inside ``rt.alike()``:
        the flag is 0 on every rank until one receives SIGTERM (which ends that rank's fit), so after a fault
        each rank's own value is every rank's, and it does not count as work after a vote that went on from
        this rank's own values (see :mod:`rlaunch.lightning.aftervote`). Nor is it a batch hook's collective
        (see :meth:`training_step`): a redone step issues it between its batches too."""
        rt = self._runtime()

        def alike_broadcast() -> None:
            before = rt.issued
            with rt.alike():
                broadcast()
            self._issued_mark += rt.issued - before

        return alike_broadcast

    def _refuse(self, why: str) -> None:
        self._runtime().refuse_moves(f"rlaunch.lightning: {why}")

    def _scaler(self) -> Any:
        precision = self.precision_plugin
        return precision.scaler if isinstance(precision, MixedPrecision) else None

    # -- step boundaries -----------------------------------------------------------------------

    def _before_read(self) -> None:
        """Before each train batch is read: the first batch of a step begins the runtime's step (once,
        however many train loaders Lightning reads it from)."""
        trainer = self._trainer
        why = self._fault_after_vote()
        if why:
            self._refuse(why)  # the next vote goes to recovery, which refuses the replacement with it
        windows = (trainer.accumulate_grad_batches, trainer.val_check_batch)
        if windows != self._windows:
            self._windows = windows
            why = checks.validation_mid_window(trainer)
            if why:
                self._refuse(why)
        progress = trainer.fit_loop.epoch_loop.batch_progress
        if progress.total.ready == self._read_at:
            return  # another loader of the same batch
        self._read_at = progress.total.ready
        if progress.current.ready % trainer.accumulate_grad_batches == 0:
            self._begin_step()
        self._reads += 1

    def _begin_step(self) -> None:
        assert self._driver is not None and self._position is not None
        self._check_logged()
        why = checks.average_replaced(self._trainer, self._averages) if self._averages else ""
        if why:
            self._refuse(why)
        self._position.capture()
        joined = self._driver.begin()
        self._window, self._reads = [], 0
        if joined:
            self._take_position()
        self._metric_counts = {id(m): m._update_count for m in self._metrics}
        self._stretch = Stretch.STEPPING
        self._issued_mark = self._runtime().issued

    def _check_logged(self) -> None:
        """What the training hooks logged since the last check: refused if it cannot be carried."""
        results = self._trainer.fit_loop.epoch_loop._results
        new = [r for key, r in results.items() if key not in self._logged_seen]
        if new:
            self._logged_seen.update(results)
            why = checks.logged_in_training(new, self._monitors)
            if why:
                self._refuse(why)

    def _fault_after_vote(self) -> str:
        """Why this rank must not move live: a fault was seen after the last vote, past work that no
        redone step runs again ("" otherwise; see :mod:`rlaunch.lightning.aftervote`)."""
        if self._driver is None:
            return ""
        return refusal(self._stretch, self._at_vote, self._reading(), self._runtime().step_failed)

    def _reading(self) -> Reading:
        driver = self._driver
        assert driver is not None
        return Reading(
            step=-1 if driver.step is None else driver.step,
            epochs=self._trainer.fit_loop.epoch_progress.total.processed,
            validations=self._validations,
            own_results=self._runtime().own_results,
        )

    def _voted(self) -> None:
        """The vote applied the step: what runs from here to the next step's first read is not run again."""
        self._stretch, self._at_vote = Stretch.AFTER_VOTE, self._reading()

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._validations += 1

    def _take_position(self) -> None:
        """(a standby that just joined) Continue where the rank it replaces stands: its loop position,
        its rank for rank-zero-only code and for the validation loaders' samplers."""
        assert self._position is not None
        trainer = self._trainer
        self._position.apply()
        self._read_at = trainer.fit_loop.epoch_loop.batch_progress.total.ready  # this read, as the loop now counts
        self.set_world_ranks()
        rank = self._runtime().rank
        train = self._data.loader if self._data is not None else None
        seeds = workerstreams.script_init(getattr(train, "worker_init_fn", None))
        if isinstance(seeds, WorkerSeeds):
            seeds.rank = rank  # its workers start after this, at the next read
        val = trainer.fit_loop.epoch_loop.val_loop._combined_loader
        for loader in val.flattened if val is not None else []:
            for sampler in (getattr(loader, "sampler", None), getattr(loader.batch_sampler, "sampler", None)):
                if sampler is not None and hasattr(sampler, "rank"):
                    sampler.rank = rank
        # Epoch-level logged values are each rank's own running sums: the sandbox's are let go (the
        # epoch's values on this rank then cover its steps since the join; what decides from such a
        # value refuses moves: see checks.logged_in_training).
        trainer.fit_loop.epoch_loop._results.clear()

    def teardown(self) -> None:
        why = self._fault_after_vote()
        if why:
            self._refuse(why)
        if self._driver is not None:
            self._driver.end()
            self._driver = None
        super().teardown()
        if why:  # the last validation's values are this rank's own, and no step follows to refuse at
            raise RefusedError(f"rank {self._runtime().rank}: {why}")

    # -- the step: training_step, the vote, the redo -------------------------------------------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._driver is None or self._redoing:
            return super().training_step(*args, **kwargs)
        trainer = self._trainer
        rt = self._runtime()
        if rt.issued != self._issued_mark:  # since the step began or its last training_step: the batch hooks'
            rt.refuse_replacement(f"rlaunch.lightning: {checks.HOOK_COLLECTIVE}")
        entry = _MicroBatch(args, rng.capture(), trainer.fit_loop.epoch_loop.batch_idx)
        self._kept = self._keep()
        try:
            if trainer.lightning_module.automatic_optimization:
                self._window.append(entry)
                return super().training_step(*args, **kwargs)
            return self._manual_training_step(entry, kwargs)
        finally:
            self._issued_mark = rt.issued

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's backward pass, with its hooks (``on_before_backward``, ``on_after_backward``), which a
        redone step runs again: what they issue is not a batch hook's collective (see :meth:`training_step`)."""
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            self._issued_mark = self._runtime().issued

    def _keep(self) -> tuple[Any, Any]:
        """What a discarded attempt may change besides the tracked state: the logged results, the callbacks."""
        results = self._trainer.fit_loop.epoch_loop._results
        return _logged(results), (copy.deepcopy(self._callbacks.state_dict()) if self._callbacks is not None else None)

    def _put_back(self) -> None:
        assert self._kept is not None
        logged, callbacks = self._kept
        _relog(self._trainer.fit_loop.epoch_loop._results, logged)
        if self._callbacks is not None:
            self._callbacks.load_state_dict(callbacks)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._driver is None or self._stepping:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        opt = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if self._data is None:  # no train batch was read through the strategy: no runtime step has begun
            raise RlaunchError(
                f"Lightning {pl.__version__} stepped the optimizer {type(opt).__name__} on a train batch from a loader "
                "it never passed to the strategy's process_dataloader, so rlaunch.lightning began no step for it and "
                "cannot vote on it; this is a defect of rlaunch.lightning with this Lightning version: report it, and "
                'train with strategy="ddp" meanwhile.'
            )
        module = model if isinstance(model, pl.LightningModule) else self.lightning_module
        if not module.automatic_optimization:
            return self._manual_optimizer_step(opt, closure, module)
        progress = self._trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress
        at_entry = copy.deepcopy(progress.state_dict())
        redo = False
        while True:
            self._redoing = redo
            try:
                result = closure()
            finally:
                self._redoing = False
            self._after_closure(module, opt, result)
            self._check_metrics()
            if self._runtime().optimizer_step(opt, scaler=self._scaler()):
                self._voted()
                return result
            self._redo_window(opt)
            progress.load_state_dict(copy.deepcopy(at_entry))
            redo = True

    def _check_metrics(self) -> None:
        """Before the vote: what the step logged, and the torchmetrics it updated without logging them."""
        self._check_logged()
        logged = checks.logged_metrics(self._trainer.fit_loop.epoch_loop._results.values())
        why = checks.metrics_updated(self._metric_counts, self._metrics, logged)
        if why:
            self._refuse(why)

    def _after_closure(self, module: Any, opt: torch.optim.Optimizer, result: Any) -> None:
        """What Lightning's precision plugin does between the closure and the step: unscale the
        gradients (with a GradScaler), the ``on_before_optimizer_step`` hooks, gradient clipping."""
        scaler = self._scaler()
        skipped = result is None and module.automatic_optimization
        if scaler is not None and not skipped and not _optimizer_handles_unscaling(opt):
            scaler.unscale_(opt)
        self.precision_plugin._after_closure(module, opt)

    def _again(self) -> None:
        """The step was discarded: its start is put back and it begins again; read its batches again."""
        assert self._driver is not None
        self._driver.redo()
        if self._data is not None and self._data.data is not None:
            for _ in range(self._reads):
                self._data.data.batch()  # the batches this step read, given again (with their draws)

    def _redo_window(self, opt: torch.optim.Optimizer) -> None:
        """Run the earlier micro-batches of the discarded step again, then let the closure run last."""
        self._again()
        epoch_loop = self._trainer.fit_loop.epoch_loop
        automatic = epoch_loop.automatic_optimization
        self._redoing = True
        try:
            for i, entry in enumerate(self._window[:-1]):
                if i:
                    self._between_batches()
                rng.restore(entry.rng)
                again = automatic._make_closure(OrderedDict(enumerate(entry.args)), opt, entry.batch_idx)
                with _block_parallel_sync_behavior(self, block=True):
                    again()
        finally:
            self._redoing = False
        if len(self._window) > 1:
            self._between_batches()
        self._put_back()
        rng.restore(self._window[-1].rng)

    def _between_batches(self) -> None:
        """The collective Lightning's loop issues before reading each batch (whether any rank got SIGTERM):
        a joiner that redoes a step from its start issues it between the step's micro-batches, so the
        survivors, who redo them inside one call, must issue it there too."""
        trainer = self._trainer
        if torch.distributed.is_available() and torch.distributed.is_initialized() and trainer.world_size > 1:
            trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()

    def _manual_training_step(self, entry: _MicroBatch, kwargs: dict[str, Any]) -> Any:
        """Manual optimization: the ``training_step`` steps the optimizer itself, so a discarded step
        reruns it whole (and Lightning's count of optimizer steps goes back to the call's start)."""
        progress = self._trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        at_entry = copy.deepcopy(progress.state_dict())
        redo = False
        while True:
            self._stepped, self._discarded, self._redoing = 0, False, redo
            try:
                out = super().training_step(*entry.args, **kwargs)
            finally:
                self._redoing = False
            if not self._discarded:
                break
            self._again()
            self._put_back()
            progress.load_state_dict(copy.deepcopy(at_entry))
            rng.restore(entry.rng)
            redo = True
        if self._stepped == 0:
            self._refuse(
                "With manual optimization, a training_step stepped no optimizer (gradients accumulated by hand), "
                "so a step spans batches a redo would not run again; step an optimizer in every training_step, or "
                "use automatic optimization."
            )
        return out

    def _manual_optimizer_step(self, opt: torch.optim.Optimizer, closure: Callable[[], Any], module: Any) -> Any:
        self._stepped += 1
        if self._discarded:
            return None  # the step is redone whole: nothing of it is applied
        if self._stepped > 1:
            self._refuse(
                "With manual optimization, a training_step stepped optimizers more than once, and a step has one "
                "vote (the later steps are applied without one); step one optimizer once per training_step, or "
                "use automatic optimization."
            )
            return self.precision_plugin.optimizer_step(opt, model=module, closure=closure)
        result = closure()
        self._after_closure(module, opt, result)
        self._check_metrics()
        if self._runtime().optimizer_step(opt, scaler=self._scaler()):
            self._voted()
        else:
            self._discarded = True
        return result


#: what ``self.log`` changes on a logged value (Lightning's ``_ResultMetric``); each update binds new objects
_LOGGED_FIELDS = ("value", "cumulated_batch_size", "_forward_cache", "_computed", "_update_count", "has_reset")


def _logged(results: dict[str, Any]) -> dict[str, tuple[Any, dict[str, Any]]]:
    """The logged values as they stand (references: an update rebinds them, it never writes in place)."""
    return {
        key: (metric, {f: getattr(metric, f) for f in _LOGGED_FIELDS if hasattr(metric, f)})
        for key, metric in results.items()
    }


def _relog(results: dict[str, Any], logged: dict[str, tuple[Any, dict[str, Any]]]) -> None:
    """Put the logged values back as :func:`_logged` found them (a value first logged since is dropped)."""
    results.clear()
    for key, (metric, fields) in logged.items():
        for name, value in fields.items():
            setattr(metric, name, value)
        results[key] = metric


def _metric_modules(module: Any) -> list[Any]:
    """The torchmetrics ``Metric`` modules of ``module`` (none when torchmetrics is not installed)."""
    try:
        from torchmetrics import Metric
    except ImportError:
        return []
    return [m for m in module.modules() if isinstance(m, Metric)]
