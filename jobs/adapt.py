"""Adapt the served drafter to the endpoint's recorded traffic on a Ray cluster (= `peagle-ray adapt`).

RAY_AUTH_MODE=token ray job submit --working-dir . -- python jobs/adapt.py --config configs/demo.yaml \
    --set serving.record_dir=/srv/peagle/traffic --set training.storage_path=/srv/peagle/train
"""

import sys

from peagle_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["adapt", *sys.argv[1:]]))
