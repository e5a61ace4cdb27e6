"""What `peagle-ray serve` serves without --drafter: the registry's word where there is a registry.

The version of tracking.registered_model holding adapt.alias ("serving") is what adaptation last promoted;
the registered model's served.* tags (adapt.served_tags) are the verdict of the last comparison that judged
it: the decoder and K that were measured fastest. Without a registry or an aliased version, the training
run's export is served, as `peagle-ray train` left it.

    chosen = default_drafter(cfg)      # ServedExport(directory, label, drafter, why)
    chosen.why                         # "registry peagle-drafter: version 2 holds alias 'serving'; ..."
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from peagle_ray import layout
from peagle_ray.config import PeagleConfig
from peagle_ray.export.speculators import DrafterInfo, Recommendation, read_drafter


@dataclass(frozen=True)
class ServedExport:
    directory: Path
    label: str | None  # the registered version, e.g. "peagle-drafter/2" (None: not from the registry)
    drafter: DrafterInfo  # read_drafter's, with the registry's verdict as its recommendation where recorded
    why: str


def registry_uri(cfg: PeagleConfig) -> str | None:
    """tracking.tracking_uri, else the local store a local run wrote (sqlite; reading it needs no server),
    else None: no registry to ask."""
    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    db = layout.mlflow_dir(layout.storage(cfg)) / "mlflow.db"
    return f"sqlite:///{db.resolve()}" if db.is_file() else None


def registry_verdict(tags: dict[str, str], label: str, k: int) -> Recommendation | None:
    """The registered model's served.* tags as the verdict on version `label`; None where they judged another
    version (or nothing). e.g. {"served.decoder": "suffix", "served.k": "4", "served.version":
    "peagle-drafter/2", "served.why": "suffix 1.7x ..."} for "peagle-drafter/2" -> Recommendation(True, 4,
    "registry: suffix 1.7x ...", "suffix"); served.decoder "target" -> Recommendation(False, k, ...)."""
    decoder = tags.get("served.decoder")
    if tags.get("served.version") != label or decoder is None:
        return None
    why = f"registry: {tags.get('served.why') or 'no reason recorded'}"
    if decoder == "target":
        return Recommendation(False, k, why)
    return Recommendation(True, int(tags.get("served.k") or k) or k, why, decoder)


def default_drafter(cfg: PeagleConfig) -> ServedExport:
    """The version holding adapt.alias with its recorded verdict where a registry has one, else the training
    run's export (layout.drafter_dir). The version's files come from its own export directory where it still
    exists on this machine (tags served.dir / export_dir), else they are downloaded from the registry once."""
    from peagle_ray.tracking import EXPORT_DIR_TAG, aliased_version, model_tags

    name, uri = cfg.tracking.registered_model, registry_uri(cfg)
    found = aliased_version(uri, name, cfg.adapt.alias) if name and uri else None
    if found is None:
        directory = layout.drafter_dir(cfg)
        why = "the training run's export" + (
            f" (no version of {name!r} holds alias {cfg.adapt.alias!r} in {uri})" if name and uri else " (no registry)"
        )
        return ServedExport(directory, None, read_drafter(directory), why)
    assert name is not None and uri is not None
    label, tags = f"{name}/{found['version']}", model_tags(uri, name)
    local = [tags.get("served.dir") if tags.get("served.version") == label else None, found["tags"].get(EXPORT_DIR_TAG)]
    present = next((Path(d) for d in local if d and (Path(d) / "config.json").is_file()), None)
    directory = present or _download(cfg, name, found["version"])
    drafter = read_drafter(directory)
    verdict = registry_verdict(tags, label, drafter.num_speculative_tokens)
    if verdict is not None:
        drafter = replace(drafter, recommendation=verdict)
    why = f"registry {name}: version {found['version']} holds alias {cfg.adapt.alias!r}" + (
        "" if verdict is not None else "; no comparison recorded for it"
    )
    return ServedExport(directory, label, drafter, why)


def chosen_drafter(cfg: PeagleConfig, drafter_dir: Path | None, no_drafter: bool = False) -> ServedExport | None:
    """`peagle-ray serve`'s drafter: none with --no-drafter, --drafter DIR as given, else default_drafter."""
    if no_drafter:
        return None
    if drafter_dir is not None:
        return ServedExport(Path(drafter_dir), cfg.serving.drafter_version, read_drafter(drafter_dir), "--drafter")
    return default_drafter(cfg)


def _download(cfg: PeagleConfig, name: str, version: str) -> Path:
    """The version's files under <storage>/registry/<name>/<version> (kept: a second serve reads them)."""
    from peagle_ray.tracking import download_version, tracking_uri

    target = layout.storage(cfg) / "registry" / name / version
    cached = sorted(target.glob("**/config.json"))
    if cached:
        return cached[0].parent
    with tracking_uri(cfg, layout.mlflow_dir(layout.storage(cfg))) as uri:  # artifacts need the server
        return download_version(uri, name, version, target)
