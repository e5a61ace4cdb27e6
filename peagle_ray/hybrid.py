"""The hybrid decoder (issue 37): a trained drafter (P-EAGLE or EAGLE-3) and suffix decoding in one vLLM
engine, as a vLLM plugin (entry point `vllm.general_plugins: peagle_hybrid`, `register`), not a fork.

Each step, for each request, suffix decoding's draft is taken where its score (the sum of its estimated token
probabilities: arctic-inference's SuffixDecodingDraft.score) reaches the threshold (by default the drafter's
K, Arctic Inference's rule), else the drafter's (`choose`). The drafter's forward runs every step either way
(whether it could be skipped on suffix steps is not measured yet: the same forward writes the drafter's KV for
the tokens the target just verified). What each source drafted and what of
it the target accepted is counted per source (`count_step`, into STATS), as vLLM counts all drafts
(spec_counters.SpecStats). An engine runs the hybrid when its environment sets THRESHOLD_ENV (compare.hybrid
does); the plugin checks the vLLM release it was written for. Lossless: the target verifies every draft.

    drafts, sources = choose([[5, 6], [7, 8]], [([1, 2, 3], 2.5), ([9], 0.4)], threshold=2)
    -> [[1, 2, 3], [7, 8]], ["suffix", "drafter"]

Found on vLLM 0.32 (CPU): the EAGLE path proposes a [requests, K] tensor in its padded mode (parallel drafting
has no other), and a list of per-request drafts of any length <= K in its place is verified as given; the
batch's token ids end before the tokens the step just sampled (`sampled` rows, -1 after the accepted ones).
"""

from __future__ import annotations

from collections.abc import Sequence

from peagle_ray.spec_counters import SpecStats, add_lists

SOURCES = ("suffix", "drafter")


def choose(
    drafter: Sequence[list[int]], suffix: Sequence[tuple[list[int], float]], threshold: float
) -> tuple[list[list[int]], list[str]]:
    """Per request: suffix decoding's tokens when it has some and its score >= `threshold`, else the
    drafter's; with the source of each."""
    if len(drafter) != len(suffix):
        raise ValueError(f"one draft per request from each source; got {len(drafter)} and {len(suffix)}")
    drafts, sources = [], []
    for own, (tokens, score) in zip(drafter, suffix, strict=True):
        use_suffix = bool(tokens) and score >= threshold
        drafts.append(list(tokens) if use_suffix else list(own))
        sources.append("suffix" if use_suffix else "drafter")
    return drafts, sources


def count_step(
    stats: dict[str, SpecStats], sources: Sequence[str], drafted: Sequence[int], accepted: Sequence[int]
) -> None:
    """Add one verified step to `stats` ({source: SpecStats}): request i's draft of `drafted[i]` tokens came
    from `sources[i]`, and the target accepted its first `accepted[i]` tokens (the tokens it sampled, less the
    one of its own). A request that drafted nothing is not a draft.

    e.g. sources ["suffix", "drafter"], drafted [3, 2], accepted [2, 0] -> suffix: 1 draft, 3 draft tokens,
    2 accepted, per position [1, 1, 0]; drafter: 1 draft, 2 draft tokens, 0 accepted, per position [0, 0]."""
    for source, n, a in zip(sources, drafted, accepted, strict=True):
        if not 0 <= a <= n:
            raise ValueError(f"accepted tokens must be 0..{n} (the draft's length); got {a}")
        if n == 0:
            continue
        s = stats.setdefault(source, SpecStats())
        s.drafts, s.draft_tokens, s.accepted_tokens = s.drafts + 1, s.draft_tokens + n, s.accepted_tokens + a
        s.accepted_per_position = add_lists(s.accepted_per_position, [1] * a + [0] * (n - a))


# ---- the vLLM plugin (entry point vllm.general_plugins: peagle_hybrid) ---------------------------------------

VLLM_VERSION = "0.32.0"  # the release whose model runner this plugin wraps
THRESHOLD_ENV = "PEAGLE_RAY_HYBRID_THRESHOLD"  # set in an engine's environment: that engine runs the hybrid
STATS: dict[str, SpecStats] = {}  # this process's counts per source (an in-process engine: the eval's, a CPU replica's)


