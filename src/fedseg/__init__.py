"""fedseg: cross-silo federated learning of medical image segmentation models."""

__version__ = "0.2.0"
