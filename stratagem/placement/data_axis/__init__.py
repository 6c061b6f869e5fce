"""The data axis: gradients summed over it, the step's order, and the update rules.

:mod:`.axis` is the data axis of every synchronous placement (:class:`~.axis.DataAxis`: what the
placement hands its optimizers' methods and ``no_sync`` to) and the collective of a mesh's data
axis (:class:`~.axis.AxisCollective`); :mod:`.gradient_sync` sums the replicas' gradients when
backward ends (the gradient contract); :mod:`.step` is the order of one optimizer step, written once; the update rule
(:mod:`.update_rule`) applies the update and keeps the optimizer's state: :mod:`.mirrored_update`,
:mod:`.central` (central storage), :mod:`.zero` (ZeRO 1/2; its ranges, over the workers or a pipeline's
data axis, in :mod:`.zero_ranges` and :mod:`.sharded_update`), :mod:`.local_update` (torch's own over the
shards a process holds) and a pipeline's :mod:`.pipeline_optimizers`. :mod:`.buffers` averages the
floating buffers over the workers at each step.
"""
