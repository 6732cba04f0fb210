"""Before a job runs: will its checkpoints fit where it writes them? Login-node code, no torch.

A read-only run root (or checkpoint.uri given as a path) is refused: every rank's first write
would fail. Free space below what the job's checkpoints take (keep + 1 in flight, each about the
model's weights and optimizer state, where the toolkit knows the model: the built-in ones) is a
warning line, not a refusal: a cluster's scratch is often freed by others while a job waits.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from hpc.config.schema import JobConfig
from hpc.errors import UserError
from trainers.data.datasets import DatasetInfo
from trainers.faults import mount_point, size_text

RESNET50_BODY = 23_508_032 + 53_173  # torchvision's resnet50 without its final layer (2048 x classes + classes), and its BatchNorm statistics


def mlp_parameters(in_features: int, hidden: list[int], classes: int) -> int:
    count = 0
    for width in [*hidden, classes]:
        count += in_features * width + width
        in_features = width
    return count


def model_parameters(name: str, hidden: list[int], channels: list[int], input_shape: tuple[int, ...], classes: int) -> int | None:
    """The parameter and buffer count of a built-in model (trainers.models.build_model's); None
    for a model it does not know."""
    if name == "mlp":
        return mlp_parameters(math.prod(input_shape), hidden, classes)
    if name == "cnn" and len(input_shape) == 3:
        count, current = 0, input_shape[0]
        for out in channels or [32]:
            count += current * out * 9 + out + 4 * out + 1  # conv weight and bias, BatchNorm's affine and statistics
            current = out
        return count + mlp_parameters(current * (input_shape[1] // 2) * (input_shape[2] // 2), hidden, classes)
    if name == "resnet50" and len(input_shape) == 3:
        return RESNET50_BODY + (input_shape[0] - 3) * 64 * 49 + 2048 * classes + classes
    return None


def checkpoint_bytes(parameters: int, optimizer: str) -> int:
    """A checkpoint of a model of `parameters` float32 values: the weights and the optimizer's
    state per weight (SGD's momentum: one, AdamW's moments: two)."""
    slots = 2 if "adam" in optimizer.lower() else 1
    return 4 * parameters * (1 + slots)


def read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(mount_point(path)).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def free_bytes(path: Path) -> int | None:
    try:
        found = os.statvfs(mount_point(path))
    except OSError:
        return None
    return found.f_bavail * found.f_frsize


def check_space(key: str, where: str, each: int | None, keep: int) -> str | None:
    """Refuses a read-only `where`; the warning line when its free space is below `keep` + 1
    checkpoints of `each` bytes (None: fits, or the size is not known)."""
    path = Path(where).expanduser().absolute()
    if read_only(path):
        raise UserError(f"{key}={where}: the file system at {mount_point(path)} is read-only; choose a writable {key}")
    free = free_bytes(path)
    if each is None or free is None or free >= (keep + 1) * each:
        return None
    need = (keep + 1) * each
    return (
        f"warning: {key}={where}: {size_text(free)} free on {mount_point(path)}, the job's checkpoints take about {size_text(need)} "
        f"({keep} kept + 1 being written, about {size_text(each)} each); the run will stop with 'no space left' when it is full"
    )


def space_warnings(job: JobConfig, info: DatasetInfo | None) -> list[str]:
    """check_space for the job's run root and, when it is a path, checkpoint.uri (where the
    checkpoints then go); the warning lines (none: fits, or the size is not known)."""
    each = None
    if info is not None and job.script is None:  # the built-in classify task: the model is known
        count = model_parameters(job.model.name, list(job.model.hidden_sizes), list(job.model.channels), info.input_shape, info.num_classes)
        each = checkpoint_bytes(count, job.optim.name) if count is not None else None
    uri = job.checkpoint.uri
    local_uri = uri is not None and "://" not in uri
    found = [check_space("run_root", job.run_root, None if local_uri else each, job.checkpoint.keep)]
    if local_uri:
        found.append(check_space("checkpoint.uri", str(uri), each, job.checkpoint.keep))
    return [line for line in found if line]
