"""Command-line options declared where they are used: a benchmark's parameter annotated
`Annotated[int, Opt("what it sets")]` is the option `--its-name` of `peagle-ray bench KIND`, with its type,
default and help read from the function's signature (cli.py). Parameters without an `Opt` (the config, the
drafters, the progress callback, internal knobs) are not options.

e.g. `steps: Annotated[int, Opt("Optimizer steps per variant.")] = 100` -> `--steps STEPS` (int, default 100).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Opt:
    """One option's help; `flag` where the parameter's name reads badly on a command line (e.g. --sequences for
    num_sequences), `choices` where only some values are accepted, `variants` for the repeatable
    `--variant NAME OVERRIDE...` of the ablation benches."""

    help: str
    flag: str | None = None
    choices: tuple[str, ...] | None = None
    variants: bool = False
