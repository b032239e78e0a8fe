"""proxy: agent API keys (hashed, optionally scoped to a rollout-id prefix)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 00:40:00.000000
"""

from __future__ import annotations

from alembic import op
import sqlalchemy as sa

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('agent_keys',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=True),
    sa.Column('rollout_prefix', sa.String(length=128), nullable=True),
    sa.Column('max_concurrency', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('key_hash')
    )


def downgrade() -> None:
    op.drop_table('agent_keys')
