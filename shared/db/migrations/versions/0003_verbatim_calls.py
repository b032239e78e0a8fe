"""calls: exact request/response bytes beside the queryable JSON; undurable calls

Existing calls keep their JSON columns as they are; their new byte columns stay NULL
(their bytes were never kept) and `json_exact` NULL (what PostgreSQL accepted was stored
unchanged). Nothing is rewritten, so the upgrade is quick on a large table: three
nullable columns and one small table.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 00:45:00.000000
"""

from __future__ import annotations

from alembic import op
import sqlalchemy as sa

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('calls', schema=None) as batch_op:
        batch_op.add_column(sa.Column('request_body', sa.LargeBinary(), nullable=True))
        batch_op.add_column(sa.Column('response_body', sa.LargeBinary(), nullable=True))
        batch_op.add_column(sa.Column('json_exact', sa.Text(), nullable=True))

    op.create_table('undurable_calls',
    sa.Column('call_id', sa.String(length=40), nullable=False),
    sa.Column('rollout_id', sa.String(length=128), nullable=True),
    sa.Column('attempt_id', sa.String(length=128), nullable=True),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.PrimaryKeyConstraint('call_id')
    )
    with op.batch_alter_table('undurable_calls', schema=None) as batch_op:
        batch_op.create_index('ix_undurable_calls_attempt', ['rollout_id', 'attempt_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('undurable_calls', schema=None) as batch_op:
        batch_op.drop_index('ix_undurable_calls_attempt')
    op.drop_table('undurable_calls')
    # A plain DROP COLUMN (SQLite >= 3.35 has it): a batch would copy `calls` into a new table
    # and drop the old one, which the foreign keys from `call_drops` forbid once calls exist.
    for column in ('json_exact', 'response_body', 'request_body'):
        op.execute(f'ALTER TABLE calls DROP COLUMN {column}')
