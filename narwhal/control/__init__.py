"""The control shell around the pure fleet: supervisor (evidence in, probes out), readmission, the monitor."""
