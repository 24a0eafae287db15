"""Atomic save and resume: model weights, optimizer, scheduler, RNG, data position, step.

Layout of a checkpoint directory:

    ckpt_dir/
      latest                 text file: name of the newest complete checkpoint
      step-000100/           model.save_pretrained output (loads with from_pretrained)
        config.json, model.safetensors, ...
        trainer_state.pt     optimizer, scheduler, RNG states, step, user `state`
      step-000200/

    path = save_checkpoint(ckpt_dir, step, model=model, optimizer=opt, scheduler=sched,
                           state={"data_position": 1234})
    ...
    if (path := latest_checkpoint(ckpt_dir)) is not None:
        state = load_checkpoint(path, model=model, optimizer=opt, scheduler=sched)
        start_step, data_position = state["step"], state["data_position"]

Atomicity: everything is written into a hidden temporary sibling (`.tmp-step-...`),
fsynced, and renamed into place, so a `step-*` directory is always complete; a crash
leaves only a temp directory, which `latest_checkpoint` never returns. Saving is meant
for one process (rank 0); the temp directories of crashed saves are removed by the next
save that prunes.

`trainer_state.pt` is a pickle (it holds numpy RNG state and arbitrary user state), so
load only checkpoints you wrote yourself.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tamer.models import quiet_progress
from tamer.models.lora import ADAPTER_WEIGHTS, DEFAULT, is_lora, set_adapter_state
from tamer.storage import as_storage_error, fsync_dir, fsync_tree

TRAINER_STATE = "trainer_state.pt"
LATEST = "latest"
TORCH_WEIGHTS = "model.pt"  # for models without save_pretrained
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"  # sharded save_pretrained output
TMP_PREFIX = ".tmp-"
STEP_DIR = re.compile(r"^step-(\d{6,})$")
FORMAT_VERSION = 1


class CheckpointError(Exception):
    """A checkpoint directory is missing, incomplete or does not match the model."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files exist but cannot be read (truncated, garbled)."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


# ---------------------------------------------------------------------------- saving


def save_checkpoint(
    ckpt_dir: str | Path,
    step: int,
    *,
    model: Any,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    state: dict | None = None,
    keep_last: int | None = 2,
    tokenizer: Any = None,
) -> Path:
    """Write `ckpt_dir/step-{step:06d}/` atomically, point `latest` at it, prune old ones.

    `state` is any picklable dict (data position, best score, ...); `tokenizer`, when
    given, is saved alongside so the directory is a self-contained HF model.
    `keep_last=None` keeps every checkpoint. Returns the final directory.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / step_dir_name(step)
    tmp = ckpt_dir / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        _save_model(_unwrap(model), tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        trainer_state = _trainer_state(step, optimizer, scheduler, state)
        torch.save(trainer_state, tmp / TRAINER_STATE)
        fsync_tree(tmp)
        _publish(tmp, final)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        translated = as_storage_error(err, final, "a checkpoint")  # disk full -> one line
        if translated is err:
            raise
        raise translated from err
    _write_latest(ckpt_dir, final.name)
    if keep_last is not None:
        _prune(ckpt_dir, keep_last, keep=final)
    return final


def _unwrap(model: Any) -> Any:
    """Strip DDP and torch.compile wrappers so saved keys have no `module.`/`_orig_mod.` prefix."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def _save_model(model: Any, out: Path) -> None:
    if is_lora(model):  # the policy adapter only: the frozen base is rebuilt from the run's config
        with quiet_progress():
            model.save_pretrained(out, selected_adapters=[DEFAULT])
    elif hasattr(model, "save_pretrained"):
        with quiet_progress():
            model.save_pretrained(out)
    else:
        torch.save(model.state_dict(), out / TORCH_WEIGHTS)


def _trainer_state(step: int, optimizer: Any, scheduler: Any, state: dict | None) -> dict:
    return {
        "format": FORMAT_VERSION,
        "step": step,
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "state": dict(state or {}),
        "rng": _capture_rng(),
    }


