"""fedseg: cross-silo federated learning of medical image segmentation models."""

__version__ = "0.1.0"
