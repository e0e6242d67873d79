"""Every field a run can set, with its default.

A config file (``configs/*.py``) defines ``get_config()`` returning a ConfigDict built on
:func:`default_config`. `jaxllm.validate` checks one; `jaxllm.cli` reads one from the command
line, where any field can be overridden in the ml_collections style: ``--config.mesh.tensor=2``.
"""

from __future__ import annotations

from ml_collections import ConfigDict

MESH_AXES = ('data', 'fsdp', 'pipe', 'tensor')


REMAT_POLICIES = ('none', 'full', 'dots', 'dots_except_mlp', 'attention')


ATTENTION_IMPLS = ('xla', 'cudnn')
# A layer's attention (model.layer_types): causal over the whole context, or over a window.
LAYER_TYPES = ('full', 'sliding')
MLP_ACTIVATIONS = ('silu', 'gelu_tanh')  # model.mlp_activation: SwiGLU, GeGLU
ROPE_SCALINGS = ('llama3', 'linear')     # model.rope_scaling.kind
FP8_RECIPES = ('none', 'delayed', 'current')


DTYPES = ('float32', 'bfloat16')


DATA_SOURCES = ('files', 'synthetic')


DATA_FORMATS = ('auto', 'text', 'lines', 'jsonl', 'parquet', 'arrayrecord', 'chat')


# Schedules whose stages interleave forwards and backwards (`jaxllm.pipeline.one_f_one_b`).
ONE_F_ONE_B_SCHEDULES = ('1f1b', 'interleaved_1f1b')
PIPELINE_SCHEDULES = ('gpipe', 'circular', *ONE_F_ONE_B_SCHEDULES)
# The schedules whose micro-batches go round the stages pipeline.repeats ≥ 2 times, and the
# one-trip schedule of each.
ROUND_TRIP_SCHEDULES = {'circular': 'gpipe', 'interleaved_1f1b': '1f1b'}


GATHER_MODES = ('step', 'iteration')


ZERO_STAGES = (0, 1, 2)


ROUTERS = ('softmax', 'sigmoid')  # model.moe.router
DISPATCHES = ('ring', 'all_to_all')  # model.moe.dispatch


SCHEDULES = ('cosine', 'linear', 'constant', 'wsd')  # optim.schedule

# Which config field sets the size of each logical parameter axis (for error messages).


AXIS_FIELDS = {
    'vocab': 'model.vocab_size',
    'embed': 'model.embed_dim',
    'heads': 'model.num_heads',
    'kv_heads': 'model.num_kv_heads',
    'head_dim': 'model.head_dim',
    'mlp': 'model.mlp_dim',
    'layers': 'model.num_layers',
    'norm': 'model.embed_dim',
    'experts': 'model.moe.experts',
    'expert_mlp': 'model.moe.mlp_dim',
}


class ConfigError(ValueError):
  """A user-facing configuration problem; the message names the field and the fix."""


class TrainingError(RuntimeError):
  """A run that cannot go on (e.g. a non-finite loss); the message names the step and the fix."""


