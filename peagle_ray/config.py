"""The one typed configuration of peagle-ray.

Every default lives here, once, with a docstring under each field. Lower layers take this config (or the
section they need) or explicit arguments; they never invent defaults of their own.

    cfg = load_config("configs/demo.yaml")          # YAML -> validated PeagleConfig
    cfg = load_config(None, ["training.learning_rate=1e-3"])   # defaults + dotted overrides
    dump_config(cfg, "resolved.yaml")

Invalid values raise ConfigError, whose message names the field, the rule and the value received:
    training.learning_rate: Input should be greater than 0; got -1
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Environment variable that moves the cache (converted targets, downloaded wheels) away from ~/.cache.
CACHE_ENV = "PEAGLE_RAY_CACHE"


def default_cache_dir() -> Path:
    """~/.cache/peagle-ray, or $PEAGLE_RAY_CACHE when set."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "peagle-ray"


Loss = Literal["kl", "argmax_ce"]
"""training.loss: the per-element training loss (train/loss.py)."""


class ConfigError(ValueError):
    """A configuration value broke a rule; the message names the field, the rule and the value."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class TargetConfig(_Section):
    path: str | None = None
    """HF directory of the target (verifier) model. None means the embedded SmolLM2-135M-Instruct,
    converted by `peagle-ray target prepare` into the cache dir."""

    cache_dir: str | None = None
    """Where converted targets and downloaded wheels live. None means $PEAGLE_RAY_CACHE or
    ~/.cache/peagle-ray."""

    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Dtype the target runs in. float32 keeps greedy speculative decoding bit-identical to target-only
    decoding on CPU (bf16 batched verification rounds differently); GPU runs usually pick bfloat16."""

    max_model_len: int = Field(default=2048, gt=0)
    """Longest sequence (prompt + generation) the vLLM engine accepts."""

    trust_remote_code: bool = False
    """Allow model code shipped inside the target directory to run. Off unless you trust the source."""

    seed: int = 0
    """Seed of every vLLM engine of the target (capture, serving, evaluation); requests may carry their own."""

    kv_cache_gib: int = Field(default=2, ge=1)
    """KV-cache GiB given to each CPU vLLM engine (VLLM_CPU_KVCACHE_SPACE, whole GiB); ignored on GPU."""

    cpu_reserved_cores: int | None = Field(default=None, ge=0)
    """CPU cores each CPU vLLM engine keeps free of model threads (VLLM_CPU_NUM_OF_RESERVED_CPU): its model
    runs on the node's other cores (engine.use_local_cores). None: 0, every core (vLLM's own default of one
    core per worker was for a scheduler process that busy-waits; peagle-ray runs the model inside that
    process, engine.py); ignored on GPU. VLLM_CPU_NUM_OF_RESERVED_CPU set in the environment wins (on a box
    shared with other work, two-thread engines side by side decoded 2.5x slower than one-thread ones)."""


