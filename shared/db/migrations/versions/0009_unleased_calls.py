"""calls a proxy sent upstream without a lease row, while it could not reach the database

A proxy cut off from the database goes on serving (records wait in its spool), but its calls
then have no `call_leases` row that `finish` on another proxy could wait for. It reports how
many such calls are not yet committed in its heartbeat; `finish` elsewhere waits while any
live proxy reports some, or has not been heard from lately (`proxy.cluster`).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03 10:40:00.000000
"""

from __future__ import annotations

from alembic import op
import sqlalchemy as sa

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('proxies', sa.Column('unleased_calls', sa.Integer(), server_default='0', nullable=False))


def downgrade() -> None:
    op.drop_column('proxies', 'unleased_calls')
