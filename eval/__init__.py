"""lm-eval integration: the model adapter, the evaluation suites, the runner and HF export."""
