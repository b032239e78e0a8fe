"""The one settings object of Rolltap, shared by the proxy and the trainer.

Values come, highest priority first, from: explicit arguments (CLI flags), environment
variables (`ROLLTAP_` prefix, `__` between levels: `ROLLTAP_DB__URL`), a config file
(TOML, JSON or YAML; path in `ROLLTAP_CONFIG`), then the defaults here. Every field is
documented in `docs/config.md`; a test keeps the two in sync.

Build it once in `main()` and pass it down. There is no module-level instance.
"""

from __future__ import annotations

import json
import os
from ipaddress import ip_network
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

__all__ = [
    "ClusterSettings", "DbSettings", "LimitSettings", "PoolSettings", "ProxySettings", "RecorderSettings", "SamplingSettings", "Settings",
    "TrainerSettings",
]

CONFIG_ENV = "ROLLTAP_CONFIG"


class DbSettings(BaseModel):
    """Where records live. SQLite by default; PostgreSQL for several proxies or a remote trainer."""

    url: str = Field(
        default="sqlite:///./rolltap.db",
        description="SQLAlchemy URL; `sqlite:///PATH` or `postgresql://USER@HOST/DB`. "
        "Drivers are chosen for you (aiosqlite/asyncpg for the proxy, sqlite3/psycopg for migrations).",
    )
    migrate_on_start: bool = Field(
        default=True, description="Run `alembic upgrade head` when a process starts."
    )
    sqlite_busy_timeout_ms: int = Field(
        default=10_000, ge=0, description="SQLite `busy_timeout`: how long a locked database is waited for."
    )
    sqlite_synchronous: Literal["OFF", "NORMAL", "FULL"] = Field(
        default="FULL",
        description="SQLite `synchronous` pragma. FULL makes every committed batch survive a power cut; "
        "batching keeps its cost low.",
    )
    pool_size: int = Field(default=5, ge=1, description="PostgreSQL connection pool size per process.")


class RecorderSettings(BaseModel):
    """The proxy's write path: a bounded queue drained in batches by one writer task."""

    queue_size: int = Field(
        default=4096, ge=1, description="Records waiting for the writer; when full, requests wait (back-pressure)."
    )
    batch_max: int = Field(default=256, ge=1, description="Most records written in one transaction.")
    linger_ms: float = Field(
        default=10.0,
        ge=0,
        description="How long the writer waits after a batch's first record for more to join its "
        "transaction (fewer commits: a third less CPU per call for one agent). A `finish`, a lifecycle "
        "write or a stop cuts it short; the journal covers a crash meanwhile. 0: write at once.",
    )
    spool_dir: Path = Field(
        default=Path("./.rolltap/spool"),
        description="Where batches wait on local disk while the database is unreachable.",
    )
    retry_interval_s: float = Field(
        default=1.0, gt=0, description="Pause between attempts to write spooled batches back to the database."
    )
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024,
        ge=1024,
        description="Largest response body kept for a record; beyond it the stored body is cut and flagged.",
    )
    journal: bool = Field(
        default=True,
        description="Journal every call on local disk (its start, then its record before the client gets the "
        "last byte) so that a `kill -9` of the proxy loses nothing: on start, records of a dead process are "
        "written from its journal and calls it left in flight become `interrupted` records.",
    )
    journal_dir: Path | None = Field(
        default=None,
        description="Where journals live (one file set per process, recovered only once its owner is dead); "
        "default `<spool_dir>/journal`.",
    )
    journal_fsync: bool = Field(
        default=False,
        description="fsync the journal (grouped across concurrent calls) before a call's last byte goes out. "
        "Off, a journaled call survives the proxy's death but not the machine's (power loss, kernel panic).",
    )
    journal_segment_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=4096,
        description="A journal file is rotated at this size and deleted once all its calls are in the database "
        "or the spool.",
    )


PINNABLE_SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"
)


