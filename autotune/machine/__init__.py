"""What this machine is: hardware detection and the fingerprint, the probe, NVML monitoring.

The only room that asks the machine. It never creates a CUDA context: GPUs are read through NVML
(``machine.nvml``; tests inject a fake there, this room never imports one).
"""
