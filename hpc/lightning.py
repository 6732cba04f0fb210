"""PyTorch Lightning under the toolkit's guarantees: two names imported from here instead of
Lightning's and torch's, nothing else changed in the script.

    from hpc.lightning import DataLoader, Trainer   # instead of Lightning's Trainer, torch's DataLoader

- `Trainer` is Lightning's, with the run handle (hpc.run) inside: after every optimizer step all
  ranks vote (one small allreduce), a periodic save or the agreed stop (preemption, the time
  limit's signal, hpc.stop, Ctrl-C) commits Lightning's whole checkpoint (what its own .ckpt
  holds: weights, buffers, optimizers, schedulers, precision plugin, loops, callbacks) with every
  rank's RNG streams through the toolkit's protocol (atomic, checksummed, pickle-free on load),
  at the point where Lightning takes its own step checkpoints (the end of the training batch).
  `fit()` resumes from the newest committed checkpoint (its own `ckpt_path` otherwise), and after
  a stop ends the process to be resumed (exit 75, or the Slurm requeue) instead of returning.
  The loss of every step goes to steps.jsonl, what validation logs (`val_*`) to metrics.jsonl
  and result.json, so hpc.status, sweeps and studies read them.
- `DataLoader` is torch's, resumable mid-epoch (Lightning's stateful-loader protocol): it keeps the
  RNG state its epoch's iterator began from and how many batches were trained, and a resumed start
  draws the same order (and workers' seeds) again and skips those. Augmentation drawn from torch's
  global generator in the main process is not repeated as it was: draw it in loader workers.

Strategies: one device and DDP (Lightning's default on several ranks); a sharded strategy (FSDP,
DeepSpeed) is refused in one line. Lightning's own checkpointing (ModelCheckpoint) stays as it was
where the script asks for it; it is off by default. Works with `pytorch_lightning` and with
`lightning.pytorch`, whichever the script imported first (pytorch_lightning when neither).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import torch

from hpc.adapters import end_steps_until, numeric
from hpc.run import Run, start_run

RESUME = "hpc-toolkit://newest-committed"  # the ckpt_path fit() passes once the run handle restored a checkpoint
SUPPORTED_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy")


def lightning_package() -> str:
    """The Lightning the script uses: the one imported already, else pytorch_lightning when installed."""
    if "lightning.pytorch" in sys.modules and "pytorch_lightning" not in sys.modules:
        return "lightning.pytorch"
    if importlib.util.find_spec("pytorch_lightning") is None and importlib.util.find_spec("lightning") is not None:
        return "lightning.pytorch"
    return "pytorch_lightning"


pl: Any = importlib.import_module(lightning_package())
TorchCheckpointIO: Any = importlib.import_module(f"{pl.__name__}.plugins.io").TorchCheckpointIO


class DataLoader(torch.utils.data.DataLoader):
    """torch's DataLoader, resumable mid-epoch (see the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._epoch_rng: torch.Tensor | None = None  # torch's RNG state when this epoch's iterator was made
        self._skip = 0  # batches a resumed start skips
        self.trained = 0  # batches trained in this epoch: set by the Trainer at each save

    def __iter__(self) -> Any:  # torch's own iterator type is private
        skip, self._skip = self._skip, 0
        if not skip or self._epoch_rng is None:
            self._epoch_rng = torch.get_rng_state()
            return super().__iter__()
        resumed = torch.get_rng_state()
        torch.set_rng_state(self._epoch_rng)  # the epoch's order and the workers' seeds, drawn as they were
        iterator = super().__iter__()
        for _ in range(skip):
            next(iterator)
        torch.set_rng_state(resumed)
        return iterator

    def state_dict(self) -> dict[str, Any]:
        return {"epoch_rng": self._epoch_rng, "trained": self.trained}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch_rng, self._skip = state.get("epoch_rng"), int(state.get("trained", 0))