class SamplingSettings(BaseModel):
    """Sampling parameters pinned per deployment, so that agents cannot change them unnoticed (`proxy/sampling.py`)."""

    pinned: dict[str, float | int] = Field(
        default_factory=dict,
        description="Sampling parameters every recorded call is sent with, e.g. `{temperature = 1.0, top_p = 1.0}` "
        "(any of temperature, top_p, top_k, min_p, presence_penalty, frequency_penalty, repetition_penalty). "
        "A call that leaves one out gets the pinned value, written into its recorded request.",
    )
    policy: Literal["override", "reject"] = Field(
        default="override",
        description="A recorded call that asks for a different value: `override` replaces it with the pinned "
        "one (the record shows what the replica used); `reject` refuses it with a 400 (`sampling_pinned`).",
    )

    @field_validator("pinned")
    @classmethod
    def _known_parameters(cls, value: dict[str, float | int]) -> dict[str, float | int]:
        unknown = sorted(set(value) - set(PINNABLE_SAMPLING))
        if unknown:
            raise ValueError(f"cannot pin {unknown}: pinnable are {list(PINNABLE_SAMPLING)}")
        return value


class PoolSettings(BaseModel):
    """How calls are spread over replicas, and how failures are handled."""

    policy: Literal["sticky_least_loaded", "least_outstanding", "round_robin", "consistent_hash"] = Field(
        default="sticky_least_loaded",
        description="`sticky_least_loaded`: a new rollout goes to the least-loaded healthy replica and stays "
        "there (prefix cache) until its attempts finish or go idle. Others: per call.",
    )
    sticky_idle_s: float = Field(
        default=300.0, gt=0, description="A rollout with no call for this long loses its replica binding."
    )
    use_replica_metrics: bool = Field(
        default=True,
        description="Refine load with the replica's own `/metrics` (requests running and waiting, KV-cache use), "
        "scraped by the probe loop.",
    )
    eject_after_errors: int = Field(
        default=3, ge=1, description="Consecutive 5xx answers that eject a replica until its probe passes again."
    )
    max_retries: int = Field(
        default=2,
        ge=0,
        description="Retries on another replica for connect errors, 429 and 503, only before any byte "
        "reached the client.",
    )
    retry_backoff_s: float = Field(default=0.05, ge=0, description="First retry delay; doubles each retry.")
    weight_mode: Literal["none", "lora", "full"] = Field(
        default="none",
        description="How replicas given on the command line take new weights: `lora` (started with "
        "--enable-lora), `full` (VLLM_SERVER_DEV_MODE=1), or `none`.",
    )
    pause_wait_s: float = Field(
        default=30.0, gt=0, description="While admission is paused, how long a new call waits before a 503."
    )


class TracingSettings(BaseModel):
    """OpenTelemetry traces of relayed calls (off unless a collector is named)."""

    otlp_endpoint: str | None = Field(
        default=None,
        description="OTLP/HTTP traces endpoint of a collector (`http://host:4318/v1/traces`); unset: no tracing, "
        "and the OpenTelemetry SDK is not imported.",
    )
    service_name: str = Field(default="rolltap-proxy", description="The `service.name` spans carry.")
    sample_ratio: float = Field(
        default=1.0, ge=0, le=1,
        description="Share of new traces kept; a caller's sampled `traceparent` decision is always followed.",
    )
    export_interval_s: float = Field(default=1.0, gt=0, description="Most time a finished span waits for export.")
    export_timeout_s: float = Field(default=5.0, gt=0, description="Longest one export to the collector may take.")


class ClusterSettings(BaseModel):
    """Several proxies (processes or hosts) on one PostgreSQL database acting as one (`proxy.cluster`)."""

    enabled: bool | None = Field(
        default=None,
        description="Share the active policy, the admission pause, `finish` barriers and crash leases with "
        "every proxy on the database. Default: on for PostgreSQL; SQLite serves one process only.",
    )
    heartbeat_s: float = Field(
        default=1.0, gt=0, description="Pause between heartbeats (and re-reads of the shared state)."
    )
    # `lease_s` was this setting's first name; configurations written with it keep working.
    dead_after_s: float = Field(
        default=5.0, gt=0, validation_alias=AliasChoices("dead_after_s", "lease_s"),
        description="A proxy silent this long is dead: it is no longer waited for, and its calls in flight are "
        "recorded `interrupted` by a live proxy.",
    )
    propagate_timeout_s: float = Field(
        default=10.0, gt=0, description="How long a policy change waits for every live proxy to apply it."
    )
    eject_hold_s: float = Field(
        default=5.0, ge=0,
        description="A replica one proxy ejects is out of every proxy's pool for at least this long, then until "
        "that proxy's probe passes again (a replica that fails calls but passes `/health` does not flap).",
    )


