"""Layer 2, one site's runtime: the workload (what is learned) and the site (its data, models, optimizers,
local loop and scores). No file I/O and no knowledge of the run around it.
"""