def _capture_rng() -> dict:
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def _publish(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; an existing `final` (re-saving a step) is swapped out first."""
    old = None
    if final.exists():
        # rename() cannot replace a non-empty directory, so move the old one aside.
        old = final.with_name(f"{TMP_PREFIX}old-{final.name}-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_latest(ckpt_dir: Path, name: str) -> None:
    tmp = ckpt_dir / f"{TMP_PREFIX}{LATEST}-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt_dir / LATEST)
    fsync_dir(ckpt_dir)


def _prune(ckpt_dir: Path, keep_last: int, keep: Path) -> None:
    """Delete all but the `keep_last` highest steps (never `keep`) and crashed temp dirs."""
    steps = sorted(_step_dirs(ckpt_dir), key=lambda p: _step_of(p))
    for path in steps[:-keep_last]:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)
    for path in ckpt_dir.glob(f"{TMP_PREFIX}*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------- finding


def _step_dirs(ckpt_dir: Path) -> list[Path]:
    return [p for p in ckpt_dir.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]


def _step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))  # type: ignore[union-attr]


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The newest complete checkpoint in `ckpt_dir`, or None if there is none.

    Follows the `latest` pointer (the most recent save, even if a run went back to an
    earlier step); if it is missing or stale, falls back to the highest complete step.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return None
    pointer = ckpt_dir / LATEST
    if pointer.is_file():
        target = ckpt_dir / pointer.read_text(encoding="utf-8").strip()
        if STEP_DIR.match(target.name) and (target / TRAINER_STATE).is_file():
            return target
    complete = [p for p in _step_dirs(ckpt_dir) if (p / TRAINER_STATE).is_file()]
    return max(complete, key=_step_of, default=None)


# ---------------------------------------------------------------------------- loading


def load_checkpoint(
    path: str | Path,
    *,
    model: Any,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    restore_rng: bool = True,
) -> dict:
    """Load a `step-*` directory into `model` (in place), `optimizer` and `scheduler`.

    Returns the saved `state` dict with "step" added. Raises CheckpointError naming the
    path if it is missing, incomplete, or its weights do not fit the model.
    """
    path = Path(path)
    state_file = path / TRAINER_STATE
    if not state_file.is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (no {TRAINER_STATE}); "
                              "use latest_checkpoint(ckpt_dir) to find one")
    try:
        # weights_only=False: the file holds numpy RNG state and arbitrary user state.
        saved = torch.load(state_file, map_location="cpu", weights_only=False)
    except Exception as err:
        raise CorruptCheckpointError(f"{state_file}: cannot be read ({err})") from err
    _load_model(path, _unwrap(model))
    _restore_component(path, "optimizer", optimizer, saved)
    _restore_component(path, "scheduler", scheduler, saved)
    if restore_rng:
        _restore_rng(saved["rng"])
    return {**saved["state"], "step": saved["step"]}


def load_weights(path: str | Path, model: Any) -> None:
    """Load the weights of a saved model or checkpoint directory into `model`, in place."""
    _load_model(Path(path), _unwrap(model))


def _restore_component(path: Path, name: str, obj: Any, saved: dict) -> None:
    if obj is None:
        return  # e.g. loading for evaluation only
    if saved.get(name) is None:
        raise CheckpointError(f"{path}: a {name} was passed but the checkpoint has no {name} state")
    obj.load_state_dict(saved[name])


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Tensors saved by `_save_model`: single or sharded safetensors, or a torch state_dict."""
    from safetensors.torch import load_file

    try:
        if (path / SAFETENSORS).is_file():
            return load_file(path / SAFETENSORS)
        if (path / SAFETENSORS_INDEX).is_file():
            index = json.loads((path / SAFETENSORS_INDEX).read_text(encoding="utf-8"))
            tensors: dict[str, torch.Tensor] = {}
            for shard in sorted(set(index["weight_map"].values())):
                tensors.update(load_file(path / shard))
            return tensors
        if (path / TORCH_WEIGHTS).is_file():
            return torch.load(path / TORCH_WEIGHTS, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CorruptCheckpointError(f"{path}: model weights cannot be read ({err})") from err
    raise CheckpointError(f"{path}: no model weights ({SAFETENSORS}, {SAFETENSORS_INDEX} or {TORCH_WEIGHTS})")


def _load_model(path: Path, model: Any) -> None:
    if is_lora(model) or (path / ADAPTER_WEIGHTS).is_file():
        return _load_adapter(path, model)
    tensors = _read_weights(path)
    # strict=False because save_pretrained drops tied copies (lm_head == embed_tokens);
    # anything else missing or extra means the checkpoint is for another model.
    result = model.load_state_dict(tensors, strict=False)
    untied = [k for k in result.missing_keys if k not in _tied_keys(model, set(tensors))]
    if untied or result.unexpected_keys:
        raise CheckpointError(
            f"{path}: weights do not match the model; missing {untied[:5]}"
            f"{'...' if len(untied) > 5 else ''}, unexpected {result.unexpected_keys[:5]}"
        )


def _load_adapter(path: Path, model: Any) -> None:
    """A LoRA checkpoint into a LoRA model: the adapter's weights (the base is the run's own)."""
    from safetensors.torch import load_file

    if not is_lora(model):
        raise CheckpointError(f"{path}: holds a LoRA adapter but the model has none; set model.lora as the run "
                              "that wrote it did")
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise CheckpointError(f"{path}: holds no LoRA adapter ({ADAPTER_WEIGHTS}) but the model is a LoRA model; "
                              "set model.lora as the run that wrote it did")
    try:
        tensors = load_file(path / ADAPTER_WEIGHTS)
    except Exception as err:
        raise CorruptCheckpointError(f"{path}: adapter weights cannot be read ({err})") from err
    try:
        missing, unexpected = set_adapter_state(model, tensors)
    except RuntimeError as err:  # a shape mismatch: another rank or model
        raise CheckpointError(f"{path}: the adapter does not fit the model ({str(err).splitlines()[0][:200]})") from err
    if missing or unexpected:
        raise CheckpointError(f"{path}: the adapter does not match the model; missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")


def _tied_keys(model: torch.nn.Module, loaded: set[str]) -> set[str]:
    """Parameter names that share storage with a parameter present in `loaded`."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    tied: set[str] = set()
    for names in aliases.values():
        if len(names) > 1 and any(n in loaded for n in names):
            tied.update(n for n in names if n not in loaded)
    return tied


def _restore_rng(rng: dict) -> None:
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    cuda_states = rng.get("cuda")
    if cuda_states and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if count != len(cuda_states):
            warnings.warn(f"checkpoint has CUDA RNG states for {len(cuda_states)} devices, "
                          f"this process sees {count}; restoring the first {min(count, len(cuda_states))}",
                          stacklevel=2)
        for device, cuda_state in enumerate(cuda_states[:count]):
            torch.cuda.set_rng_state(cuda_state, device)
