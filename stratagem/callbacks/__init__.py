"""Callbacks: hooks a training loop calls, with Keras's names and arguments.

A Keras-style ``fit`` calls every callback's hooks; a custom loop calls the ones it needs.

- :class:`Callback` -- the base class (``base.py``);
- :class:`BackupAndRestore` -- a job killed and restarted resumes from its last backup;
- :class:`ModelCheckpoint` -- save every epoch, every N steps, or the best by a monitored value;
- :class:`EarlyStopping` -- stop when a monitored value stops improving, on every worker at once;
- :class:`LearningRateScheduler` -- set the learning rate at the start of every epoch;
- :class:`CSVLogger` -- one CSV row per epoch;
- :class:`LambdaCallback` -- functions called at the hooks;
- :class:`TensorBoard` -- scalar summaries for TensorBoard.

In a multi-worker job every worker runs every callback; files and summaries are written
by the chief (worker 0) only, and decisions (stop, save) are the chief's, sent to all.
"""

from stratagem.callbacks.backup import BackupAndRestore
from stratagem.callbacks.base import Callback
from stratagem.callbacks.checkpoint import ModelCheckpoint
from stratagem.callbacks.csv_logger import CSVLogger
from stratagem.callbacks.early_stopping import EarlyStopping
from stratagem.callbacks.lambda_callback import LambdaCallback
from stratagem.callbacks.schedule import LearningRateScheduler
from stratagem.callbacks.tensorboard import TensorBoard

__all__ = ["BackupAndRestore", "CSVLogger", "Callback", "EarlyStopping", "LambdaCallback", "LearningRateScheduler", "ModelCheckpoint",
           "TensorBoard"]
