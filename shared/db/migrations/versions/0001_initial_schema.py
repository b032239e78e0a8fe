"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-30 04:46:52.472775
"""

from __future__ import annotations

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('policy_versions',
    sa.Column('version', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('served_name', sa.String(length=256), nullable=False),
    sa.Column('base_model', sa.String(length=256), nullable=True),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('path', sa.Text(), nullable=True),
    sa.Column('is_active', sa.Boolean(), server_default=sa.false(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.PrimaryKeyConstraint('version')
    )
    op.create_table('replicas',
    sa.Column('url', sa.String(length=512), nullable=False),
    sa.Column('weight_mode', sa.String(length=16), server_default='none', nullable=False),
    sa.Column('state', sa.String(length=16), server_default='active', nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.PrimaryKeyConstraint('url')
    )
    op.create_table('rollouts',
    sa.Column('rollout_id', sa.String(length=128), nullable=False),
    sa.Column('group_id', sa.String(length=128), nullable=True),
    sa.Column('task', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('metadata', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.PrimaryKeyConstraint('rollout_id')
    )
    with op.batch_alter_table('rollouts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_rollouts_group_id'), ['group_id'], unique=False)

    op.create_table('training_steps',
    sa.Column('step', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('policy_version', sa.Integer(), nullable=True),
    sa.Column('metrics', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.PrimaryKeyConstraint('step')
    )
    op.create_table('attempts',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('rollout_id', sa.String(length=128), nullable=False),
    sa.Column('attempt_id', sa.String(length=128), nullable=False),
    sa.Column('status', sa.String(length=16), server_default='running', nullable=False),
    sa.Column('num_calls', sa.Integer(), server_default='0', nullable=False),
    sa.Column('policy_version', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['rollout_id'], ['rollouts.rollout_id'], name='fk_attempts_rollout'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('rollout_id', 'attempt_id', name='uq_attempts_rollout_attempt')
    )
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_attempts_finished_at'), ['finished_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_attempts_status'), ['status'], unique=False)

    op.create_table('calls',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('call_id', sa.String(length=40), nullable=False),
    sa.Column('rollout_id', sa.String(length=128), nullable=True),
    sa.Column('attempt_id', sa.String(length=128), nullable=True),
    sa.Column('seq', sa.Integer(), nullable=True),
    sa.Column('route', sa.String(length=64), nullable=False),
    sa.Column('is_streaming', sa.Boolean(), nullable=False),
    sa.Column('status', sa.String(length=24), nullable=False),
    sa.Column('http_status', sa.Integer(), nullable=True),
    sa.Column('error', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('request', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('response', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('response_truncated', sa.Boolean(), server_default=sa.false(), nullable=False),
    sa.Column('prompt_token_ids', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('completion_token_ids', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('completion_logprobs', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('finish_reason', sa.String(length=32), nullable=True),
    sa.Column('usage', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('replica', sa.String(length=512), nullable=True),
    sa.Column('policy_version', sa.Integer(), nullable=True),
    sa.Column('requested_model', sa.String(length=256), nullable=True),
    sa.Column('served_model', sa.String(length=256), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('first_byte_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('ended_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.ForeignKeyConstraint(['rollout_id', 'attempt_id'], ['attempts.rollout_id', 'attempts.attempt_id'], name='fk_calls_attempt'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('call_id'),
    sa.UniqueConstraint('rollout_id', 'attempt_id', 'seq', name='uq_calls_attempt_seq')
    )
    with op.batch_alter_table('calls', schema=None) as batch_op:
        batch_op.create_index('ix_calls_started_at', ['started_at'], unique=False)

    op.create_table('rewards',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('rollout_id', sa.String(length=128), nullable=False),
    sa.Column('attempt_id', sa.String(length=128), nullable=False),
    sa.Column('value', sa.Float(), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=True),
    sa.Column('call_id', sa.String(length=40), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.ForeignKeyConstraint(['rollout_id', 'attempt_id'], ['attempts.rollout_id', 'attempts.attempt_id'], name='fk_rewards_attempt'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('rewards', schema=None) as batch_op:
        batch_op.create_index('ix_rewards_attempt', ['rollout_id', 'attempt_id'], unique=False)

    op.create_table('training_step_attempts',
    sa.Column('attempt_pk', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['attempt_pk'], ['attempts.id'], name='fk_tsa_attempt'),
    sa.ForeignKeyConstraint(['step'], ['training_steps.step'], name='fk_tsa_step'),
    sa.PrimaryKeyConstraint('attempt_pk')
    )
    with op.batch_alter_table('training_step_attempts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_training_step_attempts_step'), ['step'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('training_step_attempts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_training_step_attempts_step'))

    op.drop_table('training_step_attempts')
    with op.batch_alter_table('rewards', schema=None) as batch_op:
        batch_op.drop_index('ix_rewards_attempt')

    op.drop_table('rewards')
    with op.batch_alter_table('calls', schema=None) as batch_op:
        batch_op.drop_index('ix_calls_started_at')

    op.drop_table('calls')
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_attempts_status'))
        batch_op.drop_index(batch_op.f('ix_attempts_finished_at'))

    op.drop_table('attempts')
    op.drop_table('training_steps')
    with op.batch_alter_table('rollouts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_rollouts_group_id'))

    op.drop_table('rollouts')
    op.drop_table('replicas')
    op.drop_table('policy_versions')
