"""Many configs, one study: the tuner process. It never initialises CUDA and never imports the
in-trial loop (``trial.bench``); it talks to trials through ``trial.spec``, ``trial.launch`` and
``trial.measurement`` only, and to Optuna's internals only through ``storage``.
"""
