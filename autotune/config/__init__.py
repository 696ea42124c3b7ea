"""What can be tuned: the knob registry, configs and search spaces.

Pure: nothing here imports torch or Optuna at import time, and narrowing a space to the hardware
reads what the machine room detected (``machine.hardware.Hardware``), never the machine itself.
"""
