"""peagle-ray: train and serve P-EAGLE parallel-drafting speculators with Ray, vLLM and MLflow."""

__version__ = "0.1.0"
