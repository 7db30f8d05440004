"""Client keys, per-key limits and priority classes on the data plane."""
