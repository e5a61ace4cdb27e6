"""Prepare data and capture hidden states on a Ray cluster (= `peagle-ray data capture --prepare`).

RAY_AUTH_MODE=token ray job submit --working-dir . -- python jobs/capture.py --config configs/demo.yaml
"""

import sys

from peagle_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["data", "capture", "--prepare", *sys.argv[1:]]))
