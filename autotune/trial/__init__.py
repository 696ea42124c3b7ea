"""One config, measured. Runs on both sides of the process boundary.

``spec`` is the contract between tuner and trial; ``launch`` plans a trial as data and runs it
(the only place that starts processes); ``memory`` watches its process tree; ``measurement``
classifies what came back; ``bench`` is the loop inside the trial process; ``apply`` is how a
config is applied, there and in a training script's ``Profile``. Nothing here imports the tuner.
"""
