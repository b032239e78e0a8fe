"""replica ejections shared by every proxy on the database

A proxy that ejects a replica (connection errors, repeated 5xx, failed probes) holds a
row here until its own probe re-admits it; every live proxy keeps the replica out of its
pool while any live proxy holds one (`proxy.cluster`).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 07:20:00.000000
"""

from __future__ import annotations

from alembic import op
import sqlalchemy as sa

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('replica_ejections',
    sa.Column('url', sa.String(length=512), nullable=False),
    sa.Column('proxy_id', sa.String(length=64), nullable=False),
    sa.Column('reason', sa.String(length=512), nullable=False),
    sa.Column('ejected_at', sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.PrimaryKeyConstraint('url', 'proxy_id')
    )


def downgrade() -> None:
    op.drop_table('replica_ejections')
