"""``BackupAndRestore``: a job killed and started again carries on from its last backup.

The final parameters equal those of a job that was never stopped.
"""

from __future__ import annotations

import os
from pathlib import Path

from stratagem.callbacks.base import Callback
from stratagem.callbacks.checkpoint import check_save_freq
from stratagem.errors import InvalidArgumentError
from stratagem.checkpoint.checkpoint import Checkpoint
from stratagem.checkpoint.manager import CheckpointManager

__all__ = ["BackupAndRestore"]

_COUNTERS = ("backup_epoch", "backup_step", "backup_steps_total")


class BackupAndRestore(Callback):
    """Back up the training state every epoch or every ``save_freq`` steps; resume from it.

    Give it the state as an :class:`sg.Checkpoint <stratagem.Checkpoint>` (model,
    optimizer, the distributed dataset for an exact input position, ...): ``restore``
    returns ``(epoch, step_in_epoch)`` to start from -- ``(0, 0)`` on a fresh start. Then
    call ``on_train_batch_end()`` after every step and ``on_epoch_end(epoch)`` after every
    epoch; ``on_train_end()`` deletes the backup when ``delete_checkpoint`` (a finished job
    restarted then starts over). The backups are ``backup-<n>`` in ``backup_dir``; the
    newest two are kept, so a backup found corrupt falls back to the one before (a warning).

    Example::

        import tempfile, torch, stratagem as sg
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        backup = sg.callbacks.BackupAndRestore(tempfile.mkdtemp(), save_freq=2)
        start_epoch, start_step = backup.restore(sg.Checkpoint(model=model, optimizer=optimizer))
        for epoch in range(start_epoch, 2):
            for step in range(3):
                optimizer.zero_grad()
                model(torch.ones(4, 2)).sum().backward()
                optimizer.step()
                backup.on_train_batch_end(step)
            backup.on_epoch_end(epoch)
        backup.on_train_end()
    """

    def __init__(self, backup_dir: "str | os.PathLike", save_freq: "str | int" = "epoch",
                 delete_checkpoint: bool = True, *, checkpoint: Checkpoint | None = None):
        super().__init__()
        check_save_freq(save_freq, "BackupAndRestore")
        self.backup_dir = Path(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = bool(delete_checkpoint)
        self.checkpoint = checkpoint
        self.epoch = 0            # the epoch in progress (or the next to begin)
        self.step = 0             # steps done in it
        self._steps_total = 0     # steps done since the job began (for save_freq in steps)
        self._state: Checkpoint | None = None
        self._manager: CheckpointManager | None = None

    def restore(self, checkpoint: Checkpoint | None = None) -> tuple[int, int]:
        """Restore the newest backup into ``checkpoint``'s objects; return ``(epoch, step_in_epoch)``."""
        if checkpoint is not None:
            if not isinstance(checkpoint, Checkpoint):
                raise InvalidArgumentError(f"BackupAndRestore.restore takes an sg.Checkpoint, got "
                                           f"{type(checkpoint).__name__}")
            self.checkpoint = checkpoint
        if self.checkpoint is None:
            raise InvalidArgumentError("BackupAndRestore needs the training state to back up: "
                                       "backup.restore(sg.Checkpoint(model=..., optimizer=..., data=...))")
        taken = [name for name in _COUNTERS if name in self.checkpoint.trackables]
        if taken:
            raise InvalidArgumentError(f"BackupAndRestore keeps its own {', '.join(taken)}; rename that "
                                       f"entry of your Checkpoint")
        self._state = Checkpoint(**self.checkpoint.trackables, **{name: 0 for name in _COUNTERS})
        self._manager = CheckpointManager(self._state, self.backup_dir, max_to_keep=2, checkpoint_name="backup")
        # the counters are those of the backup found, else a fresh start: a callback given to a second fit
        # after the first deleted its backup trains again (it kept the first fit's last epoch, and skipped them all)
        self.epoch = self.step = self._steps_total = 0
        if self._manager.restore_or_initialize() is not None:
            self.epoch, self.step = self._state.backup_epoch, self._state.backup_step
            self._steps_total = self._state.backup_steps_total
            for name, value in self._state.trackables.items():   # ints live in the user's checkpoint
                if isinstance(value, int) and name not in _COUNTERS:
                    setattr(self.checkpoint, name, value)
        return self.epoch, self.step

    def save(self) -> str:
        """Write a backup now (every worker calls it); return its path."""
        if self._manager is None or self._state is None:
            raise InvalidArgumentError("call backup.restore(checkpoint) (or on_train_begin) before training")
        for name, value in self.checkpoint.trackables.items():
            if isinstance(value, int):
                setattr(self._state, name, value)
        self._state.backup_epoch, self._state.backup_step = self.epoch, self.step
        self._state.backup_steps_total = self._steps_total
        return self._manager.save()

    # ------------------------------------------------------------ the hooks

    def reads_train_batch_logs(self) -> bool:
        return False   # it counts the steps


    def on_train_begin(self, logs: dict | None = None) -> None:
        if self._manager is None:
            self.restore()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if epoch != self.epoch:   # a new epoch (the restored one keeps its step count)
            self.epoch, self.step = epoch, 0

    def on_train_batch_end(self, batch: int | None = None, logs: dict | None = None) -> None:
        self.step += 1
        self._steps_total += 1
        if self.save_freq != "epoch" and self._steps_total % self.save_freq == 0:
            self.save()

    def on_epoch_end(self, epoch: int | None = None, logs: dict | None = None) -> None:
        self.epoch = (self.epoch if epoch is None else epoch) + 1
        self.step = 0
        if self.save_freq == "epoch":
            self.save()

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.delete_checkpoint and self._manager is not None:
            self._manager.delete_all()
