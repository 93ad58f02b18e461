"""Layer 3, the seams: the algorithm base (server half + site half), the transport protocol, and the run's
files (checkpoints, best models, site state).
"""
