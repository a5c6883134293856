"""Every message that crosses a process boundary, one tagged union per socket edge.

All are msgspec ``Struct``s encoded as msgpack (never pickle). ``tag=True`` puts the class name on the wire,
so a decoder for an edge's union accepts exactly that edge's messages and rejects anything else.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

# ----------------------------------------------------------------------------- shared pieces


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Sampling knobs, SGLang's names. ``temperature == 0`` means greedy; ``top_k == -1`` means off."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    seed: int | None = None

    def stop_strings(self) -> list[str]:
        """``stop`` as a list (a single string becomes a one-element list)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One chat turn; rendered through the model's chat template."""

    role: str
    content: str


class FinishReason(msgspec.Struct, omit_defaults=True):
    """Why a request ended: ``type`` is ``stop`` (EOS, stop token or string), ``length`` or ``abort``."""

    type: str
    matched: Union[int, str, None] = None
    message: str | None = None


class MetaInfo(msgspec.Struct):
    """Per-request facts returned to clients (SGLang's ``meta_info``)."""

    id: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason | None = None
    lora_path: str | None = None
    # with GenerateReq.return_logprob: one [logprob, token_id] per generated token (fp32 log-softmax of the
    # logits the token was sampled from, before temperature/top-p), and with top_logprobs_num = k > 0 the
    # k most likely [logprob, token_id] pairs at each position (SGLang's names)
    output_token_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (SGLang's name)


class AdapterState(msgspec.Struct, array_like=True):
    """An adapter as the workers hold it: enough to rebuild a registry or restore it under the same uid."""

    uid: str
    name: str
    path: str
    pinned: bool
    content_hash: str
    rows: int = 0  # rank rows it takes in a pool (ipc.lora_config.lora_rows); 0 = unknown


class AdapterInfo(msgspec.Struct):
    """One adapter as the registry and worker pools see it (for ``adapters.py list``)."""

    name: str
    uid: str
    path: str
    rank: int
    pinned: bool
    slots: dict[str, int] = {}  # "rank N" -> slot index, for ranks whose pool holds it


# ----------------------------------------------------------------------------- client <-> tokenizer_proc


class GenerateReq(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """A generation request. Exactly one of ``text``, ``input_ids`` or ``messages`` is set."""

    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    lora_path: str | None = None
    rid: str | None = None
    allow_special_tokens_in_content: bool = False  # chat: special-token text in content becomes control tokens
    return_logprob: bool = False  # meta_info gets output_token_logprobs (and output_top_logprobs, see below)
    top_logprobs_num: int = 0  # 0..20 most likely alternatives per generated token


class AbortReq(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Abort the caller's request ``rid``."""

    rid: str


class LoadLoraReq(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Load a PEFT adapter folder at run time under ``lora_name``."""

    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoraReq(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Unload adapter ``lora_name``: new requests are refused, in-flight ones finish first."""

    lora_name: str


class ListLorasReq(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """List the registry's adapters and which slots hold them on each TP rank."""


class HealthReq(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Liveness probe; answered with ``AdminOut``."""


ClientMsg = Union[GenerateReq, AbortReq, LoadLoraReq, UnloadLoraReq, ListLorasReq, HealthReq]


class GenerateOut(msgspec.Struct, tag=True):
    """A result (``finished``) or a stream chunk; ``text`` and ``output_ids`` are cumulative."""

    rid: str
    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    finished: bool


class ErrorOut(msgspec.Struct, tag=True):
    """A request failed; ``message`` says what was wrong. ``rid`` is empty when no rid could be read from the frame."""

    rid: str
    message: str
    kind: str = "bad_request"  # bad_request | not_found | server_error | overloaded | unavailable (draining)


class AdminOut(msgspec.Struct, tag=True):
    """Answer to an admin request (load/unload/health). ``kind`` names a failure as the HTTP API's native errors do
    (``bad_request``, ``not_found`` for an adapter nothing knows, ``server_error``); empty when ``ok``."""

    ok: bool
    message: str = ""
    info: dict[str, Any] = {}
    kind: str = ""


class LoraListOut(msgspec.Struct, tag=True):
    """Answer to ``ListLorasReq``."""

    adapters: list[AdapterInfo]


ServerMsg = Union[GenerateOut, ErrorOut, AdminOut, LoraListOut]

# ----------------------------------------------------------------------------- tokenizer_proc -> scheduler


class TokenizedReq(msgspec.Struct, tag=True):
    """A validated, tokenized request. ``lora_uid`` is the registry's uid (None = base model).

    A request resubmitted after a scheduler restart has ``resume=True`` and carries the ``output_ids`` its
    client already received: the scheduler prefills prompt + those and continues after them (a resubmission of
    a rid the scheduler already holds is ignored).
    """

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    lora_uid: str | None = None
    stream: bool = False
    output_ids: list[int] = []
    resume: bool = False
    return_logprob: bool = False  # the client's GenerateReq.return_logprob: TokenOut carries new_token_logprobs
    top_logprobs_num: int = 0  # ... and, when > 0, new_top_logprobs with this many alternatives per token


class AbortRid(msgspec.Struct, tag=True):
    """Abort ``rid`` wherever it is (waiting, running); its KV slots are freed at once."""

    rid: str
    reason: str = "aborted by client"


class LoraLoadCmd(msgspec.Struct, tag=True):
    """Load adapter ``uid`` on every TP rank; all succeed or all roll back.

    ``content_hash`` is set when the registry restores an adapter it already knows under the same uid (after
    a restart): ranks refuse files whose content changed since the first load.
    """

    op_id: int
    uid: str
    name: str
    path: str
    pinned: bool = False
    content_hash: str = ""


class LoraUnloadCmd(msgspec.Struct, tag=True):
    """Unload adapter ``uid`` on every rank once no waiting or running request uses it."""

    op_id: int
    uid: str


class LoraSlotsQuery(msgspec.Struct, tag=True):
    """Ask the scheduler for each rank's uid -> slot table (for ``adapters.py list``)."""

    op_id: int


class FrontDoorHello(msgspec.Struct, tag=True):
    """A tokenizer_proc (re)started as ``incarnation``: the scheduler aborts the requests of any earlier front
    door (nobody can receive their output) and answers with a :class:`ClusterView`."""

    incarnation: str


class ShutdownCmd(msgspec.Struct, tag=True):
    """Stop cleanly."""


class WorkersRestarting(msgspec.Struct, tag=True):
    """Launcher -> scheduler: the TP group is being replaced by group ``epoch`` because of ``cause``.

    The scheduler drops what the old group was computing, puts its running requests back in the queue and
    waits for every rank of ``epoch`` to say READY.
    """

    epoch: int
    cause: str
    process: str = "gpu_worker"  # e.g. "gpu_worker[1]" (died) or "gpu_worker" (the group hung)
    restarts: dict[str, int] = {}  # the launcher's restart count per process


ToSchedulerMsg = Union[
    TokenizedReq,
    AbortRid,
    LoraLoadCmd,
    LoraUnloadCmd,
    LoraSlotsQuery,
    ShutdownCmd,
    WorkersRestarting,
    FrontDoorHello,
]

# ----------------------------------------------------------------------------- scheduler -> tokenizer_proc


class TokenOut(msgspec.Struct):
    """New tokens for one request since the last message."""

    rid: str
    new_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_kind: str = "bad_request"  # bad_request (refused) | server_error (a step failed)
    # for a request with return_logprob, aligned with new_ids: [logprob, token_id] of each new token (fp32
    # log-softmax of the logits it was sampled from) and, with top_logprobs_num = k > 0, its k most likely
    # [logprob, token_id] pairs; the front door accumulates them into MetaInfo.output_token_logprobs / _top_
    new_token_logprobs: list[tuple[float, int]] | None = None
    new_top_logprobs: list[list[tuple[float, int]]] | None = None
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache at admission (same on every TokenOut)


class BatchTokenOut(msgspec.Struct, tag=True):
    """One message per scheduler step carrying every request that changed."""

    items: list[TokenOut]


class LoraOpResult(msgspec.Struct, tag=True):
    """Outcome of a ``LoraLoadCmd`` / ``LoraUnloadCmd`` / ``LoraSlotsQuery``."""

    op_id: int
    ok: bool
    error: str = ""
    slots: dict[str, dict[str, int]] = {}  # uid -> {"rank N": slot}
    content_hash: str = ""  # a load's sha256 of the adapter files every rank read


class LostAdapter(msgspec.Struct):
    """An adapter a restart could not restore: its uid, name and why (folder gone, files changed, invalid)."""

    uid: str
    name: str
    reason: str


class ClusterEvent(msgspec.Struct, tag=True):
    """Something the front door must know about the cluster's health.

    ``kind``:
    - ``workers_restarting``: the TP group ``epoch`` is being (re)started because of ``message``; requests
      wait in the queue until ``workers_recovered``.
    - ``workers_recovered``: group ``epoch`` serves again; ``resumed`` running requests were re-admitted,
      ``restored`` adapters (names) reloaded under their uids, ``lost`` ones removed from the cluster.
    - ``fatal``: the cluster cannot go on; ``message`` says why.
    """

    kind: str
    message: str
    epoch: int = 0
    process: str = ""  # the process whose death or hang caused a restart, e.g. "gpu_worker[1]"
    restarts: dict[str, int] = {}  # the launcher's restart count per process
    resumed: int = 0
    restored: list[str] = []
    lost: list[LostAdapter] = []


class ClusterView(msgspec.Struct, tag=True):
    """Scheduler -> tokenizer: the adapters every worker rank holds, sent when a scheduler ``incarnation``
    starts (a new incarnation means a scheduler restart: the front door resubmits its pending requests and
    LoRA commands) and in answer to :class:`FrontDoorHello`. ``restarts`` is the launcher's restart count per
    process."""

    scheduler_incarnation: str
    epoch: int
    adapters: list[AdapterState] = []
    restarts: dict[str, int] = {}
    serving: bool = True  # False while the TP group is being replaced (the front door reports 503 meanwhile)


class SchedulerBeat(msgspec.Struct, tag=True):
    """Scheduler -> tokenizer about once a second while the scheduler's loop runs: the heartbeat ``/health``
    reads, with what the scheduler knows of the TP ranks and the batch (for ``/metrics``).

    ``unresponsive`` names the ranks that left a liveness probe unanswered past its timeout (rank -> why); a
    rank busy with a step or a LoRA command is judged by ``--step-timeout`` / ``--lora-op-timeout`` instead.
    """

    incarnation: str
    epoch: int
    rank_silence_s: list[float] = []  # per rank: seconds since its last answer to anything
    unresponsive: dict[int, str] = {}
    running: int = 0  # requests in the running batch
    waiting: int = 0  # requests in the scheduler's waiting queue
    kv_used_tokens: int = 0  # KV token slots held by running requests or reserved for their remaining output
    kv_capacity_tokens: int = 0
    running_lora_uids: list[str] = []  # adapters of running requests (sorted, no duplicates)
    waiting_lora_uids: list[str] = []  # adapters of waiting requests
    # distinct adapters at --max-lora-rank one batch can mix (0 = not known yet): --max-loras-per-batch where the
    # workers copy adapters into slots, up to --max-running-requests where they read them in place
    max_batch_loras: int = 0
    slot_uids: list[str] = []  # adapters in a slot on rank 0 after the last step
    slot_evictions: int = 0  # adapters evicted from a slot by another since this scheduler started
    # prefix cache (Scheduler.cache_stats), in tokens: hit rate = cached_tokens_total / prompt_tokens_total
    prompt_tokens_total: int = 0  # prompt tokens admitted since this scheduler started (each request once)
    cached_tokens_total: int = 0  # of those, reused from the prefix cache
    cache_tokens: int = 0  # KV slots the prefix cache holds now
    cache_evictable_tokens: int = 0  # of those, read by no running request
    cache_evicted_tokens: int = 0  # freed by LRU eviction since this scheduler started


class DrainCmd(msgspec.Struct, tag=True):
    """Launcher -> tokenizer on SIGTERM: stop admitting requests (new ones get ``unavailable`` / HTTP 503), let
    those in flight finish for up to ``timeout_s`` seconds (then fail the rest), and exit."""

    timeout_s: float


ToTokenizerMsg = Union[BatchTokenOut, LoraOpResult, ClusterEvent, ClusterView, SchedulerBeat, DrainCmd]

# ----------------------------------------------------------------------------- scheduler <-> gpu_worker


class WorkerSampling(msgspec.Struct, array_like=True):
    """What rank 0 needs to sample one request's next token."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None


class BatchReq(msgspec.Struct, array_like=True):
    """One request in a forward step.

    ``input_ids`` are the tokens to run now (the whole prompt at prefill, the last token at decode);
    ``prefix_len`` tokens are already in the KV cache; ``out_slots`` are the KV-cache token slots the new
    tokens are written to (``len(out_slots) == len(input_ids)``); ``req_idx`` is the request's row in the
    worker's request -> token-slot table. ``prefix_slots`` is sent once, in a request's first plan when its
    first ``prefix_len`` tokens come from the prefix cache: their slots, which the worker copies into the row
    (empty otherwise: the row already holds the prefix, or there is none).
    """

    rid: str
    req_idx: int
    input_ids: list[int]
    prefix_len: int
    out_slots: list[int]
    lora_uid: str | None
    sampling: WorkerSampling
    output_len: int = 0  # tokens generated so far (seeds the per-request sampler deterministically)
    logprobs: int = -1  # -1: none; 0: the sampled token's logprob; k > 0: also the k most likely tokens
    prefix_slots: list[int] = []  # KV slots of the cached prefix (len == prefix_len), first plan only


class ForwardBatch(msgspec.Struct, tag=True):
    """The plan for one step, sent unchanged to every TP rank."""

    step: int
    reqs: list[BatchReq]


class WorkerLoraLoad(msgspec.Struct, tag=True):
    """Load adapter ``uid`` from ``path`` into host memory (validate, shard).

    ``content_hash`` is empty at a first load; a restore after a worker restart sets it to the hash recorded
    at the first load, and the rank refuses files whose content changed since.
    """

    op_id: int
    uid: str
    name: str
    path: str
    pinned: bool = False
    content_hash: str = ""


class WorkerLoraUnload(msgspec.Struct, tag=True):
    """Drop adapter ``uid`` from host memory and its slot (``rollback`` marks an undo of a failed load)."""

    op_id: int
    uid: str
    rollback: bool = False


class WorkerShutdown(msgspec.Struct, tag=True):
    """Stop cleanly."""


class WorkerPing(msgspec.Struct, tag=True):
    """Liveness probe of an idle rank (for ``/health``); the rank answers :class:`WorkerPong` at once."""

    op_id: int


class SchedulerHello(msgspec.Struct, tag=True):
    """A (re)started scheduler asks each rank to register again; the rank answers with its WorkerReady."""

    incarnation: str


ToWorkerMsg = Union[ForwardBatch, WorkerLoraLoad, WorkerLoraUnload, WorkerShutdown, SchedulerHello, WorkerPing]


class WorkerReady(msgspec.Struct, tag=True):
    """A worker rank is up: its KV capacity (tokens), a fresh incarnation id (new at every start), the TP group
    ``epoch`` the launcher started it in (every group restart increments it), the adapter uids it holds, its
    LoRA pool's size in rank rows (0: LoRA off) and the steps it has run in this epoch (0 at start-up; a reply to a
    restarted scheduler's ``SchedulerHello`` may have more)."""

    rank: int
    incarnation: str
    kv_capacity_tokens: int
    loaded_uids: list[str] = []
    epoch: int = 1
    adapters: list[AdapterState] = []  # the host tier's adapters, sorted by uid (a scheduler restart reads them)
    lora_rows: int = 0
    steps: int = 0


class RowLogprobs(msgspec.Struct, array_like=True):
    """One plan row's logprobs (rank 0): the sampled token's fp32 log-softmax value and the ``k`` most likely
    ``(logprob, token_id)`` pairs, most likely first (empty when the row asked for none)."""

    logprob: float
    top: list[tuple[float, int]] = []


class StepResult(msgspec.Struct, tag=True):
    """A rank finished step ``step``. ``next_ids`` (rank 0 only) has one token per request in plan order.

    ``row_errors`` (rank 0 only) maps the plan rows whose token could not be sampled (the model gave NaN/+inf or
    only -inf logits) to why; ``next_ids`` holds -1 there. Only those requests fail; ``error`` fails the step.

    ``slot_digest`` hashes the rank's uid -> slot table and eviction order after the step so the scheduler can
    check every rank made the same decisions. ``slots`` is that table (uid -> slot).
    """

    step: int
    rank: int
    next_ids: list[int]
    slot_digest: str = ""
    slots: dict[str, int] = {}
    error: str | None = None
    epoch: int = 1  # the sender's TP group epoch: results of a group that was replaced are dropped
    logprobs: dict[int, RowLogprobs] = {}  # rank 0: plan row -> logprobs, for rows whose BatchReq asked
    row_errors: dict[int, str] = {}  # rank 0: plan row -> why it could not be sampled (next_ids has -1 there)


class LoraOpAck(msgspec.Struct, tag=True):
    """A rank's answer to a LoRA load/unload."""

    op_id: int
    rank: int
    ok: bool
    error: str = ""
    content_hash: str = ""  # sha256 of the adapter files this rank read (loads only)
    epoch: int = 1
    rows: int = 0  # rank rows the adapter takes in this rank's pool (loads only)


class WorkerPong(msgspec.Struct, tag=True):
    """A rank's answer to :class:`WorkerPing` (``epoch``: its TP group's)."""

    op_id: int
    rank: int
    epoch: int = 1


FromWorkerMsg = Union[WorkerReady, StepResult, LoraOpAck, WorkerPong]

# ----------------------------------------------------------------------------- every process -> launcher


class ProcReady(msgspec.Struct, tag=True):
    """A process finished start-up; ``facts`` are shown in the launcher's log."""

    name: str
    pid: int
    facts: dict[str, Any] = {}


class ProcFailed(msgspec.Struct, tag=True):
    """A process could not start; ``error`` says why."""

    name: str
    pid: int
    error: str


class RestartWorkers(msgspec.Struct, tag=True):
    """Scheduler -> launcher: TP group ``epoch`` is hung (a step or LoRA operation timed out); replace it."""

    epoch: int
    reason: str


class Heartbeat(msgspec.Struct, tag=True):
    """scheduler_proc / tokenizer_proc -> launcher, every second: still serving (a silent one is hung)."""

    name: str
    pid: int


ControlMsg = Union[ProcReady, ProcFailed, RestartWorkers, Heartbeat]
