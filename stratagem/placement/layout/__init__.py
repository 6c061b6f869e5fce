"""Where this process's tensors live: mirror copies, tensor-parallel shards, pipeline stages, FSDP2 units.

:mod:`.mirrored` keeps a copy of every variable per local replica (:mod:`.mirrored_dict`);
:mod:`.roots` is the base of the layouts that take whole models created in scope:
:mod:`.tensor_parallel` (a plan over a mesh's model axis), :mod:`.fully_sharded` (ZeRO-3's FSDP2
units over the workers), :mod:`.pipeline` (stages over a pipe axis: :mod:`.pipeline_plan`,
:mod:`.pipeline_schedule`, :mod:`.pipeline_trace`, :mod:`.pipeline_balance`, :mod:`.recompute`;
its layout parts in mesh order: :mod:`.stages` cuts the model, then on a 3-D mesh the
tensor-parallel and FSDP2 parts place this process's stages). :mod:`stratagem.placement.dtensor_state`
(shared with the data axis) reads and writes the state of DTensor parameters whole.
"""
