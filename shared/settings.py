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
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

__all__ = ["DbSettings", "PoolSettings", "ProxySettings", "RecorderSettings", "Settings", "TrainerSettings"]

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
        default=0.0,
        ge=0,
        description="Extra wait for companions before a small batch is written. Under load batches form "
        "on their own while the previous one is written, so 0 is usually best.",
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
    connect_timeout_s: float = Field(default=5.0, gt=0, description="Connecting to a replica.")
    read_timeout_s: float = Field(
        default=600.0, gt=0, description="Longest silence from a replica while a response is being read."
    )
    max_connections: int = Field(default=1024, ge=1, description="Upstream connections kept per proxy.")
    health_interval_s: float = Field(default=2.0, gt=0, description="Pause between active replica probes.")
    finish_timeout_s: float = Field(
        default=60.0, gt=0, description="How long `finish` waits for the attempt's calls still in flight."
    )
    shutdown_timeout_s: float = Field(
        default=30.0, gt=0, description="On SIGTERM: how long in-flight calls and the record flush may take."
    )
    recorder: RecorderSettings = Field(default_factory=RecorderSettings)
    pool: PoolSettings = Field(default_factory=PoolSettings)
    litellm_config: Path | None = Field(
        default=None,
        description="YAML file with a LiteLLM `model_list`: hosted models (OpenAI, Anthropic, Azure, any "
        "OpenAI-compatible server) served through LiteLLM's Router when a call names them.",
    )
    log_level: str = Field(default="info", description="Python logging level name.")

    @field_validator("replicas", mode="before")
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
        description="How an attempt's reward is spread over its triplets: the final reward on every triplet, "
        "on the last one only, discounted by `gamma` per triplet from the end, or per-call rewards.",
    )
    gamma: float = Field(default=0.9, ge=0, le=1, description="Discount per triplet for `credit = discounted`.")
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
