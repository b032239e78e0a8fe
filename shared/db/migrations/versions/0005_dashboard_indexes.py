"""dashboard: indexes for the attempt list's filters under keyset pagination (newest first)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 04:00:00.000000
"""

from __future__ import annotations

from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index('ix_attempts_status_id', 'attempts', ['status', 'id'])
    op.create_index('ix_attempts_policy_version_id', 'attempts', ['policy_version', 'id'])
    op.create_index('ix_attempts_created_at', 'attempts', ['created_at'])


def downgrade() -> None:
    op.drop_index('ix_attempts_created_at', table_name='attempts')
    op.drop_index('ix_attempts_policy_version_id', table_name='attempts')
    op.drop_index('ix_attempts_status_id', table_name='attempts')
