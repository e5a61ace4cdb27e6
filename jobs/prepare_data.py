"""Prepare training conversations on a Ray cluster (= `peagle-ray data prepare`).

RAY_AUTH_MODE=token ray job submit --working-dir . -- python jobs/prepare_data.py --config configs/demo.yaml
"""

import sys

from peagle_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["data", "prepare", *sys.argv[1:]]))
