"""One-machine simulation: every site in this process (``runner``: ``run``, ``simulate``), through the
in-process transport (``inprocess``), optionally vectorized (``vectorize/``)."""
