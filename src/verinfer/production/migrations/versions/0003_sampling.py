"""The monitor's verification budget (``--sample``): how many traces each window and shard held beside
how many were verified, and the fraction a shard was sampled at (existing rows verified every trace);
and retention (``--retain-shards``): when a verified shard's files were deleted.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-06 06:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN, never batch mode: SQLite's batch mode copies and drops the table, and the
    # ON DELETE CASCADE of the rows that refer to windows and shards (streams, window_traces,
    # shard_results) would empty them. The server default stays: a NOT NULL column added to rows.
    op.add_column('windows', sa.Column('offered', sa.Integer(), nullable=False, server_default='0'))
    op.execute("UPDATE windows SET offered = traces")
    op.add_column('shards', sa.Column('offered', sa.Integer(), nullable=True))
    op.add_column('shards', sa.Column('sample', sa.Float(), nullable=True))
    op.add_column('shards', sa.Column('files_deleted_at', sa.DateTime(), nullable=True))
    op.execute("UPDATE shards SET offered = traces")


def downgrade() -> None:
    op.drop_column('shards', 'files_deleted_at')
    op.drop_column('shards', 'sample')
    op.drop_column('shards', 'offered')
    op.drop_column('windows', 'offered')
