"""Orbax checkpoints of a training run: the train state (params, optimizer state, step, rng) and
the grain iterator state, saved together, asynchronously, atomically, keeping the last N.

Layout: RUN_DIR/checkpoints/<step>/{state, data}. Restoring takes an abstract state whose leaves
carry the target shardings, so a checkpoint restores onto a different mesh shape.
"""
from __future__ import annotations

from pathlib import Path

import grain
import jax
import orbax.checkpoint as ocp

from dflash_jax._errors import CheckpointError  # a run directory with no checkpoint, or one that cannot be restored
from train.step import TrainState


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir).absolute() / "checkpoints"


def make_manager(run_dir: str | Path, keep: int = 3, async_save: bool = True) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
    return ocp.CheckpointManager(checkpoint_dir(run_dir), options=options)


def _state_tree(state: TrainState) -> dict:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state, "rng": state.rng}


def save(manager: ocp.CheckpointManager, state: TrainState, iterator, *, force: bool = False) -> None:
    """Start saving (returns before the write finishes when async; the step dir appears atomically)."""
    step = int(jax.device_get(state.step))
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_state_tree(state)),
                                               data=grain.checkpoint.CheckpointSave(iterator)), force=force)


def _restore(manager: ocp.CheckpointManager, step: int | None, **items):
    step = manager.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint to resume from in {manager.directory}")
    steps = sorted(manager.all_steps())
    if step not in steps:
        raise CheckpointError(f"{manager.directory} has no checkpoint of step {step}; its steps: "
                              f"{', '.join(map(str, steps)) or 'none'}")
    try:
        return step, manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax raises many types for unreadable directories
        raise CheckpointError(f"checkpoint {manager.directory}/{step} cannot be restored (corrupt, "
                              f"incomplete, or written by a different config): {type(e).__name__}: {e}") from e


def restore(manager: ocp.CheckpointManager, abstract_state: TrainState, iterator, step: int | None = None):
    """-> (state placed by the shardings of abstract_state's leaves, iterator at the saved position)."""
    _, restored = _restore(manager, step, state=ocp.args.StandardRestore(_state_tree(abstract_state)),
                           data=grain.checkpoint.CheckpointRestore(iterator))
    return TrainState(**restored["state"]), restored["data"]


def restore_params(run_dir: str | Path, step: int | None = None) -> tuple[int, dict]:
    """(step, trainable params as host numpy) from a run directory, for export."""
    with ocp.CheckpointManager(checkpoint_dir(run_dir)) as manager:  # closed: its threads end here
        step, restored = _restore(manager, step, state=ocp.args.StandardRestore())
        return step, jax.device_get(restored["state"]["params"])