class DataConfig(_Section):
    sources: list[str] = Field(default_factory=lambda: ["builtin"])
    """Input conversations: JSONL files (OpenAI `messages` or ShareGPT `conversations`), directories saved
    with `datasets.save_to_disk`, plain prompt lists (.txt), "builtin" for the shipped prompt suite,
    "sharegpt" / "sharegpt:N" for ShareGPT V3 (all, or N sampled with data.seed; the `data` extra), or
    "magpie:N" for N user prompts the target writes itself (needs data.regenerate)."""

    seed: int = 0
    """Seed of data generation: which ShareGPT conversations, the split, and each request to the target
    (Magpie prompt writing and regeneration: data.seed + the request's number in the run)."""

    magpie_temperature: float = Field(default=0.8, gt=0.0)
    """Sampling temperature of Magpie prompt writing (greedy would write one prompt over and over)."""

    magpie_max_tokens: int = Field(default=128, gt=0)
    """Most tokens of one Magpie prompt; a prompt still going at this limit is dropped as degenerate."""

    max_row_bytes: int = Field(default=1 << 20, gt=0)
    """Longest input row (a JSONL line, or a row's text) read; longer rows are skipped as `too_large`."""

    max_length: int = Field(default=1024, gt=0)
    """Token length each conversation is truncated to after the chat template is applied."""

    regenerate: bool = True
    """Regenerate assistant turns with the target itself (on-policy data, as the released P-EAGLE drafters
    were trained)."""

    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature for regenerated responses; 0 is greedy."""

    regenerate_batch_size: int = Field(default=64, gt=0)
    """Conversations whose answers are regenerated at once (the requests reach the target together and vLLM
    batches them); the prepared rows of a batch are written when all of its answers are back."""

    max_new_tokens: int = Field(default=256, gt=0)
    """Most tokens generated per regenerated assistant turn."""

    validation_fraction: float = Field(default=0.1, ge=0.0, lt=1.0)
    """Share of user-supplied conversations held out for validation (the built-in suite has a fixed split)."""

    output_dir: str = "runs/data"
    """Where prepared conversations, token frequencies and the bad-row summary are written."""

    @field_validator("sources")
    @classmethod
    def _counted_sources(cls, v: list[str]) -> list[str]:
        for source in v:
            name, sep, count = source.partition(":")
            if name in ("sharegpt", "magpie") and (sep or name == "magpie"):
                if not (count.isdigit() and int(count) > 0):
                    raise ValueError(f"entry {source!r} must look like {name}:N with N a positive integer")
        return v


class CaptureConfig(_Section):
    aux_layer_ids: list[int] | None = None
    """Target layers whose inputs feed the drafter (HF `hidden_states[i]`). None means the paper's
    (2, L/2, L-1) for a target with L layers."""

    mode: Literal["online", "offline"] = "online"
    """online: hidden states stream straight into training and nothing stays on disk; offline: written as
    shards with a manifest, reusable across runs."""

    output_dir: str = "runs/hidden"
    """Shard directory for offline mode."""

    num_actors: int = Field(default=2, gt=0)
    """Ray Data actors calling the Serve-hosted target concurrently: with 2, one batch's states travel back
    while the engine prefills the next."""

    batch_size: int = Field(default=32, gt=0)
    """Conversations per capture request: one Serve call, prefilled together by the engine. Larger batches
    amortize the per-request cost (`peagle-ray bench capture`: tiny target 8 -> 32 took capture from 0.2x to
    ~1x plain prefill); each in-flight batch's hidden states (batch x T x layers x H in the target's dtype)
    are held in the replica and the object store at once."""

    num_gpus: float = Field(default=0, ge=0)
    """GPUs the capture replica (the Serve-hosted target) takes (Ray actor option num_gpus). 0 runs its vLLM
    engine on CPU; a GPU replica runs compiled (no enforce_eager) with vLLM's stock hidden-states connector."""

    shard_size: int = Field(default=64, gt=0)
    """Records per offline shard file (capture.mode offline)."""

    epoch_cache_gb: float = Field(default=8.0, ge=0.0)
    """Online mode: each training worker keeps up to this many GB of the records it received in the first epoch
    in a file on its local temp disk, and replays them in later epochs instead of capturing them through the
    target again. A worker whose first epoch outgrows it re-captures every epoch; 0 always re-captures."""

    num_replicas: int = Field(default=1, gt=0)
    """Replicas of the Serve-hosted target the capture actors share (Serve routes each request to one).
    Scale capture out with more replicas on more nodes (or GPUs) and capture.num_actors >= num_replicas."""

    max_replicas_per_node: int | None = Field(default=None, gt=0)
    """Most target replicas on one Ray node (Serve's max_replicas_per_node); 1 spreads them one per node.
    None lets Serve place them anywhere."""

    @field_validator("aux_layer_ids")
    @classmethod
    def _non_negative_layers(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or min(v) < 0):
            raise ValueError(f"must be a non-empty list of layer ids >= 0; got {v}")
        return v


