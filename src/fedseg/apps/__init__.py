"""Layer 7, applications built on runs: studies (comparisons, FedSM studies), the HTML report, deployment."""
