"""proxy cluster: live proxies (heartbeats), call leases, the shared admission state

Several proxies on one PostgreSQL database share the admission pause and learn of
changes through a state epoch (`cluster_state`, one row); each live proxy keeps a
heartbeat row (`proxies`); a tracked call in flight holds a lease row (`call_leases`)
until its record is committed, so `finish` on any proxy can wait for it and a live
proxy can turn the leases of a dead one into `interrupted` records.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 04:10:00.000000
"""

from __future__ import annotations

from alembic import op
import sqlalchemy as sa

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('proxies',
    sa.Column('proxy_id', sa.String(length=64), nullable=False),
    sa.Column('host', sa.String(length=256), nullable=False),
    sa.Column('pid', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.Column('in_flight', sa.Integer(), server_default='0', nullable=False),
    sa.Column('seen_epoch', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('drained_epoch', sa.BigInteger(), server_default='0', nullable=False),
    sa.PrimaryKeyConstraint('proxy_id')
    )
    op.create_table('call_leases',
    sa.Column('call_id', sa.String(length=40), nullable=False),
    sa.Column('proxy_id', sa.String(length=64), nullable=False),
    sa.Column('rollout_id', sa.String(length=128), nullable=False),
    sa.Column('attempt_id', sa.String(length=128), nullable=False),
    sa.Column('route', sa.String(length=64), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('call_id')
    )
    op.create_index('ix_call_leases_attempt', 'call_leases', ['rollout_id', 'attempt_id'], unique=False)
    op.create_index('ix_call_leases_proxy', 'call_leases', ['proxy_id'], unique=False)
    state = op.create_table('cluster_state',
    sa.Column('id', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('epoch', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('paused', sa.Boolean(), server_default=sa.false(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.bulk_insert(state, [{'id': 1, 'epoch': 0, 'paused': False}])


def downgrade() -> None:
    op.drop_table('cluster_state')
    op.drop_index('ix_call_leases_proxy', table_name='call_leases')
    op.drop_index('ix_call_leases_attempt', table_name='call_leases')
    op.drop_table('call_leases')
    op.drop_table('proxies')
