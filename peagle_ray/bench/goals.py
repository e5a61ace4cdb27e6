"""The benchmarks' goals, in one place: the thresholds each benchmark's "goals" section checks its figures
against (ratios within one run; each goal is the issue's that asked for it)."""

# bench e2e (issue 6): P-EAGLE at its best K against the target alone and against EAGLE-3 at its best K
E2E = {"peagle_vs_target": 1.8, "peagle_vs_eagle3": 1.3}

# bench adapt (issue 21): the adapted drafter's held-out AL, its speedup over the target alone and over the
# un-adapted drafter, and the most general-suite AL it may lose
ADAPT = {"acceptance_length": 2.0, "speedup": 1.5, "vs_unadapted": 1.3, "general_drop": 0.02}

# bench peers: our P-EAGLE's AL over the reference trainer's, on validation and on each suite
PEERS = {"al_vs_reference": 1.15}