def register() -> None:
    """vLLM runs this in every process it starts. It changes nothing unless the engine's environment asks for
    the hybrid (THRESHOLD_ENV, the suffix score at which suffix decoding's draft is taken); then it wraps the
    model runner's proposal step so that, after the trained drafter (EAGLE-3 or P-EAGLE) proposed, each
    request's draft is suffix decoding's where its score reaches the threshold (`choose`). On another vLLM
    release it logs one error and the drafter alone drafts."""
    import logging
    import os

    if THRESHOLD_ENV not in os.environ:
        return
    import vllm

    if vllm.__version__ != VLLM_VERSION:
        logging.getLogger(__name__).error(
            "peagle-ray's hybrid decoder is written for vLLM %s and this is %s: the drafter alone drafts",
            VLLM_VERSION,
            vllm.__version__,
        )
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # CPUModelRunner inherits its proposal step

    if getattr(GPUModelRunner, "_peagle_hybrid", False):
        return
    threshold = float(os.environ[THRESHOLD_ENV])
    drafter_proposes = GPUModelRunner.propose_draft_token_ids

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        drafts = drafter_proposes(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        spec = self.speculative_config
        if spec is None or not spec.use_eagle():
            return drafts
        if "_peagle_suffix" not in self.__dict__:
            self._peagle_suffix = SuffixDrafts(spec, self.max_model_len)
        return self._peagle_suffix.merge(self.input_batch, sampled_token_ids, drafts, threshold)

    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    GPUModelRunner._peagle_hybrid = True


class SuffixDrafts:
    """Suffix decoding beside the drafter in one engine: one arctic-inference suffix cache (each request's
    prompt and response, and the responses of finished requests), fed the tokens each step sampled."""

    def __init__(self, spec, max_model_len: int):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.spec, self.max_model_len = spec, max_model_len
        self.cache = SuffixDecodingCache(
            max_tree_depth=spec.suffix_decoding_max_tree_depth,
            max_cached_requests=spec.suffix_decoding_max_cached_requests,
        )
        self.drafted: dict[str, tuple[str, int]] = {}  # request -> (source, tokens) of its draft being verified

    def merge(self, batch, sampled, drafter_drafts, threshold: float) -> list[list[int]]:
        """Per request of `batch`: the drafter's draft or suffix decoding's (`choose`); counts the drafts the
        target just verified into STATS. In vLLM's padded mode `sampled` is a [requests, K + 1] tensor with -1
        after the accepted tokens, and the batch's token ids end before them."""
        rows = sampled.tolist() if hasattr(sampled, "tolist") else sampled
        new = [[t for t in row if t >= 0] for row in rows]
        own = drafter_drafts.tolist() if hasattr(drafter_drafts, "tolist") else [list(d) for d in drafter_drafts]
        suffix: list[tuple[list[int], float]] = []
        for i, req_id in enumerate(batch.req_ids):
            if req_id in self.drafted and new[i]:
                source, n = self.drafted.pop(req_id)
                count_step(STATS, [source], [n], [min(len(new[i]) - 1, n)])
            suffix.append(self._speculate(batch, i, req_id, new[i]) if new[i] else ([], 0.0))
        drafts, sources = choose(own, suffix, threshold)
        for i, req_id in enumerate(batch.req_ids):
            if new[i] and drafts[i]:
                self.drafted[req_id] = (sources[i], len(drafts[i]))
        for req_id in self.cache.active_requests - batch.req_id_to_index.keys():
            self.cache.stop_request(req_id)  # finished: its response joins the global tree
            self.drafted.pop(req_id, None)
        return drafts

    def _speculate(self, batch, i: int, req_id: str, new: list[int]) -> tuple[list[int], float]:
        spec = self.spec
        n = int(batch.num_tokens_no_spec[i])
        if req_id not in self.cache.active_requests:
            if req_id in self.cache.cached_requests:
                self.cache.evict_cached_response(req_id)
            self.cache.start_request(req_id, batch.token_ids_cpu[i, : int(batch.num_prompt_tokens[i])])
        self.cache.add_active_response(req_id, new)
        context = [*batch.token_ids_cpu[i, max(0, n - spec.suffix_decoding_max_tree_depth) : n].tolist(), *new]
        room = self.max_model_len - (n + len(new)) - 1
        if room <= 0:
            return [], 0.0
        draft = self.cache.speculate(
            req_id,
            context[-spec.suffix_decoding_max_tree_depth :],
            max_spec_tokens=min(spec.num_speculative_tokens, room),
            max_spec_factor=spec.suffix_decoding_max_spec_factor,
            min_token_prob=spec.suffix_decoding_min_token_prob,
        )
        return list(draft.token_ids), float(draft.score)