def default_config() -> ConfigDict:
  """Every field a run can set, with its default. Configs start from this."""
  c = ConfigDict()
  # Simulated devices to create when JAX runs on the CPU (0: JAX's default of one).
  c.cpu_devices = 0
  # XLA flags for the run (before any in the XLA_FLAGS environment variable, which win). The
  # latency-hiding scheduler lets GPU collectives overlap compute; CPUs ignore GPU flags.
  c.xla_flags = '--xla_gpu_enable_latency_hiding_scheduler=true'
  # A training run keeps its compiled programs here, and the next run of the same programs
  # reads them back instead of compiling (programs for GPUs that are not there: their kernels).
  # 'auto': jaxllm/compilation under the user's cache directory ($XDG_CACHE_HOME, else
  # ~/.cache); '': no cache.
  c.compilation_cache = 'auto'

  c.model = ConfigDict(dict(
      vocab_size=320,
      embed_dim=128,
      num_layers=4,
      num_heads=4,
      num_kv_heads=4,
      head_dim=32,
      mlp_dim=512,
      rope_theta=10_000.0,
      # Frequency scaling; factor 0 turns it off. kind 'llama3': Llama 3's (long wavelengths
      # slowed by factor, short ones kept, the band between blended); 'linear': every
      # frequency divided by factor (positions interpolated).
      rope_scaling=ConfigDict(dict(kind='llama3', factor=0.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position=8192)),
      norm_eps=1e-5,
      tie_embeddings=False,
      # What other families change in the block; the defaults are Llama's. Qwen3: qk_norm;
      # Qwen2/2.5: qkv_bias; Mistral: sliding layers; Gemma 3: all but qkv_bias.
      qk_norm=False,          # RMSNorm over each head of q and of k, before RoPE
      qkv_bias=False,         # biases on the q, k and v projections
      mlp_activation='silu',  # the gated MLP's: 'silu' (SwiGLU) or 'gelu_tanh' (GeGLU)
      # RMSNorm scales stored as w and applied as 1 + w, so they start at 0 (Gemma's norms)
      norm_zero_centered=False,
      # a norm on attention's and on the MLP's output too, before each joins the residual
      post_norms=False,
      scale_embeddings=False,  # the embedding's rows times √embed_dim
      attention_scale=0.0,     # what q·k is multiplied by before the softmax; 0: 1/√head_dim
      # Each layer's attention: 'full' (every earlier position) or 'sliding' (the last
      # sliding_window positions, its own included), the tuple repeated over the layers:
      # ('sliding',) is Mistral's, ('sliding',) * 5 + ('full',) Gemma 3's.
      layer_types=('full',),
      sliding_window=0,
      # the sliding layers' RoPE base, which then takes no rope_scaling (Gemma 3's local
      # layers); 0: the same RoPE as the full layers
      sliding_rope_theta=0.0,
      init_std=0.02,
      dtype='float32',        # compute dtype of activations and matmuls
      # storage dtype of the parameters: the master weights the optimizer updates. At
      # fine-tuning learning rates most updates are below bfloat16's spacing and round away.
      param_dtype='float32',
      # element type weight gradients are summed in across the devices that split the batch
      grad_reduce_dtype='float32',
      attention='xla',        # 'xla' everywhere, 'cudnn' fused flash attention on NVIDIA GPUs
      # cudnn: documents a packed row may hold (the loader refuses a row with more). cuDNN
      # keeps fp32 softmax statistics for each as if it filled the row: [rows·M, heads, T].
      max_documents=16,
      # What each layer keeps for its backward, pipelined or not (the rest is recomputed):
      # 'none' (everything), 'full' (only its input), 'dots' (weight-matmul outputs; reruns
      # attention), 'dots_except_mlp' (q, k, v and attention's output and statistics;
      # recomputes the MLP) or 'attention' (attention's output and statistics; recomputes
      # every matmul but not cuDNN's attention forward; with XLA's attention, nearly 'full')
      remat='none',
      # The loss makes logits this many positions at a time (0: the whole sequence at once),
      # taking each chunk's gradients as it goes: one [batch, loss_chunk, vocab] fp32 chunk
      # exists at a time, and nothing is recomputed in the backward.
      loss_chunk=1024,
      # the context the model is for: max_position_embeddings of an exported config.json, and
      # where generation stops. 0: data.seq_len
      max_position=0,
      # Under sequence parallelism (needs sharding.rules.act_seq=('tensor',)): the tensor
      # all-gathers before the q/k/v and gate/up matmuls and the reduce-scatters after the
      # attention-output and down matmuls run as rings of transfers hidden behind those
      # matmuls, block by block (jaxllm.parallel.collective_matmul). Nothing on tensor=1.
      collective_matmul=False,
      # The layer matmuls (attention's q/k/v and output projections, the MLP's) in FP8:
      # 'none', 'delayed' (scales from an amax history kept in the train state, as Transformer
      # Engine's default recipe) or 'current' (scales from this step's amaxes). Inputs and
      # weights are E4M3, output gradients E5M2 (jaxllm.model.fp8). The embedding, head,
      # attention itself, norms and loss keep `dtype`.
      fp8='none',
      fp8_history=1024,       # delayed: steps of amaxes each scale is taken from
      # Mixture of experts (jaxllm.model.moe): the MLP of some layers becomes `experts` SwiGLU
      # experts, each token sent to `top_k` of them by a router that computes in fp32.
      moe=ConfigDict(dict(
          experts=0,            # routed experts of an MoE layer; 0: every layer is dense
          top_k=2,              # experts each token goes to
          mlp_dim=0,            # each expert's hidden width; 0: model.mlp_dim
          shared_experts=0,     # experts every token also goes through (DeepSeek, Qwen2-MoE)
          shared_mlp_dim=0,     # each shared expert's hidden width; 0: moe.mlp_dim
          # 'softmax': the top-k of the softmax (Mixtral, Qwen3-MoE); 'sigmoid': the top-k of
          # sigmoid scores plus a bias that only selects (DeepSeek-V3's aux-loss-free
          # balancing: the train step moves it by bias_rate·sign(mean load − load))
          router='softmax',
          renormalize=True,     # the top-k weights divided by their sum (Mixtral: always)
          route_scale=1.0,      # the routed experts' output times this (DeepSeek-V3: 2.5)
          bias_rate=0.001,      # sigmoid: the bias's step per update; 0 keeps it as it is
          # load-balancing loss (transformers' load_balancing_loss_func) and router z-loss
          # coefficients; the logged loss stays the cross-entropy
          aux_loss=0.001,
          z_loss=0.0,
          first_dense=0,        # the first k layers keep the dense MLP (DeepSeek-V3: 3)
          every=1,              # of the others, every n-th is MoE (Qwen3-MoE's decoder_sparse_step)
          # 0: dropless; c: an expert takes at most ceil(c·N·top_k/experts) of the N tokens
          # of each device, in order of preference (every token's first choice first)
          capacity_factor=0.0,
          # how tokens reach the experts split over sharding.rules.experts: 'ring' (all-gather
          # the tokens, each device runs its experts, reduce-scatter the outputs) or
          # 'all_to_all' (each device sends each token to its experts' devices and back)
          dispatch='ring',
          grouped_matmul='xla',  # the experts' grouped matmul (jaxllm.model.grouped_matmul)
      )),
  ))

  # -1 means "whatever is left of the devices"; at most one axis may say so.
  # across_hosts: on several hosts, the axes (comma-separated, first filled first) whose
  # extent is split between hosts; the rest stay inside each host, on its fast links.
  c.mesh = ConfigDict(dict(data=1, fsdp=-1, pipe=1, tensor=1, across_hosts='data,pipe,fsdp,tensor'))

  # Logical axis name -> mesh axes it is split over (empty tuple: replicated).
  # This table is the one place that binds model axes to the mesh.
  # seq splits every activation along the sequence (context parallelism: attention gathers
  # each row's keys and values), e.g. seq=('fsdp',) with batch=('data',); act_seq splits the
  # residual stream and its norms further (sequence parallelism: act_seq=('tensor',) turns
  # the tensor all-reduces into reduce-scatters and all-gathers).
  c.sharding = ConfigDict(dict(rules=ConfigDict(dict(
      batch=('data', 'fsdp'),
      seq=(),
      act_seq=(),
      vocab=('tensor',),
      embed=('fsdp',),
      heads=('tensor',),
      kv_heads=('tensor',),
      head_dim=(),
      mlp=('tensor',),
      layers=('pipe',),
      norm=(),
      act_embed=(),
      act_heads=('tensor',),
      act_kv_heads=('tensor',),
      act_mlp=('tensor',),
      act_vocab=('tensor',),
      # expert parallelism: an MoE layer's experts split over fsdp, each device running its
      # own on the tokens routed to them; the experts' hidden units split over tensor
      experts=('fsdp',),
      expert_mlp=('tensor',),
  ))))
  # ZeRO over data, on top of what the rules split: 0 off; 1 the AdamW moments split over
  # data as well: the gradients' all-reduce becomes a reduce-scatter, each device updates its
  # slice of the parameters and the slices are all-gathered (the same bytes as the
  # all-reduce); 2 the fp32 gradient sum too, each micro-batch's gradients reduce-scattered
  # into it (train.micro_batches times the reduce-scatter traffic; with one micro-batch, 1's
  # program). Parameters stay whole over data. Means nothing when mesh.data=1.
  c.sharding.zero = 0

  # Used when mesh.pipe > 1: the layer stack is split into mesh.pipe stages.
  c.pipeline = ConfigDict(dict(
      schedule='gpipe',       # 'gpipe', or 'circular' (stage s holds blocks s, s+S, ...)
      repeats=1,              # circular: trips of each micro-batch round the stages (R ≥ 2)
      microbatches=0,         # M; 0: 2 × stages
      # 'step': all-gather fsdp-split stage weights once per step (more memory, one gather
      # and one gradient reduce-scatter per step); 'iteration': gather them in every
      # pipeline iteration (less memory, traffic repeated per micro-batch).
      gather_weights='step',
  ))

  c.train = ConfigDict(dict(
      steps=100,
      log_every=10,
      seed=0,
      global_batch=8,      # sequences per optimizer step, over all devices
      micro_batches=1,     # gradient accumulation: the step runs this many slices in turn
      peak_flops=0.0,      # peak FLOP/s of one device for MFU; 0: look the device up
      # Non-finite loss or gradients: False stops the run naming the step (the last good
      # checkpoint stays as it is); True skips that update and goes on.
      skip_nonfinite=False,
  ))

  c.optim = ConfigDict(dict(
      lr=3e-4,             # peak learning rate
      warmup_steps=10,     # update s of the first W takes lr·s/W; update W takes the peak
      # after warmup: 'cosine' or 'linear' decay to lr·min_lr_ratio, 'constant', or 'wsd'
      # (warmup-stable-decay: the peak until the last decay_steps, then linear decay)
      schedule='cosine',
      # cosine/linear: the updates after warmup the lr falls over (0: to train.steps), then
      # it stays at the final lr; wsd: the last updates, which it falls over (0: a fifth)
      decay_steps=0,
      min_lr_ratio=0.1,    # final lr = lr * min_lr_ratio
      b1=0.9,
      b2=0.95,
      eps=1e-8,
      weight_decay=0.1,    # not applied to norm scales
      clip_norm=1.0,       # global gradient norm clip; 0 turns it off
      # z-loss: adds z_loss · log²Z per token (Z: the softmax's normaliser) to the objective,
      # keeping the logits from drifting; the logged loss stays the cross-entropy
      z_loss=0.0,
      # dtype the AdamW moments are stored in; 'bfloat16' halves their memory but loses
      # the small updates of low learning rates (gradients are always accumulated in fp32)
      state_dtype='float32',
  ))

  c.data = ConfigDict(dict(
      source='files',      # 'files': documents at data.path; 'synthetic': one fixed random batch
      path='',             # a file, a directory, or a glob of shards
      # 'auto' picks by extension (.jsonl, .parquet, .arrayrecord; anything else is text);
      # 'text': a document per file, 'lines': a document per line, 'arrayrecord': records of
      # pre-tokenised documents (little-endian int32 ids), 'chat' (never picked by 'auto'):
      # JSONL conversations {"messages": [{"role", "content"}, ...]}, rendered with the chat
      # template and trained on the assistant's turns only.
      format='auto',
      text_field='text',   # the text column of JSONL and Parquet records
      tokenizer='byte',    # 'byte' (built in), a Hugging Face tokenizer.json, or a SentencePiece .model
      # 'chat': a Jinja chat template file; '' takes the tokenizer's (chat_template.jinja, or
      # chat_template in tokenizer_config.json, beside its tokenizer.json)
      chat_template='',
      packing=True,        # pack documents into rows (attention stays inside each); False: one per row
      seq_len=128,
      eval_path='',        # held-out documents; or hold out a fraction of data.path:
      eval_fraction=0.0,
      prefetch=4,          # batches prepared ahead of the train step
      # Independent streams the documents are read in, each filling its block of rows of
      # every batch; a process reads the streams its rows come from. 0: one per process
      # (or what the run's checkpoint used). A fixed number makes the batches the same on
      # any number of processes.
      streams=0,
  ))

  c.eval = ConfigDict(dict(
      every=0,             # steps between evaluations on the held-out split; 0: never
      batches=4,           # batches per evaluation (of global_batch / micro_batches rows)
  ))

  c.checkpoint = ConfigDict(dict(
      dir='',              # default: <workdir>/checkpoints; a run resumes from its latest
      every=500,           # steps between saves (and a save at the last step); 0: never
      keep=3,              # newest checkpoints kept
      async_save=True,     # write in the background while training goes on
  ))
  # Start from the parameters of this checkpoint (a checkpoint dir or one step in it, or
  # 'hf:DIR', a Hugging Face checkpoint of a family jaxllm.hf reads) and fresh optimizer state:
  # fine-tuning. Ignored when the run has checkpoints of its own.
  c.init_from = ''

  # Many processes (hosts) as one run, through jax.distributed. Under SLURM, Open MPI or
  # Kubernetes the fields below are found from the environment; set them to launch by hand.
  c.distributed = ConfigDict(dict(
      coordinator_address='',  # host:port of process 0, reachable from every process
      num_processes=0,         # 0: from the cluster, or a single process when there is none
      process_id=-1,           # this process, 0 … num_processes-1; -1: from the cluster
      initialization_timeout=300,  # seconds for all processes to join before giving up
      heartbeat_timeout=100,   # seconds a process may go silent before the run stops with an error
  ))

  # Where the rows of <workdir>/metrics.jsonl go besides (process 0 only).
  c.metrics = ConfigDict(dict(
      tensorboard=True,    # TensorBoard event files in <workdir>/tensorboard, and the config
      wandb_project='',    # also log to this Weights & Biases project ('': no); needs wandb
  ))

  # A jax.profiler trace of steps start_step … start_step+steps-1 into <workdir>/profile.
  c.profile = ConfigDict(dict(
      start_step=0,        # the first step traced; 0: no trace. Past the first few, which warm up
      steps=3,             # steps traced; a few suffice and traces grow quickly
  ))
  return c


