"""`rolltap-trainer`: the trainer's command line.

Subcommands: `run` (the training loop, `trainer/loop.py`), `export` (triplets to
JSONL/Parquet, optionally consuming them), `export-sft` (chat conversations in OpenAI's
fine-tuning format), `stats`. Settings come from `Settings()` (environment,
`ROLLTAP_CONFIG`); flags override them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from shared.db.engine import create_sync_db
from shared.db.migrate import upgrade
from shared.settings import CONFIG_ENV, Settings
from trainer.trajectory import Tokenizer

logger = logging.getLogger(__name__)


def load_tokenizer(path: str) -> Tokenizer:
    """A local Hugging Face tokenizer (never downloaded: the path must exist)."""
    if not Path(path).exists():
        raise SystemExit(f"--model {path}: no such directory (tokenizers are never downloaded)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer: Tokenizer = AutoTokenizer.from_pretrained(path)
    return tokenizer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rolltap-trainer", description="Rolltap trainer: data export and stats.")
    parser.add_argument("--db", metavar="URL", help="database URL (overrides ROLLTAP_DB__URL)")
    parser.add_argument("--log-level", default="warning", help="Python logging level (default: warning)")
    sub = parser.add_subparsers(dest="command", required=True)

    exp = sub.add_parser("export", help="export the triplets of ready groups, one row per triplet")
    exp.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    exp.add_argument("--out", type=Path, required=True, help="output file")
    exp.add_argument(
        "--mark-consumed", action="store_true", help="record the export so its attempts are never used again"
    )
    exp.add_argument("--model", help="local tokenizer directory to re-tokenise calls recorded without token IDs")
    exp.add_argument("--group-size", type=int, help="override trainer.group_size")
    exp.add_argument("--max-staleness", type=int, help="override trainer.max_staleness")
    exp.add_argument("--group-timeout-s", type=float, help="override trainer.group_timeout_s")
    exp.add_argument(
        "--credit", choices=["identical", "last_only", "discounted", "per_call"], help="override trainer.credit"
    )

    sft = sub.add_parser("export-sft", help="export finished attempts' conversations (OpenAI fine-tuning format)")
    sft.add_argument("--out", type=Path, required=True, help="output file")
    sft.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    sft.add_argument("--include-failed", action="store_true", help="also attempts finished as failed")
    sft.add_argument("--min-reward", type=float, help="only attempts whose final reward is at least this")

    run = sub.add_parser("run", help="the training loop: read groups, update with verl, push, repeat")
    run.add_argument("--config", type=Path, help="settings file (TOML/JSON/YAML); flags and env override it")
    run.add_argument("--model", help="local model directory of the policy (trainer.model)")
    run.add_argument("--proxy-url", help="the proxy whose replicas get the new weights (trainer.proxy_url)")
    run.add_argument("--admin-token", help="the proxy's admin token (trainer.admin_token)")
    run.add_argument("--max-steps", type=int, help="train up to this step (trainer.max_steps)")
    run.add_argument("--checkpoint-dir", help="checkpoints; a restarted run resumes here (trainer.checkpoint_dir)")
    run.add_argument("--no-push", action="store_true", help="train from logs only: no weight push")
    run.add_argument("--group-size", type=int, help="override trainer.group_size")

    stats = sub.add_parser("stats", help="attempts, consumption, drop reasons, rewards, policy versions")
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    stats.add_argument("--plot", type=Path, metavar="DIR",
                       help="also write charts to DIR: reward and entropy per training step (training.png), "
                       "drop reasons (drops.png), staleness of consumed attempts (staleness.png)")
    return parser


def resolve_settings(args: argparse.Namespace) -> Settings:
    if getattr(args, "config", None) is not None:
        # The file is the lowest layer: environment and flags still override it.
        os.environ[CONFIG_ENV] = str(args.config)
    settings = Settings()
    if args.db:
        settings = settings.model_copy(update={"db": settings.db.model_copy(update={"url": args.db})})
    overrides: dict[str, Any] = {}
    for flag, field in [
        ("group_size", "group_size"),
        ("max_staleness", "max_staleness"),
        ("group_timeout_s", "group_timeout_s"),
        ("credit", "credit"),
        ("model", "model"),
        ("proxy_url", "proxy_url"),
        ("admin_token", "admin_token"),
        ("max_steps", "max_steps"),
        ("checkpoint_dir", "checkpoint_dir"),
    ]:
        value = getattr(args, flag, None)
        if value is not None:
            overrides[field] = value
    if getattr(args, "no_push", False):
        overrides["push"] = False
    if overrides:
        trainer = settings.trainer.model_validate({**settings.trainer.model_dump(), **overrides})
        settings = settings.model_copy(update={"trainer": trainer})
    return settings


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = resolve_settings(args)
    if args.command == "run":
        return _run(settings)
    logger.info("settings: %s", settings.trainer.model_dump_json())
    if settings.db.migrate_on_start:
        upgrade(settings.db)
    engine = create_sync_db(settings.db)
    try:
        if args.command == "export":
            from trainer.export import export_triplets

            tokenizer = load_tokenizer(settings.trainer.model) if settings.trainer.model else None
            result = export_triplets(
                engine, settings.trainer, args.out, args.format, mark_consumed=args.mark_consumed, tokenizer=tokenizer
            )
            consumed = f", consumed as export {result.export_id}" if result.export_id is not None else ""
            print(
                f"wrote {result.num_triplets} triplets from {result.num_attempts} attempts in "
                f"{result.num_groups} groups to {result.path} ({result.num_drops} calls dropped{consumed})"
            )
        elif args.command == "export-sft":
            from trainer.sft import export_sft

            sft = export_sft(
                engine, args.out, fmt=args.format, include_failed=args.include_failed, min_reward=args.min_reward
            )
            print(f"wrote {sft.num_examples} conversations from {sft.num_attempts} attempts to {sft.path}")
        elif args.command == "stats":
            from trainer.stats import collect_stats, render_stats

            with engine.connect() as conn:
                report = collect_stats(conn, settings.trainer)
                if args.plot is not None:
                    from trainer.plot import plot_data_charts, plot_steps, step_metrics

                    report["plot"] = str(plot_steps(step_metrics(conn), args.plot))
                    report["plots"] = [report["plot"], *(str(p) for p in plot_data_charts(conn, args.plot))]
            sys.stdout.write(json.dumps(report, indent=2) + "\n" if args.json else render_stats(report))
    finally:
        engine.dispose()
    return 0


def _run(settings: Settings) -> int:
    from trainer.loop import run_loop
    from trainer.progress import Progress

    logging.getLogger("trainer").setLevel(logging.INFO)
    tokenizer = load_tokenizer(settings.trainer.model) if settings.trainer.model else None
    with Progress(settings.trainer) as progress:
        reports = run_loop(settings, tokenizer=tokenizer, on_step=progress.step)
    print(f"done: {len(reports)} step(s) this run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
