"""The commbench harness: config, model, data, training loop, launch, sweeps, reports."""
