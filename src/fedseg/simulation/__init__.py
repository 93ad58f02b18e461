"""One-machine simulation: every site in this process (``run``, ``simulate``), optionally vectorized."""
