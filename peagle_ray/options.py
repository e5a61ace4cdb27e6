"""Command-line options declared where they are used: a benchmark's parameter annotated
`Annotated[int, Opt("what it sets")]` is the option `--its-name` of `peagle-ray bench KIND`, with its type,
default and help read from the function's signature (bench_options, option_arg; cli.py builds the parser).
Parameters without an `Opt` (the config, the drafters, the progress callback, internal knobs) are not
options; those named in NEEDS are filled in by the command.

e.g. `steps: Annotated[int, Opt("Optimizer steps per variant.")] = 100` -> `--steps STEPS` (int, default 100).
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
from collections import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Union, get_args, get_origin


def arg(*flags: str, **options) -> tuple[tuple[str, ...], dict]:
    """One argparse option as (flags, keyword options)."""
    return flags, options


@dataclass(frozen=True)
class Opt:
    """One option's help; `flag` where the parameter's name reads badly on a command line (e.g. --sequences for
    num_sequences), `choices` where only some values are accepted, `variants` for the repeatable
    `--variant NAME OVERRIDE...` of the ablation benches."""

    help: str
    flag: str | None = None
    choices: tuple[str, ...] | None = None
    variants: bool = False


@functools.cache
def module_source(module: str) -> ast.Module:
    """A module's syntax tree, read without importing it (its package's __init__ is imported); read once."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return ast.parse(Path(spec.origin).read_text())


def docstring(where: str) -> str:
    """The docstring of "package.module" or "package.module:function", read without importing the module: a
    command's help is the docstring of the function it calls (cli.py), a benchmark's its module's."""
    module, _, function = where.partition(":")
    tree = module_source(module)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function) if function else tree
    return ast.get_docstring(node) or ""


def summary(doc: str) -> str:
    """A docstring's first paragraph on one line, without its "`peagle-ray x`: " lead: the line a command or a
    benchmark gets in its parent's list."""
    first = " ".join(doc.split("\n\n")[0].split()).split(": ", 1)[-1]
    return first[:1].upper() + first[1:]


NEEDS = ("cfg", "drafters", "progress")  # a benchmark's parameters the command fills in


def bench_needs(function: Callable) -> set[str]:
    return set(inspect.signature(function).parameters) & set(NEEDS)


def bench_options(function: Callable) -> list[tuple[str, Opt, object, object]]:
    """(parameter, its Opt, its type, its default) of each option of a benchmark function (options.py)."""
    module = sys.modules[function.__module__]
    out = []
    for name, parameter in inspect.signature(function).parameters.items():
        hint = parameter.annotation
        if isinstance(hint, str):
            if not hint.startswith("Annotated["):
                continue
            hint = eval(hint, vars(module))  # noqa: S307 - the module's own annotation, as typing would
        opt = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Opt)), None)
        if opt is not None:
            out.append((name, opt, get_args(hint)[0], parameter.default))
    return out


def option_arg(name: str, opt: Opt, kind: object, default: object) -> tuple:
    """The argparse (flags, options) of one benchmark option, from its type: bool -> a switch, a sequence ->
    nargs="+" of its element type, X | None -> X."""
    flags = (opt.flag or "--" + name.replace("_", "-"),)
    typed = " ".join(map(str, default)) if isinstance(default, tuple | list) else default  # as a user types it
    shown = f"{opt.help} (default: {typed})" if default is not None else opt.help
    options: dict = {"dest": name, "help": shown}
    if opt.variants:
        return arg("--variant", **options, nargs="+", action="append", metavar=("NAME", "OVERRIDE"))
    args = [a for a in get_args(kind) if a is not type(None)] if get_origin(kind) in (Union, UnionType) else [kind]
    kind = args[0]
    if kind is bool:
        return arg(*flags, **options, action="store_const", const=True)
    if get_origin(kind) in (tuple, list, Sequence, abc.Sequence):
        options["nargs"] = "+"
        kind = next(a for a in get_args(kind) if a is not Ellipsis)
    if opt.choices:
        options["choices"] = opt.choices
    return arg(*flags, **options, type=kind)
