"""``fedseg predict`` and ``fedseg export``: a finished run's models applied to new scans, and handed to other
runtimes (MONAI bundle, TorchScript, ONNX)."""

from fedseg.apps.predict.model import MODEL_CHOICES, Loaded, load_predictor
from fedseg.apps.predict.run import keep_largest, predict_files, segment

__all__ = ["MODEL_CHOICES", "Loaded", "keep_largest", "load_predictor", "predict_files", "segment"]