class LimitSettings(BaseModel):
    """What one caller may send and hold; each limit exceeded is an OpenAI-shaped error."""

    max_body_bytes: int = Field(
        default=32 * 1024 * 1024, ge=1024, description="Largest request body accepted (413 beyond it)."
    )
    max_adapter_bytes: int = Field(
        default=1024 * 1024 * 1024, ge=1024, le=1024 * 1024 * 1024,
        description="Largest LoRA adapter the trainer may upload (`PUT /admin/adapters/{name}`, 413 beyond it); "
        "at most 1 GiB, PostgreSQL's limit on one value. The proxy holds an upload in memory while it stores it.",
    )
    max_header_bytes: int = Field(
        default=64 * 1024, ge=1024,
        description="Largest request header block, names and values together (431 beyond it). A block still "
        "arriving is bounded in time by `header_timeout_s`.",
    )
    max_headers: int = Field(default=100, ge=8, description="Most request headers accepted (431 beyond it).")
    call_timeout_s: float = Field(
        default=900.0, gt=0,
        description="Longest one relayed call may take, first byte to last (504 before the response started; "
        "a final error event once a stream has started).",
    )
    max_calls_per_key: int = Field(
        default=64, ge=1,
        description="Relayed calls (streamed or not) one agent key may have in flight on one proxy process "
        "(429 beyond it); a key's own `max_concurrency` overrides it.",
    )
    max_calls_in_flight: int = Field(
        default=4096, ge=1,
        description="Relayed calls in flight on one proxy process, all callers together (503 with "
        "`Retry-After` beyond it).",
    )
    max_abs_reward: float = Field(
        default=1e6, gt=0, le=1e15,
        description="Largest reward magnitude accepted by `reward` and `finish` (400 `reward_out_of_range` "
        "beyond it), so the trainer's sums, spreads and float32 loss terms of rewards stay finite "
        "(at most 1e15).",
    )
    header_timeout_s: float = Field(
        default=10.0, gt=0,
        description="Time a client has to send a request's whole header block, from the connection's opening or from "
        "the first byte of a later request on it; past it the connection is closed (with a 408 when part of a request "
        "came). The longest an unused new connection stays open.",
    )
    body_timeout_s: float = Field(
        default=60.0, gt=0,
        description="Time a client has to send a request's whole body once its headers are in (408, and the "
        "connection closed, beyond it). A relayed call holds no concurrency slot while its body arrives.",
    )