def context_length(cfg: ConfigDict) -> int:
  """The context the model is for: model.max_position, or the rows it trains on."""
  return cfg.model.max_position or cfg.data.seq_len


def moe_layers(model_cfg: ConfigDict) -> int:
  """The layers with experts: after the first `moe.first_dense`, every `moe.every`-th."""
  m = model_cfg.moe
  return (model_cfg.num_layers - m.first_dense) // m.every if m.experts else 0


def scan_units(model_cfg: ConfigDict) -> int:
  """The steps of the layer scan over `blocks`, what a pipeline splits into stages: one per
  layer, or with experts one per MoE layer (with the dense layers before it where moe.every
  is n > 1); the first dense layers are a stack of their own."""
  return moe_layers(model_cfg) or model_cfg.num_layers
def layer_types(model_cfg: ConfigDict) -> tuple[str, ...]:
  """Each layer's attention type, 'full' or 'sliding': model.layer_types repeated over the
  model.num_layers layers."""
  pattern = model_cfg.layer_types
  return tuple(pattern[i % len(pattern)] for i in range(model_cfg.num_layers))


def pipeline_shape(cfg: ConfigDict, stages: int) -> tuple[int, int]:
  """(repeats, micro-batches) of the pipeline over `stages` stages."""
  p = cfg.pipeline
  return p.repeats, p.microbatches or 2 * stages
