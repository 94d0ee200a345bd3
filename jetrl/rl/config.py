"""GRPOConfig: the RL hyper-parameters, under TRL's field names, validated on construction.

One RL *step* is: sample ``generation_batch_size`` completions (``generation_batch_size /
num_generations`` prompts, ``num_generations`` samples each), score them, then run
``num_iterations`` epochs over them in micro-batches of ``per_device_train_batch_size``
completions, stepping the optimizer every ``gradient_accumulation_steps`` micro-batches.
So one RL step makes ``num_iterations * generation_batch_size / (per_device_train_batch_size
* gradient_accumulation_steps)`` optimizer steps. ``max_steps`` counts RL steps (TRL counts
optimizer steps; with the defaults below the two are equal). Under torchrun with N data-parallel
ranks (replicas.py), ``generation_batch_size`` stays the whole step's, as in TRL: each rank samples
1/N of it, in micro-batches of its own ``per_device_train_batch_size``.

Each field is documented once, in its ``help`` metadata (``jetrl train --help-config`` prints them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from jetrl.engine.sampling import GREEDY_BELOW
from jetrl.rl.correction import CORRECTION_LEVELS
from jetrl.rl.loss import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES
from jetrl.rl.schedule import LR_SCHEDULER_TYPES

TEMPLATE_ARGUMENTS = {"conversation", "messages", "add_generation_prompt", "continue_final_message", "tokenize",
                      "return_dict"}  # chat_template_kwargs may not set these: jetrl sets them


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def valid_template_kwargs(kwargs: Any) -> bool:
    """Whether ``kwargs`` can reach a chat template (``chat_template_kwargs``, ``--chat-template-kwargs``): a mapping
    of keyword names, none of the ``TEMPLATE_ARGUMENTS`` jetrl sets itself."""
    return isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs) and not set(kwargs) & TEMPLATE_ARGUMENTS


@dataclass(kw_only=True)
class GRPOConfig:
    # --- schedule
    max_steps: int = _f(100, "RL steps (one rollout batch + its updates each)")
    learning_rate: float = _f(1e-5, "AdamW learning rate (after warmup; see lr_scheduler_type)")
    warmup_steps: int = _f(0, "optimizer steps of linear learning-rate warmup")
    lr_scheduler_type: str = _f("constant", "after warmup: 'constant' (DAPO, verl), 'linear' (TRL's default) or "
                                            "'cosine' decay to 0 at the end of max_steps (jetrl/rl/schedule.py)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.99, "AdamW beta2")
    max_grad_norm: float = _f(1.0, "clip the global gradient norm to this (0 disables clipping)")
    seed: int = _f(0, "seed of data order, sampling and initialization")
    # --- rollout
    num_generations: int = _f(8, "completions per prompt (the GRPO group size G)")
    generation_batch_size: int = _f(64, "completions per RL step, over all data-parallel ranks as in TRL (a multiple "
                                    "of num_generations; each rank samples whole groups)")
    max_prompt_length: int = _f(256, "prompts longer than this (in tokens) are an error at start")
    max_completion_length: int = _f(256, "maximum new tokens per completion")
    temperature: float = _f(1.0, "sampling temperature of the rollout; the trainer's logprobs are of the same "
                            "tempered distribution, softmax(logits / T), as TRL's")
    top_p: float = _f(1.0, "nucleus sampling mass of the rollout")
    top_k: int = _f(0, "top-k of the rollout (0 = off)")
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "keyword arguments of the tokenizer's chat template, for training and held-out prompts alike, as "
                "TRL's: e.g. {enable_thinking: false} for Qwen3"})
    # --- update
    per_device_train_batch_size: int = _f(16, "completions per micro-batch, per data-parallel rank")
    gradient_accumulation_steps: int = _f(4, "micro-batches per optimizer step")
    num_iterations: int = _f(1, "epochs over each rollout batch (GRPO's mu)")
    epsilon: float = _f(0.2, "PPO clip range, lower side (epsilon_low)")
    epsilon_high: float | None = _f(None, "PPO clip range, upper side (DAPO clip-higher; None = epsilon)")
    loss_type: str = _f("dapo", f"loss aggregation, one of {LOSS_TYPES}")
    scale_rewards: str = _f("group", "advantage scaling: 'group' (GRPO), 'batch' or 'none' (Dr. GRPO)")
    importance_sampling_level: str = _f("token", "the policy ratio: 'token' (PPO/GRPO), 'sequence' (GSPO: one "
                                                 "ratio per completion, clip with epsilon=3e-4, epsilon_high=4e-4) or "
                                                 "'sequence_token' (GSPO-token)")
    beta: float = _f(0.0, "weight of the k3 KL to the initial (reference) policy; 0 = no reference model")
    mask_truncated_completions: bool = _f(False, "DAPO overlong filter: truncated completions get no loss")
    overlong_penalty_length: int = _f(0, "DAPO soft overlong penalty: the last N tokens before the limit (0 = off)")
    overlong_penalty_factor: float = _f(1.0, "DAPO soft overlong penalty at the limit")
    dynamic_sampling: bool = _f(False, "DAPO dynamic sampling: drop groups whose rewards are all equal")
    reward_weights: list[float] | None = _f(None, "weights of the reward functions (None = all 1)")
    # --- precision flow and off-policy handling
    old_logprobs: str = _f("auto", "'recompute' (trainer pass), 'rollout' (reuse the rollout's: an on-policy recipe, "
                           "top_p=1, top_k=0 and no rollout_correction), or 'auto' (rollout where it may)")
    rollout_correction: str = _f("none", "'none', 'tis' (truncated IS) or 'mis' (masked IS / IcePop)")
    rollout_correction_threshold: float = _f(2.0, "C of TIS/MIS (> 1)")
    rollout_correction_level: str = _f("token", "the IS ratio TIS/MIS compare with C: 'token', 'sequence' (the "
                                                "product over a completion) or 'geometric' (its per-token mean); a "
                                                "sequence level weights or rejects whole completions")
    nonfinite_step: str = _f("skip", "a step whose loss or gradient is NaN/Inf: 'skip' it or 'stop' the run")
    # --- data parallel (torchrun; jetrl/rl/replicas.py)
    shard_optimizer_state: bool = _f(False, "data parallel: each rank keeps the AdamW state of its share of the "
                                     "parameters only (ZeRO-1), dividing that memory by the rank count; the owner "
                                     "broadcasts each updated parameter, so the replicas stay bit-identical. No effect "
                                     "on one process")
    shard_weights: bool = _f(False, "data parallel under an FP8-trained recipe (jet, jet_kv): each rank keeps the BF16 "
                             "master, gradient and AdamW state of 1/N of every FP8 layer's rows and the full FP8 codes "
                             "the layers and the rollout read, all-gathered once per optimizer step "
                             "(jetrl/fp8/weight_shard.py): 2 + 8/N bytes per FP8-layer parameter instead of 10. No "
                             "effect on one process")
    # --- speed
    group_by_length: bool = _f(True, "form each optimizer step's micro-batches from its rows sorted by length, so "
                               "each is trimmed to rows of similar length (less padding computed; the same rows per "
                               "optimizer step); with eager layers (no train_cuda_graphs) a micro-batch of short "
                               "rows takes more of them, up to the positions and logit rows of the step's longest "
                               "micro-batch. Under loss_type=bnpo, whose loss is a per-micro-batch mean, the update "
                               "keeps rollout order; false makes data-parallel runs bit-identical across rank counts "
                               "(jetrl/rl/micro_batches.py)")
    train_cuda_graphs: str | bool = _f("auto", "replay the decoder layers' training forward+backward from CUDA graphs, "
                                       "one per micro-batch shape: 'on' (or true), 'off' (or false), or 'auto' (on "
                                       "for models of up to 3.5B parameters on CUDA, where eager training is "
                                       "host-bound; jetrl/rl/train_graphs.py says what it costs)")
    train_graph_length_multiple: int | str = _f("auto", "with train_cuda_graphs, micro-batch lengths are padded up "
                                                "to a multiple of this (fewer shapes to capture against more "
                                                "padding); 'auto': 128, or coarser where the longest sequence "
                                                "(max_prompt_length + max_completion_length) would otherwise need "
                                                "more than 6 lengths, so the captured shapes stay within the "
                                                "graphs' cache when micro-batches are grouped by length")
    train_graph_row_multiple: int = _f(1, "with train_cuda_graphs, a micro-batch's rows are padded up to a multiple "
                                       "of this (a divisor of per_device_train_batch_size; 1 = no padding): with "
                                       "per_device_train_batch_size, a short last micro-batch (dynamic sampling) "
                                       "replays the full one's graph instead of a capture of its own, and computes "
                                       "its padding rows (jetrl/rl/train_graphs.py says when that pays)")
    train_graph_capture_on_use: int = _f(2, "with train_cuda_graphs, a micro-batch shape is captured on this use; the "
                                         "ones before it run eagerly, with the same numbers (1 = capture on first "
                                         "use; jetrl/rl/train_graphs.py)")

    def __post_init__(self) -> None:
        if isinstance(self.train_cuda_graphs, bool):  # YAML reads an override's on/off as a boolean
            self.train_cuda_graphs = "on" if self.train_cuda_graphs else "off"
        positive = ("max_steps", "num_generations", "generation_batch_size", "max_prompt_length",
                    "max_completion_length", "per_device_train_batch_size", "gradient_accumulation_steps",
                    "num_iterations")
        multiple = self.train_graph_length_multiple
        if multiple != "auto" and (not isinstance(multiple, int) or isinstance(multiple, bool) or multiple < 1):
            raise ValueError(f"grpo.train_graph_length_multiple={multiple!r} must be 'auto' or an int >= 1")
        for name in (*positive, "train_graph_row_multiple", "train_graph_capture_on_use"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"grpo.{name}={value!r} must be an int >= 1")
        if self.per_device_train_batch_size % self.train_graph_row_multiple:
            raise ValueError(f"grpo.train_graph_row_multiple={self.train_graph_row_multiple} must divide "
                             f"grpo.per_device_train_batch_size={self.per_device_train_batch_size}, or full "
                             "micro-batches would be padded too; use 1 (no padding) or the micro-batch size")
        if self.generation_batch_size % self.num_generations:
            raise ValueError(
                f"grpo.generation_batch_size={self.generation_batch_size} must be a multiple of "
                f"grpo.num_generations={self.num_generations}"
            )
        if self.generation_batch_size % self.per_device_train_batch_size:
            raise ValueError(
                f"grpo.generation_batch_size={self.generation_batch_size} must be a multiple of "
                f"grpo.per_device_train_batch_size={self.per_device_train_batch_size}"
            )
        if self.num_generations < 2:
            raise ValueError(f"grpo.num_generations={self.num_generations} must be >= 2: an advantage is a reward "
                             "minus its group's mean, so a group of one has zero advantage and nothing is learned")
        checks = [
            (0 < self.learning_rate < math.inf, "learning_rate", "must be > 0 and finite"),
            (GREEDY_BELOW <= self.temperature < math.inf, "temperature",
             f"must be >= {GREEDY_BELOW} and finite for RL sampling (below it the engine decodes greedily)"),
            (0 <= self.adam_beta1 < 1, "adam_beta1", "must be in [0, 1)"),
            (0 <= self.adam_beta2 < 1, "adam_beta2", "must be in [0, 1)"),
            (0 <= self.weight_decay < math.inf, "weight_decay", "must be >= 0 and finite"),
            (valid_template_kwargs(self.chat_template_kwargs), "chat_template_kwargs",
             ("must be a mapping of keyword names to values, e.g. {enable_thinking: false}, "
              f"none of {sorted(TEMPLATE_ARGUMENTS)} (jetrl sets those)")),
            (self.reward_weights is None or (len(self.reward_weights) > 0 and all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
                for w in self.reward_weights)),
             "reward_weights", "must be None (all 1) or a list of finite numbers, one per reward function"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be >= 0"),
            (0 <= self.epsilon < 1, "epsilon", "must be in [0, 1)"),
            (self.epsilon_high is None or self.epsilon_high >= 0, "epsilon_high", "must be >= 0"),
            (0 <= self.beta < math.inf, "beta", "must be >= 0 and finite"),
            (0 <= self.overlong_penalty_factor < math.inf, "overlong_penalty_factor", "must be >= 0 and finite"),
            (self.max_grad_norm >= 0, "max_grad_norm", "must be >= 0"),
            (self.warmup_steps >= 0, "warmup_steps", "must be >= 0"),
            (self.lr_scheduler_type in LR_SCHEDULER_TYPES, "lr_scheduler_type", f"must be one of {LR_SCHEDULER_TYPES}"),
            (self.loss_type in LOSS_TYPES, "loss_type", f"must be one of {LOSS_TYPES}"),
            (self.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS, "importance_sampling_level",
             f"must be one of {IMPORTANCE_SAMPLING_LEVELS}"),
            (self.scale_rewards in ("group", "batch", "none"), "scale_rewards", "must be 'group', 'batch' or 'none'"),
            (self.old_logprobs in ("auto", "recompute", "rollout"), "old_logprobs", "must be 'auto', 'recompute' or 'rollout'"),
            (self.rollout_correction in ("none", "tis", "mis"), "rollout_correction", "must be 'none', 'tis' or 'mis'"),
            (self.rollout_correction_threshold > 1, "rollout_correction_threshold", "must be > 1"),
            (self.rollout_correction_level in CORRECTION_LEVELS, "rollout_correction_level",
             f"must be one of {CORRECTION_LEVELS}"),
            (self.nonfinite_step in ("skip", "stop"), "nonfinite_step", "must be 'skip' or 'stop'"),
            (self.train_cuda_graphs in ("auto", "on", "off"), "train_cuda_graphs", "must be 'auto', 'on' or 'off'"),
            (not (self.shard_weights and self.shard_optimizer_state), "shard_optimizer_state",
             ("cannot be combined with grpo.shard_weights=true, which shards the FP8 layers' AdamW state already (the "
              "rest -- embeddings, norms, lm_head -- stays whole); set one of them")),
            (0 <= self.overlong_penalty_length < self.max_completion_length, "overlong_penalty_length",
             "must be in [0, max_completion_length)"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"grpo.{name}={getattr(self, name)!r} {why}")

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def prompts_per_step(self) -> int:
        return self.generation_batch_size // self.num_generations

    @property
    def optimizer_steps_per_rl_step(self) -> int:
        """Per epoch over the rollout batch, one step per gradient_accumulation_steps micro-batches, the last one on
        what is left (as the trainer's update loop groups them). One process: :meth:`rl_step_optimizer_steps`."""
        return self.rl_step_optimizer_steps(1)

    def rl_step_optimizer_steps(self, world_size: int = 1) -> int:
        """The optimizer steps a full RL step makes on each of ``world_size`` data-parallel ranks (each holds 1/N of
        the micro-batches); the learning-rate schedule's unit (jetrl/rl/schedule.py)."""
        micro = self.generation_batch_size // world_size // self.per_device_train_batch_size
        return self.num_iterations * -(-micro // self.gradient_accumulation_steps)

    def generation_batch_size_per_rank(self, world_size: int) -> int:
        """Completions one of ``world_size`` data-parallel ranks samples per RL step: whole GRPO groups (a group
        never spans ranks) that the rank's micro-batches divide; an actionable error where the step cannot split."""
        if self.prompts_per_step % world_size:
            raise ValueError(f"{world_size} data-parallel ranks cannot split the step's {self.prompts_per_step} "
                             f"prompts (grpo.generation_batch_size={self.generation_batch_size} / grpo.num_generations="
                             f"{self.num_generations}) evenly: make the prompts per step a multiple of {world_size}")
        local = self.generation_batch_size // world_size
        if local % self.per_device_train_batch_size:
            size = self.per_device_train_batch_size
            raise ValueError(f"each of the {world_size} data-parallel ranks samples {local} completions per step, "
                             f"not a multiple of grpo.per_device_train_batch_size={size}: set "
                             f"grpo.per_device_train_batch_size={math.gcd(local, size)} "
                             "(or another divisor of that), or raise grpo.generation_batch_size")
        return local

    @classmethod
    def field_help(cls) -> dict[str, str]:
        return {f.name: f.metadata.get("help", "") for f in fields(cls)}