class ProxySettings(BaseModel):
    """The HTTP front."""

    host: str = Field(default="127.0.0.1", description="Interface to listen on.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port to listen on.")
    # NoDecode: the env source would JSON-decode a list field and reject "url1,url2";
    # `_split_replicas` below accepts both forms.
    replicas: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Base URLs of the vLLM replicas (`http://host:port`, no `/v1`). "
        "In the environment: a JSON list or comma-separated URLs.",
    )
    model: str | None = Field(
        default=None,
        description="Served model name to rewrite requests to before a policy is set; "
        "by default the first model the first healthy replica lists.",
    )
    admin_token: SecretStr | None = Field(
        default=None, description="Bearer token for `/admin/...`; admin routes are refused when unset."
    )
    adapter_token: SecretStr | None = Field(
        default=None,
        description="Bearer token replicas' Rolltap plugin sends to fetch LoRA adapters pushed as bytes "
        "(`GET /adapters/{name}`, `trainer.lora_transport = \"bytes\"`); the admin token is accepted too. "
        "With neither set the route is refused. Give replicas this one, not the admin token.",
    )
    open_access: bool = Field(
        default=False,
        description="Serve relayed, reward, finish and read routes without an agent key (logged as a WARNING "
        "at start). Off: every such call needs an agent key (`rolltap-proxy keys create`).",
    )
    agent_key: SecretStr | None = Field(
        default=None,
        description="An unscoped agent key the proxy ensures (hashed) in the database at start, so a "
        "deployment can configure one from its environment (`ROLLTAP_PROXY__AGENT_KEY`).",
    )
    keys_refresh_s: float = Field(
        default=5.0, gt=0,
        description="How often the proxy reloads agent keys from the database: a revoked key stops working "
        "within this time; a new key works within a second (an unknown key triggers a reload, at most one a second).",
    )
    limits: LimitSettings = Field(default_factory=LimitSettings)
    connect_timeout_s: float = Field(default=5.0, gt=0, description="Connecting to a replica.")
    read_timeout_s: float = Field(
        default=600.0, gt=0, description="Longest silence from a replica while a response is being read."
    )
    max_connections: int = Field(default=1024, ge=1, description="Upstream connections kept per proxy.")
    health_interval_s: float = Field(default=2.0, gt=0, description="Pause between active replica probes.")
    finish_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="How long `finish` and `reward` may take in all (waiting for the attempt's calls still in "
        "flight, then writing); past it they answer 503 with Retry-After. Reading an attempt waits as long for "
        "its calls.",
    )
    shutdown_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="On SIGTERM: new relayed calls get 503 `proxy_draining` while calls in flight may take this "
        "long to end (lifecycle routes keep answering meanwhile); the record flush then gets as long again.",
    )
    keep_alive_s: int = Field(
        default=75,
        ge=1,
        description="How long an idle client connection stays open, counted from its opening (see also "
        "`limits.header_timeout_s`) and from the end of each response. Longer than clients' own pool expiry (httpx 5 s, "
        "aiohttp 15 s) and a balancer's idle timeout (60 s is common), so the client closes an idle connection, not "
        "the proxy: when both close it at the same moment, a call sent on it fails before the proxy reads it (seen "
        "with uvicorn's default of 5 s: 1 call in 256 from 64 httpx agents).",
    )
    drain_grace_s: float = Field(
        default=2.0,
        ge=0,
        description="On SIGTERM, once no relayed call is in flight: how long the proxy still answers lifecycle "
        "calls (an agent's `finish` follows its last call) before it exits; each reward, finish or "
        "registration restarts it, within `shutdown_timeout_s`.",
    )
    # NoDecode and the split below: as for `replicas`.
    trusted_proxies: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="IP addresses or CIDR networks (`10.0.0.0/8`) of the reverse proxies in front of this one. "
        "Only a direct peer listed here is believed when its `X-Forwarded-Proto` and `X-Forwarded-Host` say the "
        "client came over HTTPS, or to another host: the dashboard's sign-in cookie is then `Secure`, and its "
        "cross-site check compares a form's `Origin` with that origin. Empty: nobody's X-Forwarded-* headers are "
        "read. In the environment: a JSON list or comma-separated entries.",
    )
    recorder: RecorderSettings = Field(default_factory=RecorderSettings)
    pool: PoolSettings = Field(default_factory=PoolSettings)
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    rollout_logprobs: Literal["on", "off", "sample"] = Field(
        default="on",
        description="Ask the replica for each generated token's logprob on recorded calls: `on` (every call), "
        "`off` (token IDs only), `sample` (the attempts `rollout_logprobs_rate` picks, all of an attempt's calls "
        "or none). The trainer recomputes the old policy's logprobs itself; the replica's are only needed for "
        "off-policy correction (`trainer.rollout_is`) and the train/replica mismatch metric, and on a CPU-bound "
        "vLLM front end they cost throughput (docs/gpu-results.md). An agent's own `logprobs` request is kept.",
    )
    rollout_logprobs_rate: float = Field(
        default=0.0625, ge=0.0, le=1.0,
        description="With `rollout_logprobs = sample`: the share of attempts asked for logprobs (picked by a hash "
        "of the rollout and attempt ids, so every proxy picks alike).",
    )
    litellm_config: Path | None = Field(
        default=None,
        description="YAML file with a LiteLLM `model_list`: hosted models (OpenAI, Anthropic, Azure, any "
        "OpenAI-compatible server) served through LiteLLM's Router when a call names them.",
    )
    log_level: str = Field(default="info", description="Python logging level name.")
    workers: int = Field(
        default=1, ge=1, description="Proxy processes sharing the port (`--workers`); more than one needs PostgreSQL."
    )

    @field_validator("replicas", "trusted_proxies", mode="before")
    @classmethod
    def _split_replicas(cls, value: Any) -> Any:
        # Env values arrive as one string; accept a JSON list or "url1,url2".
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    @field_validator("replicas")
    @classmethod
    def _normalise_replicas(cls, value: list[str]) -> list[str]:
        out = []
        for url in value:
            url = url.rstrip("/")
            if url.endswith("/v1"):
                url = url[: -len("/v1")]
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica URL must start with http:// or https://: {url!r}")
            out.append(url)
        return out

    @field_validator("trusted_proxies")
    @classmethod
    def _check_networks(cls, value: list[str]) -> list[str]:
        # A bare address is a network of one; host bits set (10.0.0.1/8) are cleared, not refused.
        return [str(ip_network(entry.strip(), strict=False)) for entry in value]


