"""Evaluate the trained drafters against the target alone (= `peagle-ray eval`).

RAY_AUTH_MODE=token ray job submit --working-dir . -- python jobs/evaluate.py --config configs/demo.yaml --json /abs/eval.json
"""

import sys

from peagle_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))
