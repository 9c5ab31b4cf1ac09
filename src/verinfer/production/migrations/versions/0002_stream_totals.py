"""Stream totals (windows, tokens, last update) kept in ``streams``, so ``/metrics`` and the dashboard
read one row per stream instead of summing its windows; existing streams are filled from their windows.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-26 04:20:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('streams', schema=None) as batch_op:
        batch_op.add_column(sa.Column('windows', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('tokens', sa.BigInteger(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('updated_at', sa.DateTime(), nullable=True))
    same = ("windows.provider = streams.provider AND windows.model = streams.model "
            "AND windows.profile = streams.profile AND windows.seconds = streams.seconds")
    op.execute(f"UPDATE streams SET windows = (SELECT COUNT(*) FROM windows WHERE {same}), "
               f"tokens = (SELECT COALESCE(SUM(windows.tokens), 0) FROM windows WHERE {same}), "
               f"updated_at = (SELECT MAX(windows.updated_at) FROM windows WHERE {same})")
    with op.batch_alter_table('streams', schema=None) as batch_op:  # the model keeps no server default
        batch_op.alter_column('windows', server_default=None)
        batch_op.alter_column('tokens', server_default=None)


def downgrade() -> None:
    with op.batch_alter_table('streams', schema=None) as batch_op:
        batch_op.drop_column('updated_at')
        batch_op.drop_column('tokens')
        batch_op.drop_column('windows')