class TrainerSettings(BaseModel):
    """The trainer sidecar. Later capabilities add their knobs here."""

    group_size: int = Field(default=8, ge=1, description="Attempts per GRPO group before it is used.")
    max_staleness: int = Field(
        default=1, ge=0, description="Oldest policy version (behind the current one) whose attempts are used."
    )
    group_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="A group short of `group_size` is used anyway once its oldest member finished this long ago, "
        "if it has at least `min_group_size` members; smaller groups keep waiting until they go stale.",
    )
    min_group_size: int = Field(
        default=2,
        ge=1,
        description="Fewest members a timed-out group needs to be used (GRPO needs two to compare).",
    )
    include_failed: bool = Field(
        default=False,
        description="Also train on attempts finished as `failed` that carry a reward. Off: a failed attempt is "
        "usually a broken harness, not a wrong answer (a wrong answer is `succeeded` with a low reward).",
    )
    max_prompt_len: int = Field(
        default=4096, ge=1, description="Tokens; a call whose prompt is longer is dropped (`prompt_too_long`)."
    )
    max_response_len: int = Field(
        default=8192,
        ge=1,
        description="Tokens in one triplet's response (generated tokens plus the masked turns between them). "
        "A call that would overflow it starts a new triplet; a single completion longer than this is dropped.",
    )
    drop_truncated: bool = Field(
        default=False,
        description="Drop calls whose completion was cut by the length limit (`finish_reason == \"length\"`).",
    )
    credit: Literal["identical", "last_only", "discounted", "per_call"] = Field(
        default="identical",
        description="How an attempt's reward is spread over its turns (one per call, also inside a merged row): "
        "the final reward on every turn, on the last one only, discounted by `gamma` per turn from the end, "
        "or per-call rewards.",
    )
    gamma: float = Field(default=0.9, ge=0, le=1, description="Discount per turn for `credit = discounted`.")
    include_hosted: bool = Field(
        default=False,
        description="Train on calls a hosted model answered (re-tokenised, see `model`). Off: they stay in the "
        "record but are left out of policy samples (drop reason `hosted`): the policy did not produce them.",
    )
    unreproducible_sampling: Literal["drop", "keep"] = Field(
        default="drop",
        description="Calls sampled with `top_p < 1`, `top_k > 0`, `min_p > 0` or temperature 0, whose "
        "distribution the update cannot recompute: `drop` (reason `sampling_not_reproducible`) or `keep` "
        "(trained at their temperature, the truncation ignored).",
    )
    dynamic_sampling: bool = Field(
        default=False,
        description="Skip groups whose attempts all scored the same (advantage 0) and read more groups, so a "
        "step keeps `groups_per_step` groups with a signal (DAPO). Skipped groups are consumed all the same.",
    )
    staleness_gate: bool = Field(
        default=True,
        description="Only use attempts within `max_staleness` versions of the current policy. Off: attempts of "
        "any version are used, corrected by `rollout_is` or dropped beyond `off_policy_max_lag`.",
    )
    off_policy_max_lag: int | None = Field(
        default=None,
        ge=0,
        description="Calls sampled more than this many versions behind the current policy are dropped "
        "(`too_stale`); unset keeps them (with `staleness_gate` off, the only bound).",
    )
    mini_batch_size: int = Field(
        default=8, ge=1, description="Rows (triplets) per PPO mini-batch; a batch is rounded to a multiple of it."
    )
    batch_round: Literal["pad", "drop"] = Field(
        default="pad",
        description="How a batch reaches a multiple of `mini_batch_size`: `pad` adds copies of real rows with "
        "an all-zero `response_mask` and reward (they add nothing to the loss); `drop` removes the last rows.",
    )
    pad_token_id: int = Field(
        default=0, ge=0, description="Token ID written into padding positions (hidden by `attention_mask`)."
    )
    model: str | None = Field(
        default=None,
        description="Local Hugging Face model or tokenizer directory, used to re-tokenise calls recorded "
        "without token IDs (hosted providers). Without it such calls are dropped (`no_tokens`).",
    )

    # The update (trainer/update.py, trainer/algos.py): verl's estimators and PPO loss.
    adv_estimator: Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"] = Field(
        default="grpo",
        description="Advantage estimator (verl's `core_algos`): `grpo` (reward minus group mean, over the group "
        "std), `rloo` (minus the mean of the other members), `reinforce_plus_plus` (discounted return, whitened), "
        "`reinforce_plus_plus_baseline` (minus group mean, whitened), `gae` (needs a critic's values).",
    )
    norm_adv_by_std_in_grpo: bool = Field(
        default=True, description="Divide GRPO advantages by the group's std; off gives Dr. GRPO."
    )
    adv_gamma: float = Field(
        default=1.0, ge=0, le=1, description="Discount per token for `reinforce_plus_plus` and `gae`."
    )
    gae_lambda: float = Field(default=1.0, ge=0, le=1, description="GAE's lambda (`adv_estimator = gae`).")
    clip_ratio_low: float = Field(
        default=0.2, gt=0, lt=1, description="PPO clip: the ratio is kept above `1 - clip_ratio_low`."
    )
    clip_ratio_high: float = Field(
        default=0.2, gt=0, description="PPO clip: the ratio is kept below `1 + clip_ratio_high` (0.28 is DAPO's)."
    )
    clip_ratio_c: float = Field(
        default=3.0, gt=1, description="Dual-clip PPO: the loss of a negative-advantage token is capped at "
        "`clip_ratio_c` times its advantage."
    )
    loss_agg_mode: Literal[
        "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = Field(default="token-mean", description="How per-token losses become one number (verl's `agg_loss`).")
    entropy_coeff: float = Field(default=0.0, ge=0, description="Weight of the entropy bonus in the loss.")
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        description="Weight of the KL-to-reference loss; 0 turns it off. The reference is the base model "
        "(the adapter switched off with LoRA; a frozen second copy with full weights).",
    )
    kl_type: Literal["low_var_kl", "k3", "kl", "k1", "abs", "mse", "k2", "low_var_kl+", "k3+"] = Field(
        default="low_var_kl",
        description="KL estimator for `kl_coef` (verl's `kl_penalty`); a trailing `+` uses k2's unbiased gradient.",
    )
    rollout_is: Literal["token", "sequence", "off"] = Field(
        default="token",
        description="Off-policy correction with the replica's logprobs: truncated importance weights "
        "pi_trainer / pi_replica per token or per sequence, or `off`. Rows recorded without logprobs get weight 1.",
    )
    rollout_is_threshold: float = Field(
        default=2.0, gt=0, description="Importance weights above this are truncated to it (TIS)."
    )
    ppo_epochs: int = Field(
        default=2,
        ge=1,
        description="Passes over each batch per update. From the second pass on the policy differs from the one "
        "that sampled, so PPO's clip acts (with one pass and one mini-batch the ratio is always 1).",
    )
    micro_batch_size: int = Field(
        default=1,
        ge=1,
        description="Rows per forward/backward on each worker; gradients accumulate over a mini-batch. "
        "`mini_batch_size / num_workers` must be a multiple of it.",
    )
    lr: float = Field(default=1e-5, gt=0, description="AdamW learning rate (constant).")
    weight_decay: float = Field(default=0.01, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(default=1.0, gt=0, description="Gradients are clipped to this global L2 norm.")
    lora_rank: int = Field(
        default=8,
        ge=0,
        description="LoRA rank; 0 trains the full weights (and exports full weights). LoRA replicas must be "
        "started with `--max-lora-rank` at least this.",
    )
    lora_alpha: int = Field(default=16, gt=0, description="LoRA alpha (the update is scaled by alpha / rank).")
    lora_serve: Literal["adapter", "merged"] = Field(
        default="adapter",
        description="How a LoRA run's versions reach replicas. `adapter`: the adapter is pushed and replicas "
        "serve it through vLLM's runtime LoRA (`--enable-lora`; one API server each, vLLM refuses more). "
        "`merged`: each version is exported with the adapter merged into the base weights and pushed as full "
        "weights (as `weight_transfer` says: a folder to reload, or in memory), to replicas started for "
        "full weights (no LoRA kernels; `--api-server-count` allowed). Serving an adapter made 0.40-0.85x of "
        "the tokens/s of the same layout serving plain weights on an H100 (docs/gpu-results.md); a merged push "
        "writes the whole model each version.",
    )
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["all-linear"],
        description="Module names LoRA adapts; `[\"all-linear\"]` means every linear layer but the output head.",
    )
    backend: Literal["local", "ray"] = Field(
        default="local",
        description="`local`: verl's worker in the trainer process (one device); `ray`: a verl Ray worker group "
        "of `num_workers` FSDP2 ranks.",
    )
    num_workers: int = Field(default=1, ge=1, description="Workers (FSDP2 ranks) of the `ray` backend.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Where to train; `auto` is CUDA when available, else CPU."
    )
    ray_object_store_mb: int = Field(
        default=512,
        ge=100,
        description="Object store size when the trainer starts Ray itself (Ray's default takes ~30% of RAM).",
    )
    ray_address: str | None = Field(
        default=None,
        description="Ray cluster the `ray` backend attaches to, made with `ray start --head` (and `ray start "
        "--address` on other nodes): `auto` (the cluster started on this host) or `HOST:PORT` of its head. "
        "Unset, the trainer starts a local Ray. Attached, the workers go on as few nodes as can hold them "
        "(docs/scale.md); the trainer disconnects at the end and leaves the cluster running.",
    )
    seed: int = Field(default=42, description="Seeds the LoRA initialisation and the mini-batch order.")
    checkpoint_dir: str | None = Field(
        default=None,
        description="Directory of update checkpoints (model, optimizer, step), one subdirectory per step "
        "and a `latest` pointer; a restarted trainer resumes from it. Must be shared by all Ray nodes.",
    )
    keep_checkpoints: int = Field(
        default=2,
        ge=2,
        description="Checkpoints kept in `checkpoint_dir`; at least 2, because a restart resumes from the last "
        "committed step, which is the one before the newest while a step is being committed.",
    )

    # -- the loop (`rolltap-trainer run`) ----------------------------------------------
    max_steps: int = Field(default=100, ge=0, description="Training steps this run goes up to (counting resumed ones).")
    groups_per_step: int = Field(default=4, ge=1, description="Ready groups one step trains on, at most.")
    min_groups_per_step: int = Field(
        default=1,
        ge=1,
        description="A step waits for this many ready groups (up to `step_wait_s`), so it does not train on a "
        "sliver of the data while the rest of a policy version's groups are still being sampled.",
    )
    step_wait_s: float = Field(
        default=60.0, ge=0, description="Longest a step waits for `min_groups_per_step` before taking fewer."
    )
    poll_interval_s: float = Field(default=0.5, gt=0, description="Pause between looks for ready groups.")
    push: bool = Field(
        default=True, description="Push each new policy to the proxy's replicas; off trains from logs only."
    )
    proxy_url: str = Field(default="http://127.0.0.1:8000", description="The proxy whose replicas get new weights.")
    admin_token: SecretStr | None = Field(
        default=None, description="The proxy's admin token; defaults to `proxy.admin_token`."
    )
    keep_loaded_versions: int = Field(
        default=3, ge=1, description="LoRA versions kept loaded on replicas so calls in flight end on theirs."
    )
    lora_transport: Literal["path", "bytes"] = Field(
        default="path",
        description="How a LoRA push reaches replicas. `path`: each replica loads the exported folder by its "
        "path, so it must read the trainer's filesystem (one machine or a shared volume). `bytes`: the trainer "
        "uploads the adapter once to the proxy, which stores it in the database, and each replica fetches it "
        "through the Rolltap vLLM plugin (`rolltap_vllm`, configured with `ROLLTAP_LORA_SOURCE` and "
        "`ROLLTAP_LORA_TOKEN`): no shared filesystem needed (docs/deploy.md).",
    )
    weight_transfer: Literal["disk", "ipc", "shm"] = Field(
        default="disk",
        description="How a full-weight push (`lora_rank = 0`, or LoRA with `lora_serve = merged`) reaches "
        "replicas. `disk`: the trainer exports an HF folder and each replica re-reads it (`reload_weights`; the folder's path must be readable there). "
        "In memory, through vLLM's weight-transfer engine (replicas started with `--weight-transfer-config`), "
        "no folder written: `ipc` hands CUDA IPC handles of the trainer's tensors to replicas on the trainer's "
        "GPUs (backend `ipc`, and `VLLM_ALLOW_INSECURE_SERIALIZATION=1` on the replica); `shm` one host "
        "shared-memory segment to replicas on the trainer's host (backend `rolltap_shm`, from the `rolltap_vllm` "
        "plugin). docs/scale.md measures them.",
    )
    run_dir: str | None = Field(
        default=None, description="Where exported policies go; default `<checkpoint_dir>/policies`."
    )
    served_name: str | None = Field(
        default=None, description="The base model's served name when no proxy is asked (push off)."
    )
    tensorboard_dir: str | None = Field(
        default=None, description="Write per-step metrics as TensorBoard scalars here (needs `tensorboard`)."
    )
    wandb_project: str | None = Field(
        default=None,
        description="Log per-step metrics to this Weights & Biases project (needs `wandb`; its own `WANDB_*` "
        "variables apply, e.g. `WANDB_MODE=offline` without network).",
    )

    @model_validator(mode="after")
    def _check_weight_transfer(self) -> TrainerSettings:
        # In memory moves full weights (a LoRA run's merged ones): adapters pushed, it would do nothing.
        if self.weight_transfer != "disk" and self.lora_rank > 0 and self.lora_serve == "adapter":
            raise ValueError(f"weight_transfer = {self.weight_transfer!r} moves full weights; it needs lora_rank = 0 "
                             f"or lora_serve = merged (adapters are pushed as files: see lora_transport)")
        return self


class Settings(BaseSettings):
    """Everything configurable, in one object."""

    model_config = SettingsConfigDict(
        env_prefix="ROLLTAP_",
        env_nested_delimiter="__",
        extra="ignore",
    )

    db: DbSettings = Field(default_factory=DbSettings)
    proxy: ProxySettings = Field(default_factory=ProxySettings)
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = os.environ.get(CONFIG_ENV)
        if path:
            sources.append(_file_source(settings_cls, Path(path)))
        return tuple(sources)


def _file_source(settings_cls: type[BaseSettings], path: Path) -> PydanticBaseSettingsSource:
    if not path.is_file():
        raise FileNotFoundError(f"{CONFIG_ENV}={path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".toml":
        return TomlConfigSettingsSource(settings_cls, toml_file=path)
    if suffix == ".json":
        return JsonConfigSettingsSource(settings_cls, json_file=path)
    if suffix in (".yaml", ".yml"):
        return YamlConfigSettingsSource(settings_cls, yaml_file=path)
    raise ValueError(f"{CONFIG_ENV}={path}: config files are .toml, .json or .yaml")
