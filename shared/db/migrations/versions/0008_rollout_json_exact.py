"""rollouts: the exact task and metadata beside the queryable JSON

`json_exact` holds {"task", "metadata"} as ASCII JSON text when the queryable copies had to
change to be storable (U+0000, lone surrogates, numbers beyond float64), as `calls.json_exact`
does for calls; NULL otherwise. Existing rollouts keep NULL: what was stored is what they have.
One nullable column: the upgrade rewrites nothing.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 09:00:00.000000
"""

from __future__ import annotations

from alembic import op
import sqlalchemy as sa

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('rollouts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('json_exact', sa.Text(), nullable=True))


def downgrade() -> None:
    # A plain DROP COLUMN (SQLite >= 3.35): a batch would copy `rollouts`, which `attempts` refers to.
    op.execute('ALTER TABLE rollouts DROP COLUMN json_exact')
