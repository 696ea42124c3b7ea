"""What can be tuned: the knob registry, configs, search spaces, and how a config is applied.

Pure: nothing here imports torch or Optuna at import time, and narrowing a space to the hardware
reads what the machine room detected (``machine.hardware.Hardware``), never the machine itself.
"""
