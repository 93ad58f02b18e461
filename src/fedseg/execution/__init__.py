"""Layer 5, how a run executes: the round loop (engine), the in-process transport and its vectorized
executor, and the remote transport (wire format, deadlines, reply checks).
"""
