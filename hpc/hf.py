"""Hugging Face's Trainer under the toolkit's guarantees: one name imported from here instead of
transformers', nothing else changed in the script.

    from hpc.hf import Trainer   # instead of: from transformers import Trainer

`Trainer` is transformers', with the run handle (hpc.run) inside:
- after every optimizer step, once the step's logging, evaluation and Hugging Face's own save are
  done (after the epoch's, for an epoch's last step), all ranks vote (one small allreduce); a
  periodic save or the agreed stop (preemption, the time limit's signal, hpc.stop, Ctrl-C)
  commits the model, optimizer, scheduler, grad scaler, the Trainer's state (global step, epoch,
  log history, best metric, stateful callbacks), its logging accumulators and every rank's RNG
  streams through the toolkit's protocol (atomic, checksummed, pickle-free on load);
- `train()` resumes from the newest committed checkpoint through Hugging Face's own resume
  (its data skipping and the RNG restored where it restores it), the pieces handed over from
  memory instead of its files; after a stop it ends the process to be resumed (exit 75, or the
  Slurm requeue) instead of returning;
- the loss of every optimizer step goes to steps.jsonl; what evaluation reports (`eval_acc`) to
  metrics.jsonl and result.json as `val_acc`, with the learning rate and gradient norm, so
  hpc.status, sweeps and studies read them.

Hugging Face's own checkpoints (save_strategy) are written as the arguments ask; the toolkit's
are its own. DeepSpeed and FSDP shard the state: refused in one line. Needs transformers 5.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from typing import Any, cast

import torch
import transformers
from transformers.trainer_callback import ExportableState, TrainerCallback, TrainerState

from hpc.adapters import end_steps_until, numeric
from hpc.run import Run, per_rank, start_run
from trainers.checkpoint.registry import unwrapped
from trainers.checkpoint.state import restore_rng, rng_state

TRAINER_STATE_FILE = "trainer_state.json"  # the one file of Hugging Face's checkpoint its resume reads by name
NOT_FIGURES = ("_runtime", "_per_second", "total_flos", "epoch")  # wall-clock and bookkeeping, not the run's figures


class TrainerStateEntry:
    """What the run handle keeps of a Hugging Face Trainer: one entry of its registry, taken at
    each save and handed back to Hugging Face's resume from memory."""

    def __init__(self, trainer: HFTrainer) -> None:
        self.trainer = trainer
        self.loaded: dict[str, Any] | None = None
        self.training = False

    def state_dict(self) -> dict[str, Any]:
        if not self.training:  # the registry looks at the live state before training
            return {}
        trainer: Any = self.trainer
        kept: dict[str, Any] = {
            "model": unwrapped(trainer.model).state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.lr_scheduler.state_dict(),
            "trainer_state": trainer_state(trainer),
        }
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            kept["scaler"] = scaler.state_dict()
        return kept

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


class LoggingWindow:
    """The Trainer's logging accumulators since its last log, this rank's own (the loss summed on
    each rank, averaged over ranks when Hugging Face logs): a resume continues the window."""

    def __init__(self, trainer: HFTrainer) -> None:
        self.trainer = trainer
        self.loaded: dict[str, Any] | None = None
        self.first_step = 0  # where the run's first start began training (the end's train_loss averages from there)
        self.earlier_seconds = 0.0  # training time of the run's earlier starts
        self.began = time.time()  # this start's

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        if not trainer._hpc_state.training:
            return {}
        return {
            "tr_loss": trainer._tr_loss.detach().cpu().clone(),
            "total_loss": float(trainer._total_loss_scalar),
            "last_logged": int(trainer._globalstep_last_logged),
            "flos": float(trainer.current_flos),
            "first_step": self.first_step,
            "train_seconds": self.earlier_seconds + time.time() - self.began,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state

    def reopen(self, resumed: bool) -> None:
        """Into the Trainer, once its loop has set up its own (empty) window."""
        self.began, self.first_step = time.time(), self.trainer.state.global_step
        if not resumed or not self.loaded:
            return
        trainer, loaded = self.trainer, self.loaded
        self.first_step, self.earlier_seconds = loaded["first_step"], loaded["train_seconds"]
        trainer._tr_loss = loaded["tr_loss"].to(trainer._tr_loss.device)
        trainer._total_loss_scalar = loaded["total_loss"]
        trainer._globalstep_last_logged = loaded["last_logged"]
        trainer.current_flos = loaded["flos"]


def trainer_state(trainer: Any) -> dict[str, Any]:
    """The Trainer's state as its trainer_state.json holds it, the stateful callbacks as they are now."""
    callbacks = [cb for cb in trainer.callback_handler.callbacks + [trainer.control] if isinstance(cb, ExportableState)]
    state = dataclasses.replace(trainer.state, stateful_callbacks=TrainerState(stateful_callbacks=cast(Any, callbacks)).stateful_callbacks)
    plain: dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(state)))  # tuples as lists: what the file would hold
    return plain


class Reporter(TrainerCallback):
    """Hugging Face's logs into the run's records; the epoch's open or done (the vote's place)."""

    def __init__(self, trainer: HFTrainer) -> None:
        self.trainer = trainer
        self.epoch_open = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        resumed = trainer._hpc_resume_dir is not None
        trainer._hpc_window.reopen(resumed=resumed)
        trainer._hpc_state.loaded = None  # handed over by now: not kept beside the live state
        run = trainer._hpc_run
        if run is not None and not resumed and state.global_step > run.step:
            run.handle.step = state.global_step  # HF resumed its own checkpoint: counted from there

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.epoch_open = True

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.epoch_open = False

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        run = self.trainer._hpc_run
        if run is None or not logs:
            return
        figures = {figure_name(name): value for name, value in logs.items() if numeric(value) and not name.endswith(NOT_FIGURES) and name != "loss"}
        if figures:
            run.log(step=state.global_step, **figures)


