"""The simulated machine's kernel: its sysfs/dev layout (`tree`) and the emulator that applies driver
binding writes the way the kernel does (`emulator`).

Import the modules themselves: `agent.sim.hardware` builds on `tree`, and the emulator
builds on `nvml_hardware`, so this package imports neither eagerly.
"""
