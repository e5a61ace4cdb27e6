"""Train a drafter on a Ray cluster (= `peagle-ray train`).

RAY_AUTH_MODE=token ray job submit --working-dir . -- python jobs/train.py --config configs/demo.yaml
"""

import sys

from peagle_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
