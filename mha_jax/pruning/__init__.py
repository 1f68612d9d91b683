"""Head pruning: Hard Concrete L0 gates (Voita et al.), Michel et al.'s iterative pruning,
random pruning, and export of physically pruned checkpoints."""
