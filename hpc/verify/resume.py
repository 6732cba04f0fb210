"""`hpc-launch verify=resume OVERRIDES...`: the user's own job, run uninterrupted and then
interrupted as a cluster interrupts it (stopped by a real signal at random steps, killed with
SIGKILL once a periodic save committed), resumed each time as a requeue would (`bash
RUN_DIR/command.txt` here; on a scheduler the job requeues or restarts itself: hpc.verify.runs),
and compared with the uninterrupted run: the loss of every step and every leaf of the final
checkpoint, bit for bit (hpc.verify.compare).

Its runs are its own, under RUN_ROOT/verify/DATE/TIME/ (`reference/`, `interrupted/` and, where
the two differ, `again/`: a second uninterrupted run tells a job that is not deterministic from
one that does not resume exactly); it never writes into another run dir. The last line says
`verify: PASS ...` (exit 0) or `verify: FAIL at step N: ...` (exit 1)."""

from __future__ import annotations

import dataclasses
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc.config.local_gpus import override_key
from hpc.rundir import RunDir, read_jsonl
from hpc.verify.compare import Losses, compare_states, final_state, first_divergence, hint, kind_of
from hpc.verify.runs import Launch, Runs, VerifyFailure, committed, logged_step, runs_for, seen_events, wait_until


@dataclass(frozen=True)
class VerifyPlan:
    """What the verifier runs: the job's overrides (the verifier's own left out, its step count
    and periodic save put in), the script's arguments, how to interrupt it, and where its ranks
    run (`queued_on`: the scheduler's launcher, None: here)."""

    overrides: list[str]
    script_args: list[str] | None
    stops: int
    kill: bool
    seed: int
    root: Path
    queued_on: str | None = None


@dataclass
class Interrupted:
    """What happened to the interrupted run: each start's end, and the steps it resumed from."""

    events: list[str] = field(default_factory=list)
    resumes: list[int] = field(default_factory=list)


def with_override(overrides: list[str], key: str, value: object) -> list[str]:
    """`overrides` with `key=value` in place of any value of `key` given already."""
    return [o for o in overrides if override_key(o) != key] + [f"{key}={value}"]


def child_overrides(overrides: list[str], steps: int | None, every_steps: int, builtin_loop: bool) -> list[str]:
    """The job's overrides for the verifier's runs: none of verify's own, the built-in loop's
    length set to `steps` (a script's own arguments decide its length), a periodic save every
    `every_steps` (a SIGKILL needs one to come back to)."""
    kept = [o for o in overrides if override_key(o) != "verify" and not override_key(o).startswith("verify.")]
    if builtin_loop and steps is not None:
        kept = with_override(kept, "trainer.max_steps", steps)
    if every_steps:
        kept = with_override(kept, "checkpoint.every_steps", every_steps)
    return kept


