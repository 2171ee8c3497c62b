"""Typed config: one dataclass per section, named and shaped like the reference's YAML.

These classes are the single source of truth for YAML files, `-o Section.key=value` overrides,
`gptforge config show` and the docs (docs/config.md is generated from the field comments).
A value left blank in YAML (`key:`) means "use the default / derive it", as in the reference.
Keys the reference accepts but that have no effect in PyTorch are kept (so reference files
load unchanged) and marked "accepted, no effect" in their comment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GlobalConfig:
    device: str = "auto"  # auto | cpu | cuda | gpu (= cuda) | cuda:N
    seed: int = 1024
    global_batch_size: int | None = None  # samples per optimizer step over all data ranks
    local_batch_size: int | None = None  # samples per optimizer step on one data rank
    micro_batch_size: int | None = None  # samples per forward/backward (local/micro = accumulation)


@dataclass
class ModelConfig:
    module: str = "GPTModule"  # accepted, no effect (the verb chooses what runs)
    name: str = "GPT"  # accepted; the tokenizer comes from Data.tokenizer or the checkpoint
    preset: str | None = None  # 345M | 1.3B | 6.7B | 13B | 175B | 124M | tiny | mini | small (fills unset shape keys)
    vocab_size: int = 50304  # padded up to a multiple of vocab_size_divisible_unit * mp_degree
    vocab_size_divisible_unit: int = 128
    hidden_size: int = 1024
    num_layers: int = 24
    num_attention_heads: int = 16
    head_dim: int | None = None  # derived: hidden_size / num_attention_heads
    ffn_hidden_size: int | None = None  # derived: 4 * hidden_size
    layer_num_heads: list[int] | None = None  # per-layer head counts (non-uniform shapes), else uniform
    layer_ffn_sizes: list[int] | None = None  # per-layer FFN widths (non-uniform shapes), else uniform
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 1024
    type_vocab_size: int = 16  # accepted, no effect (GPT has no token types)
    initializer_range: float = 0.02
    scale_output_init: bool = True  # out_proj/linear2 init std = range/sqrt(2L) (reference HEAD); False = 0.02 everywhere
    layer_norm_epsilon: float = 1e-5
    use_recompute: bool = False
    recompute_granularity: str | None = None  # full | full_attn | core_attn (derived: full when use_recompute)
    no_recompute_layers: list[int] | None = None
    fused_linear: bool = False  # accepted, no effect (PyTorch's addmm already fuses the bias)
    fuse_attn_qkv: bool = True  # our model always fuses qkv; False only describes .pdparams layouts on import
    scale_qk_by_layer_num: bool = True  # accepted, numerically a no-op in the reference
    sequence_parallel: bool = False  # only with mp_degree > 1
    use_flash_attn: bool = False  # accepted; scaled_dot_product_attention picks flash kernels on GPU anyway
    fused_softmax_with_triangular: bool = True  # accepted, no effect
    virtual_pp_degree: int = 1  # pipeline stages per rank (interleaved / looped / ZBV schedules)
    recompute_layers: list[int] | None = None  # old layout: layers to recompute (blank = all); becomes no_recompute_layers
    recompute_start_layer: int | None = None  # old layout: recompute layers >= this index; becomes no_recompute_layers
    # Mixture of Experts (the reference's pretrain_moe layout; docs/moe.md)
    num_experts: list[int] = field(default_factory=lambda: [1])  # experts per MoE layer: one value, or one per MoE layer ('2,' = [2]); 1 = dense model
    expert_interval: int = 1  # layer i (0-based) is MoE when (i + 1) % expert_interval == 0
    topk: int = 1  # experts per token (1 or 2; naive gate: any k <= num_experts)
    moe_gate: str | None = None  # switch (top-1) | gshard (top-2) | naive (top-k, no capacity, no aux loss); derived from topk
    moe_use_residual: bool = False  # Residual MoE: a dense FFN beside the experts, mixed by a learned 2-way softmax
    moe_train_capacity_factor: float = 1.0  # expert capacity = ceil(tokens * topk / num_experts * factor) in training
    moe_eval_capacity_factor: float = 1.0  # the same for eval / generate
    moe_min_capacity: int = 4  # capacity never below this many tokens per expert
    moe_token_dropping: bool = True  # drop assignments past capacity (their FFN output is 0; the residual carries them); False = no limit
    balance_loss_weight: float = 0.01  # weight of the mean per-layer load-balancing loss added to the training loss
    enable_expert_tensor_parallelism: bool = False  # accepted when false; true (experts split over mp) is refused
    # fine-tuning (gptforge finetune)
    num_classes: int | None = None  # sequence-classification labels (GPTFinetuneModule)
    pretrained: str | None = None  # fine-tuning: the weights to start from (a model directory or a .pdparams prefix)
    loss: dict[str, Any] | None = None  # fine-tuning: {train: {name: CrossEntropyLoss}, eval: {...}}
    metric: dict[str, Any] | None = None  # fine-tuning: {eval: {name: Accuracy}}


@dataclass
class DatasetConfig:
    name: str = "GPTDataset"
    input_dir: str = "./data/"  # a directory with <prefix>_ids.npy + <prefix>_idx.npz, a prefix, or "builtin"
    split: Any = field(default_factory=lambda: [949, 50, 1])  # three weights [949, 50, 1] (also '949,50,1'); a GLUE split name (train, dev, ...) for fine-tuning
    max_seq_len: int = 1024
    num_samples: int | None = None  # accepted, no effect (old layout): derived from max_steps x global batch
    eos_id: int | None = None  # accepted, no effect (old layout): EOS comes from the tokenizer; the loss mask is all ones
    mode: str | None = None  # accepted, no effect (old layout): Train/Eval/Test comes from the section
    overlapping_eval: int | None = None  # accepted, no effect (offline-eval examples layout: its run.py overwrites it with Offline_Eval.overlapping_eval)
    # fine-tuning (gptforge finetune)
    root: str | None = None  # GLUE: the task's directory of TSV files
    max_length: int | None = None  # GLUE: tokens per example (truncate / pad)


@dataclass
class SamplerConfig:
    name: str = "GPTBatchSampler"
    shuffle: bool = False  # accepted; order comes from the dataset's shuffle_idx
    drop_last: bool = True
    num_replicas: int | None = None  # accepted, no effect (old layout): derived from the launch
    rank: int | None = None  # accepted, no effect (old layout): derived from the launch
    # fine-tuning (gptforge finetune)
    batch_size: int | None = None  # DistributedBatchSampler: samples per rank per step


@dataclass
class LoaderConfig:
    num_workers: int = 1
    return_list: bool = False  # accepted, no effect
    collate_fn: str = "gpt_collate_fn"  # accepted, no effect


@dataclass
class DataSplitConfig:
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    collate_fn: str | None = None  # accepted, no effect (auto-parallel layout)
    sample_split: int | None = None  # accepted, no effect (auto-parallel layout: how many sample fields are inputs)


@dataclass
class DataConfig:
    Train: DataSplitConfig = field(default_factory=DataSplitConfig)
    Eval: DataSplitConfig = field(default_factory=DataSplitConfig)
    Test: DataSplitConfig = field(default_factory=DataSplitConfig)
    tokenizer: str | None = None  # gpt2 | a dir with tokenizer.json or vocab.json+merges.txt | a tokenizer.json (default: the checkpoint's, else gpt2)


@dataclass
class LRConfig:
    name: str = "CosineAnnealingWithWarmupDecay"  # | LinearDecayWithWarmup | Constant
    decay_steps: int | None = 360000  # derived: max_steps; converted to samples (x global batch)
    warmup_rate: float = 0.01  # fraction of decay_steps
    warmup_steps: int | None = None  # overrides warmup_rate when set
    max_lr: float = 5.0e-5
    min_lr: float = 1.0e-5
    use_increments: bool = True  # schedule measured in samples; False keeps lr at max_lr (the reference would keep 0)
    # fine-tuning (gptforge finetune)
    warmup: float | None = None  # LinearDecayWithWarmup: < 1 a fraction of the total steps (sets warmup_rate), else steps (sets warmup_steps)


@dataclass
class GradClipConfig:
    name: str = "ClipGradByGlobalNorm"
    clip_norm: float = 1.0  # 0 disables clipping
    multi_precision: bool = False  # accepted, no effect: the norm is always accumulated in fp32


@dataclass
class OptimizerConfig:
    name: str = "FusedAdamW"  # FusedAdamW | AdamW | Muon (blocks' matrices; AdamW for the rest)
    weight_decay: float = 0.01  # on 2-D weights incl. embeddings; never on biases or LayerNorm
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1.0e-8
    muon_momentum: float = 0.95  # Muon's Nesterov momentum (Optimizer.name: Muon only)
    lr: LRConfig = field(default_factory=LRConfig)
    grad_clip: GradClipConfig = field(default_factory=GradClipConfig)
    tensor_fusion: bool = False  # accepted; the fused/foreach AdamW kernels are used when available
    multi_precision: bool = False  # accepted, no effect: fp32 master weights are always kept


@dataclass
class MixPrecisionConfig:
    enable: bool = False  # old name: use_pure_fp16
    dtype: str = "float16"  # float16 | bfloat16
    level: str = "O2"  # O1 (autocast) | O2 (autocast + low-precision params where safe)
    scale_loss: float = 32768.0  # initial dynamic loss scale (float16 only)
    custom_black_list: list[str] = field(default_factory=list)  # accepted; loss and softmax always run in fp32
    custom_white_list: list[str] = field(default_factory=list)  # accepted, no effect
    use_main_grad: bool = False  # accepted; fp32 master weights are always kept
    use_fp16_guard: bool = False  # accepted, no effect (auto-parallel static graphs; autocast has no guard scopes)
    use_bf16_guard: bool = False  # accepted, no effect (as use_fp16_guard)


@dataclass
class SaveLoadConfig:
    save_steps: int | None = 1000  # blank or -1: only at the end
    save_epoch: int = 1  # run_mode epoch: save every N epochs (gptforge finetune)
    output_dir: str = "./output"
    ckpt_dir: str | None = None  # resume from this training checkpoint
    keep_last: int | None = None  # keep only the newest N step checkpoints
    load_meta_state: bool = True  # resume restores step, epoch and RNG state (False is not supported)
    load_rng_state: bool = True  # accepted: every RNG is always restored on resume (across world sizes too)


@dataclass
class DistillConfig:
    teacher: str | None = None  # a model directory (same tokenizer): adds a KL-to-teacher term to the training loss
    alpha: float = 0.5  # loss = (1 - alpha) * cross-entropy + alpha * temperature^2 * KL(teacher || student)
    temperature: float = 1.0  # both distributions are softened by it before the KL


@dataclass
class EngineConfig:
    run_mode: str = "step"  # step | epoch (epoch: fine-tuning)
    max_steps: int = 500000  # -1: derived from num_train_epochs (run_mode epoch), or unused (export/inference recipes)
    max_time: float | None = None  # seconds of training in this run: then save a checkpoint and stop (--resume continues)
    fit_to_max_time: bool = False  # with max_time: re-fit max_steps and the lr decay to the steps that fit in it, as measured
    fit_max_steps: int | None = None  # with fit_to_max_time: the most steps the fit may choose (None: no limit)
    num_train_epochs: int = 1  # run_mode epoch: passes over the training set (gptforge finetune)
    accumulate_steps: int | None = None  # derived: local_batch_size / micro_batch_size
    logging_freq: int = 1
    eval_freq: int = 500  # <= 0: never; in epochs under run_mode epoch
    eval_iters: int = 10
    test_iters: int | None = None  # derived: 10 * eval_iters
    mix_precision: MixPrecisionConfig = field(default_factory=MixPrecisionConfig)
    save_load: SaveLoadConfig = field(default_factory=SaveLoadConfig)
    compile: bool = False  # torch.compile the model (GPU; no gain on a small CPU)
    on_nonfinite: str = "stop"  # stop | skip: what a non-finite fp32/bf16 loss does
    verbose: int | None = None  # accepted, no effect (auto-parallel engine's log verbosity)
    auto_mode: str | None = None  # accepted, no effect (auto-parallel engine: semi)
    distill: DistillConfig = field(default_factory=DistillConfig)  # knowledge distillation from a teacher model
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])  # tensorboard | wandb | mlflow (docs/tracking.md)
    tracker_project: str = "gptforge"  # W&B project / MLflow experiment
    tracker_run_name: str | None = None  # W&B / MLflow run name (derived: the run directory's name)


@dataclass
class ShardingConfig:
    sharding_degree: int = 1
    sharding_stage: int = 1  # 1 optimizer state | 2 + grads | 3 + params
    sharding_offload: bool = False
    reduce_overlap: bool = False
    broadcast_overlap: bool = False
    comm_overlap: bool = False


@dataclass
class DistributedConfig:
    dp_degree: int | None = None  # derived: world / (mp * pp * sharding)
    mp_degree: int = 1
    pp_degree: int = 1  # pipeline stages (torch.distributed.pipelining)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    pp_recompute_interval: int = 1  # with full recompute under pp: blocks recomputed as one segment
    pp_schedule: str | None = None  # GPipe | 1F1B | Interleaved1F1B | LoopedBFS | InterleavedZeroBubble | ZBVZeroBubble (derived: 1F1B, Interleaved1F1B when Model.virtual_pp_degree > 1)
    fuse_sequence_parallel_allreduce: bool = False
    backend: str | None = None  # nccl | gloo (derived from the device)
    ep_degree: int = 1  # expert parallel: each MoE layer's experts split over this many data ranks (divides dp_degree and num_experts)
    sharding_in_dp: bool = False  # auto-parallel recipes (set for them): dp_degree counts the sharding ranks too (world = dp x mp x pp); applied, then reset


@dataclass
class GenerationConfig:
    decode_strategy: str = "sampling"  # sampling | greedy_search | beam_search
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    temperature: float = 1.0
    min_dec_len: int = 0
    max_dec_len: int = 20
    num_return_sequences: int = 1
    repetition_penalty: float = 1.0
    num_beams: int = 1
    num_beam_groups: int = 1
    length_penalty: float = 1.0  # beam score = sum logprob / len**length_penalty
    diversity_rate: float = 0.0
    early_stopping: bool = False
    use_topp_sampling: bool = False  # accepted (a CUDA op in the reference); same distribution as top_p
    inference: bool = False  # accepted, no effect
    use_cache: bool = True  # False: recompute the whole sequence every step (slow; a reference path)
    early_finish: bool = True  # stop when every sequence has emitted EOS
    fast_cpu_decode: bool = True  # CPU fp32: decode with oneDNN-packed weight copies (+1x weight memory)
    kv_cache_dtype: str = "auto"  # KV cache storage: auto (the model's dtype) | float32 | bfloat16 (1/2 the bytes) | int8 (per-head, per-token scales: ~1/4)
    bos_token_id: int | None = None  # derived: tokenizer EOS
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    seed: int | None = None
    draft: str | None = None  # speculative decoding: a draft model directory with the same tokenizer
    num_draft_tokens: str = "5"  # tokens the draft proposes per target step: an integer, or auto (adapts to acceptance)


@dataclass
class OfflineEvalConfig:
    eval_path: str | None = None  # LAMBADA jsonl or WikiText text file, supplied by the user
    cloze_eval: bool = False  # True: LAMBADA accuracy; False: perplexity
    lambada_split: str = "reference"  # LAMBADA context/target rule: reference (text.split(), the reference's) | lm_eval (lambada_openai's text.split(' '), example by example)
    overlapping_eval: int | None = 32  # perplexity window stride (blank = max_seq_len)
    detokenize: bool = True  # perplexity: undo WikiText's tokenization first (False: score the file's text as it is, e.g. code)
    batch_size: int = 8  # windows per forward pass; LAMBADA packs short passages into batch_size x max_seq_len tokens
    max_seq_len: int | None = None  # window in tokens (blank = the model's context); LAMBADA and lm-eval cap a longer one at the context
    logging_freq: int = 10  # only used by `gptforge eval --emulate-reference-aggregation`
    output: str | None = None  # results JSON (derived: ./eval_results_<lambada|wikitext|harness|glue>.json)


@dataclass
class QuantizationConfig:
    enable: bool = False
    weight_quantize_type: str = "channel_wise_abs_max"  # abs_max | channel_wise_abs_max
    activation_quantize_type: str = "moving_average_abs_max"  # moving_average_abs_max | abs_max
    activation_preprocess_type: str | None = None  # PACT
    weight_preprocess_type: str | None = None  # accepted; none supported besides None
    weight_bits: int = 8
    activation_bits: int = 8
    quantizable_layer_type: list[str] = field(
        default_factory=lambda: ["Linear", "ColumnParallelLinear", "RowParallelLinear"]
    )
    onnx_format: bool = True  # accepted, no effect: input and weight scales are always stored (the reference adds output-scale observers)
    freeze_embedding: bool = False  # word + position embeddings (and so the tied head) are not trained
    skip_tensor_map: dict[str, list[str]] = field(default_factory=dict)  # block_i: [qkv_proj|out_proj|linear1|linear2]
    skip_layers: list[str] = field(default_factory=list)  # globs over our names, e.g. "blocks.3.linear2", or reference names "linear_15"
    weight_only: bool = False  # 4-bit QAT: only the weights are fake-quantized, group-wise on the grid of `gptforge quantize --weights` (activations float); `quantize --weights int4` of the checkpoint gives the weight-only model
    group_size: int = 64  # weight_only: input columns per scale (and zero): 32 | 64 | 128 | 256, 0 = one per output row
    weight_sym: bool = True  # weight_only: symmetric groups; false: asymmetric (an integer zero point per group, `quantize --asym`)
    head_bits: int = 8  # weight_only: the tied embedding / LM head at 4 | 8 bits (same groups), 16 (bf16) or 32 (float, not quantized)
    learn_scales: bool = False  # weight_only: each group's scale is trained too (LSQ), starting from the clip that rounds the group best; `quantize --weights` of the checkpoint uses the learned scales
    scale_lr_mult: float = 50.0  # learn_scales: the scales' learning rate (of their logarithm) as a multiple of the weights'
    distill: bool = False  # qat: train toward the next-token distributions of the float model the run starts from (Compress.pretrained, the frozen teacher); the loss mix and temperature are Engine.distill.alpha / temperature (alpha 1: distillation only)
    quantize_embedding: bool = False  # also quantize the tied word embedding / LM head weight (per row, weight only); `quantize --convert` then stores it as int8
    moving_rate: float = 0.9  # moving_average_abs_max: accum = rate*accum + max|x|, state = rate*state + 1
    pact_init: float = 100.0  # PACT clip alpha at start
    pact_lr_mult: float = 1000.0  # PACT alpha learning-rate multiplier
    dtype: str = "int8"  # accepted
    window_size: int = 10000  # accepted, no effect
    fuse_conv_bn: bool = False  # accepted, no effect
    calib_batches: int = 8  # PTQ: batches used to calibrate activation scales
    calib_algo: str = "avg"  # PTQ observer: avg (mean of per-batch abs max) | abs_max (max over batches) | moving_average (the QAT update)
    converted: bool = False  # set by `gptforge quantize --convert`: weights are stored as int8 + scales (a real INT8 model)
    not_quant_pattern: list[str] = field(default_factory=lambda: ["skip_quant"])  # accepted: the LM head (the reference's skip_quant scope) is never quantized
    for_tensorrt: bool = False  # accepted, no effect
    is_full_quantize: bool = False  # accepted, no effect (only the block Linears are quantizable)


@dataclass
class PruneConfig:
    enable: bool = False
    criterion: str = "l1_norm"  # l1_norm | l2_norm | taylor | activation
    ratio: float = 0.125  # fraction of heads and FFN neurons removed
    head_ratio: float | None = None  # derived: ratio
    ffn_ratio: float | None = None  # derived: ratio
    scope: str = "uniform"  # uniform (same width in every layer) | global (per-layer widths)
    cal_sens: bool = False  # accepted, no effect
    semi_structured: str | None = None  # 2:4 sparsity: magnitude | wanda
    calib_batches: int = 8  # batches for taylor / activation / wanda scores


@dataclass
class CompressConfig:
    pretrained: str | None = None  # weights to start from (weights only, no optimizer state)
    Quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    Prune: PruneConfig = field(default_factory=PruneConfig)


@dataclass
class TensorRTConfig:  # accepted so reference inference files load; TensorRT is not used
    max_batch_size: int = 1
    workspace_size: int = 1 << 30
    min_subgraph_size: int = 3
    precision: str = "fp32"
    use_static: bool = False
    use_calib_mode: bool = False
    collect_shape: bool = False
    shape_range_info_filename: str | None = None


@dataclass
class InferenceConfig:
    model_dir: str = "./output"
    mp_degree: int = 1
    TensorRT: TensorRTConfig = field(default_factory=TensorRTConfig)


@dataclass
class ProfilerConfig:
    enable: bool = False
    scheduler: list[int] = field(default_factory=lambda: [1, 5])  # [start_step, end_step)
    profiler_log: str = "profiler_log"
    detailed: bool = False


@dataclass
class TuningConfig:  # auto-parallel recompute tuner: accepted, no effect (recompute is what Model.* says)
    enable: bool = False
    tuning_recompute: bool = False
    profile_start_step: int = 1
    profile_end_step: int = 1
    run_after_tuning: bool = True
    debug: bool = True


@dataclass
class LoraConfig:
    """LoRA / DoRA adapters (docs/lora.md); nested by the fine-tuning verbs, read by gptforge.adapters."""

    r: int = 8  # rank of every adapter
    alpha: float = 16.0  # scaling = alpha / r (alpha / sqrt(r) with rslora)
    dropout: float = 0.0  # dropout on the adapter's input (training only)
    rslora: bool = False  # rank-stabilized scaling alpha / sqrt(r) (peft use_rslora)
    dora: bool = False  # weight-decomposed LoRA: a trained magnitude per output row (peft use_dora)
    targets: list[str] = field(default_factory=lambda: ["q", "k", "v"])  # q | k | v | qkv | out_proj | linear1 | linear2 | head | all (= every block Linear)
    layers: list[int] | None = None  # block indices to adapt (blank: every block)
    init: str = "kaiming"  # kaiming (A kaiming-uniform, B zeros: peft's default) | gaussian (A ~ N(0, 1/r), B zeros)


@dataclass
class FusedPassesConfig:  # auto-parallel static-graph fusion passes: accepted, no effect
    enable: bool = False
    fused_passes_list: list[str] = field(default_factory=list)


@dataclass
class InstructConfig:  # gptforge sft / gptforge dpo (docs/sft.md)
    train_data: list[str] = field(default_factory=list)  # JSON / JSONL files: alpaca, messages, sharegpt, prompt/completion (sft); prompt/chosen/rejected (dpo)
    eval_data: list[str] = field(default_factory=list)  # validation files (else eval_fraction of train_data)
    eval_fraction: float = 0.0  # fraction of train_data held out for validation when eval_data is empty
    format: str = "auto"  # auto (by each record's keys) | alpaca | messages | sharegpt | prompt_completion | preference
    chat_template: str | None = None  # a .jinja file or a tokenizer_config.json (default: the model's own, else gptforge's)
    train_on_inputs: bool = False  # learn every token, not only the assistant turns / completion (+ EOS)
    packing: bool = True  # several examples per row (block-diagonal attention, positions restart); sft only
    epochs: int = 1  # passes over train_data (sets Engine.max_steps and the lr decay)
    max_steps: int | None = None  # optimizer steps instead of epochs
    method: str = "full"  # full (every weight) | lora (adapters from Instruct.lora; the run also writes OUT/adapter in PEFT's format)
    lora: LoraConfig = field(default_factory=LoraConfig)  # method lora: rank, alpha, dropout, rslora, dora, targets, layers
    beta: float = 0.1  # dpo: strength of the KL tie to the reference model
    label_smoothing: float = 0.0  # dpo: assumed fraction of flipped preference labels (conservative DPO), in [0, 0.5)


@dataclass
class Config:
    """The whole resolved configuration. Attribute names are the YAML section names."""

    Global: GlobalConfig = field(default_factory=GlobalConfig)
    Model: ModelConfig = field(default_factory=ModelConfig)
    Data: DataConfig = field(default_factory=DataConfig)
    Optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    Engine: EngineConfig = field(default_factory=EngineConfig)
    Distributed: DistributedConfig = field(default_factory=DistributedConfig)
    Generation: GenerationConfig = field(default_factory=GenerationConfig)
    Offline_Eval: OfflineEvalConfig = field(default_factory=OfflineEvalConfig)
    Compress: CompressConfig = field(default_factory=CompressConfig)
    Inference: InferenceConfig = field(default_factory=InferenceConfig)
    Profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    Tuning: TuningConfig = field(default_factory=TuningConfig)
    FusedPasses: FusedPassesConfig = field(default_factory=FusedPassesConfig)
    Instruct: InstructConfig = field(default_factory=InstructConfig)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


SECTIONS = tuple(Config.__dataclass_fields__)
