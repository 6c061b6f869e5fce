"""What a strategy's scope does while it is open: hooks, the Placement interface, the unscoped checks.

:mod:`.hooks` hands every module, optimizer and ``GradScaler`` created in a scope to the
strategy's placement (:class:`~.base.Placement`, the interface every placement implements);
:mod:`.unscoped` refuses optimizers created outside every scope inside a multi-replica ``run``;
:mod:`.clipping` routes ``clip_grad_norm_`` to the placements that split gradients;
:mod:`.grad_scaler`, :mod:`.sync_batch_norm` and :mod:`.learning_rate` adapt torch's
``GradScaler``, ``SyncBatchNorm`` and optimizers created in scope.
"""