def stop_steps(total: int, stops: int, rng: random.Random) -> list[int]:
    """`stops` distinct steps in the first two thirds of a run of `total` steps, drawn at random,
    ascending: signals sent there land before the run ends, even some steps late."""
    last = max(1, (2 * total) // 3)
    candidates = list(range(1, last + 1))
    return sorted(rng.sample(candidates, min(stops, len(candidates))))


def run_once(plan: VerifyPlan, runs: Runs, run_dir: Path) -> int:
    """An uninterrupted run of the job into `run_dir`; its exit code."""
    return runs.start(plan.overrides, plan.script_args, run_dir).wait()


def stop_at(runs: Runs, run_dir: Path, launch: Launch, step: int) -> bool:
    """A real stop signal to every rank once the run logged `step`; False: it ended first."""
    if not wait_until(lambda: logged_step(run_dir) >= step, launch):
        return False
    return wait_until(lambda: runs.signal(run_dir, "stop"), launch)


def kill_after_save(runs: Runs, run_dir: Path, launch: Launch, after: int, total: int) -> tuple[int, int] | None:
    """SIGKILL to every rank once a periodic save after step `after` and before the run's last
    committed: the step of that save and the start events seen before the kill (None: the run
    ended first)."""
    if not wait_until(lambda: any(after < s < total for s in committed(run_dir)), launch):
        return None
    saved, seen = max(s for s in committed(run_dir) if s < total), seen_events(run_dir, "kill")
    return (saved, seen) if wait_until(lambda: runs.signal(run_dir, "KILL"), launch) else None


def interrupted_run(plan: VerifyPlan, runs: Runs, run_dir: Path, total: int) -> Interrupted:
    """The job stopped at random steps and killed after a periodic save, resumed after each as a
    requeue would, until it completes. A signal that comes as the run completes counts for
    nothing: the run completed."""
    rng = random.Random(plan.seed)
    record = Interrupted()
    launch = runs.start(plan.overrides, plan.script_args, run_dir)
    for drawn in stop_steps(total, plan.stops, rng):
        target = max(drawn, (record.resumes[-1] if record.resumes else 0) + 1)  # an earlier stop landed past it: the next step
        if target >= total:
            break
        seen = seen_events(run_dir, "stop")
        went = runs.went_on(run_dir, launch, "stop", seen) if stop_at(runs, run_dir, launch, target) else None
        if went is None:
            record.events.append(f"the run completed before the stop after step {target} landed")
            return finished(launch, record)
        launch, resumed = went
        record.events.append(f"stopped at step {resumed} (signal after step {target})")
        record.resumes.append(resumed)
    if plan.kill:
        killed = kill_after_save(runs, run_dir, launch, record.resumes[-1] if record.resumes else 0, total)
        went = runs.went_on(run_dir, launch, "kill", killed[1]) if killed is not None else None
        if killed is None or went is None:
            record.events.append("the run completed before a periodic save to kill it after" if killed is None else "the run completed before the kill landed")
            return finished(launch, record)
        launch, resumed = went
        record.events.append(f"killed (SIGKILL) after the save at step {killed[0]}")
        record.resumes.append(resumed)
    return finished(launch, record)


def finished(launch: Launch, record: Interrupted) -> Interrupted:
    """The interrupted run's last start, ended: it must have completed."""
    code = launch.wait()
    if code != 0:
        raise VerifyFailure(f"the interrupted run's last start ended with code {code}: {launch.tail()}")
    return record


def step_losses(run_dir: Path) -> Losses:
    """steps.jsonl's last losses of each step (every figure named *loss*: a GAN logs two; steps
    re-run after a kill log again)."""
    losses = {}
    for row in read_jsonl(RunDir(run_dir).steps):
        if "step" in row:
            losses[int(row["step"])] = tuple(sorted((k, v) for k, v in row.items() if "loss" in k and isinstance(v, int | float)))
    return losses


def validation_figures(run_dir: Path) -> Losses:
    """metrics.jsonl's validation figures (val_*) by the step they were taken at, the last of each."""
    figures = {}
    for row in read_jsonl(RunDir(run_dir).metrics):
        found = tuple(sorted((k, v) for k, v in row.items() if k.startswith("val_") and isinstance(v, int | float)))
        if found and "step" in row:
            figures[int(row["step"])] = found
    return figures


def loss_text(losses: Losses, step: int) -> str:
    found = losses.get(step)
    return "not logged" if found is None else ", ".join(f"{k} {v!r}" for k, v in found) or "no loss"


@dataclass(frozen=True)
class RunRecord:
    """What a finished run left that the verifier compares, read once: every leaf of its final
    checkpoint, its buffers' names, its losses and validation figures by step."""

    state: dict[str, Any]
    buffers: list[str]
    losses: Losses
    validation: Losses

    @classmethod
    def read(cls, run_dir: Path) -> RunRecord:
        state, buffers = final_state(run_dir)
        return cls(state, buffers, step_losses(run_dir), validation_figures(run_dir))


@dataclass(frozen=True)
class RunComparison:
    """The comparison of one run with the reference: the first step whose losses differ and the
    final state's differing leaves (both None/empty: exact), and the two runs compared."""

    first_step: int | None
    differing: list[str]
    compared: int
    tensors: int
    reference: RunRecord
    other: RunRecord
    first_validation: int | None = None  # the first step whose validation figures differ

    @property
    def exact(self) -> bool:
        return self.first_step is None and not self.differing and self.first_validation is None


def compare_runs(reference: RunRecord, other: RunRecord) -> RunComparison:
    diff = compare_states(reference.state, other.state)
    losses = first_divergence(reference.losses, other.losses)
    validation = first_divergence(reference.validation, other.validation)
    return RunComparison(losses, diff.differing, diff.compared, diff.tensors, reference, other, validation)


def failure_text(outcome: RunComparison, resumes: list[int]) -> str:
    """What follows `verify: FAIL`: ` at step N: losses ... against ...; which leaves differ, by
    kind; the likely cause` (`: every step's loss is equal ...` where only the final state differs)."""
    parts = []
    step, ref, got = outcome.first_step, outcome.reference, outcome.other
    if step is not None:
        parts.append(f"{loss_text(got.losses, step)} against {loss_text(ref.losses, step)} uninterrupted")
    elif outcome.first_validation is not None:
        at = outcome.first_validation
        figures = f"{loss_text(got.validation, at)} against {loss_text(ref.validation, at)} uninterrupted"
        parts.append(f"every step's loss is equal, but the validation at step {at} differs: {figures}")
    else:
        parts.append("every step's loss is equal, but the final state differs")
    kinds = [kind_of(name, ref.buffers) for name in outcome.differing]
    if outcome.differing:
        shown = ", ".join(f"{name} ({kind})" for name, kind in list(zip(outcome.differing, kinds, strict=True))[:6])
        more = f" and {len(outcome.differing) - 6} more" if len(outcome.differing) > 6 else ""
        parts.append(f"{len(outcome.differing)} of {outcome.compared} leaves of the final checkpoint differ: {shown}{more}")
    parts.append(hint(step, resumes, kinds))
    return (f" at step {step}: " if step is not None else ": ") + "; ".join(parts)


def verify_paths(run_root: str) -> Path:
    """RUN_ROOT/verify/DATE/TIME: a folder of the verifier's own, never an existing run dir."""
    now = time.time()
    stamp = time.strftime("%Y-%m-%d/%H-%M-%S", time.localtime(now)) + f"-{int(now * 1e6) % 1_000_000:06d}"
    root = Path(run_root).absolute() / "verify" / stamp
    root.mkdir(parents=True, exist_ok=False)
    return root


def verify_resume(plan: VerifyPlan, is_script: bool) -> int:
    """Run, interrupt, resume and compare; print what happened and the verdict; the exit code.
    A Ctrl-C (or SIGTERM) stops the runs under way and judges nothing (exit 130)."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    runs = runs_for(plan.queued_on)
    try:
        return verified(plan, runs, is_script)
    except KeyboardInterrupt:
        runs.abandon()
        return verdict(f"verify: interrupted: its runs were stopped, nothing was judged ({plan.root})", 130)
    finally:
        signal.signal(signal.SIGTERM, previous)


def verified(plan: VerifyPlan, runs: Runs, is_script: bool) -> int:
    reference, interrupted = plan.root / "reference", plan.root / "interrupted"
    print(f"verify: runs under {plan.root}", flush=True)
    began = time.perf_counter()
    code = run_once(plan, runs, reference)
    if code != 0:
        return verdict(f"verify: FAIL: the uninterrupted run ended with code {code}: {Launch.tail_of(reference.with_suffix('.log'))}", 1)
    if not committed(reference):
        what = "the script keeps no state through the run handle (hpc.run.start_run)" if is_script else "the run left no committed checkpoint"
        return verify_cannot(f"{what}: only the run handle's state can be compared (checkpoint.enabled must be true)")
    uninterrupted = RunRecord.read(reference)
    total = max(uninterrupted.losses, default=0) or max(committed(reference))
    print(f"verify: uninterrupted: {total} steps in {time.perf_counter() - began:.1f} s", flush=True)
    try:
        record = interrupted_run(plan, runs, interrupted, total)
    except VerifyFailure as err:
        return verdict(f"verify: FAIL: {err}", 1)
    print(f"verify: interrupted: {'; '.join(record.events) or 'no interruption landed'}", flush=True)
    outcome = compare_runs(uninterrupted, RunRecord.read(interrupted))
    if outcome.exact:
        if not record.resumes:
            return verdict(f"verify: INCONCLUSIVE: no stop or kill landed before the run ended ({total} steps); give more steps (verify.steps=)", 1)
        return verdict(f"verify: PASS: {passed(record, outcome)}", 0)
    return judged_again(plan, runs, outcome, record)


def judged_again(plan: VerifyPlan, runs: Runs, outcome: RunComparison, record: Interrupted) -> int:
    """Not exact: a second uninterrupted run tells what the job itself does not reproduce. Its
    losses or weights: not deterministic, nothing judged. RNG streams the job never seeds (a
    script that leaves Python's or numpy's alone): left out, and the rest judged."""
    again = plan.root / "again"
    code = run_once(plan, runs, again)
    if code != 0:
        return verdict(f"verify: FAIL: a second uninterrupted run ended with code {code}: {Launch.tail_of(again.with_suffix('.log'))}", 1)
    twice = compare_runs(outcome.reference, RunRecord.read(again))
    unseeded = [name for name in twice.differing if kind_of(name, outcome.reference.buffers) == "an RNG stream"]
    if twice.first_step is not None or len(unseeded) < len(twice.differing):
        where = f"at step {twice.first_step}" if twice.first_step is not None else f"in {len(twice.differing)} leaves of the final state"
        return verdict(
            f"verify: NOT DETERMINISTIC: two uninterrupted runs differ {where}: bit-exactness cannot hold for this job (a non-deterministic "
            "kernel, data order or unseeded draw; on GPUs trainer.deterministic=true); the resume was not judged",
            1,
        )
    left = [name for name in outcome.differing if name not in set(unseeded)]
    judged = dataclasses.replace(outcome, differing=left, compared=outcome.compared - len(unseeded))
    if judged.exact and record.resumes:
        unjudged = f"RNG streams the job never seeds differ between any two runs: {streams(unseeded)}, not compared"
        return verdict(f"verify: PASS: {passed(record, judged)} ({unjudged})", 0)
    return verdict(f"verify: FAIL{failure_text(judged, record.resumes)}", 1)


def passed(record: Interrupted, outcome: RunComparison) -> str:
    return (
        f"{', '.join(record.events)}; every step's loss, every validation figure and all {outcome.compared} leaves of the final checkpoint "
        f"({outcome.tensors} tensors) equal the uninterrupted run's bit for bit"
    )


def streams(names: list[str]) -> str:
    """`rank 0's python, numpy`: the unseeded streams by rank, for the PASS line."""
    found: dict[str, list[str]] = {}
    for name in names:
        where, leaf = name.split(":", 1)
        stream = leaf.split(".", 1)[1].split("[", 1)[0] if "." in leaf else leaf
        found.setdefault(where, [])
        if stream not in found[where]:
            found[where].append(stream)
    return "; ".join(f"{where}: {', '.join(kinds)}" for where, kinds in found.items())


def verify_cannot(why: str) -> int:
    return verdict(f"verify: cannot compare: {why}", 2)


def verdict(line: str, code: int) -> int:
    print(line, flush=True)
    return code
