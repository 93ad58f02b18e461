"""Layer 5, how a run executes, below the two ways of hosting one (``fedseg.simulation``,
``fedseg.deployment``): the round loop (``engine``), a run's data and results files (``federation``,
``results``), and the in-process transport with its vectorized executor.
"""
