"""What the endpoint decodes with: the target alone, a trained drafter at K, vLLM's suffix decoding at K, or both
in one engine (the hybrid, peagle_ray/hybrid.py) - one value the startup line, /v1/speculative_stats, the
traffic records and the registry's tags all read, so they cannot disagree.

    served = served_decoder(read_drafter(export), k=None, asked="auto")   # evaluation's verdict (recommendation.json)
    served.speculative_config(max_batch_size)    # vLLM's speculative_config (None: the target alone)
    served.additional_config(stats_file)          # vLLM's additional_config (the hybrid's options), or None
    served.line()                                 # "decoder:  hybrid at K = 4 (...)"

serving.decoder "auto" serves what the drafter's evaluation measured fastest (recommendation.json); a K asked
for (serving.num_speculative_tokens) keeps that decoder but drafts - a verdict of "the target alone" then
serves the drafter, as before. Any other serving.decoder is served as asked. Suffix decoding needs no drafter;
the drafter export stays the endpoint's unit of deployment all the same (adaptation starts from it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from peagle_ray.config import ConfigError
from peagle_ray.export.speculators import DrafterInfo, speculative_config
from peagle_ray.hybrid import default_threshold

DEFAULT_SUFFIX_K = 4  # suffix decoding served without a drafter or a K asked for


@dataclass(frozen=True)
class ServedDecoder:
    decoder: str  # "target" | "drafter" | "suffix" | "hybrid"
    k: int  # tokens drafted per step (0 for the target alone)
    drafter: DrafterInfo | None = None  # the export this endpoint was deployed with (None: no drafter at all)
    version: str | None = None  # its registered version (e.g. peagle-drafter/3)
    threshold: float | str | None = None  # suffix score threshold (None: K / 2; "drafter": adaptive; hybrid.py)
    reason: str = ""  # why this decoder (evaluation's verdict, or "asked for")

    def speculative_config(self, max_batch_size: int | None = None) -> dict | None:
        """vLLM's speculative_config: None for the target alone; suffix decoding's own for suffix (drafting at
        every batch size); the drafter's (export.speculative_config; above `max_batch_size` running requests the
        target decodes alone) for the drafter and the hybrid."""
        if self.decoder == "target":
            return None
        if self.decoder == "suffix":
            # no per-batch K (serving.draft_max_batch_size): vLLM 0.32's suffix proposer asserts that the K the
            # scheduler asks for is its own, so a smaller one above the cutoff kills the engine (EngineDeadError
            # at the second concurrent request). Its drafts cost a tree lookup, not a forward pass.
            return {"method": "suffix", "num_speculative_tokens": self.k}
        assert self.drafter is not None  # served_decoder checks it
        return speculative_config(self.drafter, self.k, max_batch_size)

    def additional_config(self, stats_file: str | None = None) -> dict | None:
        """vLLM's additional_config running the hybrid (its counts per source into `stats_file`), else None."""
        from peagle_ray.hybrid import engine_config

        return engine_config(self.threshold, stats_file=stats_file) if self.decoder == "hybrid" else None

    @property
    def uses_suffix(self) -> bool:
        return self.decoder in ("suffix", "hybrid")

    def to_json(self) -> dict:
        """/v1/speculative_stats' description (and each traffic record's "drafter"): the decoder, K, the
        drafter's algorithm, path and version, and why."""
        d = self.drafter
        return {
            "decoder": self.decoder,
            "k": self.k,
            "algorithm": d.algorithm if d and self.decoder in ("drafter", "hybrid") else None,
            "drafter": d.path if d else None,
            "version": self.version,
            "threshold": (self.threshold or default_threshold(self.k)) if self.decoder == "hybrid" else None,
            "why": self.reason,
        }

    def describe(self) -> str:
        """e.g. "hybrid (peagle drafter + suffix decoding) at K = 4"."""
        if self.decoder == "target":
            return "the target alone"
        if self.decoder == "suffix":
            return f"suffix decoding at K = {self.k}"
        algorithm = self.drafter.algorithm if self.drafter else "?"
        if self.decoder == "hybrid":
            return f"hybrid ({algorithm} drafter + suffix decoding) at K = {self.k}"
        return f"{algorithm} at K = {self.k}"

    def line(self) -> str:
        """What the endpoint decodes with, and why, for a person reading the console."""
        where = f" ({self.drafter.path})" if self.drafter and self.decoder in ("drafter", "hybrid") else ""
        why = f": {self.reason}" if self.reason else ""
        return f"decoder:  {self.describe()}{where}{why}"


def served_decoder(
    drafter: DrafterInfo | None,
    k: int | None = None,
    asked: str = "auto",
    threshold: float | str | None = None,
    version: str | None = None,
) -> ServedDecoder:
    """The decoder to serve (module docstring): `asked` is serving.decoder, `k` serving.num_speculative_tokens
    (None: the verdict's or the drafter's K). The hybrid on a vLLM release it was not written for serves the
    drafter, saying so (hybrid.unsupported)."""
    from peagle_ray.hybrid import unsupported

    verdict = drafter.recommendation if drafter is not None else None
    if asked == "auto":
        if drafter is None:
            return ServedDecoder("target", 0, reason="no drafter given")
        if verdict is None:
            decoder, reason = "drafter", "not evaluated"
        elif not verdict.draft and k is None:
            return ServedDecoder(
                "target", 0, drafter, version, reason=f"evaluation of {drafter.path}: {verdict.reason}"
            )
        else:
            decoder = verdict.decoder if verdict.draft else "drafter"
            reason = verdict.reason if verdict.draft else f"K = {k} asked for (evaluation: {verdict.reason})"
    elif asked == "target":
        return ServedDecoder("target", 0, drafter, version, reason="serving.decoder = target")
    else:
        decoder, reason = asked, f"serving.decoder = {asked}"
        if drafter is None and asked in ("drafter", "hybrid"):
            raise ConfigError(f"serving.decoder {asked!r} needs a drafter (an export directory); got none")
    if decoder == "hybrid" and (problem := unsupported()) is not None:
        logging.getLogger("peagle_ray.serve").error(problem)
        decoder, reason = "drafter", problem
    k = k or (drafter.num_speculative_tokens if drafter is not None else DEFAULT_SUFFIX_K)
    return ServedDecoder(decoder, k, drafter, version, threshold, reason)
