"""The core: messages, arrays, config, seeding, errors, device, workload, site, engine, checkpoints."""
