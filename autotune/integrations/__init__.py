"""A profile in a framework's terms, and callbacks that report the framework's training steps to
autotune, so that ``autotune run -- CMD`` can tune a Hugging Face or Lightning script that loads
its profile: ``autotune.integrations.hf`` (``TrainingArguments`` kwargs, ``AutotuneCallback``)
and ``autotune.integrations.lightning`` (``Trainer`` kwargs, ``AutotuneCallback``). Each imports
its framework itself; importing ``autotune`` (or this package) imports neither.
"""