class LightningState:
    """Lightning's whole checkpoint, one entry of the run handle's registry: taken from the
    trainer at each save, and handed back to Lightning's own restore through CheckpointIO."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.loaded: dict[str, Any] | None = None
        self.fitting = False

    def state_dict(self) -> dict[str, Any]:
        if self.trainer is None or not self.fitting:  # the registry looks at the live state before fit
            return {}
        dumped: dict[str, Any] = self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        for code_owned in ("hyper_parameters", "hparams_name", "datamodule_hyper_parameters", "hparams_type"):
            dumped.pop(code_owned, None)  # the module's own arguments, made again by the script: not state to pickle
        return dumped

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


class CheckpointIO(TorchCheckpointIO):
    """Lightning's files as before; RESUME is what the run handle restored."""

    def __init__(self, state: LightningState) -> None:
        super().__init__()
        self.state = state

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
        if str(path) == RESUME and self.state.loaded is not None:
            restored, self.state.loaded = self.state.loaded, None  # handed over once: not kept beside the live state
            return restored
        loaded: dict[str, Any] = super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        return loaded


class Guard(pl.Callback):
    """The run handle's end_step() after every optimizer step; the stop it agrees on."""

    def __init__(self, state: LightningState) -> None:
        self.state = state
        self.run: Run | None = None
        self.loss: torch.Tensor | None = None  # the last training batch's, until its step is told
        self.figures: dict[str, Any] = {}  # and what its training_step logged

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        strategy = type(trainer.strategy).__name__
        if strategy not in SUPPORTED_STRATEGIES:
            raise RuntimeError(f"hpc.lightning keeps Lightning's state with the {' or '.join(SUPPORTED_STRATEGIES)}; {strategy} shards it")
        self.state.fitting = True

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.run is not None and self.run.resumed_from is None and trainer.global_step > self.run.step:
            self.run.handle.step = trainer.global_step  # Lightning resumed its own ckpt_path: counted from there
        plain = [type(loader).__name__ for loader in training_loaders(trainer) if not isinstance(loader, DataLoader)]
        if plain and self.run is not None and self.run.is_main:
            print(
                f"hpc.lightning: the training loader is a {plain[0]}, not hpc.lightning.DataLoader: a resume mid-epoch starts the epoch's data again",
                flush=True,
            )

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.loss = loss.detach() if isinstance(loss, torch.Tensor) else None
        self.figures = training_figures(trainer)  # what training_step logged for this batch (self.log)
        if validation_follows(trainer):
            return  # the vote after it: a save here would resume with that validation skipped (and its draws)
        # Where Lightning takes its own step checkpoints (its restart expects them here): the
        # batch trained and its optimizer step done, the batch not yet counted completed.
        self.vote(trainer, in_flight=1)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.run is None or trainer.sanity_checking or self.run.stopped_by is not None:
            return
        # val_loss, val/acc: as val_loss, val_acc (the names hpc.status and sweep.objective read)
        figures = {name.replace("val/", "val_", 1): value for name, value in trainer.callback_metrics.items() if name.startswith(("val_", "val/"))}
        figures = {name: value for name, value in figures.items() if numeric(value)}
        if figures:
            self.run.log(step=trainer.global_step, **figures)
        if trainer.state.fn == "fit":  # validation inside fit (Lightning's other place for a step checkpoint: the batch completed)
            self.vote(trainer, in_flight=0)

    def vote(self, trainer: Any, in_flight: int) -> None:
        loss, self.loss = self.loss, None
        figures, self.figures = self.figures, {}
        if self.end_steps(trainer, {"loss": loss} if loss is not None else {}, in_flight=in_flight):
            trainer.should_stop = True
            trainer.limit_val_batches = 0  # Lightning validates on a stop: not in the stop's grace time, after the save
            trainer.fit_loop.min_epochs, trainer.fit_loop.epoch_loop.min_steps = 0, None  # else Lightning trains on past should_stop
            return
        if figures and trainer.global_step % max(1, trainer.log_every_n_steps) == 0 and self.run is not None:
            self.run.log(step=trainer.global_step, **figures)  # rank 0's, no collective: ranks may log different names

    def end_steps(self, trainer: Any, metrics: dict[str, Any] | None = None, in_flight: int = 0) -> bool:
        """The loaders' position, then end_step() for each optimizer step since the last call, the
        last with `metrics` (averaged over ranks into steps.jsonl); True: stop now (saved)."""
        assert self.run is not None
        trained = trainer.fit_loop.epoch_loop.batch_progress.current.completed + in_flight
        for loader in training_loaders(trainer):
            if isinstance(loader, DataLoader):
                loader.trained = trained
        return end_steps_until(self.run, trainer.global_step, metrics or {})


