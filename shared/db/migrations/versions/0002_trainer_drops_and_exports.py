"""trainer: per-call drop reasons, export consumption records

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 12:00:00.000000
"""

from __future__ import annotations

from alembic import op
import sqlalchemy as sa

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

# Same spelling as shared.db.models.BigId: SQLite only auto-increments INTEGER PRIMARY KEY.
_BigId = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table('call_drops',
    sa.Column('call_id', sa.String(length=40), nullable=False),
    sa.Column('rollout_id', sa.String(length=128), nullable=False),
    sa.Column('attempt_id', sa.String(length=128), nullable=False),
    sa.Column('reason', sa.String(length=32), nullable=False),
    sa.Column('detail', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.ForeignKeyConstraint(['call_id'], ['calls.call_id'], name='fk_call_drops_call'),
    sa.PrimaryKeyConstraint('call_id')
    )
    with op.batch_alter_table('call_drops', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_call_drops_reason'), ['reason'], unique=False)

    op.create_table('exports',
    sa.Column('id', _BigId, autoincrement=True, nullable=False),
    sa.Column('format', sa.String(length=16), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('num_attempts', sa.Integer(), nullable=False),
    sa.Column('num_triplets', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('export_attempts',
    sa.Column('attempt_pk', _BigId, nullable=False),
    sa.Column('export_id', _BigId, nullable=False),
    sa.ForeignKeyConstraint(['attempt_pk'], ['attempts.id'], name='fk_export_attempts_attempt'),
    sa.ForeignKeyConstraint(['export_id'], ['exports.id'], name='fk_export_attempts_export'),
    sa.PrimaryKeyConstraint('attempt_pk')
    )
    with op.batch_alter_table('export_attempts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_export_attempts_export_id'), ['export_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('export_attempts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_export_attempts_export_id'))

    op.drop_table('export_attempts')
    op.drop_table('exports')
    with op.batch_alter_table('call_drops', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_call_drops_reason'))

    op.drop_table('call_drops')