class DrafterConfig(_Section):
    algorithm: Literal["peagle", "eagle3"] = "peagle"
    """peagle drafts K tokens in one forward pass; eagle3 is the autoregressive baseline (K passes)."""

    init_std: float = Field(default=0.02, gt=0.0)
    """Std of the normal init of the drafter's new weights (fc, decoder layers, mask hidden state); the
    embedding and lm_head rows are the target's."""

    num_depths: int = Field(default=4, ge=1, le=16)
    """K: depths trained and tokens drafted per step."""

    num_layers: int = Field(default=1, ge=1)
    """Decoder layers in the drafter."""

    draft_vocab_size: int | None = Field(default=None, gt=0)
    """Size of the reduced draft vocabulary (most frequent loss-masked tokens). None keeps the full target
    vocabulary."""

    mask_token_id: int | None = Field(default=None, ge=0)
    """Token id whose embedding marks depths 2..K (P-EAGLE). None resolves it from the tokenizer."""

    cod_keep_ratio: float = Field(default=0.7, gt=0.0, le=1.0)
    """COD sampling: depth d keeps a fraction keep_ratio**d of the chains that reached depth d-1."""

    cod_min_ratio: float = Field(default=0.2, ge=0.0, le=1.0)
    """COD sampling: floor on the kept fraction at any depth."""

    ttt_steps: int | None = Field(default=None, ge=1)
    """EAGLE-3 only: training-time-test steps (depths trained, one forward each). None means num_depths.
    EAGLE-3 samples its deeper steps with the same COD ratios as P-EAGLE, so both see equal data."""

    norm_before_residual: bool = False
    """Apply hidden_norm before the residual connection of layer 0 (speculators config flag)."""

    freeze_lm_head: bool = False
    """Keep the draft lm_head at its initial value, the target's lm_head rows of the draft vocabulary (as the
    speculators reference trainer does): DV x H fewer trained parameters and no head gradient GEMM."""

    frozen: list[str] = Field(default_factory=lambda: ["embed_tokens"])
    """Parameter-name prefixes kept at their initial (or training.init_from) values, e.g. ["embed_tokens", "fc"]
    trains only the decoder layer, the norms and P-EAGLE's mask_hidden (adaptation on little traffic). Names as
    in the exported model.safetensors; a prefix that names no parameter is refused. `[]` trains everything.
    By default the embedding table (the target's) stays frozen for P-EAGLE too, unlike the paper and the
    speculators trainer: on SmolLM2 it reached the same validation AL with a faster step and far fewer trained
    parameters (docs/benchmarks.md, the frozen-embedding ablation); the mask token's input still learns
    through mask_hidden."""

    normalize_features: bool = False
    """Scale each channel of the target's aux hidden states to unit RMS before fc (measured on the first 64
    captured training records; needs capture.mode offline). A fixed buffer folded into fc at export, so
    vLLM serves the same files. For targets with massive activations (SmolLM2: channel 507's RMS is ~275x
    the median channel's in layer 15), where a few channels dominate fc's input; on SmolLM2 it measured worse
    (docs/benchmarks.md, the normalized-features ablation), so it is off by default."""

    k_train: int | None = Field(default=None, ge=1, le=16)
    """P-EAGLE: depths trained (K_train), at least num_depths, the K served and validated. None trains
    num_depths. The paper trains K = 8 to serve K = 5 (AL 2.41 -> 2.51 against training at 5)."""

    init_from_target: int | None = None
    """Start the drafter from the target's own weights: decoder layer i from target layer init_from_target + i
    (negative counts from the top: -1 is the last; attention, MLP and norms), fc passing the top aux feature
    through unchanged, the final norm from the target's (drafter/build.py init_from_target). None starts them
    at random (init_std). The aux layers' defaults end at the last layer's input, so -1 makes the untrained
    depth-0 output the target's own last layer at the anchor. Off by default: measured on SmolLM2 only (a Llama
    layer, copied exactly; one doubling of training data ahead on the learning curve, docs/benchmarks.md), and
    there configs/demo.yaml and cpu-full.yaml set -1; Qwen3's and GPT-OSS's copies leave tensors out (below)
    and are unmeasured on real weights. With num_layers > 1, -num_layers starts from the top layers."""

    init_embed_half: Literal["random", "zero"] = "random"
    """With init_from_target: layer 0's q/k/v weights on the token-embedding half of its input, random
    (init_std) or zero (the untrained layer then ignores the token)."""

    @property
    def trained_depths(self) -> int:
        """Depths a training sequence samples: ttt_steps for EAGLE-3 when set, k_train for P-EAGLE when set,
        else num_depths."""
        if self.algorithm == "eagle3":
            return self.ttt_steps or self.num_depths
        return self.k_train or self.num_depths

    @model_validator(mode="after")
    def _ttt_only_for_eagle3(self) -> DrafterConfig:
        if self.ttt_steps is not None and self.algorithm != "eagle3":
            raise ValueError(f"drafter.ttt_steps applies only to algorithm 'eagle3'; got algorithm {self.algorithm!r}")
        if self.k_train is not None and self.algorithm != "peagle":
            raise ValueError(
                f"drafter.k_train applies only to algorithm 'peagle' (eagle3 has ttt_steps); got algorithm "
                f"{self.algorithm!r}"
            )
        if self.k_train is not None and self.k_train < self.num_depths:
            raise ValueError(
                f"drafter.k_train must be at least drafter.num_depths ({self.num_depths}), the K served; got "
                f"{self.k_train}"
            )
        return self


