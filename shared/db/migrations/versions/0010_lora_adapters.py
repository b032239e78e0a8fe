"""LoRA adapters pushed as bytes, for replicas that share no filesystem with the trainer

The trainer uploads each adapter once to a proxy (`trainer.lora_transport = "bytes"`); every proxy
on the database serves it to the replicas' Rolltap plugin by name, checked by its SHA-256.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03 19:30:00.000000
"""

from __future__ import annotations

from alembic import op
import sqlalchemy as sa

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('lora_adapters',
    sa.Column('name', sa.String(length=256), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('data', sa.LargeBinary(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
    op.create_index('ix_lora_adapters_version', 'lora_adapters', ['version'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_lora_adapters_version', table_name='lora_adapters')
    op.drop_table('lora_adapters')
