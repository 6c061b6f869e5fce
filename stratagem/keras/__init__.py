"""The Keras layer: ``sg.Model`` with ``compile`` / ``fit`` / ``evaluate`` / ``predict`` over any strategy.

- ``model.py`` -- :class:`~stratagem.Model`; ``steps.py`` -- the functions it runs per replica
  (``pipeline_steps.py`` under a pipeline); ``epochs.py`` -- the synchronous loops over
  ``strategy.run`` (the parameter-server loop is ``stratagem/ps/fit_loop.py``);
  ``inputs.py`` -- what the loops accept as input; ``callback_list.py`` and ``progress.py`` --
  callbacks and what the loops print;
- ``losses.py`` -- Keras's losses by name (``sg.losses``);
- saving: ``model_io.py`` (``save``, ``save_weights``, ``summary``), ``model_file.py``,
  ``architecture.py``, ``shared_file.py``, ``summary.py``; ``summaries.py`` (TensorBoard
  scalars); ``sidecar.py`` (:class:`~stratagem.SidecarEvaluator`).

The layer calls the core through declared hooks: a strategy names the kind of steps its
models run (``Strategy.model_steps_kind``), and :func:`stratagem.keras.step_kinds.steps_for`
picks the class; it names how ``fit`` runs its epochs (``Strategy.model_fit_loop_kind``:
``"scheduled"`` for the parameter-server loop); the core imports nothing from here.
"""