class TrainingConfig(_Section):
    num_workers: int | list[int] = 2
    """Ray Train workers (data-parallel): N, or [min, max] for elastic training. Elastic runs start with as
    many workers as the cluster has room for (at least min), shrink when a node is lost, and grow again (from
    the last checkpoint) when capacity returns; gradients are averaged over the current world size and the
    data shards are re-split over it."""

    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement strategy of the workers' bundles: PACK fills a node first, SPREAD puts them on as many
    nodes as it can (STRICT_* refuse to start otherwise)."""

    resize_check_s: float = Field(default=60.0, gt=0.0)
    """Elastic runs (num_workers = [min, max]) below max look for room for more workers this often (seconds);
    Ray Train's elastic_resize_monitor_interval_s."""

    use_gpu: bool = False
    """Train on GPUs (one per worker, nccl) instead of CPUs (gloo)."""

    cpus_per_worker: int = Field(default=1, ge=1)
    """CPUs reserved for each worker; Ray sets the worker's OMP_NUM_THREADS (torch's threads) to it."""

    precision: Literal["float32", "bfloat16"] = "float32"
    """Training math: float32, or bfloat16 autocast (weights, optimizer state and the loss's softmax stay
    float32). bfloat16 is the usual choice on GPUs, and on CPUs with AMX (`bench train-memory --bf16` measures
    the step both ways); CPUs without bf16 units are faster in float32."""

    learning_rate: float = Field(default=3e-4, gt=0.0)
    """Peak AdamW learning rate."""

    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW weight decay."""

    warmup_steps: int = Field(default=10, ge=0)
    """Linear warm-up steps before the cosine decay."""

    max_steps: int = Field(default=200, gt=0)
    """Optimizer steps to train for."""

    epochs: int = Field(default=1, gt=0)
    """Passes over the data; training stops at whichever of epochs / max_steps comes first."""

    grad_clip: float = Field(default=1.0, gt=0.0)
    """Max global gradient norm."""

    sequences_per_step: int = Field(default=1, ge=1)
    """Sequences whose gradients are accumulated per optimizer step (per worker)."""

    segment_length: int = Field(default=2048, gt=0)
    """Sequence partitioning: most elements (anchor, depth pairs) in one forward/backward segment."""

    depth_weights: list[float] | None = None
    """Per-depth loss weights (length K). None weighs all depths equally."""

    loss: Loss = "kl"
    """The per-element loss: "kl", forward KL(target || draft) over the draft vocabulary (P-EAGLE's and the
    reference trainer's), or "argmax_ce", the cross-entropy of the target's argmax token, which is what greedy
    verification accepts (an acceptance-aligned loss: it spends no capacity on the rest of the distribution).
    Logged loss and val/kl figures are that loss."""

    feature_noise: float = Field(default=0.0, ge=0.0)
    """EAGLE-style noise on the target's aux hidden states while training: uniform in +-feature_noise x the
    sequence's hidden std (EAGLE trained with U(-0.1, 0.1)); it makes the drafter robust to its own errors in
    the features. 0 turns it off."""

    init_from: str | None = None
    """Start from another drafter's weights: an exported drafter directory (model.safetensors) or a training
    checkpoint (drafter.safetensors), e.g. a trained EAGLE-3 drafter fine-tuned into P-EAGLE. Tensors of equal
    name and shape are copied (P-EAGLE's mask_hidden keeps its fresh init when the source is EAGLE-3); the
    draft vocabularies must match. A resumed run continues from its own checkpoint instead."""

    validate_every: int = Field(default=50, gt=0)
    """Run validation every this many steps."""

    validation_records: int | None = Field(default=None, gt=0)
    """Most validation records measured each time (the first N by sample id); None measures all. Greedy
    replay runs one draft forward per accepted step, several seconds per long record on a small CPU."""

    validation_prefix: str = ""
    """Only validation records whose sample id starts with this are measured (e.g. "traffic:": adapt's curve
    is the workload's held-out requests, not the general data it replays); "" measures every source."""

    seed: int = 0
    """Seed of every generator used in training (COD sampling, init, data order). Data generation
    (regeneration, Magpie, sampling sources) is seeded by data.seed."""

    checkpoints_to_keep: int = Field(default=2, ge=1)
    """Checkpoints Ray Train keeps per run, the best by val/acceptance_length (the export reads the best)."""

    run_name: str = "peagle"
    """Ray Train run name; re-running the same name resumes from its last checkpoint."""

    storage_path: str = "runs/train"
    """Local directory of the run's outputs (exports, summaries, the local MLflow store) and, unless
    training.checkpoint_uri is set, of Ray Train's checkpoints. Every node must see it at the same path (one
    host, or a shared file system such as NFS): training refuses to start on a cluster with a node that
    cannot, naming this field."""

    checkpoint_uri: str | None = None
    """Ray Train's checkpoints in object storage instead of storage_path: a pyarrow.fs URI such as
    s3://bucket/prefix or gs://bucket/prefix (file:///abs/path for a local file system). Nodes then need
    no shared disk for checkpoints; the driver still writes the outputs under storage_path."""

    max_failures: int = Field(default=1, ge=0)
    """Worker crashes recovered from the last checkpoint before the run fails."""

    log_every: int = Field(default=1, gt=0)
    """Log training metrics to MLflow every this many steps."""

    crash_once_at_step: int | None = Field(default=None, ge=0)
    """Fault injection for recovery tests: worker rank 1 (or 0 with one worker) raises once when it reaches
    this step. Leave unset."""

    @field_validator("checkpoint_uri")
    @classmethod
    def _a_uri(cls, v: str | None) -> str | None:
        if v is not None and "://" not in v:
            raise ValueError(
                f"must be a URI such as s3://bucket/prefix (a local directory is training.storage_path); got {v!r}"
            )
        return v

    @field_validator("num_workers")
    @classmethod
    def _worker_count_or_range(cls, v: int | list[int]) -> int | list[int]:
        if isinstance(v, int):
            if v < 1:
                raise ValueError(f"must be at least 1; got {v}")
        elif len(v) != 2 or not 1 <= v[0] <= v[1]:
            raise ValueError(f"must be N or [min, max] with 1 <= min <= max; got {v}")
        return v

    @property
    def worker_range(self) -> tuple[int, int]:
        """(min, max) workers; equal for a fixed-size run."""
        n = self.num_workers
        return (n, n) if isinstance(n, int) else (n[0], n[1])

    @field_validator("depth_weights")
    @classmethod
    def _non_negative_weights(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (not v or min(v) < 0 or sum(v) <= 0):
            raise ValueError(f"must be non-negative with a positive sum; got {v}")
        return v


class TrackingConfig(_Section):
    tracking_uri: str | None = None
    """MLflow tracking URI. None starts a local MLflow server (sqlite backend, loopback) for the run."""

    experiment: str = "peagle-ray"
    """MLflow experiment name."""

    registered_model: str | None = "peagle-drafter"
    """Model-registry name the best drafter is registered under; None skips registration."""

    port: int = Field(default=5000, gt=0, lt=65536)
    """Port of the local MLflow server started when tracking_uri is None."""


class ServingConfig(_Section):
    host: str = "127.0.0.1"
    """Address the REST endpoint binds to. Loopback unless you mean to expose it."""

    port: int = Field(default=8000, gt=0, lt=65536)
    """Port of the REST endpoint."""

    api_token: str | None = None
    """Bearer token required on every request when set; None disables auth."""

    num_speculative_tokens: int | None = Field(default=None, ge=1)
    """K used when serving. None takes the drafter's recommended K (or drafter.num_depths)."""

    decoder: Literal["auto", "target", "drafter", "suffix", "hybrid"] = "auto"
    """What the endpoint decodes with. auto: what the drafter's evaluation measured fastest on its judged
    prompts (its recommendation.json: the drafter, suffix decoding, the hybrid, or the target alone); drafter:
    the trained drafter; suffix: vLLM's suffix decoding (training-free: drafts from earlier prompts and
    answers); hybrid: both in one engine, suffix decoding's draft where its score reaches
    serving.hybrid_threshold (peagle_ray/hybrid.py); target: no drafting."""

    hybrid_threshold: float | Literal["drafter"] | None = "drafter"
    """The hybrid's rule: take suffix decoding's draft where its score (the sum of its tokens' estimated
    probabilities: the tokens it expects accepted) reaches this, else the drafter's. "drafter" (the default):
    the drafter's own mean accepted tokens per draft so far in the engine, i.e. suffix decoding's draft
    wherever it expects more than the drafter delivers (measured on the demo's held-out requests: AL 2.13 and
    1.69x against 1.82 and 1.56x at K / 2, docs/hybrid_adaptive_threshold_smollm2.json); a number fixes it;
    None: K / 2 (hybrid.default_threshold; Arctic Inference's K takes almost no suffix draft where vLLM stops
    them at K)."""

    @field_validator("hybrid_threshold")
    @classmethod
    def _positive_threshold(cls, v):
        if isinstance(v, float | int) and v <= 0:
            raise ValueError(f'must be above 0 or "drafter"; got {v}')
        return v

    draft_max_batch_size: int | None = Field(default=None, ge=1)
    """Draft only while at most this many requests run at once; above it the endpoint decodes with the target
    alone (vLLM's num_speculative_tokens_per_batch_size schedule). None drafts at every batch size. Suffix
    decoding served alone drafts at every batch size whatever this says (vLLM's suffix proposer takes no
    per-batch K; its drafts are tree lookups, not forward passes). Verifying
    K drafts per request costs more than it saves once the batch fills the hardware: measure the crossover
    with `peagle-ray bench load --clients N` against the target alone served the same way."""

    num_gpus: float = Field(default=0, ge=0)
    """GPUs the endpoint replica takes (Ray actor option num_gpus). 0 runs its vLLM engine on CPU."""

    max_prompt_tokens: int = Field(default=1536, gt=0)
    """Longest prompt accepted; longer ones get HTTP 400."""

    max_tokens_limit: int = Field(default=512, gt=0)
    """Most tokens one request may generate: prompts x n x max_tokens; more gets HTTP 400. A request
    without max_tokens gets this divided by prompts x n."""

    max_n: int = Field(default=8, gt=0)
    """Largest `n` / `best_of` (completions per prompt) a request may ask for."""

    max_logprobs: int = Field(default=20, ge=0)
    """Largest `logprobs`, `top_logprobs` or `prompt_logprobs` a request may ask for."""

    max_prompts_per_request: int = Field(default=16, gt=0)
    """Most prompts in one list-valued `prompt` of /v1/completions."""

    log_dir: str = "runs/logs"
    """Where server processes write their logs."""

    record_dir: str | None = None
    """Record the endpoint's traffic here for `peagle-ray adapt` (None: off). Per finished request: the
    messages or prompt as sent, the prompt's token ids as the target saw them, the generated token ids,
    the sampling parameters, the model and drafter version; never headers or tokens (serve/record.py).
    Files are JSONL, mode 0600; a write failure logs one warning and recording stops."""

    record_file_mb: float = Field(default=64.0, gt=0.0)
    """Size at which a recording file is closed and the next one started."""

    record_max_mb: float = Field(default=1024.0, gt=0.0)
    """Most megabytes one endpoint replica keeps recorded; its oldest files are deleted beyond it."""

    drafter_version: str | None = None
    """The drafter's registered version (e.g. peagle-drafter/3), shown by /v1/speculative_stats and
    recorded with traffic; `peagle-ray adapt` sets it when it swaps a version in."""


class EvalConfig(_Section):
    k_values: list[int] = Field(default_factory=lambda: list(range(1, 9)))
    """Speculative lengths K swept for each algorithm."""

    prompts_per_category: int = Field(default=8, gt=0)
    """Held-out prompts per category used for acceptance measurement."""

    timing_prompts: int = Field(default=4, gt=0)
    """Prompts decoded at batch 1 for tokens/s (fewer than the acceptance set: timing is slow)."""

    engines_at_once: int = Field(default=4, ge=2)
    """vLLM engines kept alive side by side while decoders are timed: the target alone and up to N - 1
    decoders take the timed prompts in turn, prompt by prompt, so that drift between engine runs cannot
    decide a verdict. More decoders are timed in groups, each beside its own target-alone engine. Each holds
    target.kv_cache_gib of memory on CPU, an equal share of vLLM's GPU memory on a GPU."""

    max_new_tokens: int = Field(default=128, gt=0)
    """Tokens generated per evaluation prompt."""

    target_step_ms: float = Field(default=0.0, ge=0)
    """Emulate a larger target: every engine judged (the target alone and each decoder) sleeps this many
    milliseconds in each target forward (the plugin in peagle_ray/hybrid.py), as a target whose step costs
    that much more would. Shows the speedup an acceptance length gives where the drafter is a small part of
    the step (a one-layer drafter is ~3-5% of an 8B target's step on a GPU); 0 = off. Never for serving."""

    suite: Literal["validation", "mt-bench", "humaneval"] = "validation"
    """Prompts evaluated: the prepared validation split, MT-Bench's 80 first turns (8 categories), or
    HumanEval's 164 function stubs - the paper's benchmarks, read offline (the `data` extra)."""

    @field_validator("k_values")
    @classmethod
    def _positive_ks(cls, v: list[int]) -> list[int]:
        if not v or min(v) < 1:
            raise ValueError(f"must be a non-empty list of K >= 1; got {v}")
        return v


class AdaptConfig(_Section):
    traffic_dir: str | None = None
    """Recorded traffic to adapt on; None reads serving.record_dir (where the endpoint records)."""

    alias: str = "serving"
    """Registry alias of the drafter the endpoint serves: adaptation starts from it and moves it to the
    new version when promoted. The first version registered under tracking.registered_model gets it."""

    max_steps: int = Field(default=100, gt=0)
    """Fine-tuning steps of one adaptation (training.* gives everything else: lr, sequences per step...)."""

    replay: list[str] = Field(default_factory=list)
    """General data mixed into each adaptation against forgetting, as data.sources entries (e.g.
    ["sharegpt:32"]): captured with the traffic and trained on beside it; only the traffic is judged."""

    min_requests: int = Field(default=16, gt=0)
    """Fewest recorded training samples worth adapting on; fewer is refused with the count found. Counted
    among the requests recorded since the last adaptation (adapt.since): a round with fewer new requests is
    skipped, so a version is never promoted again on evidence it was already judged on."""

    since: float | None = None
    """Adapt on the requests recorded after this Unix time. None: after the newest request the last
    adaptation of tracking.registered_model learnt from (its registered model's tag adapt.traffic_until), every
    request where none ran yet; 0 adapts on the whole recording again."""

    validation_fraction: float = Field(default=0.25, gt=0.0, lt=1.0)
    """Share of recorded requests (by conversation id, else by request) held out to judge the new version."""

    min_gain: float = Field(default=0.05, ge=0.0)
    """Held-out traffic AL the new version must gain over the served one to be promoted."""

    max_regression: float = Field(default=0.02, ge=0.0)
    """Most AL the new version may lose on the general suite (forgetting) and still be promoted."""

    general_suite: Literal["mt-bench", "humaneval"] = "mt-bench"
    """Fixed suite both versions are measured on to catch forgetting."""

    swap: bool = True
    """After a promotion, swap the new drafter into the endpoint running on this Ray cluster (if any)."""

    decoders: list[Literal["suffix", "hybrid"]] = Field(default_factory=lambda: ["suffix", "hybrid"])
    """Decoders timed beside the served drafter on the held-out traffic, side by side with the target alone;
    the fastest measurably faster one is served (eval.metrics.pick_decoder): suffix = vLLM's suffix decoding,
    hybrid = the drafter and suffix decoding in one engine (serving.hybrid_threshold). [] judges the drafter
    alone."""

    warmup_requests: int = Field(default=64, ge=0)
    """The most recent recorded training requests the suffix and hybrid engines generate before they are
    timed: the answers a serving endpoint's suffix cache already holds."""


class DemoConfig(_Section):
    workload: str = "humaneval"
    """The traffic the demo sends through its endpoint and adapts to: `humaneval` (code completion),
    `sharegpt-WORD` (ShareGPT first turns containing WORD, e.g. sharegpt-email) or `builtin-CATEGORY`
    (one category of the built-in suite, e.g. builtin-coding); the names `peagle-ray bench adapt` takes."""

    requests: int = Field(default=48, gt=1)
    """Workload requests sent through the endpoint, one at a time; adapt.validation_fraction of the recorded
    ones are held out to judge the general and the adapted drafter."""

    max_tokens: int = Field(default=64, gt=0)
    """max_tokens of each workload request."""

    compare_eagle3: bool = False
    """Also train EAGLE-3 on the general data and budget and compare it with the general P-EAGLE drafter
    (`peagle-ray eval` on the general validation split): off the demo's critical path, ~15 more minutes."""


class PeagleConfig(_Section):
    target: TargetConfig = Field(default_factory=TargetConfig)
    """The model being served and verified against."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Conversations and their preparation."""
    capture: CaptureConfig = Field(default_factory=CaptureConfig)
    """Hidden-state capture from the Serve-hosted target."""
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    """The drafter's architecture and sampling."""
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    """The Ray Train job."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """MLflow."""
    serving: ServingConfig = Field(default_factory=ServingConfig)
    """The drafting-enabled REST endpoint."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Acceptance and throughput evaluation."""
    adapt: AdaptConfig = Field(default_factory=AdaptConfig)
    """Adapting the served drafter to recorded traffic (`peagle-ray adapt`)."""
    demo: DemoConfig = Field(default_factory=DemoConfig)
    """`peagle-ray demo`'s workload loop."""

    @model_validator(mode="after")
    def _cross_section_rules(self) -> PeagleConfig:
        k = self.drafter.trained_depths
        weights = self.training.depth_weights
        if weights is not None and len(weights) != k:
            raise ValueError(
                f"training.depth_weights must have one weight per trained depth ({k}); got {len(weights)} weights"
            )
        magpie = [s for s in self.data.sources if s.startswith("magpie:")]
        if magpie and not self.data.regenerate:
            raise ValueError(
                f"data.regenerate must be true for Magpie sources (they have no answers); got "
                f"sources {magpie} with regenerate false"
            )
        if self.serving.record_max_mb < self.serving.record_file_mb:
            raise ValueError(
                "serving.record_max_mb must be at least serving.record_file_mb (one file); got "
                f"{self.serving.record_max_mb} < {self.serving.record_file_mb}"
            )
        if self.drafter.cod_min_ratio > self.drafter.cod_keep_ratio:
            raise ValueError(
                "drafter.cod_min_ratio must not exceed drafter.cod_keep_ratio; "
                f"got {self.drafter.cod_min_ratio} > {self.drafter.cod_keep_ratio}"
            )
        return self

    def cache_path(self) -> Path:
        """The resolved cache directory."""
        return Path(self.target.cache_dir).expanduser() if self.target.cache_dir else default_cache_dir()


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        got = "" if "; got " in msg else f"; got {e['input']!r}"
        named = not field or msg.startswith(field)  # model-level rules name their fields themselves
        lines.append(msg if named else f"{field}: {msg}{got}")
    return "\n".join(lines)


def build_config(data: dict[str, Any] | None = None) -> PeagleConfig:
    """Validate a plain dict into a PeagleConfig, raising ConfigError with readable messages."""
    try:
        return PeagleConfig.model_validate(data or {})
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def with_values(cfg: PeagleConfig, values: dict[str, Any]) -> PeagleConfig:
    """A validated copy of `cfg` with dotted fields replaced, e.g. {"training.max_steps": 10}."""
    data = cfg.model_dump(mode="json")
    for key, value in values.items():
        section, _, name = key.partition(".")
        if section not in data or name not in data[section]:
            raise ConfigError(f"{key}: no such config field")
        data[section][name] = value
    return build_config(data)


def with_overrides(cfg: PeagleConfig, overrides: list[str]) -> PeagleConfig:
    """A validated copy of `cfg` with `section.field=value` overrides (values parsed as YAML) applied."""
    data = cfg.model_dump(mode="json")
    for override in overrides:
        _apply_override(data, override)
    return build_config(data)


def _apply_override(data: dict[str, Any], override: str) -> None:
    """Apply `section.field=value` (value parsed as YAML) to a nested dict in place."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override must look like section.field=value; got {override!r}")
    *parents, leaf = key.strip().split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
    node[leaf] = yaml.safe_load(raw)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PeagleConfig:
    """Read a YAML config (or start from defaults), apply dotted overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        loaded = yaml.safe_load(text)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections; got {type(loaded).__name__}")
        data = loaded or {}
    for override in overrides or []:
        _apply_override(data, override)
    return build_config(data)


def dump_config(cfg: PeagleConfig, path: str | Path | None = None) -> str:
    """The resolved config as YAML (written to `path` when given)."""
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    if path is not None:
        Path(path).write_text(text)
    return text
