"""Typed configuration: one dataclass per section, a docstring under every field.

Hydra composes YAML presets from ``conf/`` against these schemas (registered once in the
ConfigStore), so an unknown key or a value of the wrong type fails at composition. Range and
cross-field checks run in ``__post_init__`` and raise :class:`ConfigError` naming the full key.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional


class ConfigError(ValueError):
    """A configuration value is invalid; ``key`` is the dotted name of the offending field."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


def _require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(key, message)


def _installed(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


class Enforce(str, enum.Enum):
    """Where the staleness bound is enforced."""

    admission = "admission"
    ship = "ship"
    strict = "strict"


class Correction(str, enum.Enum):
    """Off-policy correction applied by the trainer's loss."""

    decoupled = "decoupled"
    tis = "tis"
    none = "none"
    recompute = "recompute"

    @property
    def uncorrected(self) -> bool:
        """Not an off-policy correction (none: no proximal policy; recompute: no behaviour
        weight), so trained off-policy only with trainer.allow_uncorrected."""
        return self in (Correction.none, Correction.recompute)

    @property
    def reads_proximal(self) -> bool:
        """Whether the loss clips against the proximal policy (and so needs its logprobs)."""
        return self in (Correction.decoupled, Correction.recompute)


class Proximal(str, enum.Enum):
    """Where a later minibatch's proximal logprobs come from (see :func:`rlorch.trainer.loss.loglinear_proximal`)."""

    recompute = "recompute"
    loglinear = "loglinear"


class Advantage(str, enum.Enum):
    """Advantage estimator (baselines in :mod:`rlorch.trainer.advantages`)."""

    grpo = "grpo"
    dr_grpo = "dr_grpo"
    rloo = "rloo"
    reinforce = "reinforce"


class FlatAdvantage(str, enum.Enum):
    """What a zero-variance group below the maximum reward trains with (see
    :func:`rlorch.trainer.advantages.flat_below_max`)."""

    zero = "zero"
    batch = "batch"
    negative = "negative"
    bounded = "bounded"
    unlikelihood = "unlikelihood"


class UnlikelihoodLevel(str, enum.Enum):
    """What the unlikelihood push makes less likely: each token, or the whole answer."""

    token = "token"
    sequence = "sequence"


class ScaleRewards(str, enum.Enum):
    """What centred rewards are divided by: the group's std, the batch's std, or nothing."""

    group = "group"
    batch = "batch"
    none = "none"


class LossAgg(str, enum.Enum):
    """How per-token losses combine into a minibatch's loss (see :mod:`rlorch.trainer.loss`)."""

    token_mean = "token_mean"
    seq_mean_token_sum = "seq_mean_token_sum"
    seq_mean_token_mean = "seq_mean_token_mean"


class LrSchedule(str, enum.Enum):
    """Learning-rate curve after warm-up (see :mod:`rlorch.trainer.schedule`)."""

    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class KlEstimator(str, enum.Enum):
    """Per-token estimator of KL(policy || reference) (see :mod:`rlorch.trainer.loss`)."""

    k1 = "k1"
    k2 = "k2"
    k3 = "k3"


class InferenceBackend(str, enum.Enum):
    """Registered in :mod:`rlorch.backends`; each has a preset in conf/inference/."""

    sim = "sim"
    cpu = "cpu"
    sglang = "sglang"

    @property
    def generates_model_tokens(self) -> bool:
        """Whether its tokens come from the model (the simulator's do not)."""
        return self is not InferenceBackend.sim


class WeightTransfer(str, enum.Enum):
    """How new weights reach the engines."""

    disk = "disk"
    distributed = "distributed"


class TrainerBackend(str, enum.Enum):
    """Registered in :mod:`rlorch.backends`; each has a preset in conf/trainer/."""

    sim = "sim"
    fsdp = "fsdp"

    @property
    def needs_model_tokens(self) -> bool:
        """Whether it trains a model on the tokens (and so cannot train simulated ones)."""
        return self is not TrainerBackend.sim


class Colocate(str, enum.Enum):
    """Whether launched servers and the trainer share the node's GPUs (rlorch.launch.colocation)."""

    auto = "auto"
    off = "off"
    resident = "resident"
    swap = "swap"

    @property
    def shares(self) -> bool:
        """Set to share (``auto`` decides from the GPUs at placement)."""
        return self in (Colocate.resident, Colocate.swap)


class SimReward(str, enum.Enum):
    random = "random"
    constant = "constant"
    solved = "solved"
    task = "task"


@dataclass
class RunConfig:
    name: str = "run"
    """Run name; the run directory defaults to ``outputs/<name>-<timestamp>``."""
    dir: Optional[str] = None
    """Run directory (the source of truth for a run). Empty picks ``outputs/<name>-<timestamp>``."""
    seed: int = 0
    """Seed for prompt order, sampling and the simulated backends."""
    shutdown_timeout: float = 30.0
    """Seconds a SIGINT/SIGTERM drain may take before the run checkpoints and exits."""
    progress: bool = True
    """Show progress: a live display in a terminal, a plain line every run.log_every steps
    otherwise (false: only the start-up phases and the end-of-run report)."""
    log_every: int = 25
    """Steps between plain progress lines when stderr is not a terminal."""
    report: bool = True
    """Write the run's report (PNGs and report.md in RUN_DIR/report/) when it ends."""
    batch_format: str = "safetensors"
    """The batch files' format (rollouts/step_N.*): ``safetensors`` (the arrays as tensors, about
    9 bytes a token, written as they are held) or ``jsonl`` (one JSON object per rollout, about
    20 bytes a token, for reading with a text tool). The trainer reads either."""
    gpus: Optional[int] = None
    """GPUs on this node to place processes on; empty: count the visible ones (set it to plan a
    GPU run with --dry-run on a machine without them)."""
    launcher: str = "local"
    """Where the run's processes go: ``local`` (children of this process, on this machine) or
    ``ray`` (placement groups and actors on a Ray cluster; ``pip install "rlorch[ray]"``)."""
    ray_address: Optional[str] = None
    """With ``run.launcher=ray``: the cluster to join (``auto``: the one running on this machine's
    node, ``ray://host:port`` or ``host:port``); empty starts a private local cluster for the run."""
    placement_timeout: float = 300.0
    """With ``run.launcher=ray``: seconds a placement group may stay pending (what it asks for and
    what the cluster has free is printed every 10 s) before the run fails naming the request; a
    scale request (``rlorch scale``) pending that long is dropped with a warning and the run
    goes on."""
    ray_cpus: Optional[int] = None
    """With ``run.launcher=ray`` and no ``run.ray_address``: the logical CPUs of the run's private
    cluster; empty: the cores this process may use, at least what the run asks for at start.
    Set it above the cores to leave room for ``rlorch scale`` to grow a CPU fleet (the processes
    then share the cores)."""
    colocate: Colocate = Colocate.auto
    """Servers and the trainer on the same GPUs. auto: only when the node has too few GPUs to give
    one launched server and one trainer rank their own (one GPU: resident); off: never;
    resident: both stay on the device all run, launched engines sized to what the trainer leaves
    (inference.memory_fraction), any rollout.max_staleness; swap: rollout.max_staleness=0 only,
    the engines release their memory while the trainer trains and the trainer moves its state
    to the host while they generate, for models that do not fit twice (docs/placement.md).
    Servers at inference.addresses may share the trainer's GPU too: their memory is then sized
    where they were started (SGLang: --enable-memory-saver for swap)."""
    gpu_memory_gb: Optional[float] = None
    """GiB of one GPU for sizing a colocated split; empty: measured on the device (total memory),
    or 80 where no GPU is visible (a --dry-run on a machine without one says it assumed so)."""

    def __post_init__(self) -> None:
        _require(self.launcher in ("local", "ray"), "run.launcher", f"must be local or ray (got {self.launcher!r})")
        _require(self.batch_format in ("safetensors", "jsonl"), "run.batch_format",
                 f"must be safetensors or jsonl (got {self.batch_format!r})")
        _require(self.placement_timeout > 0, "run.placement_timeout", "must be > 0 seconds")
        _require(self.ray_cpus is None or self.ray_cpus >= 1, "run.ray_cpus", "must be >= 1")
        _require(self.ray_cpus is None or self.ray_address is None, "run.ray_cpus",
                 "sizes the private cluster a run starts; a cluster joined at run.ray_address has its own size")
        _require(self.shutdown_timeout > 0, "run.shutdown_timeout", "must be > 0 seconds")
        _require(self.log_every >= 1, "run.log_every", "must be >= 1")
        _require(self.gpus is None or self.gpus >= 0, "run.gpus", "must be >= 0")
        _require(self.gpu_memory_gb is None or self.gpu_memory_gb > 0, "run.gpu_memory_gb", "must be > 0 GiB")


@dataclass
class RolloutConfig:
    max_staleness: int = 2
    """S: how many policy versions a trained token may lag the trainer (0 = synchronous)."""
    batch_size: int = 16
    """B: rollouts per training batch (a multiple of group_size)."""
    group_size: int = 4
    """Samples per prompt; advantages are computed within a group, admitted together."""
    max_concurrent: int = 48
    """C: most rollouts in flight on the inference engines at once."""
    queue_size: int = 1024
    """Capacity of the prompt input queue (>= batch_size)."""
    enforce: Enforce = Enforce.admission
    """admission: refuse to start too-stale rollouts; ship: count staleness against shipped
    batches and park a full batch until the trainer is within S versions (age <= 2S+2);
    strict: admission plus a head-age check at consumption (never train age > S)."""
    max_buffered: int = 1024
    """Backpressure: most finished-but-unconsumed rollouts held before admission pauses."""
    request_timeout: float = 300.0
    """Seconds one generation request may take before it is retried on another engine."""
    max_retries: int = 3
    """Attempts per request across engines before the run fails."""
    pack_samples: int = 64
    """Most samples one engine call carries: the groups one admission pass lets through share a
    call (SGLang's batch /generate) up to this many samples, never waiting to fill it. A group
    larger than this goes alone. An evaluation's held-out prompts (single-turn tasks) go in as
    few such calls as hold them. A pack comes back when its slowest sample does, so with long,
    varied generations a smaller pack frees engine slots sooner; 1 = one call per group."""
    max_new_tokens: int = 16
    """Generation budget per model turn."""
    temperature: float = 1.0
    """Sampling temperature (sent explicitly: servers may default it from generation_config)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling (-1 = whole vocabulary)."""
    max_regenerations: int = 2
    """strict mode: times a too-stale group is regenerated before it is dropped."""
    filter_groups: bool = True
    """Drop zero-variance groups (every sample scored the same; DAPO's dynamic sampling) and
    generate others in their place. false trains them with advantage 0: the entropy bonus and the
    token mean still see them, no replacement is generated, and they count toward the empty-batch
    guard all the same (train.max_empty_batches)."""
    replay_share: float = 0.0
    """Share of drawn prompts (0..0.5) that are replays of stuck prompts: a prompt whose group
    came back zero-variance below the maximum reward is queued (at most REPLAY_CAPACITY) and
    drawn again ahead of new prompts, one replay per 1/share draws, until its group has spread or
    is solved. 0 = off. Saved at checkpoints with the data position."""
    filter_budget: int = 4
    """Batches' worth of filtered rollouts (zero-variance groups) generated while assembling
    one batch; past it the batch trains on the groups it has (a short batch), so the loop never
    spins hunting for groups whose rewards differ. 0 = no budget."""

    @property
    def pending_limit(self) -> int:
        """(S + 1) * B: the most rollouts in the system at steady state under admission gating."""
        return (self.max_staleness + 1) * self.batch_size

    @property
    def prompts_per_batch(self) -> int:
        """B / group_size: the prompts one full batch trains on."""
        return self.batch_size // self.group_size

    @property
    def pack_groups(self) -> int:
        """Groups per engine call: as many whole groups as fit in pack_samples, at least one."""
        return max(1, self.pack_samples // self.group_size)

    def __post_init__(self) -> None:
        _require(self.max_staleness >= 0, "rollout.max_staleness", "must be >= 0")
        _require(self.batch_size >= 1, "rollout.batch_size", "must be >= 1")
        _require(self.group_size >= 1, "rollout.group_size", "must be >= 1")
        _require(self.batch_size % self.group_size == 0, "rollout.batch_size",
                 f"must be a multiple of rollout.group_size ({self.group_size})")
        _require(self.max_concurrent >= 1, "rollout.max_concurrent", "must be >= 1")
        _require(self.queue_size >= self.batch_size, "rollout.queue_size",
                 f"must be >= rollout.batch_size ({self.batch_size})")
        _require(self.max_buffered >= self.batch_size, "rollout.max_buffered",
                 f"must be >= rollout.batch_size ({self.batch_size})")
        _require(self.request_timeout > 0, "rollout.request_timeout", "must be > 0 seconds")
        _require(self.max_retries >= 1, "rollout.max_retries", "must be >= 1")
        _require(self.pack_samples >= 1, "rollout.pack_samples", "must be >= 1")
        _require(self.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
        _require(self.temperature >= 0, "rollout.temperature", "must be >= 0")
        _require(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
        _require(self.max_regenerations >= 0, "rollout.max_regenerations", "must be >= 0")
        _require(self.filter_budget >= 0, "rollout.filter_budget", "must be >= 0")
        _require(0.0 <= self.replay_share <= 0.5, "rollout.replay_share", "must be within [0, 0.5]")


@dataclass
class TrainConfig:
    steps: int = 60
    """Training steps (batches) to run before the drain phase."""
    max_empty_batches: int = 3
    """Stop the run after this many consecutive batch-worths of finished rollouts with nothing
    trainable (and, for a task with a prompt set, not before one pass over it: see
    rlorch.orchestrator.sinks)."""
    stop_on_converged: bool = True
    """End the run as ``converged`` when the empty-batch guard finds the task solved and, where
    there is an evaluation, held-out accuracy of the same weights agrees; false: train on while
    any group is trainable (a run left with nothing to train still ends converged)."""

    def __post_init__(self) -> None:
        _require(self.steps >= 1, "train.steps", "must be >= 1")
        _require(self.max_empty_batches >= 1, "train.max_empty_batches", "must be >= 1")


@dataclass
class EvalConfig:
    every: int = 25
    """Evaluate every N training steps, besides before the first step and at the end (0 = only
    those two)."""
    prompts: int = 100
    """Held-out prompts per evaluation (greedy, one sample each, never trained on, exempt from
    the staleness bound). Tasks with a smaller held-out set use all of it."""
    enabled: bool = True
    """Evaluate at all (off: no eval records, no eval accuracy in the summary)."""
    stop_at: Optional[float] = None
    """End the run ``converged`` once eval.stop_after evaluations in a row reach this held-out
    accuracy (0 < stop_at <= 1), whatever the empty-batch guard sees: the held-out set is what
    the run is for, and training on past solving it only risks it. Unset: only the guard ends a
    run converged. Off with train.stop_on_converged=false or without evaluation."""
    stop_after: int = 3
    """Evaluations in a row (eval.every steps apart) that must reach eval.stop_at. Greedy
    accuracy of a policy still sharpening flips a few prompts from one evaluation to the next:
    on the CPU default, 2 in a row ended 3 of 80 runs whose final weights, three steps later,
    scored 89-95%."""

    def __post_init__(self) -> None:
        _require(self.every >= 0, "eval.every", "must be >= 0")
        _require(self.prompts >= 1, "eval.prompts", "must be >= 1")
        _require(self.stop_at is None or 0 < self.stop_at <= 1, "eval.stop_at", "must be in (0, 1] or null")
        _require(self.stop_after >= 1, "eval.stop_after", "must be >= 1")


@dataclass
class SimEngineConfig:
    """``inference=sim``: no model, a latency per request, fixed tokens."""

    latency: list[float] = field(default_factory=lambda: [0.05, 0.05])
    """[lo, hi] seconds per rollout, drawn uniformly."""
    tokens: int = 8
    """Generated tokens per rollout."""
    reward: SimReward = SimReward.random
    """Reward function (random; constant 0.5, a broken environment; solved, always the maximum
    1; or the task's own on the simulated tokens)."""

    def __post_init__(self) -> None:
        _require(len(self.latency) == 2 and 0 <= self.latency[0] <= self.latency[1],
                 "inference.sim.latency", "must be [lo, hi] seconds with 0 <= lo <= hi")
        _require(self.tokens >= 1, "inference.sim.tokens", "must be >= 1")


@dataclass
class CpuEngineConfig:
    """``inference=cpu``: `rlorch serve` subprocesses."""

    max_batch: Optional[int] = None
    """Most sequences decoded together; unset: each engine's share of a step's rollouts
    (rollout.batch_size / inference.num_servers, rounded up)."""
    threads: int = 1
    """Torch threads per server process."""
    device: str = "cpu"
    """Where `rlorch serve` runs its model: cpu, or cuda (the model in model.dtype on the GPU the
    placement gives the server, sampling in float32; a colocated run shares it with the trainer)."""

    def __post_init__(self) -> None:
        _require(self.device in ("cpu", "cuda"), "inference.cpu.device", f"must be cpu or cuda (got {self.device!r})")
        _require(self.max_batch is None or self.max_batch >= 1, "inference.cpu.max_batch", "must be >= 1 (or null: "
                 "each engine's share of a step)")
        _require(self.threads >= 1, "inference.cpu.threads", "must be >= 1")


def engine_max_batch(config) -> int:
    """A CPU engine's ``--max-batch``: ``inference.cpu.max_batch``, or where it is unset a lone
    engine's share of a step, all of ``rollout.batch_size`` (a run's launcher resolves it per
    engine before: :mod:`rlorch.launch.placement`)."""
    return config.inference.cpu.max_batch or config.rollout.batch_size


@dataclass
class InferenceConfig:
    backend: InferenceBackend = InferenceBackend.cpu
    """sim: no model (inference.sim); cpu: `rlorch serve` subprocesses (inference.cpu); sglang:
    SGLang servers launched here or reached at `addresses`."""
    num_servers: Optional[int] = 1
    """Servers to launch (cpu, sglang without addresses); empty (null, the cpu and sglang presets):
    for sglang as many as fill the node's GPUs beside the trainer, for cpu engines as many as
    this machine's cores feed beside the trainer (1 up to 5 cores), else 1 (rlorch.launch.placement)."""
    control_concurrency: int = 256
    """Control calls (pause, continue, weight updates, health probes) on the wire at once across
    all servers: a fleet's fan-out is concurrent but bounded, over one shared connection pool."""
    parse_workers: int = 0
    """Processes that parse long /generate answers beside the event loop (0: the loop parses
    them). Each such body goes to one over a pipe and its arrays come back: more CPU in all, less
    on the loop's core. For a fleet one core cannot keep up with (scripts/bench_fleet.py: the
    trainer idle while the orchestrator's core is busy)."""
    addresses: list[str] = field(default_factory=list)
    """Running servers to connect to instead of launching, host:port (with `router`: the workers
    behind it)."""
    router: Optional[str] = None
    """A sglang-router's host:port: generation goes through it; pause, continue, weight updates
    and version checks go to every server of `addresses` (or every launched server)."""
    tp_size: int = 1
    """Tensor-parallel size of each launched SGLang server (--tp-size): GPUs per server."""
    gpus: list[int] = field(default_factory=list)
    """GPU ids for the launched servers (num_servers x tp_size of them, in order); empty: the
    first ones visible (see rlorch.launch.placement)."""
    launch_args: list[str] = field(default_factory=list)
    """Extra command-line arguments for each launched server: SGLang's flags (e.g.
    ["--mem-fraction-static", "0.8"]), or the CPU engine's (``python -m rlorch.serve.server
    --help``, e.g. ["--min-step-time", "0.05"]; checked before the run starts)."""
    expect_version: Optional[str] = None
    """Refuse servers whose /get_server_info version differs (engine and trainer are one unit)."""
    ready_timeout: float = 600.0
    """Seconds to wait for launched servers to answer /health_generate."""
    shutdown_timeout: float = 10.0
    """Seconds launched servers get to exit before they are killed."""
    weight_transfer: WeightTransfer = WeightTransfer.disk
    """disk: engines load each published HF checkpoint; distributed: the trainer's rank 0
    broadcasts each version over a process group with the engines (SGLang's
    /init_weights_update_group and /update_weights_from_distributed; gloo with cpu engines, nccl
    with sglang). Resumable checkpoints are written to disk either way."""
    transfer_address: str = "127.0.0.1"
    """weight_transfer=distributed: the trainer host's address as the engines reach it."""
    transfer_timeout: float = 60.0
    """weight_transfer=distributed: seconds the group may take to form and one version to
    arrive before the trainer publishes that version to disk instead."""
    control_timeout: float = 10.0
    """Seconds a pause, continue, abort or other control call may take on one server; past it the
    server is suspect: it takes no new work until it answers again and holds the current weights."""
    reload_timeout: float = 300.0
    """Seconds one server may take to load a version (from disk or over the group); past it the
    server is suspect and the version goes live on the servers that loaded it."""
    health_interval: float = 5.0
    """Seconds between probes (``/health_generate``: one generated token) of each server in rotation."""
    health_timeout: float = 10.0
    """Seconds a probe may take; a slower answer is a miss."""
    health_failures: int = 3
    """Consecutive missed probes that make a server suspect (its requests are aborted here and
    continue on the other servers)."""
    hang_timeout: float = 60.0
    """Seconds a launched server may stay suspect before it is killed (and restarted, up to
    max_restarts); a server that cannot be restarted is out of the run."""
    max_restarts: int = 3
    """Restarts of each launched server whose process exited (or whose Ray actor died) or that
    was killed for hanging (0: such a server is out of the run)."""
    memory_fraction: Optional[float] = None
    """Share of a GPU's free memory a launched server's weights and KV cache take (SGLang's
    --mem-fraction-static; `rlorch serve` on cuda caps its process at it). Empty: SGLang's own
    choice, or when colocated what the trainer's estimated need leaves (the --dry-run prints the
    split)."""
    sim: SimEngineConfig = field(default_factory=SimEngineConfig)
    cpu: CpuEngineConfig = field(default_factory=CpuEngineConfig)

    @property
    def distributed(self) -> bool:
        """Weights travel over the process group (a version that does not goes by disk)."""
        return self.weight_transfer is WeightTransfer.distributed

    def __post_init__(self) -> None:
        _require(self.num_servers is None or self.num_servers >= 1, "inference.num_servers",
                 "must be >= 1 (or null: fill the node)")
        _require(self.transfer_timeout > 0, "inference.transfer_timeout", "must be > 0 seconds")
        _require(self.ready_timeout > 0, "inference.ready_timeout", "must be > 0 seconds")
        _require(self.tp_size >= 1, "inference.tp_size", "must be >= 1")
        for key in ("control_timeout", "reload_timeout", "health_interval", "health_timeout", "hang_timeout"):
            _require(getattr(self, key) > 0, f"inference.{key}", "must be > 0 seconds")
        _require(self.health_failures >= 1, "inference.health_failures", "must be >= 1")
        _require(self.max_restarts >= 0, "inference.max_restarts", "must be >= 0")
        _require(self.control_concurrency >= 1, "inference.control_concurrency", "must be >= 1")
        _require(self.parse_workers >= 0, "inference.parse_workers", "must be >= 0")
        _require(self.memory_fraction is None or 0 < self.memory_fraction < 1, "inference.memory_fraction",
                 "must be in (0, 1) (or null: sized by the run)")


@dataclass
class SimTrainerConfig:
    """``trainer=sim``: no model; publishes marker checkpoints."""

    step_time: float = 0.05
    """Seconds per training step."""

    def __post_init__(self) -> None:
        _require(self.step_time >= 0, "trainer.sim.step_time", "must be >= 0 seconds")


@dataclass
class FsdpConfig:
    """``trainer=fsdp``: torch FSDP2 under torchrun."""

    nproc: Optional[int] = 1
    """Trainer processes per node (torchrun --nproc-per-node); empty (null, the fsdp preset): beside
    launched SGLang servers on GPUs, the GPUs they leave (half the node rounded down to a power of
    two when inference.num_servers is empty too), else 1 (rlorch.launch.placement)."""
    torchrun_args: list[str] = field(default_factory=list)
    """Extra torchrun arguments (--nnodes, --rdzv-endpoint, ... for a cluster)."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    micro_batch_size: int = 16
    """Sequences per forward/backward pass, each a row padded to the longest, when
    max_tokens_per_micro_batch is empty."""
    max_tokens_per_micro_batch: Optional[int] = None
    """Token budget of a forward/backward pass: each minibatch's sequences are packed back to
    back into rows of at most this many tokens (no padding; attention stays within each
    sequence), balanced so every rank runs the same number of passes with near-equal tokens.
    Bounds a pass's activations whatever the completion lengths; set it at least to the longest
    sequence (prompt + rollout.max_new_tokens): a longer one gets a pass of its own. Empty:
    micro_batch_size sequences a pass."""
    share_prompts: bool = True
    """Each distinct prompt of a micro-batch runs through the model once, not once per sample,
    and each sequence's last token (which scores nothing) not at all: the group's samples
    attend to one copy of their prompt (rlorch.trainer.prefix). Same scores up to float
    rounding; used with rlorch's own Qwen2 (model.implementation) where it saves at least a
    tenth of a pass's positions."""
    logit_chunk_rows: int = 256
    """Trained positions whose logits exist at once: the output layer, logprobs and entropies
    are computed this many rows at a time and recomputed in the backward, never as a
    [positions, vocabulary] tensor (256 rows of a 151,936-token vocabulary: 0.15 GiB a copy, at
    most three copies at once)."""
    gpus: list[int] = field(default_factory=list)
    """GPU ids for the trainer processes on this node (nproc of them); empty: the ones after
    the servers' (see rlorch.launch.placement)."""
    nnodes: int = 1
    """Trainer nodes (torchrun --nnodes); every node runs `rlorch train` with its node_rank."""
    node_rank: int = 0
    """This node's rank among the trainer nodes (torchrun --node-rank); rank 0 runs the
    orchestrator and the inference servers."""
    rdzv_endpoint: Optional[str] = None
    """host:port of node 0's torchrun agent, reachable from every node (static rendezvous:
    torchrun --master-addr host --master-port port); required when nnodes > 1, except with
    run.launcher=ray (node 0's IP and a free port there)."""

    def __post_init__(self) -> None:
        _require(self.nproc is None or self.nproc >= 1, "trainer.fsdp.nproc", "must be >= 1 (or null: fill the node)")
        _require(self.device in ("auto", "cpu", "cuda"), "trainer.fsdp.device",
                 f"must be one of auto, cpu, cuda (got {self.device!r})")
        _require(self.micro_batch_size >= 1, "trainer.fsdp.micro_batch_size", "must be >= 1")
        _require(self.max_tokens_per_micro_batch is None or self.max_tokens_per_micro_batch >= 2,
                 "trainer.fsdp.max_tokens_per_micro_batch", "must be >= 2 tokens (or empty: micro_batch_size)")
        _require(self.logit_chunk_rows >= 1, "trainer.fsdp.logit_chunk_rows", "must be >= 1")
        _require(self.nnodes >= 1, "trainer.fsdp.nnodes", "must be >= 1")
        _require(0 <= self.node_rank < self.nnodes, "trainer.fsdp.node_rank",
                 f"must be in [0, trainer.fsdp.nnodes={self.nnodes})")
        _require(self.rdzv_endpoint is None or _is_host_port(self.rdzv_endpoint), "trainer.fsdp.rdzv_endpoint",
                 f"must be host:port (got {self.rdzv_endpoint!r})")


def _is_host_port(endpoint: Optional[str]) -> bool:
    """``host:port`` with a non-empty host and a port in 1..65535 (``[::1]:29400`` for IPv6)."""
    host, _, port = (endpoint or "").rpartition(":")
    return bool(host.strip("[]")) and port.isdigit() and 0 < int(port) < 65536


@dataclass
class TrainerConfig:
    backend: TrainerBackend = TrainerBackend.fsdp
    """sim: sleeps trainer.sim.step_time per batch and publishes marker checkpoints; fsdp: torch
    FSDP2 under torchrun (trainer.fsdp)."""
    correction: Correction = Correction.decoupled
    """Off-policy correction in the loss: decoupled (PPO clip against the recomputed proximal
    policy, each token weighted by proximal / behaviour), tis (truncated importance sampling vs
    behaviour logprobs), none (PPO clip against the behaviour logprobs: PPO without
    recomputation, its trust region around the sampling policy) or recompute (PPO clip against
    the recomputed proximal policy, the behaviour logprobs ignored: stale tokens trained as if
    sampled now). With max_staleness > 0, none and recompute take allow_uncorrected."""
    allow_uncorrected: bool = False
    """Permit correction=none or recompute with max_staleness > 0 (off-policy data trained as
    on-policy)."""
    advantage: Advantage = Advantage.grpo
    """Advantage estimator: grpo (group mean and std), dr_grpo (group mean, no std), rloo
    (leave-one-out mean of the group's other samples), reinforce (batch mean)."""
    scale_rewards: Optional[ScaleRewards] = None
    """Divide the centred rewards by the std of the group, of the batch, or none; unset: the
    estimator's own (group for grpo, none for the others). dr_grpo takes none only."""
    flat_advantage: FlatAdvantage = FlatAdvantage.zero
    """What a zero-variance group below the maximum reward (a prompt answered one wrong way)
    trains with: zero (the estimator's 0), batch ((r - batch mean) / batch std: negative when
    the batch does better on average, so a stuck wrong answer is pushed down), negative (batch's,
    never above 0: a flat wrong group above the batch mean is left alone rather than reinforced)
    or bounded (negative's, never below -1: near convergence the batch std is small and batch's
    push reaches -3 to -5) or unlikelihood (-1, which the trainer scales per token by p / (1 - p)
    of its current policy: the gradient of -log(1 - p), about 1 on the logit of a deterministic
    wrong token, where any plain advantage moves it by 1 - p, about 0). Mixed groups keep the
    estimator's advantages; flat groups at the maximum stay 0. Under unlikelihood a guard window
    holding pushed flat wrong groups ends the run converged only at 95% held-out (not 90%), and a
    collapse trains on instead of failing: the push is still moving those prompts."""
    unlikelihood_scale: float = 0.1
    """Under flat_advantage=unlikelihood, what the p / (1 - p) weight is multiplied by: the push
    on a deterministic wrong token's logit is about this much. At 1 (the unlikelihood loss's own)
    the push also knocks down the right digits of a nearly right answer, which every prompt
    shares: 2 of 80 default runs crashed from 100% held-out near the end; at 0.1, none (1 of 80
    when measured again)."""
    unlikelihood_level: UnlikelihoodLevel = UnlikelihoodLevel.token
    """Under flat_advantage=unlikelihood: token (every token by its own p / (1 - p): the same
    push on each token's logit, the answer's right tokens included) or sequence (every token of
    the answer by P / (1 - P), P the whole answer's probability: the gradient of
    -log(1 - P), whose push on a token's logit is P (1 - p) / (1 - P), so it lands on the tokens
    the policy is least sure of, and evenly where it is sure of them all)."""
    loss_agg: LossAgg = LossAgg.token_mean
    """How per-token losses make a minibatch's loss: token_mean (every trained token of the
    minibatch, all ranks, weighs the same: DAPO), seq_mean_token_sum (each sequence's token sum,
    averaged over sequences: Dr. GRPO's constant normaliser), seq_mean_token_mean (each
    sequence's token mean, averaged over sequences: the original GRPO). The entropy bonus is
    aggregated the same way."""
    lr: float = 1e-3
    """AdamW learning rate (the peak of the schedule)."""
    lr_schedule: LrSchedule = LrSchedule.constant
    """Learning rate after warm-up: constant, linear or cosine decay to min_lr_ratio * lr over
    train.steps * minibatches optimizer steps."""
    warmup_steps: int = 0
    """Optimizer steps (minibatches included) of linear warm-up from lr / warmup_steps to lr."""
    min_lr_ratio: float = 0.0
    """Floor of the linear and cosine decays, as a fraction of lr."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    clip_eps: float = 0.2
    """PPO clip range around the ratio to the proximal (or behaviour) policy: the lower bound
    1 - clip_eps, and the upper one too unless clip_high is set."""
    clip_high: Optional[float] = None
    """Upper PPO clip bound 1 + clip_high (DAPO's clip-higher, 0.28 there): a sampled token
    with a positive advantage may grow further than clip_eps allows. Unset: clip_eps
    (symmetric)."""
    is_cap: float = 2.0
    """Cap on per-token importance ratios (decoupled and tis)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus on trained tokens (keeps a collapsing policy exploring)."""
    kl_coef: float = 0.0
    """Weight of a KL penalty to the reference policy (the initial weights, frozen, sharded like
    the policy, never published); 0 keeps no reference at all: no forward, no memory."""
    kl_estimator: KlEstimator = KlEstimator.k3
    """Per-token estimator of KL(policy || reference) on the trained tokens: k1 (log ratio),
    k2 (half its square), k3 (r - 1 - log r with r = reference / policy: unbiased and >= 0)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them:
    less memory for about one more forward's time; the same losses and gradients."""
    minibatches: int = 1
    """Optimizer steps per batch (PPO-style): the batch is cut into this many minibatches; the
    proximal policy is the weights before the first (trainer.proximal). Above 1, decoupled
    (clip against the proximal policy) and tis (importance weight against the current one)
    differ."""
    proximal: Proximal = Proximal.recompute
    """With trainer.minibatches > 1, how the minibatches after the first get their proximal
    logprobs (the first one's training forward runs on the proximal weights and gives its own):
    recompute (a forward pass without gradients over them before the first update) or
    loglinear (no such pass: each token's logprob is taken to move linearly in the policy
    version, from its behaviour logprob at the version that sampled it to the logprob of the
    weights being trained, 1/minibatches of a version per update, and read at the proximal
    version; a batch with a trained token of unknown version is recomputed). Read by the
    decoupled and recompute corrections only: the others need no proximal logprobs and never
    run the pass."""
    publish_every: int = 1
    """Publish an HF weight checkpoint every N steps."""
    checkpoint_every: int = 10
    """Write a full resumable state every N steps (and at the end)."""
    keep_weight_versions: int = 3
    """Published weight versions (``weights/step_N``, what engines load) kept: the newest N; older
    ones are pruned. Resumable checkpoints are ``keep_checkpoints``."""
    keep_checkpoints: int = 3
    """Full (resumable) checkpoints kept: the newest K; older ones are deleted once a newer one
    is complete (0 = keep all)."""
    keep_checkpoints_every: int = 0
    """Also keep every full checkpoint whose step is a multiple of M (0 = none beyond the newest K)."""
    start_timeout: float = 300.0
    """Seconds the trainer may take to become ready."""
    sim: SimTrainerConfig = field(default_factory=SimTrainerConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)

    def __post_init__(self) -> None:
        _require(self.lr > 0, "trainer.lr", "must be > 0")
        _require(self.advantage is not Advantage.dr_grpo or self.scale_rewards in (None, ScaleRewards.none),
                 "trainer.scale_rewards", "dr_grpo is the group mean without a std divisor: leave "
                 "trainer.scale_rewards unset or none (grpo divides by the group's std)")
        _require(self.warmup_steps >= 0, "trainer.warmup_steps", "must be >= 0")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "trainer.min_lr_ratio", "must be within [0, 1]")
        _require(self.clip_eps > 0, "trainer.clip_eps", "must be > 0")
        _require(self.clip_high is None or self.clip_high > 0, "trainer.clip_high", "must be > 0 (unset = clip_eps)")
        _require(self.unlikelihood_scale > 0, "trainer.unlikelihood_scale", "must be > 0")
        _require(self.is_cap >= 1, "trainer.is_cap", "must be >= 1")
        _require(self.entropy_coef >= 0, "trainer.entropy_coef", "must be >= 0")
        _require(self.kl_coef >= 0, "trainer.kl_coef", "must be >= 0 (0 = no reference policy)")
        _require(self.minibatches >= 1, "trainer.minibatches", "must be >= 1")
        _require(self.publish_every >= 1, "trainer.publish_every", "must be >= 1")
        _require(self.checkpoint_every >= 1, "trainer.checkpoint_every", "must be >= 1")
        _require(self.keep_weight_versions >= 1, "trainer.keep_weight_versions", "must be >= 1")
        _require(self.keep_checkpoints >= 0, "trainer.keep_checkpoints", "must be >= 0 (0 = keep all)")
        _require(self.keep_checkpoints_every >= 0, "trainer.keep_checkpoints_every", "must be >= 0")


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every linear layer of a Qwen2/Llama decoder layer (attention and MLP)."""


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank of the adapters (through ``peft``, ``pip install "rlorch[lora]"``); 0 trains
    every weight. Only the adapters train and are checkpointed; published weights are merged."""
    alpha: float = 32.0
    """LoRA scaling numerator: the adapter's update is scaled by alpha / rank."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Names of the linear modules that get adapters (default: every attention and MLP projection)."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full beside the adapters (peft's ``modules_to_save``, matched by name
    ending), e.g. ``[norm]`` for every RMSNorm: the tiny default model is randomly initialised,
    and with its norms frozen its logits stay too flat to learn the task."""

    def __post_init__(self) -> None:
        _require(self.rank >= 0, "model.lora.rank", "must be >= 0 (0 = no LoRA)")
        _require(self.alpha > 0, "model.lora.alpha", "must be > 0")
        _require(not self.rank or bool(self.target_modules), "model.lora.target_modules",
                 "must name at least one module when model.lora.rank > 0")
        _require(not self.rank or _installed("peft"), "model.lora.rank",
                 'LoRA needs peft: pip install "rlorch[lora]" (or set model.lora.rank=0)')


IMPLEMENTATIONS = ("auto", "native", "hf")
"""The values of ``model.implementation``."""


@dataclass
class ModelConfig:
    path: Optional[str] = None
    """Local HF model directory, or a built-in model created locally on first use: ``tiny`` (the
    default when empty: random weights, RL teaches it everything) or ``tiny-copy`` (the same
    pretrained to copy earlier tokens, as any pretrained LM can: the agent example's base;
    about 2 minutes to create on 2 cores)."""
    dtype: str = "float32"
    """Served and compute dtype (float32, bfloat16, float16). Below float32 the trainer keeps
    fp32 master weights and optimizer state and computes in this dtype (FSDP2 mixed precision,
    gradients reduced in fp32); published weights are in this dtype."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    implementation: str = "auto"
    """Whose code runs the model in ``rlorch serve`` and the trainer: ``native`` (rlorch's own
    Qwen2, :mod:`rlorch.qwen2`: the same logits as transformers', without importing its modelling
    code, seconds of every start on a small machine), ``hf`` (transformers'), or ``auto``: native
    for a Qwen2 checkpoint it reproduces, without LoRA, on the CPU; transformers' otherwise.
    SGLang servers run their own code whatever this says."""

    def __post_init__(self) -> None:
        _require(self.dtype in ("float32", "bfloat16", "float16"), "model.dtype",
                 f"must be one of float32, bfloat16, float16 (got {self.dtype!r})")
        _require(self.implementation in IMPLEMENTATIONS, "model.implementation",
                 f"must be one of {', '.join(IMPLEMENTATIONS)} (got {self.implementation!r})")


@dataclass
class TaskConfig:
    name: str = "reverse"
    """Environment from the registry (reverse, sort, reverse_retry, calculator, jsonl), or
    ``package.module:Class`` for your own."""
    params: dict[str, Any] = field(default_factory=dict)
    """The environment's own parameters (the presets in conf/task/ list each task's; for your
    own environment add them with ``+task.params.key=value``)."""
    reward: Any = None
    """Reward function(s) for a task from data (``data.path``), replacing exact match:
    ``package.module:function`` or ``math`` (built in, GSM8K-style answers, needs math-verify),
    or a list of them. TRL's signature: ``f(prompts, completions, **columns) -> list[float]``,
    sync or async; the reward is their weighted sum."""
    reward_weights: Optional[list[float]] = None
    """One weight per ``task.reward`` function (default: 1 each)."""
    agent: Optional[str] = None
    """``package.module:function``: each sample's episode is your agent,
    ``async def agent(sample, *, base_url, api_key) -> float | None``, calling the model through
    any OpenAI client at ``base_url`` (a session of its own; docs/agents.md). It returns the
    reward, or None to have the task score its last answer. Unset: the task's own episodes."""
    tool_call_parser: Optional[str] = None
    """How tool calls are read from an agent call's sampled text when the call offers ``tools``:
    ``qwen25`` (alias ``hermes``: ``<tool_call>{json}</tool_call>``, as Qwen2.5 writes them) or
    ``pipe`` (the tiny model's ``name:argument|``); unset: tools are not parsed (text only)."""
    max_calls: int = 16
    """Most model calls one agent episode may make; the next is refused (HTTP 429) and the
    episode fails."""
    agent_timeout: float = 120.0
    """Seconds an agent episode may run; past it the episode fails (its calls are cancelled)."""
    agent_bridge: bool = True
    """For chat templates that render earlier turns differently once later ones follow (Qwen3's
    drops past reasoning): continue the episode's sequence with the new messages rendered after
    a stand-in history, keeping the sampled ids. false: such a call starts a new sequence (a fork)."""
    agent_sampling: bool = False
    """Use the agent's own temperature, top_p and max_tokens instead of the run's (the behaviour
    logprobs are then of another distribution than the policy's: for evaluation agents only)."""

    def __post_init__(self) -> None:
        _require(self.max_calls >= 1, "task.max_calls", "must be >= 1")
        _require(self.agent_timeout > 0, "task.agent_timeout", "must be > 0 seconds")
        if self.agent is not None:
            _require(isinstance(self.agent, str) and ":" in self.agent, "task.agent",
                     f"must be package.module:function (got {self.agent!r})")
        if self.tool_call_parser is not None:
            from rlorch.openai_api import TOOL_PARSERS

            _require(self.tool_call_parser in TOOL_PARSERS, "task.tool_call_parser",
                     f"unknown parser {self.tool_call_parser!r} (known: {', '.join(sorted(TOOL_PARSERS))})")
        if isinstance(self.reward, str):
            self.reward = [self.reward]
        if self.reward is not None:
            self.reward = list(self.reward)
            _require(bool(self.reward) and all(isinstance(r, str) and r for r in self.reward), "task.reward",
                     "must be a function (package.module:function or math) or a non-empty list of them")
        if self.reward_weights is not None:
            _require(self.reward is not None and len(self.reward_weights) == len(self.reward),
                     "task.reward_weights", "must give one weight per task.reward function")


@dataclass
class DataConfig:
    path: Optional[str] = None
    """Training data: a JSONL, JSON, CSV or Parquet file, or a directory saved by ``datasets``
    (``save_to_disk``); sets the task to the data task (exact match, or ``task.reward``). Formats
    other than JSONL need the ``datasets`` package (``pip install 'rlorch[data]'``)."""
    prompt_key: str = "prompt"
    """Column holding the prompt text."""
    messages_key: Optional[str] = None
    """Column holding the prompt as chat messages (a list of {role, content}) instead of text;
    rendered with the model's chat template."""
    answer_key: str = "answer"
    """Column holding the reference answer (passed to reward functions under its name, with
    every other column)."""
    eval_path: Optional[str] = None
    """Evaluation data in the same form, never trained on."""
    eval_fraction: float = 0.0
    """Share of ``data.path``'s rows held out for evaluation (a fixed split, the same for every
    seed, never trained on) when there is no ``data.eval_path``. 0 with no eval_path: evaluation
    draws training rows."""
    shuffle: bool = True
    """Each pass over the training rows in a fresh order seeded by run.seed and the pass; false:
    file order every pass. A resumed run continues the same order."""
    epochs: Optional[int] = None
    """Passes over the training rows: the run ends after epochs x rows / prompts per batch steps
    if train.steps is larger (groups dropped by the filters use prompts too). Unset: as many
    passes as train.steps takes."""

    def __post_init__(self) -> None:
        _require(0.0 <= self.eval_fraction < 1.0, "data.eval_fraction", "must be in [0, 1)")
        _require(self.epochs is None or self.epochs >= 1, "data.epochs", "must be >= 1")
        _require(not (self.eval_path and self.eval_fraction), "data.eval_fraction",
                 "give data.eval_path or data.eval_fraction, not both")


@dataclass
class WatcherConfig:
    poll_interval: float = 0.02
    """Seconds between checks for a newly published checkpoint."""
    stall_timeout: float = 600.0
    """Alarm (and fail) when the version has not advanced for this many seconds while batches wait."""

    def __post_init__(self) -> None:
        _require(self.poll_interval > 0, "watcher.poll_interval", "must be > 0 seconds")
        _require(self.stall_timeout > 0, "watcher.stall_timeout", "must be > 0 seconds")


@dataclass
class MetricsConfig:
    interval: float = 1.0
    """Seconds between periodic metrics records (independent of training steps)."""
    tensorboard: bool = False
    """Also write TensorBoard scalars into RUN_DIR/tensorboard/ (needs the tensorboard package)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the wandb package; WANDB_MODE=offline keeps it local,
    files in RUN_DIR/wandb/)."""
    wandb_project: str = "rlorch"
    """W&B project."""
    wandb_name: Optional[str] = None
    """W&B run name (empty: the run directory's name)."""

    def __post_init__(self) -> None:
        _require(self.interval > 0, "metrics.interval", "must be > 0 seconds")
        for key, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
            _require(not getattr(self, key) or _installed(package), f"metrics.{key}",
                     f"needs the {package} package: pip install {package}")


@dataclass
class SimConfig:
    ticks: int = 60
    """Ticks to simulate in `rlorch simulate`."""
    latency: list[int] = field(default_factory=lambda: [3, 3])
    """[lo, hi] rollout latency in ticks, drawn with rng.integers(lo, hi) (lo when hi == lo)."""
    seed: int = 0
    """Seed of the latency draws."""
    recover_at: int = 0
    """Start at this policy version, as after a resume (0 = fresh run)."""
    fix_recovery: bool = True
    """Apply the gate's recovery adjustment on resume."""

    def __post_init__(self) -> None:
        _require(self.ticks >= 1, "sim.ticks", "must be >= 1")
        _require(len(self.latency) == 2 and 1 <= self.latency[0] <= self.latency[1], "sim.latency",
                 "must be [lo, hi] ticks with 1 <= lo <= hi")
        _require(self.recover_at >= 0, "sim.recover_at", "must be >= 0")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    watcher: WatcherConfig = field(default_factory=WatcherConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    sim: SimConfig = field(default_factory=SimConfig)

    def __post_init__(self) -> None:
        _require_finite(self, "")
        fsdp = self.trainer.fsdp
        # With run.launcher=ray the rendezvous is node 0's IP and a free port there.
        _require(fsdp.nnodes == 1 or self.run.launcher == "ray" or _is_host_port(fsdp.rdzv_endpoint),
                 "trainer.fsdp.rdzv_endpoint",
                 f"must be host:port when trainer.fsdp.nnodes > 1 (got {fsdp.rdzv_endpoint!r})")
        correction = self.trainer.correction
        off_policy = self.rollout.max_staleness > 0 or self.rollout.enforce == Enforce.ship
        _require(not (correction.uncorrected and off_policy and not self.trainer.allow_uncorrected),
                 "trainer.correction",
                 f"'{correction.value}' trains off-policy data (rollout.max_staleness > 0, or enforce=ship) as if "
                 "on-policy; use decoupled or tis, set rollout.max_staleness=0 with admission or "
                 "strict, or trainer.allow_uncorrected=true")
        _require(not (correction == Correction.none and self.trainer.minibatches > 1 and not self.trainer.allow_uncorrected),
                 "trainer.correction",
                 f"'none' with trainer.minibatches={self.trainer.minibatches} trains every minibatch after "
                 "the first on weights newer than those that sampled it, as if on-policy; use decoupled "
                 "or tis, set trainer.minibatches=1, or trainer.allow_uncorrected=true")
        _require(self.inference.backend.generates_model_tokens or not self.trainer.backend.needs_model_tokens,
                 "trainer", f"trainer={self.trainer.backend.value} needs real tokens: use inference=cpu or "
                            f"inference=sglang with it, or trainer=sim with inference=sim")
        _require(self.inference.weight_transfer is WeightTransfer.disk
                 or (self.trainer.backend is TrainerBackend.fsdp and self.inference.backend is not InferenceBackend.sim),
                 "inference.weight_transfer", "distributed needs trainer=fsdp and inference=cpu or sglang")
        _require(self.inference.weight_transfer is WeightTransfer.disk or not self.inference.router,
                 "inference.router", "weight_transfer=distributed needs every server's rank in the weight group, "
                                     "which a router hides: use inference.weight_transfer=disk with "
                                     "inference.router, or list the servers in inference.addresses without it")
        _require(self.trainer.flat_advantage is FlatAdvantage.zero or not self.rollout.filter_groups,
                 "trainer.flat_advantage",
                 f"{self.trainer.flat_advantage.value} trains flat groups below the maximum reward, but "
                 "rollout.filter_groups=true drops them before they are trained: set "
                 "rollout.filter_groups=false (or trainer.flat_advantage=zero)")
        self._check_colocation()
        _require(self.rollout.max_concurrent >= self.rollout.group_size, "rollout.max_concurrent",
                 f"must be >= rollout.group_size ({self.rollout.group_size}): a group is admitted whole")


    def _check_colocation(self) -> None:
        colocate = self.run.colocate
        if not colocate.shares:
            return
        _require(self.inference.backend is not InferenceBackend.sim and not self.inference.router, "run.colocate",
                 f"{colocate.value} shares a GPU with inference servers: use inference=cpu or inference=sglang, "
                 "without inference.router (every server's memory is released and resumed by name)")
        _require(not self.inference.distributed, "inference.weight_transfer",
                 f"distributed cannot run with run.colocate={colocate.value}: NCCL refuses two ranks on one GPU; "
                 "use inference.weight_transfer=disk")
        if colocate is Colocate.swap:
            _require(self.rollout.max_staleness == 0, "run.colocate",
                     f"swap needs rollout.max_staleness=0 (got {self.rollout.max_staleness}): the engines hold "
                     "no memory while the trainer trains; use run.colocate=resident for asynchronous training")
            _require(self.rollout.enforce is not Enforce.ship, "run.colocate",
                     "swap needs rollout.enforce=admission or strict: ship-side gating generates the next batch "
                     "while the trainer trains")
            _require(self.trainer.backend is TrainerBackend.fsdp, "run.colocate",
                     "swap moves the fsdp trainer's state to the host between steps: use trainer=fsdp")
            _require(self.trainer.publish_every == 1, "trainer.publish_every",
                     f"run.colocate=swap needs 1 (got {self.trainer.publish_every}): the engines take their "
                     "memory back with each step's new version")


def _require_finite(section: Any, prefix: str) -> None:
    """No setting may be inf or NaN (``trainer.lr=inf`` would train NaN weights)."""
    import math
    from dataclasses import fields, is_dataclass

    for item in fields(section):
        value, key = getattr(section, item.name), f"{prefix}{item.name}"
        if is_dataclass(value):
            _require_finite(value, f"{key}.")
        values = value if isinstance(value, (list, tuple)) else [value]
        for number in values:
            _require(not (isinstance(number, float) and not math.isfinite(number)), key,
                     f"must be a finite number, got {number}")


def warnings_for(config: Config) -> list[str]:
    """Settings that are valid but waste capacity or surprise people."""
    r = config.rollout
    found = []
    if r.max_concurrent < r.batch_size:
        found.append(f"rollout.max_concurrent ({r.max_concurrent}) < rollout.batch_size ({r.batch_size}): "
                     "a batch needs several admission waves, generation and training barely overlap")
    if config.data.path and config.eval.enabled and not (config.data.eval_path or config.data.eval_fraction):
        found.append("data.path without data.eval_path or data.eval_fraction: evaluation draws training rows, "
                     "so eval accuracy measures recall, not generalisation")
    usable = r.pending_limit
    if r.max_concurrent > usable:
        found.append(f"rollout.max_concurrent ({r.max_concurrent}) > (S+1)*B = {usable}: "
                     f"{r.max_concurrent - usable} slots can never be used")
    updates = config.train.steps * config.trainer.minibatches
    if config.trainer.warmup_steps >= updates:
        found.append(f"trainer.warmup_steps ({config.trainer.warmup_steps}) >= train.steps * trainer.minibatches "
                     f"({updates}) optimizer steps: the run ends before the learning rate reaches trainer.lr")
    return found


def to_plain(config: Any) -> Any:
    """A JSON-serialisable view of a config (enums as their values)."""
    from dataclasses import fields, is_dataclass

    if is_dataclass(config):
        return {f.name: to_plain(getattr(config, f.name)) for f in fields(config)}
    if isinstance(config, enum.Enum):
        return config.value
    if isinstance(config, (list, tuple)):
        return [to_plain(v) for v in config]
    return config