def figure_name(name: str) -> str:
    """eval_acc as val_acc: the names hpc.status and sweep.objective read."""
    return "val_" + name.removeprefix("eval_") if name.startswith("eval_") else name


class HFTrainer(transformers.Trainer):
    """transformers' Trainer with the toolkit's stop, save and exact resume (see the module's
    docstring). `run_dir`: where the run keeps its checkpoints when started by hand (torchrun,
    srun); launch.py gives its own."""

    def __init__(self, *args: Any, run_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hpc_state = TrainerStateEntry(self)
        self._hpc_window = LoggingWindow(self)
        self._hpc_reporter = Reporter(self)
        self._hpc_run_dir = run_dir
        self._hpc_run: Run | None = None
        self._hpc_loss: torch.Tensor | None = None  # the current optimizer step's loss, summed over its micro-batches
        self._hpc_resume_dir: str | None = None
        self._hpc_rng: dict[str, Any] | None = None  # the RNG streams the resumed checkpoint holds
        self.add_callback(self._hpc_reporter)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, ignore_keys_for_eval: list[str] | None = None) -> Any:
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise RuntimeError("hpc.hf keeps the Trainer's state whole (one device or DDP); DeepSpeed and FSDP shard it")
        run = start_run(self._hpc_run_dir, hf=self._hpc_state, hf_logging=per_rank(self._hpc_window))
        self._hpc_run = run
        try:
            if run.resumed_from is not None:
                self._hpc_rng = rng_state()  # as the checkpoint left them: Hugging Face sets them where its resume does
                resume_from_checkpoint = self._hpc_resume_dir = self._resume_dir()
            self._hpc_state.training = True
            if run.resumed_from is not None and 0 < self.args.max_steps <= run.step:
                output = self._already_trained()  # Hugging Face would train a step past max_steps mid-epoch
            else:
                output = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval)
        finally:
            if self._hpc_resume_dir is not None:
                shutil.rmtree(self._hpc_resume_dir, ignore_errors=True)
                self._hpc_resume_dir = None
        self._end_steps()
        run.finish()  # the final checkpoint; after a stop, ends the process to be resumed
        return output

    def _resume_dir(self) -> str:
        """A folder holding the resumed Trainer state as Hugging Face's resume reads it (the rest
        comes from memory, in the _load_* methods below)."""
        assert self._hpc_state.loaded is not None
        folder = tempfile.mkdtemp(prefix="hpc-hf-resume-")
        with open(os.path.join(folder, TRAINER_STATE_FILE), "w", encoding="utf-8") as file:
            json.dump(self._hpc_state.loaded["trainer_state"], file)
        return folder

    def _already_trained(self) -> Any:
        folder = self._hpc_resume_dir
        assert folder is not None
        self._load_from_checkpoint(folder)
        self.state = TrainerState.load_from_json(os.path.join(folder, TRAINER_STATE_FILE))
        return transformers.trainer_utils.TrainOutput(self.state.global_step, 0.0, {})

    def _resuming(self, checkpoint: Any) -> dict[str, Any] | None:
        """The restored state when Hugging Face asks for the checkpoint this run resumes."""
        if checkpoint is None or checkpoint != self._hpc_resume_dir:
            return None
        return self._hpc_state.loaded

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        loaded = self._resuming(resume_from_checkpoint)
        if loaded is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        unwrapped(model if model is not None else self.model).load_state_dict(loaded["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        loaded = self._resuming(checkpoint)
        if loaded is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        optimizer, scheduler = cast(Any, self.optimizer), cast(Any, self.lr_scheduler)  # made by now
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        loaded = self._resuming(checkpoint)
        if loaded is None:
            super()._load_scaler(checkpoint)
            return
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and "scaler" in loaded:
            scaler.load_state_dict(loaded["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None or checkpoint != self._hpc_resume_dir or self._hpc_rng is None:  # asked for after on_train_begin let go of the rest
            super()._load_rng_state(checkpoint)
            return
        restore_rng(self._hpc_rng)

    def _finalize_training(self, trial: Any, num_train_samples: Any, start_time: float) -> Any:
        # Hugging Face's end figures cover its train() call: here the run's, as uninterrupted
        self._initial_global_step = self._hpc_window.first_step
        return super()._finalize_training(trial, num_train_samples, start_time - self._hpc_window.earlier_seconds)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        loss: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)
        self._hpc_loss = loss.detach() if self._hpc_loss is None else self._hpc_loss + loss.detach()
        return loss

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        super()._maybe_log_save_evaluate(*args, **kwargs)
        if self._hpc_run is None:
            return
        if self._hpc_reporter.epoch_open and float(self.state.epoch).is_integer():
            return  # the epoch's last step: the vote comes after the epoch's own log, evaluation and save
        if self.control.should_training_stop:
            return  # the last step (max_steps, early stopping): counted after train()'s own end, the final save after it
        if self._end_steps():
            self._hpc_run.finish()  # saved at this step on every rank: the process ends here, to be resumed

    def _end_steps(self) -> bool:
        """end_step() for each optimizer step since the last call; True: stop now (saved)."""
        assert self._hpc_run is not None
        loss, self._hpc_loss = self._hpc_loss, None
        return end_steps_until(self._hpc_run, self.state.global_step, {"loss": loss} if loss is not None else {})


Trainer = HFTrainer  # the name a script imports in place of transformers'
