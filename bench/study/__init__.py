"""bench/study: studies over many runs. Sweeps that train and resume many runs (sweep/),
claims decided from paired seeds (claims/), the report (report/), runs, groups or sweeps
side by side with a regression gate (compare.py), the what-if planner pricing methods
over links without training (whatif/) and the tracking sinks showing the records
(tracking/). It imports launch (executors, jobentry, the launcher), run (records,
summary, checkpoint), the parts (config, data, model, network, memory, env) and
algorithms; never node or cli (tests/test_layers.py)."""
