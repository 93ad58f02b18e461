"""Studies built on runs: method comparisons over seeds, re-evaluation, the FedSM studies."""
