"""Many configs, one study: the tuner process. It never initialises CUDA and never imports the
in-trial loop (``trial.bench``); it talks to trials through ``trial.spec``, ``trial.launch``,
``trial.measurement`` and ``trial.merge`` (which rank of a trial failed first), and to Optuna's
internals only through ``storage``.
"""