def start_process_group_under_torchrun(trainer: Any) -> None:
    """Under torchrun the run handle talks through the process group, which Lightning starts only
    inside fit(), after the handle must have restored: started here as Lightning would (its
    backend, its device), and Lightning finds it started. Under launch.py, mpirun and srun the
    handle talks through MPI instead."""
    import torch.distributed as dist

    from hpc.env import RankInfo
    from hpc.rank import hosting

    rank = RankInfo.from_env(os.environ)
    if hosting.host() is not None or rank.launcher != "torchrun" or rank.world_size < 2 or dist.is_initialized():
        return
    strategy = trainer.strategy
    if strategy.root_device.type == "cuda":
        torch.cuda.set_device(strategy.root_device)
    backend = strategy._get_process_group_backend() if hasattr(strategy, "_get_process_group_backend") else "gloo"
    dist.init_process_group(backend, rank=rank.rank, world_size=rank.world_size)


def hand_signals_to_the_toolkit(trainer: Any) -> None:
    """Lightning's own signal handling off: its SIGTERM handler ends the ranks with SIGTERMException
    at the next batch (before the toolkit's agreed stop saves), its SLURMEnvironment's SIGUSR1
    handler saves and requeues the job itself (a second requeue), and it broadcasts its SIGTERM
    flag before every batch (a collective per step). The run handle's stop does all three."""
    connector = trainer._signal_connector
    connector.register_signal_handlers = lambda: setattr(connector, "received_sigterm", False)
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None


def validation_follows(trainer: Any) -> bool:
    """Whether Lightning validates after the training batch that just ended."""
    fetcher = trainer.fit_loop._data_fetcher
    return fetcher is not None and bool(trainer.fit_loop.epoch_loop._should_check_val_fx(fetcher))


def training_figures(trainer: Any) -> dict[str, Any]:
    """The numbers training logged (`self.log`), by their names; validation's and the loss aside."""
    return {
        name: value.detach() if isinstance(value, torch.Tensor) else value
        for name, value in trainer.callback_metrics.items()
        if numeric(value) and name != "loss" and not name.startswith(("val_", "val/", "test_", "test/"))
    }


def training_loaders(trainer: Any) -> list[Any]:
    """The loaders Lightning trains from now (none before its data is set up)."""
    combined = trainer.fit_loop._combined_loader
    return list(combined.flattened) if combined is not None else []


class LightningTrainer(pl.Trainer):
    """Lightning's Trainer with the toolkit's stop, save and exact resume (see the module's
    docstring). `run_dir`: where the run keeps its checkpoints when started by hand (torchrun,
    srun); launch.py gives its own."""

    def __init__(self, *args: Any, run_dir: str | None = None, **kwargs: Any) -> None:
        self._hpc_state = LightningState()
        self._hpc_guard = Guard(self._hpc_state)
        self._hpc_run_dir = run_dir
        given = kwargs.get("callbacks") or []
        callbacks = list(given) if isinstance(given, list | tuple) else [given]  # Lightning takes one callback too
        if not any(isinstance(c, pl.callbacks.Checkpoint) for c in callbacks):
            kwargs.setdefault("enable_checkpointing", False)  # Lightning's own .ckpt files only where asked for
        kwargs["callbacks"] = [*callbacks, self._hpc_guard]
        plugins = kwargs.get("plugins") or []
        kwargs["plugins"] = [*(plugins if isinstance(plugins, list | tuple) else [plugins]), CheckpointIO(self._hpc_state)]
        super().__init__(*args, **kwargs)
        self._hpc_state.trainer = self
        hand_signals_to_the_toolkit(self)

    def fit(self, model: Any, *args: Any, ckpt_path: Any = None, **kwargs: Any) -> None:
        start_process_group_under_torchrun(self)
        run = start_run(self._hpc_run_dir, lightning=self._hpc_state)
        self._hpc_guard.run = run
        try:
            super().fit(model, *args, ckpt_path=RESUME if run.resumed_from is not None else ckpt_path, **kwargs)
        finally:
            self._hpc_state.fitting = run.stopped_by is None  # the final save below takes the state after fit
        if run.stopped_by is None:
            self._hpc_guard.end_steps(self)
        run.finish()  # the final checkpoint; after a stop, ends the process to be resumed


Trainer = LightningTrainer  # the name a script imports in place of Lightning's
