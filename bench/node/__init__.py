"""bench/node: tools about the machine commbench runs on. `commbench doctor`, the first-run
checks of a new node (doctor.py), and `commbench netprobe`, which measures the links
between ranks and fits a network profile to them (netprobe.py, netprobe_measure.py,
netprobe_fit.py). It imports study (the report's page renderer), launch (the launcher,
torchrun), run, the parts and algorithms; never cli (tests/test_layers.py)."""
