"""The replicas as one gateway sees them: membership, health, probes, outlier ejection, DNS
discovery, fleet mode's shared state, and their wiring."""
