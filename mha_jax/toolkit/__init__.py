"""What the studies share: ablations (zero, mean, resample, corrupt) as interventions."""
