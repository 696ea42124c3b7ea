"""Callbacks that report a framework's training steps to autotune, so that ``autotune run --
CMD`` can tune a Hugging Face or Lightning script as it is: ``autotune.integrations.hf`` and
``autotune.integrations.lightning``. Each imports its framework itself; importing ``autotune``
(or this package) imports neither.
"""
