"""Callbacks that report a framework's training steps to autotune, so that ``autotune run --
CMD`` can tune a Hugging Face or Lightning script that loads its profile:
``autotune.integrations.hf`` and ``autotune.integrations.lightning``. Each imports its
framework itself; importing ``autotune`` (or this package) imports neither.
"""
