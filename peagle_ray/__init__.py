"""peagle-ray: train and serve P-EAGLE parallel-drafting speculators with Ray, vLLM and MLflow."""

import os
from pathlib import Path

__version__ = "0.1.0"

# Ray Data reads its logging configuration once, when ray.data is first imported; ours keeps its INFO lines
# (progress every 10 s off a terminal) out of the console and in the Ray session's ray-data.log.
os.environ.setdefault("RAY_DATA_LOGGING_CONFIG", str(Path(__file__).with_name("ray_data_logging.yaml")))
